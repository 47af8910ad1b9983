"""The routing step as a component: point ``"routing"`` is the routing an MoE block's experts are
called with (top-k weights and expert ids, or a dense ``[T, E]`` matrix), found by tracing the
block's forward up to that call, captured and replaced as dense ``[T, E]`` routing weights. Tiny
float32 models of the shipped MoE families, real torch.compile; planted routing bugs (renormalisation
skipped, the scaling applied twice, the correction bias folded into the weights) are named
"routing" by blame, a faulty router weight still "router"."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import fxreplace
from fxreplace.adapters import routing_matrix
from fxreplace.blame import blame
from fxreplace.capture import capture_reference
from fxreplace.models import get_family, tiny_model
from fxreplace.models.nxd import NeuronConfig, NxDQwen3MoeModel
from fxreplace.targets import Target, TargetError

#: family -> (its router's attribute in the MoE block, a MoE layer)
MOE = {"Qwen3MoeForCausalLM": ("gate", 0), "MixtralForCausalLM": ("gate", 0), "GptOssForCausalLM": ("router", 0),
       "DeepseekV3ForCausalLM": ("gate", 1)}
ROUTING = Target("model.layers.*.mlp.experts", point="routing")
LAYERS = 4


def ids(seed=0, tokens=9):
    return torch.randint(4, 128, (1, tokens), generator=torch.Generator().manual_seed(seed))


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 128, (length,), generator=g).tolist() for length in (6, 9)]


def observed(model, input_ids) -> dict[str, torch.Tensor]:
    seen = {}
    with fxreplace.observe(model, lambda name, value: seen.setdefault(name, value.clone())), torch.no_grad():
        model(input_ids=input_ids, use_cache=False)
    return seen


@pytest.mark.parametrize("arch", sorted(MOE))
def test_routing_is_what_the_router_hands_the_experts_as_dense_rows(arch):
    """Each family declares routing between its router and its experts; what the point observes is the
    router's (weights, ids) as the dense [T, E] matrix, and instrumenting changes nothing."""
    router, layer = MOE[arch]
    assert list(get_family(arch).components)[2:4] == ["router", "routing"], arch
    model = tiny_model(arch, num_hidden_layers=2)
    returned = []
    hook = getattr(model.model.layers[layer].mlp, router).register_forward_hook(
        lambda module, args, output: returned.append(output))
    plain = model(input_ids=ids(), use_cache=False).logits
    hook.remove()
    _, weights, expert_ids = returned[0]
    fxreplace.instrument(model, [ROUTING])
    name = f"model.layers.{layer}.mlp.experts"
    assert model._fxreplace.points[0].routing_inputs == (1, 2)  # experts(hidden, ids, weights): found by tracing
    seen = observed(model, ids())
    experts = model.config.num_local_experts if arch != "Qwen3MoeForCausalLM" else model.config.num_experts
    assert seen[name].shape == (9, experts)
    assert torch.equal(seen[name], routing_matrix(weights, expert_ids, experts))
    assert ((seen[name] != 0).sum(-1) == model.config.num_experts_per_tok).all()
    fxreplace.check_unchanged(model, ids())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids(), use_cache=False, replacements=seen).logits, plain)  # its own routing


