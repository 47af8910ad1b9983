"""``instrument()``: make a model read replacement tensors at its targets' injection points.

How it works: each target module gets an instance-level ``forward``. When the
injection point is inside the module (e.g. router logits), the module is traced
alone with ``torch.fx``, :func:`~fxreplace.passes.insert_replacements` adds the
replacement/mask inputs to that small graph, and the new forward runs the
graph's code on the *original* module (so parameters, ``state_dict`` keys and
``load_state_dict`` are untouched). When the point is the module output, the
forward wraps the original one. The model's own ``forward`` takes
``replacements=`` and hands each target its tensors through a per-target slot;
tensors that reach a traced forward this way become graph inputs, so
torch.compile builds one graph for on, off and new values.
"""

from __future__ import annotations

import copy
import enum
import functools
import threading
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
from torch import nn
from torch.compiler import is_dynamo_compiling

from .context import ReplacementContext
from .injection import Injection, recording, with_element
from .passes import InjectionSpec, insert_replacements
from .points import InjectionPoint, check_adapter_fits, computes_linear_output, locate_injection_point
from .sharding import ShapeError
from .targets import ResolvedTarget, TargetError, TargetLike, closest_names, resolve_targets


class TargetNotHitError(RuntimeError):
    """A target's injection point ran zero or several times in one forward,
    e.g. because a kernel-replaced forward skips the router."""


class ConcurrentForwardError(RuntimeError):
    """An instrumented model was called while it was running a forward (from another thread):
    its targets' slots hold one forward's replacements at a time."""


class SlotState(enum.Enum):
    """Where a slot stands in its model's forward."""

    IDLE = "idle"  # outside an instrumented forward: the target passes through
    FED = "fed"  # armed eagerly with the fed buffers (output points may take the fast path)
    ARMED = "armed"  # armed with a forward's own replacements, or while the forward is recorded
    TAKEN = "taken"  # consumed: a second take in the same forward is an error


class _Slot:
    """Hands one forward's replacement to one target and records that the target
    consumed it. Between forwards it holds the fed buffers (or nothing), so a fed
    forward only sets its state. Under Dynamo, ``take`` is traced: its state is the
    same at every forward, so it is no recompile reason."""

    def __init__(self, target: ResolvedTarget):
        self.target = target
        self.fed = (None, None, False)  # (values, mask, leading_rows) that a forward without replacements= reads
        self.state = SlotState.IDLE
        self.hold_fed()

    def hold_fed(self) -> None:
        self.replacement, self.mask, self.leading_rows = self.fed

    def arm(self, replacement, mask, leading_rows=False):
        self.state = SlotState.ARMED
        self.replacement = replacement
        self.mask = mask
        self.leading_rows = leading_rows

    def take(self) -> bool:
        """True when called inside an instrumented forward."""
        state = self.state
        if state is SlotState.IDLE:
            return False
        if state is SlotState.TAKEN:
            raise TargetNotHitError(f"target {self.target.module_name!r} was hit twice in one forward")
        self.state = SlotState.TAKEN
        return True


def _bind(module: nn.Module, point: InjectionPoint, injection: Injection, slot: _Slot) -> None:
    """Give ``module`` an instance-level forward that reads ``slot``."""
    original = module.forward
    if point.graph_module is None:
        module.forward = _output_point_forward(original, point, injection, slot)
        return
    insert_replacements(
        point.graph_module,
        [InjectionSpec("", point.point, injection, "fxreplace_replacement")],
        leading_rows_input="fxreplace_leading_rows",
    )
    graph_forward = type(point.graph_module).forward

    def forward(*args, **kwargs):
        if not slot.take():
            return original(*args, **kwargs)
        return graph_forward(
            module, *args, **kwargs,
            fxreplace_replacement=slot.replacement, fxreplace_mask=slot.mask,
            fxreplace_leading_rows=slot.leading_rows,
        )

    module.forward = forward


