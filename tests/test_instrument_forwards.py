"""Instrumenting never changes what a model computes, whatever defines a target's forward.

A port (or a test) often swaps a module's code without a new class: a bound method, a
``functools.partial`` or a plain function set on the instance, a subclass, hooks, accelerate's
dispatch hooks, a submodule compiled on its own. Each is planted here as a router bug (top-k
weights not renormalised, and the logits scaled) in one layer of a tiny Qwen3-MoE: with nothing
replaced the instrumented model must compute, bit for bit in float32, what the buggy model
computes, and replacing the router logits must still replace them."""

import copy
import functools
import types

import pytest
import torch
import torch.nn.functional as F

import fxreplace.models as families
from fxreplace import TargetError, slots
from fxreplace.instrument import instrument, observe, uninstrument
from fxreplace.unchanged import InstrumentationChangedError, check_unchanged
from graph_helpers import input_ids

ARCH = "Qwen3MoeForCausalLM"
GATE = "model.layers.1.mlp.gate"
TARGETS = ["model.layers.*.mlp.gate"]


def buggy_router(self, hidden_states):
    """Qwen3-MoE's router with two port bugs: logits scaled by 2, top-k weights not renormalised."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight) * 2.0
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    return router_logits, router_top_value.to(router_logits.dtype), router_indices


def _bound_method(gate, parent):
    gate.forward = types.MethodType(buggy_router, gate)


def _partial(gate, parent):
    gate.forward = functools.partial(buggy_router, gate)


def _plain_function(gate, parent):
    def forward(hidden_states):
        return buggy_router(gate, hidden_states)

    gate.forward = forward


def _subclass(gate, parent):
    gate.__class__ = type("BuggyRouter", (type(gate),), {"forward": buggy_router})


def _forward_hook(gate, parent):
    # the bug as an output hook: the weights it hands on (output[1]) left unnormalised by a factor
    gate.register_forward_hook(lambda module, args, output: (output[0], output[1] * 1.5, output[2]))


def _pre_hook(gate, parent):
    gate.register_forward_pre_hook(lambda module, args: (args[0] * 1.5,))


def _accelerate_hook(gate, parent):
    from accelerate.hooks import ModelHook, add_hook_to_module

    _bound_method(gate, parent)  # the bug set before dispatch: accelerate's wrapper calls it as the module's forward
    add_hook_to_module(gate, ModelHook())


def _compiled_alone(gate, parent):
    _bound_method(gate, parent)
    gate.compile(backend="eager")


def _compiled_wrapper(gate, parent):
    _bound_method(gate, parent)
    parent.gate = torch.compile(gate, backend="eager")  # the parent holds an OptimizedModule around the router


PLANTS = {
    "bound method": _bound_method,
    "functools.partial": _partial,
    "plain function": _plain_function,
    "subclass": _subclass,
    "forward hook": _forward_hook,
    "pre-hook": _pre_hook,
    "accelerate hook": _accelerate_hook,
    "compiled alone": _compiled_alone,
    "compiled wrapper": _compiled_wrapper,
}


@pytest.fixture(scope="module")
def plain():
    return families.tiny_model(ARCH)


def logits(model, **kwargs):
    with torch.no_grad():
        return model(input_ids=input_ids(), **kwargs).logits


@pytest.mark.parametrize("how", list(PLANTS))
def test_instrumenting_keeps_a_forward_however_it_is_defined(plain, how):
    buggy = copy.deepcopy(plain)
    PLANTS[how](buggy.get_submodule(GATE), buggy.get_submodule(GATE.rpartition(".")[0]))
    wanted = logits(buggy)
    assert not torch.equal(wanted, logits(plain)), "the planted bug changes nothing: the test would prove nothing"
    target = instrument(buggy, TARGETS)
    assert torch.equal(logits(target), wanted), f"instrumenting erased a router bug defined by a {how}"
    check_unchanged(target, input_ids()[:1])  # the proof validate and blame run on their first forward
    # replacing the router logits still replaces them: the same values in and out change nothing
    seen = {}
    with observe(target, lambda name, computed: seen.update({name: computed.detach()})):  # what the point computes
        logits(target)
    assert torch.equal(logits(target, replacements={GATE: seen[GATE]}), wanted)
    assert not torch.equal(logits(target, replacements={GATE: torch.zeros_like(seen[GATE])}), wanted)
    uninstrument(target)
    assert torch.equal(logits(target), wanted), f"uninstrument() lost a router bug defined by a {how}"


def test_a_deep_copy_keeps_an_instance_forward(plain):
    buggy = copy.deepcopy(plain)
    _bound_method(buggy.get_submodule(GATE), None)
    wanted = logits(buggy)
    twin = copy.deepcopy(instrument(buggy, TARGETS))
    assert torch.equal(logits(twin), wanted)
    uninstrument(twin)
    assert torch.equal(logits(twin), wanted)


def test_a_forward_that_cannot_be_traced_is_refused_naming_what_defines_it(plain):
    buggy = copy.deepcopy(plain)
    gate = buggy.get_submodule(GATE)

    def untraceable(hidden_states):
        if float(hidden_states.sum()) > 1e30:  # data-dependent control flow: torch.fx cannot trace it
            return None
        return buggy_router(gate, hidden_states)

    gate.forward = untraceable
    with pytest.raises(TargetError, match=r"'model.layers.1.mlp.gate': its forward is an instance attribute "
                                          r"\(function [\w.<>]*untraceable\), which torch.fx cannot trace alone to "
                                          r"find point 'auto' \('auto': the logits its class computes inside\)"):
        instrument(buggy, TARGETS)


def test_another_modules_forward_set_on_a_target_is_refused_naming_it(plain):
    """A forward bound to another module (a port swapping in its own router's forward) computes with that
    module's weights, which the target does not hold: no point in it can be a graph of the target's."""
    buggy = copy.deepcopy(plain)
    gate = buggy.get_submodule(GATE)
    ported = copy.deepcopy(gate)
    _bound_method(ported, None)
    gate.forward = ported.forward
    with pytest.raises(TargetError, match=r"'model.layers.1.mlp.gate': its forward is an instance attribute \(method "
                                          r"buggy_router bound to another Qwen3MoeTopKRouter\), which torch.fx cannot"):
        instrument(buggy, TARGETS)


def test_a_model_whose_own_forward_is_an_instance_attribute_is_refused(plain):
    model = copy.deepcopy(plain)

    def patched_forward(self, *args, **kwargs):
        return type(self).forward(self, *args, **kwargs)

    model.forward = types.MethodType(patched_forward, model)
    with pytest.raises(TargetError, match=r"the model \(Qwen3MoeForCausalLM\): its forward is an instance attribute "
                                          r"\(method [\w.<>]*patched_forward bound to it\)"):
        instrument(model, TARGETS)


def test_a_target_changed_by_instrumenting_is_refused_naming_it(plain):
    """The proof itself: a forward changed after instrumenting (here the traced graph's code, as a trace that
    took another branch than the run would) is found and named, with the size of the change."""
    target = instrument(copy.deepcopy(plain), TARGETS)
    slot = target.get_submodule(GATE)._fxreplace_slot
    traced = slots._FORWARDS[slot.point_data]  # the graph forward, by its number

    def changed(self, *args, **kwargs):
        out = traced(self, *args, **kwargs)
        return (out[0] * 2, *out[1:])

    slot.point_data = slots._forward_number(changed)
    with pytest.raises(InstrumentationChangedError, match=r"instrumenting 'model.layers.1.mlp.gate' changed what it "
                                                          r"computes with nothing replaced \(max \|diff\| [0-9.e+-]+\)"):
        check_unchanged(target, input_ids()[:1])


def _inference_router(self, hidden_states):
    """A router with a path for inference only (grad off), as ports add for their kernels; here that path
    scales the logits. torch.fx traces with grad on, so its graph holds the other path: instrumented, the
    router would compute another model than the one given, whose forwards run with grad off."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    if not torch.is_grad_enabled():
        router_logits = router_logits * 2.0
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    return router_logits, router_top_value.to(router_logits.dtype), router_indices


def _inference_target(plain):
    target = copy.deepcopy(plain)
    gate = target.get_submodule(GATE)
    gate.forward = types.MethodType(_inference_router, gate)
    return target


PROMPTS = [[11, 12, 13, 14], [21, 22, 23]]
CHANGED = r"instrumenting 'model.layers.1.mlp.gate' changed what it computes.*method _inference_router bound to it"


def test_validation_refuses_a_target_its_instrumentation_changed(plain):
    import fxreplace

    reference = fxreplace.capture_reference(plain, PROMPTS, TARGETS, max_new_tokens=4)
    target = instrument(_inference_target(plain), TARGETS)
    runner = fxreplace.Runner(target, plain.config, fxreplace.TensorReplacer(reference.store),
                              fxreplace.RunnerConfig(prefill_buckets=(8,), batch_buckets=(2,), max_len=16))
    with pytest.raises(InstrumentationChangedError, match=CHANGED):
        fxreplace.logit_validation(runner, reference)


def test_blame_refuses_a_target_its_instrumentation_changed(plain):
    import fxreplace

    reference = fxreplace.capture_reference(plain, PROMPTS, TARGETS, max_new_tokens=4)
    with pytest.raises(InstrumentationChangedError, match=CHANGED):
        fxreplace.blame(_inference_target(plain), reference, clean=plain, progress=False)
