"""Every registered family: instrumented output equals an independent override
of the same node, off equals the plain model, one compiled graph serves
on/off/new values; the fused-router model through its adapter equals the
unfused model given the same replacement logits."""

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fxreplace.models as families
from fxreplace.instrument import instrument
from fxreplace.models import llama
from fxreplace.targets import resolve_targets
from graph_helpers import OverrideLinear, input_ids, off_context, override_outputs, random_context

ROUTED = ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM"]


def num_experts(config):
    for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hasattr(config, attr):
            return getattr(config, attr)
    raise AttributeError("no expert count")


def run(model, **kwargs):
    with torch.no_grad():
        return model(input_ids=input_ids(), use_cache=False, **kwargs).logits


@pytest.fixture(scope="module", params=ROUTED)
def routed(request):
    plain = families.tiny_model(request.param)
    model = instrument(copy.deepcopy(plain), families.get_family(request.param).targets)
    return plain, model, num_experts(plain.config)


def test_registry_lists_the_families():
    fused = ["GptOssForCausalLM+fused_router", "GptOssForCausalLM+fused_topk"]
    assert set(ROUTED + ["LlamaForCausalLM"] + fused) <= set(families.families())
    with pytest.raises(KeyError, match="registered"):
        families.get_family("NopeForCausalLM")


@pytest.mark.compat
@pytest.mark.parametrize("architecture", ROUTED)
def test_family_targets_are_the_router_logits(architecture):
    """On transformers 5 (routers return (logits, weights, ids): the point is their
    first linear) and 4.x (plain nn.Linear gates returning logits: their output),
    the family's targets replace exactly the router logits (eager: 4.x experts
    have data-dependent shapes and do not compile into one graph)."""
    plain = families.tiny_model(architecture)
    targets = families.get_family(architecture).targets
    model = instrument(copy.deepcopy(plain), targets)
    resolved, experts = resolve_targets(plain, targets), num_experts(plain.config)
    names = [t.capture_name for t in resolved]
    assert names and all(n.endswith(("mlp.gate", "mlp.router")) for n in names)  # the 5.x names on both
    ctx = random_context(names, experts, seed=1)
    weights = {plain.get_submodule(t.module_name).weight: ctx[t.capture_name] for t in resolved}
    with OverrideLinear(weights, ctx.mask):
        expected = run(plain)
    assert not torch.allclose(expected, run(plain))
    torch.testing.assert_close(run(model, replacements=ctx), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(run(model, replacements=off_context(names, experts)), run(plain))


def test_family_replacement_off_and_single_graph(routed):
    plain, model, experts = routed
    names = model.targets
    assert names and all(n.endswith(("mlp.gate", "mlp.router")) for n in names)
    contexts = [random_context(names, experts, seed=1), off_context(names, experts), random_context(names, experts, seed=2)]

    def reference(ctx):
        weights = {plain.get_submodule(n).weight: ctx[n] for n in names}
        with OverrideLinear(weights, ctx.mask):
            return run(plain)

    expected = [reference(ctx) for ctx in contexts]
    assert not torch.allclose(expected[0], run(plain))
    assert torch.equal(run(model, replacements=contexts[1]), run(plain))
    assert torch.equal(run(model), run(plain))
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    for ctx, ref in zip(contexts, expected):
        torch.testing.assert_close(run(model, replacements=ctx), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(run(compiled, replacements=ctx), ref, rtol=1e-5, atol=1e-5)
    assert cnt.frame_count == 1


@pytest.mark.parametrize("target,index", [(llama.MLP_OUTPUT, None), (llama.ATTENTION_OUTPUT, 0), (llama.RESIDUAL_STREAM, None)])
def test_llama_block_outputs(target, index):
    plain = families.tiny_model("LlamaForCausalLM")
    model = instrument(copy.deepcopy(plain), [target])
    assert len(model.targets) == 2
    ctx = random_context(model.targets, 64, scale=1.0)
    with override_outputs(plain, dict(ctx.items()), ctx.mask, index=index):
        expected = run(plain)
    assert not torch.allclose(expected, run(plain))
    torch.testing.assert_close(run(model, replacements=ctx), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(run(model, replacements=off_context(model.targets, 64)), run(plain))


@pytest.mark.parametrize("variant", ["GptOssForCausalLM+fused_router", "GptOssForCausalLM+fused_topk"])
def test_fused_router_through_adapter_equals_unfused(variant):
    """Dense affinities and (weights, ids) pairs: both fused forms, fed replacement
    logits through their adapters, equal the unfused model replacing its logits."""
    unfused = families.tiny_model("GptOssForCausalLM")
    fused = families.tiny_model(variant)
    assert list(fused.state_dict()) == list(unfused.state_dict())
    torch.testing.assert_close(run(fused), run(unfused), rtol=1e-5, atol=1e-5)
    instrument(unfused, families.get_family("GptOssForCausalLM").targets)
    instrument(fused, families.get_family(variant).targets)
    ctx = random_context(fused.targets, 8, seed=7)
    expected = run(unfused, replacements=ctx)
    assert not torch.allclose(expected, run(unfused))
    torch.testing.assert_close(run(fused, replacements=ctx), expected, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(fused, backend=cnt, fullgraph=True)
    for ctx in (ctx, off_context(fused.targets, 8), random_context(fused.targets, 8, seed=8)):
        torch.testing.assert_close(run(compiled, replacements=ctx), run(unfused, replacements=ctx), rtol=1e-5, atol=1e-5)
    assert cnt.frame_count == 1