def _output_point_forward(original, point: InjectionPoint, injection: Injection, slot: _Slot):
    """The forward of a target whose injection point is its output (or ``output[i]``).

    Eager engines call it once per target per forward, so their common case comes first:
    a slot armed eagerly with its fed buffers, a plain tensor at ``output`` or ``output[i]``
    of a tuple and a call the Injection has checked with those buffers take the fast path
    (:meth:`~fxreplace.injection.CheckedCalls.fed_entry`). Anything else, and any
    tracing, goes through the Injection."""
    index = point.output_index
    module_name, where = point.module_name, point.point
    kind = torch.Tensor if index is None else tuple

    def forward(*args, **kwargs):
        output = original(*args, **kwargs)
        # (Dynamo may start tracing inside an eager forward: then the Injection decides)
        if (slot.state is SlotState.FED and type(output) is kind and not injection.observers
                and not is_dynamo_compiling()):
            value = output if index is None else output[index]
            if type(value) is torch.Tensor:  # (not a subclass, e.g. a FakeTensor)
                entry = injection.checked.fed_entry(value)
                if entry is not None:
                    slot.state = SlotState.TAKEN
                    return with_injected(output, value, entry.inject(value))
        return inject_at_point(output)

    def inject_at_point(output):
        if not slot.take():
            return output
        if index is None:
            value = output
        elif isinstance(output, (tuple, list)):
            value = output[index]
        else:
            raise TargetError(f"{module_name!r}: point {where!r} indexes the output, but the module returns a "
                              f"{type(output).__name__} (indexing would pick a row): use point='output'")
        if type(value) is not torch.Tensor:
            _check_point_value(value, module_name, where)
        return with_injected(output, value, injection(value, slot.replacement, slot.mask, None, slot.leading_rows))

    def with_injected(output, value, injected):
        if index is None:
            return injected
        if injected is value:  # nothing replaced: the module's own output
            return output
        return with_element(output, index, injected)

    return forward


def _check_point_value(value, module_name: str, where) -> None:
    """An output point reads a tensor or a pair of tensors; anything else is an error."""
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return
    fallback = " (it cannot be traced alone, so 'auto' means its output)" if where == "auto" else ""
    raise TargetError(f"{module_name!r}: point {where!r}{fallback} is a {type(value).__name__}, not a tensor; use "
                      "point='output[i]' or a callable point")


class Instrumentation:
    """Per-model state: resolved targets, their slots and the feed buffers."""

    def __init__(self, targets: list[ResolvedTarget], points, injections, slots, max_tokens):
        self.targets = targets
        self.points = points
        self.injections = injections
        self.slots = slots
        self.max_tokens = max_tokens
        self.fed: list[tuple[torch.Tensor, torch.Tensor]] = []  # per target (values, mask) feed buffers, once fed
        self.overridden = False  # whether the slots hold a forward's own replacements (not the fed buffers)
        self.running = threading.Lock()  # held by the one eager forward in progress

    def buffer_names(self, i: int) -> tuple[str, str]:
        return f"_fxreplace_feed_{i}", f"_fxreplace_feed_mask_{i}"

    def remember_buffers(self, model: nn.Module) -> None:
        """Keep the feed buffers at hand: the slots hold them between forwards, so a forward
        without ``replacements=`` only arms them."""
        self.fed = [(getattr(model, v), getattr(model, m)) for v, m in map(self.buffer_names, range(len(self.targets)))]
        for slot, (values, mask) in zip(self.slots, self.fed):
            slot.fed = (values, mask, True)
            slot.hold_fed()

    def arm(self, model: nn.Module, replacements) -> None:
        if replacements is None:  # the fed buffers (or nothing), which the slots hold between forwards
            # FED only eagerly: a forward that make_fx/export/jit.trace records must reach the
            # Injection, which keeps Python state out of the recorded graph
            state = SlotState.ARMED if recording() else SlotState.FED
            for slot in self.slots:
                slot.state = state
            return
        if not isinstance(replacements, Mapping):
            raise TypeError(f"replacements must be a ReplacementContext or a dict of tensors, got {type(replacements)}")
        tensors = {name: replacements[name] for name in replacements}
        names = [t.capture_name for t in self.targets]
        if tensors and not any(name in tensors for name in names):
            raise KeyError(f"no replacement name {sorted(tensors)} matches a target capture name {names}")
        # A context may carry more capture names than this model instruments (e.g. one layer
        # of a full reference); names typed into a dict must each name a target.
        unknown = [] if isinstance(replacements, ReplacementContext) else [n for n in tensors if n not in names]
        if unknown:
            close = {n: closest_names(n, names, n=2) for n in unknown}
            raise KeyError(f"replacement name(s) {unknown} match no target; close capture names: {close}; "
                           f"all capture names: {names}")
        is_context = isinstance(replacements, ReplacementContext)
        self.overridden = True
        for slot, name in zip(self.slots, names):
            value = tensors.get(name)
            if value is None:
                slot.arm(None, None)  # missing from the context: this target stays off
                continue
            mask = replacements.mask_for(name) if is_context else None
            if mask is None:
                mask = torch.ones(value.shape[0], dtype=torch.bool, device=value.device)
            slot.arm(value, mask)

    def reset(self) -> list[str]:
        """Back to idle (the slots holding the fed buffers again); returns the targets armed
        but not reached since :meth:`arm`."""
        missed = [slot.target.module_name for slot in self.slots
                  if slot.state is SlotState.FED or slot.state is SlotState.ARMED]
        for slot in self.slots:
            slot.state = SlotState.IDLE
        if self.overridden:  # a forward's own replacements: not kept past it
            for slot in self.slots:
                slot.hold_fed()
            self.overridden = False
        return missed

    def finish(self) -> None:
        """:meth:`reset` after a forward that returned; every armed target must have been reached."""
        for slot in self.slots:
            if slot.state is not SlotState.TAKEN:
                break
            slot.state = SlotState.IDLE
        else:  # the common case: every target taken, nothing overridden
            if not self.overridden:
                return
        missed = self.reset()
        if missed:
            raise TargetNotHitError(
                f"targets not reached in this forward (a replaced or fused forward may skip them): {missed}"
            )


