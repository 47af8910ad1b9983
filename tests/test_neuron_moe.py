"""The Neuron-style static-shape MoE family (plain torch): instrumented output
equals an independent override of the router logits, off equals the plain
model, one compiled graph serves on/off/new values, and the fused router fed
replacement logits through its adapter equals the unfused model."""

import copy

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.export import Dim

import fxreplace
import fxreplace.models as families
import fxreplace.models.neuron_moe  # noqa: F401  (its config, read below; the registry imports a family lazily)
from fxreplace.instrument import instrument
from graph_helpers import OverrideLinear, input_ids, off_context, random_context

ARCH = "NeuronMoeForCausalLM"
EXPERTS = families.neuron_moe.NeuronMoeConfig().num_experts


def oracle(plain, ctx):
    """The plain model with its router logits overridden, without fxreplace."""
    weights = {plain.get_submodule(f"{n}.linear_router").weight: ctx[n] for n in ctx}
    with torch.no_grad(), OverrideLinear(weights, ctx.mask):
        return plain(input_ids())


def test_targets_resolve_to_router_logits():
    model = instrument(families.tiny_model(ARCH), families.get_family(ARCH).targets)
    assert model.targets == ["model.layers.0.mlp.router", "model.layers.1.mlp.router"]


def test_replacement_on_off_new_values_one_graph():
    plain = families.tiny_model(ARCH)
    model = instrument(copy.deepcopy(plain), families.get_family(ARCH).targets)
    names = model.targets
    contexts = [random_context(names, EXPERTS, seed=1), off_context(names, EXPERTS),
                random_context(names, EXPERTS, seed=2)]
    expected = [oracle(plain, ctx) for ctx in contexts]
    with torch.no_grad():
        assert not torch.allclose(expected[0], plain(input_ids()))
        assert torch.equal(model(input_ids(), replacements=contexts[1]), plain(input_ids()))
        torch._dynamo.reset()
        cnt = CompileCounterWithBackend("eager")
        compiled = torch.compile(model, backend=cnt, fullgraph=True)
        for ctx, ref in zip(contexts, expected):
            torch.testing.assert_close(model(input_ids(), replacements=ctx), ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(compiled(input_ids(), replacements=ctx), ref, rtol=1e-5, atol=1e-5)
    assert cnt.frame_count == 1


def test_fused_router_through_adapter_equals_unfused():
    unfused = instrument(families.tiny_model(ARCH), families.get_family(ARCH).targets)
    fused = families.tiny_model(ARCH + "+fused_router")
    assert list(fused.state_dict()) == list(unfused.state_dict())
    instrument(fused, families.get_family(ARCH + "+fused_router").targets)
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids()), unfused(input_ids()), rtol=1e-5, atol=1e-5)
        for ctx in (random_context(fused.targets, EXPERTS, seed=7), off_context(fused.targets, EXPERTS)):
            expected = unfused(input_ids(), replacements=ctx)
            torch.testing.assert_close(fused(input_ids(), replacements=ctx), expected, rtol=1e-5, atol=1e-5)


def test_dynamic_export_equals_eager_at_every_length():
    """export() with a dynamic sequence length (where fxreplace reads size hints,
    the one torch-version shim) on the HF-independent model, on every torch."""
    eager = instrument(families.tiny_model(ARCH), families.get_family(ARCH).targets)
    program = fxreplace.export(families.tiny_model(ARCH), (input_ids(),), families.get_family(ARCH).targets,
                               dynamic_shapes=({1: Dim("seq", min=2, max=32)},))
    for tokens in (8, 5, 16):
        ctx = random_context(eager.targets, EXPERTS, tokens, seed=tokens)
        with torch.no_grad():
            out = program.module()(input_ids=input_ids(tokens), **fxreplace.export_inputs(program, ctx))
            torch.testing.assert_close(out, eager(input_ids(tokens), replacements=ctx), rtol=1e-5, atol=1e-5)
