"""The pure pass, adapters and sharding, on small graphs (no compiles)."""

import pytest
import torch
from torch import fx, nn

import fxreplace.models as families
from fxreplace.adapters import get_adapter, register_adapter, sigmoid_bias_grouped_topk, softmax_topk_renorm, topk_softmax_scatter
from fxreplace.context import ReplacementContext
from fxreplace.instrument import instrument
from fxreplace.injection import Injection
from fxreplace.passes import InjectionSpec, insert_replacements
from fxreplace.points import find_injection_node, module_paths
from fxreplace.sharding import ShapeError, ShardSpec
from fxreplace.targets import Target


@pytest.fixture(scope="module")
def qwen():
    return families.tiny_model("Qwen3MoeForCausalLM")


def test_pass_on_a_single_module_trace(qwen):
    gate = qwen.model.layers[0].mlp.gate
    gm = fx.symbolic_trace(gate)
    result = insert_replacements(gm, [InjectionSpec("", "auto", Injection("gate", gate), "replacement")])
    assert result.rewired == {"": "linear"} and result.inputs == ["replacement", "fxreplace_mask"]
    hidden = torch.randn(5, 64)
    logits, weights, indices = gm(hidden)
    assert torch.equal(logits, gate(hidden)[0])  # inputs default to None: replacement off
    replacement = torch.randn(5, 8)
    mask = torch.tensor([True, False, True, False, True])
    logits, weights, indices = gm(hidden, replacement, mask)
    assert torch.equal(logits[mask], replacement[mask]) and torch.equal(logits[~mask], gate(hidden)[0][~mask])
    probs = torch.softmax(replacement[0], -1)
    assert torch.equal(indices[0], torch.topk(probs, 2).indices)  # downstream sees the replacement


def test_module_paths_normalise_dynamo_and_export_spellings():
    node = fx.Graph().placeholder("x")
    node.meta["nn_module_stack"] = {"a": ("L['self']._modules['model'].layers[3].mlp", None), "b": ("model.layers.3.mlp.gate", None)}
    assert module_paths(node) == {"model.layers.3.mlp", "model.layers.3.mlp.gate"}


def test_pass_on_a_whole_exported_graph_finds_the_router_linear(qwen):
    ids = torch.randint(0, 128, (1, 6))
    gm = torch.export.export(qwen, (), {"input_ids": ids, "use_cache": False}).module()
    node = find_injection_node(gm, "model.layers.1.mlp.gate", "auto")
    assert "linear" in str(node.target) and "model.layers.1.mlp.gate" in module_paths(node)


def routers():
    torch.manual_seed(0)
    out = {}
    for arch in ("GptOssForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"):
        model = families.tiny_model(arch)
        out[arch] = model.model.layers[-1].mlp.__getattr__("router" if "Gpt" in arch else "gate")
    return out


@pytest.mark.parametrize("arch,adapter", [
    ("GptOssForCausalLM", "topk_softmax_scatter"),
    ("Qwen3MoeForCausalLM", "softmax_topk_renorm"),
    ("DeepseekV3ForCausalLM", "sigmoid_bias_grouped_topk"),
])
def test_adapters_reproduce_the_hf_routing(arch, adapter):
    router = routers()[arch]
    if arch.startswith("Deepseek"):
        router.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    hidden = torch.randn(7, 64)
    with torch.no_grad():
        logits, weights, indices = router(hidden)
        dense = torch.zeros_like(logits).scatter(1, indices, weights.float())
        torch.testing.assert_close(get_adapter(adapter)(logits, router), dense)
        pair_weights, pair_indices = get_adapter(adapter + "_pairs" if "scatter" not in adapter
                                                 else "topk_softmax_pairs")(logits, router)
    assert pair_weights.shape == pair_indices.shape == indices.shape
    assert torch.equal(pair_indices.sort(-1).values, indices.sort(-1).values)  # the same experts
    torch.testing.assert_close(torch.zeros_like(logits).scatter(1, pair_indices, pair_weights), dense)


def test_adapter_registry():
    assert get_adapter(None)(torch.ones(1), None) is not None
    register_adapter("double", lambda logits, module: 2 * logits)
    assert torch.equal(get_adapter("double")(torch.ones(2), None), torch.full((2,), 2.0))
    with pytest.raises(KeyError, match="unknown adapter 'nope'.*double"):
        get_adapter("nope")
    k4 = topk_softmax_scatter(k=4)(torch.randn(3, 8), nn.Module())
    assert (k4 > 0).sum(-1).tolist() == [4, 4, 4]
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk_renorm()(torch.randn(3, 8), nn.Module())
    assert callable(sigmoid_bias_grouped_topk(k=2))