class InstrumentedModel:
    """Mixin placed in front of the model's class by :func:`instrument`."""

    _fxreplace: Instrumentation

    def forward(self, *args, replacements=None, **kwargs):
        """The model's forward; ``replacements`` is a ReplacementContext (its mask
        selects rows), a dict ``{name: Tensor[T, E]}`` (all rows replaced), or
        None (plain model, or the fed buffers after :meth:`feed`).

        One forward at a time: the targets' slots hold that forward's replacements, so a
        call while another thread's eager forward runs raises :class:`ConcurrentForwardError`
        (give each thread its own ``copy.deepcopy(model)``). Inside a compiled graph the
        check is not traced: callers of a compiled model serialize their calls themselves."""
        state = self._fxreplace
        exclusive = not is_dynamo_compiling()
        if exclusive and not state.running.acquire(blocking=False):
            raise ConcurrentForwardError(
                f"this instrumented {type(self).__name__} is already running a forward (in another thread): one "
                "instrumented model runs one forward at a time; give each thread its own copy.deepcopy(model)")
        try:
            try:
                state.arm(self, replacements)
                output = super().forward(*args, **kwargs)
            except BaseException:
                state.reset()  # a failed forward must leave no replacement armed for later calls
                raise
            state.finish()
        finally:
            if exclusive:
                state.running.release()
        return output

    def __deepcopy__(self, memo):
        """A copy with its own slots: the plain model is copied (the targets' instance forwards,
        which read this model's slots, left out) and instrumented anew with the same targets;
        fed buffers are copied and stay fed."""
        state = self._fxreplace
        cls = type(self).__bases__[1]
        twin = cls.__new__(cls)
        memo[id(self)] = twin
        own_forwards = {id(self.get_submodule(t.module_name).__dict__["forward"]) for t in state.targets}
        for key, value in self.__dict__.items():
            if key != "_fxreplace":
                twin.__dict__[key] = copy.deepcopy(value, memo)
        for target in state.targets:
            module = twin.get_submodule(target.module_name)
            if id(module.__dict__.get("forward")) in own_forwards:
                del module.__dict__["forward"]
        instrument(twin, [t.as_target() for t in state.targets], max_tokens=state.max_tokens)
        if state.fed:
            twin._fxreplace.remember_buffers(twin)
            for injection in twin._fxreplace.injections:
                injection.share_fed(None)
        return twin

    @property
    def targets(self) -> list[str]:
        """Qualified names of the instrumented modules, in model order."""
        return [t.module_name for t in self._fxreplace.targets]

    @torch.no_grad()
    def feed(self, replacements, *, bind: bool = False) -> None:
        """Copy a context into static max-size buffers that forwards without
        ``replacements=`` read (first T rows). For engines that own the forward
        call or replay CUDA graphs: buffers keep their storage, so a compiled or
        captured graph sees new values. Feed (e.g. a warmup context) before
        compiling.

        ``bind=True``: no copy; the buffers *become* the context's tensors and its
        mask (a ReplacementContext of ``max_tokens`` rows holding every target; a
        :class:`~fxreplace.context.SelectedContext` binds each target to its own mask).
        Writing into that context in place afterwards, e.g. with
        ``TensorReplacer.build_context_for_batch(..., out=<its first T rows>)``,
        is then the whole feed, before every forward: an eager forward on the host
        whose rows are all replaced reads them without a copy, so a model that
        modifies activations in place may write into them. :meth:`clear` still
        turns replacement off."""
        state = self._fxreplace
        if state.max_tokens is None:
            raise ValueError("feed() needs instrument(..., max_tokens=N) to size its buffers")
        if not isinstance(replacements, Mapping):
            raise TypeError(f"feed() needs a ReplacementContext or a dict of tensors, got {type(replacements).__name__}")
        tensors = {name: replacements[name] for name in replacements}
        mask = replacements.mask if isinstance(replacements, ReplacementContext) else None
        names = [t.capture_name for t in state.targets]
        # Every check comes before the first write: a refused feed leaves the previous one in force.
        unknown = [] if mask is not None else [n for n in tensors if n not in names]
        if unknown or (tensors and not any(n in tensors for n in names)):
            raise KeyError(f"feed(): replacement name(s) {unknown or sorted(tensors)} match no target; capture names: {names}")
        if bind:
            if mask is None or tuple(mask.shape) != (state.max_tokens,):
                raise ShapeError(f"feed(bind=True) needs a ReplacementContext of max_tokens={state.max_tokens} rows")
            for name in names:
                value = tensors.get(name)
                if value is None or value.shape[0] != state.max_tokens:
                    raise ShapeError(f"feed(bind=True): {name!r} is missing or not {state.max_tokens} rows")
            for i, name in enumerate(names):
                values_name, mask_name = state.buffer_names(i)
                self.register_buffer(values_name, tensors[name], persistent=False)
                self.register_buffer(mask_name, replacements.mask_for(name), persistent=False)
            state.remember_buffers(self)
            for injection, (values, mask) in zip(state.injections, state.fed):
                injection.share_fed(values, mask)
            return
        for i, name in enumerate(names):
            value = tensors.get(name)
            if not state.fed and value is None:
                raise KeyError(f"the first feed() must hold every target; {name!r} is missing")
            if value is None:
                continue
            shape = (state.max_tokens, *value.shape[1:]) if not state.fed else tuple(state.fed[i][0].shape)
            if value.shape[0] > state.max_tokens or tuple(value.shape[1:]) != shape[1:]:
                raise ShapeError(f"feed for {name}: shape {tuple(value.shape)} does not fit the buffer {shape}")
        for i, name in enumerate(names):
            values_name, mask_name = state.buffer_names(i)
            value = tensors.get(name)
            if not state.fed:
                self.register_buffer(values_name, value.new_zeros(state.max_tokens, *value.shape[1:]), persistent=False)
                self.register_buffer(mask_name, torch.zeros(state.max_tokens, dtype=torch.bool, device=value.device),
                                     persistent=False)
            values_buf, mask_buf = getattr(self, values_name), getattr(self, mask_name)
            mask_buf.fill_(False)
            if value is None:
                continue
            tokens = value.shape[0]
            values_buf[:tokens].copy_(value)
            mask_buf[:tokens].copy_(mask if mask is not None else torch.ones(tokens, dtype=torch.bool, device=value.device))
        state.remember_buffers(self)
        for injection in state.injections:
            injection.share_fed(None)

    @torch.no_grad()
    def clear(self) -> None:
        """Turn fed replacement off (mask all False); the same graph keeps running."""
        for _, mask in self._fxreplace.fed:
            mask.fill_(False)


