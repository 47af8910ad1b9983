"""Instrumenting proven harmless: with nothing replaced, the instrumented model computes, bit for
bit, what the model as given computes (engines prove it at start-up, before any verdict)."""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
from torch import nn

from .errors import InstrumentationChangedError
from .instrument import InstrumentedModel
from .points import describe_forward
from .slots import ARMED, SlotState
from .targets import TargetError


@torch.no_grad()
def check_unchanged(model: nn.Module, input_ids: torch.Tensor) -> None:
    """Prove on one input (``[1, T]`` token ids, a forward without a cache) that the instrumented
    ``model`` with nothing replaced computes, bit for bit, what the model as given computes
    (:func:`prove_unchanged`)."""
    if not isinstance(model, InstrumentedModel):
        raise ValueError("check_unchanged() needs an instrumented model")
    prove_unchanged(model, lambda: model(input_ids=input_ids, use_cache=False, replacements={}))


def prove_unchanged(model: nn.Module, forward: Callable[[], object], skip: Iterable[str] = ()) -> None:
    """Prove that the instrumented ``model`` with nothing replaced computes, bit for bit, what the
    model as given computes. ``forward()`` runs one forward of it the way its caller runs the model
    (a runner's prompt, an engine's dummy step); at each target, the forward it was given runs again
    on the very arguments its instrumented forward received, every target passing through meanwhile,
    and the two outputs must agree. The same inputs, so an engine's state (a dummy step reads memory
    it never wrote) cannot tell them apart; targets agreeing on their inputs, the model agrees.
    ``skip``: targets not compared (an engine's whose own forward gives other bits on each call there).
    Raises :class:`InstrumentationChangedError` naming the first target, in forward order, that differs."""
    if not isinstance(model, InstrumentedModel):
        raise ValueError("prove_unchanged() needs an instrumented model")
    state, skipped = model._fxreplace, set(skip)
    changed: list[tuple[str, str]] = []
    rerunning = False

    def compare(module, args, kwargs, output, name):
        nonlocal rerunning
        if rerunning or changed:  # a target inside one run again: its own call was compared
            return
        # outside an instrumented forward for the rerun: no entry to read, no slot armed or hit
        inputs, states, rerunning = getattr(ARMED, state.key, None), [slot.state for slot in state.slots], True
        setattr(ARMED, state.key, None)
        for slot in state.slots:
            slot.state = SlotState.IDLE
        try:
            slot = module._fxreplace_slot
            given = slot.own(*args, **kwargs)
        finally:
            setattr(ARMED, state.key, inputs)
            for slot, saved in zip(state.slots, states):
                slot.state = saved
            rerunning = False
        difference = _difference(_leaves(given), _leaves(output))
        if difference is not None:
            changed.append((name, difference))

    # first of the targets' forward hooks: what the forward itself returned (a user's hooks follow, alike in both)
    hooks = [model.get_submodule(t.module_name).register_forward_hook(
        functools.partial(compare, name=t.module_name), with_kwargs=True, prepend=True)
        for t in model._fxreplace.targets if t.module_name not in skipped]
    try:
        with state.proving():  # the instrumented forwards are what is proven, even in a forward replacing nothing
            forward()
    finally:
        for hook in hooks:
            hook.remove()
    if changed:
        name, difference = changed[0]
        raise InstrumentationChangedError(
            f"instrumenting {name!r} changed what it computes with nothing replaced ({difference}); "
            f"{describe_forward(model.get_submodule(name))}: a verdict would judge another model than the one given, "
            "so none is given; please report this with the module's forward")


def _leaves(value) -> list[torch.Tensor]:
    return [leaf.detach().clone() for leaf in torch.utils._pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN where NaN is."""
    if torch.equal(a, b):
        return True
    nan = a.isnan() if a.is_floating_point() else None
    return nan is not None and torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def _difference(given: list[torch.Tensor], instrumented: list[torch.Tensor]) -> str | None:
    """How two outputs of one call (their tensors) differ, in words; None when they are bit-equal."""
    if len(given) != len(instrumented):
        return f"{len(given)} output tensor(s) as given, {len(instrumented)} instrumented"
    for a, b in zip(given, instrumented):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"an output {a.dtype} {tuple(a.shape)} as given, {b.dtype} {tuple(b.shape)} instrumented"
        if not _bit_equal(a, b):
            gap = (a.double() - b.double()).abs().nan_to_num(0).max().item()
            return f"max |diff| {gap:.3g}"
    return None
