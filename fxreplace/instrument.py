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
import types
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
from torch import nn
from torch.compiler import is_dynamo_compiling

from .context import ReplacementContext
from .devices import computes_on
from .injection import Injection, inject_routing, recording, with_element
from .passes import InjectionSpec, insert_replacements
from .points import (GIVEN_FORWARD, ROUTING, WRAPPED_FORWARD, InjectionPoint, TargetNotLiveError, check_adapter_fits,
                     check_output_point_read, computes_linear_output, describe_forward, forward_attribute,
                     instance_forward, locate_injection_point, working_point)
from .registries import Registry
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
        self.unproven = False  # an output[i] that no graph showed read: the next eager forward watches it
        self.read: bool | None = None  # while watched: whether an op of this forward read it
        self.hold_fed()
        # set by _bind: the module's own forward, its point and Injection, the (shared) generated forward
        self.original = self.passes_self = self.point = self.injection = self.graph_forward = None

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
    """Give ``module`` an instance-level forward that reads ``slot``: one function for every target
    of a kind, bound to each module, reading everything target-specific from the slot. Dynamo
    guards on the function a module calls, so a function per target would recompile a frame
    resumed after a graph break inside a layer once per layer."""
    attribute = forward_attribute(module)
    module.__dict__[GIVEN_FORWARD] = module.__dict__.get(attribute)  # what :func:`_unbind` puts back
    original = getattr(module, attribute)
    own = isinstance(original, types.MethodType) and original.__self__ is module
    # a method's function (the class's is shared by every module of the class) rather than a method bound to this one
    slot.original, slot.passes_self = (original.__func__, True) if own else (original, False)
    slot.injection, slot.point = injection, point
    if point.graph_module is not None:
        slot.graph_forward = _shared_graph_forward(point, injection)
    module.__dict__[_SLOT] = slot
    forward = (_graph_point_forward if point.graph_module is not None else
               _routing_point_forward if point.routing_inputs is not None else _output_point_forward)
    module.__dict__[attribute] = types.MethodType(forward, module)


_SLOT = "_fxreplace_slot"
_SHARED_FORWARDS: dict[tuple, Callable] = {}


def _follow_class(module: nn.Module) -> None:
    """Point accelerate's wrapper, where the model has one, at its class's forward: it calls the
    forward bound at dispatch, which would bypass the instrumented class :func:`instrument` gives
    the model (and keep it after :func:`uninstrument`)."""
    if WRAPPED_FORWARD in module.__dict__:
        module.__dict__[WRAPPED_FORWARD] = types.MethodType(type(module).forward, module)


def _unbind(module: nn.Module) -> None:
    """Undo :func:`_bind`: the forward the module was given (its class's, or the instance's own)."""
    attribute, given = forward_attribute(module), module.__dict__.pop(GIVEN_FORWARD)
    if given is None:
        del module.__dict__[attribute]
    else:
        module.__dict__[attribute] = given
    module.__dict__.pop(_SLOT, None)


def _call_original(self, slot: _Slot, args, kwargs):
    return slot.original(self, *args, **kwargs) if slot.passes_self else slot.original(*args, **kwargs)


def _call_injection(injection: Injection, computed, replacement, mask, rank=None, leading_rows=False):
    """The op a target's graph calls: its Injection arrives as an input, not as a constant of the
    code, so every target of the same structure runs the same generated code."""
    return injection(computed, replacement, mask, rank, leading_rows)


def _shared_graph_forward(point: InjectionPoint, injection: Injection) -> Callable:
    """The forward of the point's graph (its target traced alone) with the replacement inputs
    added, shared by every target whose graph generates the same code over the same globals."""
    gm = point.graph_module
    insert_replacements(gm, [InjectionSpec("", point.point, injection, "fxreplace_replacement")],
                        leading_rows_input="fxreplace_leading_rows")
    graph = gm.graph
    node = next(n for n in graph.nodes if n.op == "call_function" and n.target is injection)
    leading = next(n for n in graph.nodes if n.op == "placeholder" and n.target == "fxreplace_leading_rows")
    with graph.inserting_after(leading):
        given = graph.placeholder("fxreplace_injection", default_value=None)
    node.target, node.args = _call_injection, (given, *node.args)
    gm.recompile()
    forward = type(gm).forward
    used = forward.__code__.co_names
    key = (gm.code, tuple((name, id(value)) for name, value in forward.__globals__.items() if name in used))
    return _SHARED_FORWARDS.setdefault(key, forward)