_instrumented_classes: dict[type, type] = {}


def _instrumented_class(cls: type) -> type:
    """A subclass with the same name, so e.g. ``save_pretrained`` records the
    original architecture."""
    if cls not in _instrumented_classes:
        _instrumented_classes[cls] = type(
            cls.__name__, (InstrumentedModel, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        )
    return _instrumented_classes[cls]


def instrument(model: nn.Module, targets: Iterable[TargetLike], *, max_tokens: int | None = None) -> nn.Module:
    """Rewrite ``model``'s targets (glob strings or :class:`~fxreplace.Target`)
    in place to take replacements, and return it.

    The returned model is the same object: same parameters, ``state_dict``
    keys and weight loading. ``model(**inputs, replacements=ctx)`` replaces
    the rows ``ctx.mask`` selects; ``model(**inputs)`` is the plain model.
    ``max_tokens`` sizes the buffers of :meth:`InstrumentedModel.feed`.
    Every forward checks that each target's injection point ran exactly once.
    """
    if isinstance(model, InstrumentedModel):
        raise ValueError("model is already instrumented")
    resolved = resolve_targets(model, targets)
    if not resolved:
        raise ValueError("instrument() needs at least one target: a model instrumented at none would ignore every "
                         "replacement it is given")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int (rows of the feed buffers), got {max_tokens!r}")
    hook = model.__dict__.pop(_REFUSE_HOOK, None)
    if hook is not None:
        hook.remove()
    points, injections, slots = [], [], []
    for target in resolved:
        module = model.get_submodule(target.module_name)
        point = locate_injection_point(module, target.module_name, target.point)
        injection = Injection(target.module_name, module, target.adapter, target.shard)
        check_adapter_fits(target.module_name, target.point, target.adapter,
                           lambda: computes_linear_output(module, point))
        slot = _Slot(target)
        points.append(point)
        injections.append(injection)
        slots.append(slot)
    for target, point, injection, slot in zip(resolved, points, injections, slots):
        _bind(model.get_submodule(target.module_name), point, injection, slot)
    model._fxreplace = Instrumentation(resolved, points, injections, slots, max_tokens)
    model.__class__ = _instrumented_class(type(model))
    return model


def uninstrument(model: nn.Module) -> nn.Module:
    """Undo :func:`instrument`: the targets' own forwards and the model's class come back."""
    if not isinstance(model, InstrumentedModel):
        raise ValueError("model is not instrumented")
    state = model._fxreplace
    for target in state.targets:
        del model.get_submodule(target.module_name).__dict__["forward"]
    for i in range(len(state.targets)):
        for name in state.buffer_names(i):
            model._buffers.pop(name, None)
    del model._fxreplace
    model.__class__ = type(model).__bases__[1]
    model.__dict__[_REFUSE_HOOK] = model.register_forward_pre_hook(_refuse_replacements, with_kwargs=True)
    return model


_REFUSE_HOOK = "_fxreplace_refuse_replacements"


def _refuse_replacements(model: nn.Module, args, kwargs):
    """After :func:`uninstrument`: an HF forward's ``**kwargs`` would swallow ``replacements=``."""
    if "replacements" in kwargs:
        raise TypeError(f"{type(model).__name__} is no longer instrumented (uninstrument() was called): it would "
                        "ignore replacements=; instrument() it again to replace")


@contextmanager
def observe(model: nn.Module, callback: Callable[[str, torch.Tensor], None]):
    """Call ``callback(capture_name, computed)`` at every target's injection point,
    with the value the model computed there (before any replacement)."""
    if not isinstance(model, InstrumentedModel):
        raise ValueError("observe() needs an instrumented model")
    state = model._fxreplace
    added = []
    for target, injection in zip(state.targets, state.injections):
        observer = functools.partial(callback, target.capture_name)
        injection.observers.append(observer)
        added.append((injection, observer))
    try:
        yield
    finally:
        for injection, observer in added:
            injection.observers.remove(observer)
