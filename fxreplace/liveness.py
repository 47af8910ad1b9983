"""Every target proven live: a replacement that cannot reach the model's output is an error.

:func:`~fxreplace.instrument.instrument` refuses what a graph shows dead (an ``output[i]``
its caller never reads, :func:`~fxreplace.points.check_output_point_read`). What no graph
decides (a caller that cannot be traced, a value read but then dropped) :func:`check_live`
decides by running the model: one forward per target with a random replacement at that
target alone, which must move the model's output. Without that call, the first eager forward
that replaces an ``output[i]`` no graph decided watches whether any op reads it
(:class:`Watched`, :func:`check_watched`). Instrumented models are read through their state,
not imported: :mod:`~fxreplace.instrument` sits above the watch.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from .points import TargetNotLiveError, working_point

Run = Callable[[], object]


def _output_tensor(output) -> torch.Tensor:
    """What a forward returns, as one tensor: a tensor, or an HF output's ``logits``."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"check_live needs run() to return the model's output tensor (or an object with .logits), "
                    f"got {type(output).__name__}")


@torch.no_grad()
def check_live(model: torch.nn.Module, run: Run, *, seed: int = 0) -> dict[str, float]:
    """Prove that each of ``model``'s targets reaches its output.

    ``run()`` runs one forward of the instrumented model and returns its output (logits, or an HF
    output): call the model directly, or through the application that owns the forward (e.g.
    NxDI's bucketed wrapper), without ``replacements=``. It runs once with every replacement off
    and once per target with random values (the computed value's mean and spread) replacing all
    rows of that target alone; the fed buffers are left as they were. Eager only.

    Returns ``{module name: max |output change|}``. Raises :class:`TargetNotLiveError` naming
    every target whose replacement left the output unchanged, its point, and the point that works.
    """
    state = getattr(model, "_fxreplace", None)  # (not imported: instrument reads the watch below)
    if state is None:
        raise ValueError("check_live() needs an instrumented model")
    with _proving(state):
        return _check_live(model, run, seed)


def _check_live(model: torch.nn.Module, run: Run, seed: int) -> dict[str, float]:
    state = model._fxreplace
    computed: dict[str, torch.Tensor] = {}

    def record(name: str, value) -> None:
        if isinstance(value, torch.Tensor):
            computed[name] = value.detach().reshape(-1, value.shape[-1])

    with state.forcing({}), state.observing(record):
        baseline = _output_tensor(run()).clone()
    moved: dict[str, float] = {}
    dead = []
    generator = torch.Generator().manual_seed(seed)
    for target in state.targets:
        value = computed.get(target.capture_name)
        if value is None:
            raise TypeError(f"check_live: {target.module_name!r} (point {target.point!r}) computes no single tensor; "
                            "check it by replacing it in a validation run")
        spread = value.float().std().nan_to_num(1.0) + 1.0
        noise = torch.randn(value.shape, generator=generator) * spread + value.float().mean()
        with state.forcing({target.capture_name: noise.to(value.device)}):
            output = _output_tensor(run())
        moved[target.module_name] = (output.float() - baseline.float()).abs().max().item()
        if moved[target.module_name] == 0:
            dead.append(target)
    if dead:
        module = model.get_submodule(dead[0].module_name)
        raise TargetNotLiveError(
            f"replacing these targets does not change the model's output: "
            f"{', '.join(f'{t.module_name!r} (point {t.point!r})' for t in dead)}; "
            f"{working_point(module, dead[0].point)}")
    return moved


@contextmanager
def _proving(state):
    """While :func:`check_live` runs, its forwards decide, not the watch: the targets it passes
    are proven live, the others stay watched."""
    watched, state.unproven = state.unproven, []
    for slot in watched:
        slot.unproven = False
    try:
        yield
    except BaseException:
        for slot in watched:
            slot.unproven = True
        state.unproven = watched
        raise


def check_watched(state, model: torch.nn.Module) -> None:
    """After an eager forward of ``model`` (``state``, its Instrumentation): the targets it watched
    (see :class:`Watched`): read ones are proven live and no longer watched; one that no op read is
    dead, an error naming the point that works."""
    watched = [slot for slot in state.unproven if slot.read is not None]
    dead = [slot for slot in watched if not slot.read]
    for slot in watched:
        slot.unproven, slot.read = not slot.read, None
    state.unproven = [slot for slot in state.unproven if slot.unproven]
    if dead:
        state.reset()
        first = dead[0].target
        raise TargetNotLiveError(
            f"replacing {', '.join(f'{s.target.module_name!r} (point {s.target.point!r})' for s in dead)} changes "
            f"nothing: this forward never read what the target returns there (its caller could not be traced to "
            f"check this at instrument time); {working_point(model.get_submodule(first.module_name), first.point)}")


class Watched(torch.Tensor):
    """A target's output handed on while its slot watches whether any op reads it: the first
    eager forward through a target that no graph showed read proves it live (or dead) at the
    cost of one subclass dispatch per op on this one tensor. Ops on it return plain tensors."""

    @staticmethod
    def watch(value: torch.Tensor, slot) -> "Watched":
        watched = value.as_subclass(Watched)
        watched._fxreplace_watched = slot
        slot.read = False
        return watched

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _mark_read((args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _mark_read(value) -> None:
    if type(value) is Watched:
        value._fxreplace_watched.read = True
    elif isinstance(value, (tuple, list)):
        for item in value:
            _mark_read(item)
    elif isinstance(value, dict):
        for item in value.values():
            _mark_read(item)