def _graph_point_forward(self, *args, **kwargs):
    """The forward of a target whose point is a node inside it: its graph's code on the module."""
    slot = self._fxreplace_slot
    if not slot.take():
        return _call_original(self, slot, args, kwargs)
    return slot.graph_forward(
        self, *args, **kwargs,
        fxreplace_replacement=slot.replacement, fxreplace_mask=slot.mask,
        fxreplace_leading_rows=slot.leading_rows, fxreplace_injection=slot.injection,
    )


def _routing_point_forward(self, *args, **kwargs):
    """The forward of a target whose point is the routing it is called with (see
    :func:`~fxreplace.injection.inject_routing`): the module runs on the replaced arguments."""
    slot = self._fxreplace_slot
    if not slot.take():
        return _call_original(self, slot, args, kwargs)
    point = slot.point
    args, kwargs = list(args), dict(kwargs)
    given = [args[key] if isinstance(key, int) else kwargs[key] for key in point.routing_inputs]
    routed = inject_routing(slot.injection, given, point.num_experts, slot.replacement, slot.mask, slot.leading_rows)
    for key, value in zip(point.routing_inputs, routed):
        if isinstance(key, int):
            args[key] = value
        else:
            kwargs[key] = value
    return _call_original(self, slot, tuple(args), kwargs)


def _output_point_forward(self, *args, **kwargs):
    """The forward of a target whose injection point is its output (or ``output[i]``).

    Eager engines call it once per target per forward, so their common case comes first:
    a slot armed eagerly with its fed buffers, a plain tensor at ``output`` or ``output[i]``
    of a tuple and a call the Injection has checked with those buffers take the fast path
    (:meth:`~fxreplace.injection.CheckedCalls.fed_entry`). Anything else, and any
    tracing, goes through the Injection."""
    slot = self._fxreplace_slot
    injection, index = slot.injection, slot.point.output_index
    output = _call_original(self, slot, args, kwargs)
    # (Dynamo may start tracing inside an eager forward: then the Injection decides)
    if (slot.state is SlotState.FED and type(output) is (torch.Tensor if index is None else tuple)
            and not injection.observers and not slot.unproven and not is_dynamo_compiling()):
        value = output if index is None else output[index]
        if type(value) is torch.Tensor:  # (not a subclass, e.g. a FakeTensor)
            entry = injection.checked.fed_entry(value)
            if entry is not None:
                slot.state = SlotState.TAKEN
                return _with_injected(output, index, value, entry.inject(value))
    if not slot.take():
        return output
    if index is None:
        value = output
    elif isinstance(output, (tuple, list)):
        value = output[index]
    else:
        raise TargetError(f"{slot.point.module_name!r}: point {slot.point.point!r} indexes the output, but the module "
                          f"returns a {type(output).__name__} (indexing would pick a row): use point='output'")
    if type(value) is not torch.Tensor:
        _check_point_value(value, slot.point.module_name, slot.point.point)
    injected = injection(value, slot.replacement, slot.mask, None, slot.leading_rows)
    if (slot.unproven and slot.replacement is not None and type(injected) is torch.Tensor
            and not is_dynamo_compiling() and not recording()):
        injected = _Watched.watch(injected, slot)
    return _with_injected(output, index, value, injected)


class _Watched(torch.Tensor):
    """A target's output handed on while its slot watches whether any op reads it: the first
    eager forward through a target that no graph showed read proves it live (or dead) at the
    cost of one subclass dispatch per op on this one tensor. Ops on it return plain tensors."""

    @staticmethod
    def watch(value: torch.Tensor, slot: _Slot) -> "_Watched":
        watched = value.as_subclass(_Watched)
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
    if type(value) is _Watched:
        value._fxreplace_watched.read = True
    elif isinstance(value, (tuple, list)):
        for item in value:
            _mark_read(item)
    elif isinstance(value, dict):
        for item in value.values():
            _mark_read(item)


def _with_injected(output, index: int | None, value, injected):
    if index is None:
        return injected
    if injected is value:  # nothing replaced: the module's own output
        return output
    return with_element(output, index, injected)