class RankRows(nn.Module):
    """Stands in for a sequence-parallel router: sees only its rank's rows."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 8)

    def forward(self, x):
        return self.router(x)


@pytest.mark.parametrize("tensor_rank", [False, True])
def test_sequence_and_expert_parallel_slices(tensor_rank):
    full = torch.randn(6, 8)
    for rank in (0, 1):
        r = torch.tensor(rank) if tensor_rank else rank
        sp = instrument(RankRows(), [Target("router", point="output", shard=ShardSpec("sequence", 2, r))])
        out = sp(torch.randn(3, 4), replacements={"router": full})
        assert torch.equal(out, full[3 * rank:3 * rank + 3])
        ep = RankRows()
        ep.router = nn.Linear(4, 4)  # this rank computes 4 of 8 experts
        ep = instrument(ep, [Target("router", point="output", shard=ShardSpec("expert", 2, r))])
        out = ep(torch.randn(6, 4), replacements={"router": full})
        assert torch.equal(out, full[:, 4 * rank:4 * rank + 4])
    dp = instrument(RankRows(), [Target("router", point="output", shard=ShardSpec("data", 2, 1))])
    assert torch.equal(dp(torch.randn(6, 4), replacements={"router": full}), full)


def test_sequence_parallel_mask_and_tensor_rank_under_compile():
    rank = torch.tensor(0)
    model = instrument(RankRows(), [Target("router", point="output", shard=ShardSpec("sequence", 2, rank))])
    full, mask = torch.randn(6, 8), torch.tensor([True, False, True, False, True, True])
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    computed = model.router(x)
    with torch.no_grad():
        for value in (0, 1):
            rank.fill_(value)  # same SPMD graph, other rank
            out = compiled(x, replacements=ReplacementContext({"router": full}, mask))
            rows = slice(3 * value, 3 * value + 3)
            torch.testing.assert_close(out, torch.where(mask[rows, None], full[rows], computed))
    assert cnt.frame_count == 1


def test_sharding_errors():
    with pytest.raises(ValueError, match="rank 2 out of range"):
        ShardSpec("sequence", 2, 2)
    with pytest.raises(ValueError, match="rank 3 out of range"):
        ShardSpec("sequence", 2, torch.tensor(3))
    with pytest.raises(ValueError, match="shard mode"):
        ShardSpec("tensor", 2, 0)
    rank = torch.tensor(0)
    model = instrument(RankRows(), [Target("router", point="output", shard=ShardSpec("sequence", 4, rank))])
    with pytest.raises(ShapeError, match=r"router has shape \(6, 8\).*computes \(1, 8\).*\[4, E\]"):
        model(torch.randn(1, 4), replacements={"router": torch.randn(6, 8)})  # 4 ranks x 1 row != 6
    rank.fill_(5)
    with pytest.raises(ValueError, match="rank 5 out of range"):
        model(torch.randn(1, 4), replacements={"router": torch.randn(4, 8)})
    ep = RankRows()
    ep.router = nn.Linear(4, 3)
    ep = instrument(ep, [Target("router", point="output", shard=ShardSpec("expert", 3, 0))])
    with pytest.raises(ShapeError, match="size 8 is not divisible by world_size 3"):
        ep(torch.randn(2, 4), replacements={"router": torch.randn(2, 8)})


def test_pair_points_are_replaced_elementwise_and_refuse_expert_sharding():
    class TopKRouter(nn.Module):
        top_k = 2

        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 8)

        def forward(self, x):
            values, ids = torch.topk(self.linear(x), 2, dim=-1)
            return values.softmax(-1), ids

    router, x = TopKRouter(), torch.randn(5, 4)
    logits, mask = torch.randn(5, 8) * 3, torch.tensor([True, False, True, True, False])
    weights, ids = Injection("router", router, "topk_softmax_pairs")(router(x), logits, mask)
    want_w, want_i = get_adapter("topk_softmax_pairs")(logits, router)
    plain_w, plain_i = router(x)
    assert torch.equal(ids[mask], want_i[mask]) and torch.equal(ids[~mask], plain_i[~mask])
    assert torch.equal(weights[mask], want_w[mask]) and torch.equal(weights[~mask], plain_w[~mask])
    sharded = Injection("router", router, "topk_softmax_pairs", ShardSpec("expert", 2, 0))
    with pytest.raises(ShapeError, match="top-k pairs hold global expert ids"):
        sharded(router(x), logits, mask)