def skip_renorm(self, hidden_states):
    """Qwen3MoeTopKRouter.forward without the top-k renormalisation."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    return router_logits, router_top_value.to(router_logits.dtype), router_indices


def test_the_reference_routing_undoes_a_routing_bug_bit_for_bit():
    """A router that skips the renormalisation (planted in the instance's forward) computes the clean
    logits: replacing its layer's routing with the clean model's gives the clean model's output exactly,
    replacing its logits changes nothing."""
    clean = tiny_model("Qwen3MoeForCausalLM", num_hidden_layers=2)
    want = clean(input_ids=ids(), use_cache=False).logits
    targets = [ROUTING, "model.layers.*.mlp.gate"]
    reference = observed(fxreplace.instrument(copy.deepcopy(clean), targets), ids())
    target = copy.deepcopy(clean)
    gate = target.model.layers[1].mlp.gate
    gate.forward = types.MethodType(skip_renorm, gate)
    broken = target(input_ids=ids(), use_cache=False).logits
    assert (broken - want).abs().max() > 0.1
    fxreplace.instrument(target, targets, max_tokens=16)
    fxreplace.check_unchanged(target, ids())  # the bug stays: instrumenting traced the forward that runs
    with torch.no_grad():
        run = lambda names: target(input_ids=ids(), use_cache=False, replacements={n: reference[n] for n in names}).logits
        assert torch.equal(run(["model.layers.1.mlp.gate"]), broken)
        assert torch.equal(run(["model.layers.1.mlp.experts"]), want)
        # an engine that owns the forward: the fed buffers, then cleared
        target.feed(fxreplace.ReplacementContext(reference, torch.tensor([False] * 8 + [True])))
        fed = target(input_ids=ids(), use_cache=False).logits
        assert torch.equal(fed[0, :8], broken[0, :8]) and not torch.equal(fed[0, 8], broken[0, 8])
        target.clear()
        assert torch.equal(target(input_ids=ids(), use_cache=False).logits, broken)


def test_one_compiled_graph_for_routing_off_on_and_new_values():
    model = tiny_model("Qwen3MoeForCausalLM", num_hidden_layers=2)
    fxreplace.instrument(model, [ROUTING, "model.layers.*.mlp.gate"])
    seen = observed(model, ids(tokens=8))
    gen = torch.Generator().manual_seed(1)
    off, on = torch.zeros(8, dtype=torch.bool), torch.ones(8, dtype=torch.bool)
    contexts = [fxreplace.ReplacementContext(seen, off), fxreplace.ReplacementContext(seen, on),
                fxreplace.ReplacementContext({n: torch.rand(v.shape, generator=gen) for n, v in seen.items()},
                                             torch.arange(8) % 2 == 0),
                fxreplace.ReplacementContext(seen, off)]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    outputs = []
    with torch.no_grad():
        for step, ctx in enumerate(contexts):
            got = compiled(input_ids=ids(step, 8), use_cache=False, replacements=ctx).logits
            want = model(input_ids=ids(step, 8), use_cache=False, replacements=ctx).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"step {step}")
            outputs.append(want)
    assert counter.frame_count == 1
    plain = [model(input_ids=ids(step, 8), use_cache=False).logits for step in (2, 3)]
    assert not torch.allclose(outputs[2], plain[0], atol=1e-3) and torch.equal(outputs[3], plain[1])


def test_the_runner_selects_routing_per_request_in_one_compiled_graph():
    """Blame's embedded runner: every component instrumented, compiled; requests side by side, one replacing
    the faulty layer's routing from the reference, get the reference's tokens and logits, the others the
    target's, from one graph per bucket."""
    from fxreplace.components import resolve_components
    from fxreplace.context import PerRequest
    from fxreplace.engines.embedded.runner import Runner, RunnerConfig
    from fxreplace.replacer import TensorReplacer

    arch = "Qwen3MoeForCausalLM"
    clean = tiny_model(arch, num_hidden_layers=2)
    components = get_family(arch).components
    reference = capture_reference(clean, prompts(), [], 3, components=components, progress=False)
    target = copy.deepcopy(clean)
    target.model.layers[1].mlp.gate.forward = types.MethodType(skip_renorm, target.model.layers[1].mlp.gate)
    model = fxreplace.instrument(target, [c.target for c in resolve_components(target, components)])
    runner = Runner(model, clean.config, TensorReplacer(reference.store),
                    RunnerConfig(prefill_buckets=(16,), batch_buckets=(4,), max_len=32), compile="eager")
    ids = reference.store.prompt_token_ids
    n = len(ids)
    out = runner.generate(list(ids) * 2, 3, replace=PerRequest([()] * n + [("model.layers.1.mlp.experts",)] * n))
    assert runner.graphs_compiled == 2  # the prefill bucket and the decode bucket
    for p in range(n):
        fixed, broken = torch.stack(out[n + p].logits), torch.stack(out[p].logits)
        assert out[n + p].tokens == reference.tokens(p)
        torch.testing.assert_close(fixed, reference.logits(p), rtol=0, atol=1e-4)
        assert (broken - reference.logits(p)).abs().max() > 1e-2


def test_routing_computed_inline_in_the_block_is_found_as_its_dense_matrix():
    """The Neuron-style stand-in's block scatters the top-k affinities itself and hands its experts
    the dense [T, E] matrix: that argument is the point, found by the same tracing."""
    model = tiny_model("NeuronMoeForCausalLM")
    plain = model(ids())
    fxreplace.instrument(model, [Target("model.layers.*.mlp.expert_mlps", point="routing")])
    assert model._fxreplace.points[0].routing_inputs == (1,)
    seen = {}
    with fxreplace.observe(model, lambda name, value: seen.setdefault(name, value.clone())), torch.no_grad():
        assert torch.equal(model(ids()), plain)
    dense = seen["model.layers.0.mlp.expert_mlps"]
    assert dense.shape == (9, 8) and ((dense != 0).sum(-1) == 2).all()
    torch.testing.assert_close(dense.sum(-1), torch.ones(9))  # renormalised top-k affinities
    with torch.no_grad():
        assert torch.equal(model(ids(), replacements=seen), plain)
        assert not torch.allclose(model(ids(), replacements={n: v.flip(-1) for n, v in seen.items()}), plain)


def test_a_family_that_does_not_expose_the_routing_step_is_refused_in_one_line():
    """A fused kernel hands its experts (weights, ids) straight from the hidden states: no top-k is
    computed where the experts are called, so there is no routing step to replace apart from the router."""
    model = tiny_model("GptOssForCausalLM+fused_topk")
    with pytest.raises(TargetError, match=r"^'model\.layers\.0\.mlp\.experts': point 'routing': no argument of its "
                                          r"call in 'model\.layers\.0\.mlp' is computed from a top-k") as e:
        fxreplace.instrument(model, [ROUTING])
    assert "\n" not in str(e.value)
    assert "routing" not in get_family("GptOssForCausalLM+fused_topk").components
    with pytest.raises(TargetError, match="point 'routing' is the routing the module is called with"):
        fxreplace.export(tiny_model("Qwen3MoeForCausalLM"), {"input_ids": ids(), "use_cache": False}, [ROUTING])
    # NxD's experts take every expert's affinities and the ids: only the ids come from the top-k
    nxd = NxDQwen3MoeModel.from_hf(tiny_model("Qwen3MoeForCausalLM"), NeuronConfig(batch_size=1, buckets=(8,)))
    fxreplace.instrument(nxd, [Target("layers.*.mlp.expert_mlps", point="routing")])
    with pytest.raises(TargetError, match=r"^'layers\.0\.mlp\.expert_mlps': point 'routing': the one argument computed "
                                          r"from a top-k is torch\.int64 \(8, 2\), expert ids without their weights"):
        nxd(ids(tokens=8), torch.arange(8)[None], replacements={})


def test_a_routing_replacement_of_the_wrong_width_names_the_module():
    model = fxreplace.instrument(tiny_model("Qwen3MoeForCausalLM"), [ROUTING])
    with pytest.raises(fxreplace.ShapeError, match=r"model\.layers\.0\.mlp\.experts .*\(9, 8\)"):
        model(input_ids=ids(), use_cache=False, replacements={"model.layers.0.mlp.experts": torch.zeros(9, 5),
                                                             "model.layers.1.mlp.experts": torch.zeros(9, 8)})


# ------------------------------------------------------------------------------------------ blame


def deepseek_scale_twice(moe):
    """DeepSeekV3MoE.forward applying the routed scaling factor again (the router applied it already)."""

    def forward(self, hidden_states):
        residuals, shape = hidden_states, hidden_states.shape
        _, topk_weights, topk_indices = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        topk_weights = topk_weights * self.gate.routed_scaling_factor
        return self.experts(hidden_states, topk_indices, topk_weights).view(*shape) + self.shared_experts(residuals)

    moe.forward = types.MethodType(forward, moe)


def deepseek_bias_in_weights(gate):
    """DeepseekV3TopkRouter whose weights are gathered from the bias-corrected scores (the bias is
    for choosing experts only)."""
    original = type(gate).forward

    def forward(self, hidden_states):
        logits, _, topk_indices = original(self, hidden_states)
        weights = (logits.sigmoid() + self.e_score_correction_bias).gather(1, topk_indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, topk_indices

    gate.forward = types.MethodType(forward, gate)


class SoftmaxOverAllExperts(torch.nn.Module):
    """GPT-OSS's router with the softmax over every expert's logit instead of the chosen k."""

    def __init__(self, router):
        super().__init__()
        self.top_k, self.num_experts, self.weight, self.bias = router.top_k, router.num_experts, router.weight, router.bias

    def forward(self, hidden_states):
        router_logits = F.linear(hidden_states, self.weight, self.bias)
        probs = torch.softmax(router_logits, dim=-1)
        router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)
        return router_logits, probs.gather(1, router_indices), router_indices


def gpt_oss_softmax_over_all(mlp):
    mlp.router = SoftmaxOverAllExperts(mlp.router)


def flip_router(name):
    return lambda mlp: getattr(mlp, name).weight.data.mul_(-1.0)


PLANTED = {  # name -> (family, layer, fault on the layer's MoE block, kind blame must name)
    "qwen3-renorm-skipped": ("Qwen3MoeForCausalLM", 2, lambda mlp: setattr(
        mlp.gate, "forward", types.MethodType(skip_renorm, mlp.gate)), "routing"),
    "qwen3-router-weight": ("Qwen3MoeForCausalLM", 1, flip_router("gate"), "router"),
    "deepseek-scaled-twice": ("DeepseekV3ForCausalLM", 2, deepseek_scale_twice, "routing"),
    "deepseek-bias-in-weights": ("DeepseekV3ForCausalLM", 3, lambda mlp: deepseek_bias_in_weights(mlp.gate), "routing"),
    "deepseek-router-weight": ("DeepseekV3ForCausalLM", 2, flip_router("gate"), "router"),
    "gpt-oss-softmax-over-all": ("GptOssForCausalLM", 1, gpt_oss_softmax_over_all, "routing"),
    "gpt-oss-router-weight": ("GptOssForCausalLM", 3, flip_router("router"), "router"),
}


@pytest.fixture(scope="module")
def cleans():
    models = {}
    for arch in {family for family, *_ in PLANTED.values()}:
        config = {"layer_types": ["sliding_attention", "full_attention"] * 2} if arch == "GptOssForCausalLM" else {}
        models[arch] = tiny_model(arch, num_hidden_layers=LAYERS, **config)
    gen = torch.Generator().manual_seed(0)
    for layer in models["DeepseekV3ForCausalLM"].model.layers[1:]:  # a trained model's correction bias (init: 0)
        layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(8, generator=gen) * 0.5)
    return models


@pytest.fixture(scope="module")
def routers_only(cleans):
    """References holding the routers alone: blame captures what it replaces from the clean model."""
    return {arch: capture_reference(model, prompts(), get_family(arch).targets, 6, progress=False)
            for arch, model in cleans.items()}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_blame_names_a_routing_bug_routing_and_a_logits_fault_router(planted, cleans, routers_only):
    arch, layer, fault, kind = PLANTED[planted]
    target = copy.deepcopy(cleans[arch])
    with torch.no_grad():
        fault(target.model.layers[layer].mlp)
    result = blame(target, routers_only[arch], clean=cleans[arch], progress=False)
    module = {"routing": "experts", "router": "router" if arch == "GptOssForCausalLM" else "gate"}[kind]
    named = [(o.kind, o.layer, o.component) for o in result.origins]
    assert named == [(kind, layer, f"model.layers.{layer}.mlp.{module}")], result.table()
    assert result.confident and f"layer {layer} {kind} " in result.verdict
    if kind == "routing":  # the logits are intact: the router explains nothing
        router = next(b for b in result.ranking if b.kind == "router" and b.layer == layer)
        assert router.explained < 0.01, result.table()