def _check_point_value(value, module_name: str, where) -> None:
    """An output point reads a tensor or a pair of tensors; anything else is an error."""
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return
    fallback = " (it cannot be traced alone, so 'auto' means its output)" if where == "auto" else ""
    raise TargetError(f"{module_name!r}: point {where!r}{fallback} is a {type(value).__name__}, not a tensor; use "
                      "point='output[i]' or a callable point")


BypassHint = Callable[[nn.Module, str], "str | None"]
_BYPASS_HINTS: Registry[BypassHint] = Registry("bypass hint")


def register_bypass_hint(hint: BypassHint, *, replace: bool = False) -> BypassHint:
    """``hint(model, module_name)`` says what skipped a target that a forward did not reach and
    what to turn off (e.g. a fused kernel a model family enables by a config flag), or None.
    Families register theirs (see ``fxreplace.models.nxd``); :class:`TargetNotHitError` shows them.
    Registered by its qualified name, which another hint takes only with ``replace=True``."""
    return _BYPASS_HINTS.register(f"{hint.__module__}.{hint.__qualname__}", hint, replace=replace)


def _bypass_hint(model: nn.Module, missed: list[str]) -> str:
    hints = [h for name in missed for h in (hint(model, name) for hint in _BYPASS_HINTS.values()) if h]
    if not hints:
        return ""
    more = f" (and {len(hints) - 1} more like it)" if len(hints) > 1 else ""
    return f"; {hints[0]}{more}"


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
        self.bound = False  # whether the feed buffers are a context's own tensors (feed(bind=True))
        self.unbound_by_move: str | None = None  # where a move made copies of bound buffers (dtype, device)
        self.forced: dict[str, torch.Tensor] | None = None  # see forcing()
        self.unproven = [slot for slot in slots if slot.unproven]  # see _check_watched()

    def buffer_names(self, i: int) -> tuple[str, str]:
        return f"_fxreplace_feed_{i}", f"_fxreplace_feed_mask_{i}"

    def remember_buffers(self, model: nn.Module) -> None:
        """Keep the feed buffers at hand: the slots hold them between forwards, so a forward
        without ``replacements=`` only arms them."""
        self.fed = [(getattr(model, v), getattr(model, m)) for v, m in map(self.buffer_names, range(len(self.targets)))]
        for slot, (values, mask) in zip(self.slots, self.fed):
            slot.fed = (values, mask, True)
            slot.hold_fed()

    def follow_move(self, model: nn.Module) -> None:
        """After ``model.to(...)`` (or any ``_apply``): the fed buffers are the model's new
        tensors, so the slots read those. Bound buffers are now copies of the context the
        caller writes into: forwards refuse to run until it is fed again."""
        if not self.fed:
            return
        moved = [(getattr(model, v), getattr(model, m)) for v, m in map(self.buffer_names, range(len(self.targets)))]
        if all(a is b for pair, old in zip(moved, self.fed) for a, b in zip(pair, old)):
            return
        if self.bound:
            self.unbound_by_move = f"{moved[0][0].dtype} on {moved[0][0].device}"
        self.remember_buffers(model)
        for injection in self.injections:
            injection.share_fed(None)

    @contextmanager
    def forcing(self, values: Mapping[str, torch.Tensor]):
        """While inside, an eager forward without ``replacements=`` replaces every row of the
        targets named in ``values`` (capture names) and nothing else; the fed buffers are kept."""
        self.forced = dict(values)
        try:
            yield
        finally:
            self.forced = None

    def arm(self, model: nn.Module, replacements) -> None:
        if replacements is None and self.unbound_by_move is not None:
            raise ValueError(
                f"the model was moved or converted after feed(bind=True): its feed buffers are now copies "
                f"({self.unbound_by_move}), no longer the context you write into; feed the context again after the "
                "move, built or moved there (feed(ctx.to(device), bind=True))")
        if replacements is None and self.forced is not None:
            replacements = self.forced
        if replacements is None:  # the fed buffers (or nothing), which the slots hold between forwards
            # FED only eagerly: a forward that make_fx/export/jit.trace records must reach the
            # Injection, which keeps Python state out of the recorded graph
            state = SlotState.ARMED if recording() else SlotState.FED
            for slot in self.slots:
                slot.state = state
            return
        if not isinstance(replacements, Mapping):
            raise TypeError(f"replacements must be a ReplacementContext or a dict of tensors, got {type(replacements)}")
        names = [t.capture_name for t in self.targets]
        is_context = isinstance(replacements, ReplacementContext)
        # A context is read by target name only: a compiled graph guards on what it reads, and
        # iterating would make it guard on the order in which the context lists its names.
        tensors = ({name: replacements[name] for name in names if name in replacements} if is_context
                   else {name: replacements[name] for name in replacements})
        if len(replacements) and not any(name in tensors for name in names):
            raise KeyError(f"no replacement name {sorted(replacements)} matches a target capture name {names}")
        # A context may carry more capture names than this model instruments (e.g. one layer
        # of a full reference); names typed into a dict must each name a target.
        unknown = [] if is_context else [n for n in tensors if n not in names]
        if unknown:
            close = {n: closest_names(n, names, n=2) for n in unknown}
            raise KeyError(f"replacement name(s) {unknown} match no target; close capture names: {close}; "
                           f"all capture names: {names}")
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

    @contextmanager
    def proving(self):
        """While :func:`~fxreplace.liveness.check_live` runs, its forwards decide, not the watch:
        the targets it passes are proven live, the others stay watched."""
        watched, self.unproven = self.unproven, []
        for slot in watched:
            slot.unproven = False
        try:
            yield
        except BaseException:
            for slot in watched:
                slot.unproven = True
            self.unproven = watched
            raise

    def _check_watched(self, model: nn.Module) -> None:
        """The targets this forward watched (see :class:`_Watched`): read ones are proven live
        and no longer watched; one that no op read is dead, an error naming the point that works."""
        watched = [slot for slot in self.unproven if slot.read is not None]
        dead = [slot for slot in watched if not slot.read]
        for slot in watched:
            slot.unproven, slot.read = not slot.read, None
        self.unproven = [slot for slot in self.unproven if slot.unproven]
        if dead:
            self.reset()
            first = dead[0].target
            raise TargetNotLiveError(
                f"replacing {', '.join(f'{s.target.module_name!r} (point {s.target.point!r})' for s in dead)} changes "
                f"nothing: this forward never read what the target returns there (its caller could not be traced to "
                f"check this at instrument time); {working_point(model.get_submodule(first.module_name), first.point)}")

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

    def finish(self, model: nn.Module) -> None:
        """:meth:`reset` after a forward that returned; every armed target must have been reached."""
        if self.unproven:
            self._check_watched(model)
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
                + _bypass_hint(model, missed))


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
            state.finish(self)
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
        for slot in state.slots:  # not copied: the twin gets its own
            memo[id(slot)] = None
        for key, value in self.__dict__.items():
            if key != "_fxreplace":
                twin.__dict__[key] = copy.deepcopy(value, memo)
        for target in state.targets:
            module = twin.get_submodule(target.module_name)
            if _SLOT in module.__dict__:  # the copied instance forward reads this model's slot
                _unbind(module)
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
        whose rows are all replaced reads contiguous ones without a copy, so a model that
        modifies activations in place may write into them (a replacer's contexts hold
        strided columns, which go through ``where``). :meth:`clear` still
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
            state.bound, state.unbound_by_move = True, None
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
            if not state.fed:  # where the target computes, whatever device the context was built on
                device = computes_on(self.get_submodule(state.targets[i].module_name)) or value.device
                # plain tensors even under torch.inference_mode(): later feeds and clear() may run outside it
                with torch.inference_mode(False):
                    self.register_buffer(values_name, value.new_zeros(state.max_tokens, *value.shape[1:], device=device),
                                         persistent=False)
                    self.register_buffer(mask_name, torch.zeros(state.max_tokens, dtype=torch.bool, device=device),
                                         persistent=False)
            values_buf, mask_buf = getattr(self, values_name), getattr(self, mask_name)
            mask_buf.fill_(False)
            if value is None:
                continue
            tokens = value.shape[0]
            values_buf[:tokens].copy_(value)
            mask_buf[:tokens].copy_(mask if mask is not None else torch.ones(tokens, dtype=torch.bool, device=value.device))
        state.remember_buffers(self)
        state.bound, state.unbound_by_move = False, None
        for injection in state.injections:
            injection.share_fed(None)

    def _apply(self, fn, *args, **kwargs):
        """``to()``, ``cuda()``, ``half()``...: the fed buffers move with the model and the targets read them there."""
        out = super()._apply(fn, *args, **kwargs)
        self._fxreplace.follow_move(self)
        return out

    @torch.no_grad()
    def clear(self) -> None:
        """Turn fed replacement off (mask all False); the same graph keeps running."""
        if not torch.is_inference_mode_enabled() and any(mask.is_inference() for _, mask in self._fxreplace.fed):
            raise ValueError("clear(): the fed masks are the tensors of a context built under torch.inference_mode() "
                             "(feed(bind=True)), which only change inside it: call clear() inside inference_mode too, "
                             "or build the bound context outside it")
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
    if instance_forward(model) is not None:
        raise TargetError(f"the model ({type(model).__name__}): {describe_forward(model)}, which would bypass the "
                          "forward taking replacements= that instrument() gives the model's class; define that forward "
                          "on a subclass of the model instead")
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
        proven = check_output_point_read(model, target.module_name, target.point)
        parent = model.get_submodule(target.module_name.rpartition(".")[0])
        point = locate_injection_point(module, target.module_name, target.point, parent=parent)
        if point.point == ROUTING and target.shard is not None and target.shard.mode == "expert":
            raise TargetError(f"{target.module_name!r}: point 'routing' takes every expert's column (its expert ids "
                              "are global); give this rank the full routing (no expert shard)")
        injection = Injection(target.module_name, module, target.adapter, target.shard)
        check_adapter_fits(target.module_name, target.point, target.adapter,
                           lambda: computes_linear_output(module, point))
        slot = _Slot(target)
        slot.unproven = not proven
        points.append(point)
        injections.append(injection)
        slots.append(slot)
    for target, point, injection, slot in zip(resolved, points, injections, slots):
        _bind(model.get_submodule(target.module_name), point, injection, slot)
    model._fxreplace = Instrumentation(resolved, points, injections, slots, max_tokens)
    model.__class__ = _instrumented_class(type(model))
    _follow_class(model)
    return model


def uninstrument(model: nn.Module) -> nn.Module:
    """Undo :func:`instrument`: the targets' own forwards and the model's class come back."""
    if not isinstance(model, InstrumentedModel):
        raise ValueError("model is not instrumented")
    state = model._fxreplace
    for target in state.targets:
        _unbind(model.get_submodule(target.module_name))
    for i in range(len(state.targets)):
        for name in state.buffer_names(i):
            model._buffers.pop(name, None)
    del model._fxreplace
    model.__class__ = type(model).__bases__[1]
    _follow_class(model)
    model.__dict__[_REFUSE_HOOK] = model.register_forward_pre_hook(_refuse_replacements, with_kwargs=True)
    return model


_REFUSE_HOOK = "_fxreplace_refuse_replacements"


def _refuse_replacements(model: nn.Module, args, kwargs):
    """After :func:`uninstrument`: an HF forward's ``**kwargs`` would swallow ``replacements=``."""
    if "replacements" in kwargs:
        raise TypeError(f"{type(model).__name__} is no longer instrumented (uninstrument() was called): it would "
                        "ignore replacements=; instrument() it again to replace")


class InstrumentationChangedError(TargetError):
    """Instrumenting changed what a target computes with nothing replaced: a verdict on this model
    would judge another program than the one the user gave."""


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
    slots, skipped = model._fxreplace.slots, set(skip)
    changed: list[tuple[str, str]] = []
    rerunning = False

    def compare(module, args, kwargs, output, name):
        nonlocal rerunning
        if rerunning or changed:  # a target inside one run again: its own call was compared
            return
        states, rerunning = [slot.state for slot in slots], True
        for slot in slots:
            slot.state = SlotState.IDLE
        try:
            given = _call_original(module, module._fxreplace_slot, args, kwargs)
        finally:
            for slot, state in zip(slots, states):
                slot.state = state
            rerunning = False
        difference = _difference(_leaves(given), _leaves(output))
        if difference is not None:
            changed.append((name, difference))

    # first of the targets' forward hooks: what the forward itself returned (a user's hooks follow, alike in both)
    hooks = [model.get_submodule(t.module_name).register_forward_hook(
        functools.partial(compare, name=t.module_name), with_kwargs=True, prepend=True)
        for t in model._fxreplace.targets if t.module_name not in skipped]
    try:
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
