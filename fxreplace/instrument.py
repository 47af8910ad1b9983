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
import itertools
import threading
import types
import weakref
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
from torch import nn
from torch._dynamo.symbolic_convert import InstructionTranslator as _InstructionTranslator  # no public way to ask fullgraph
from torch._guards import TracingContext as _TracingContext  # no public way to tell a trace apart
from torch.compiler import is_dynamo_compiling

from .context import Layout, ReplacementContext
from .devices import computes_on
from .injection import Injection, inject, inject_routing, recording, with_element
from .passes import InjectionSpec, insert_replacements
from .points import (GIVEN_FORWARD, ROUTING, TARGET_CLASS, WRAPPED_FORWARD, InjectionPoint, TargetNotLiveError,
                     check_adapter_fits, check_output_point_read, computes_linear_output, describe_forward,
                     forward_attribute, given_class, instance_forward, locate_injection_point, working_point)
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
    """One target's part of its model's forwards: what is fixed at instrument time (its point, its
    Injection, the forward it was given, and ``constants``: the plain values a compiled graph folds
    in with one identity guard on the slot) and, eagerly, whether this forward reached it."""

    def __init__(self, target: ResolvedTarget):
        self.target = target
        self.state = SlotState.IDLE
        self.unproven = False  # an output[i] that no graph showed read: the next eager forward watches it
        self.read: bool | None = None  # while watched: whether an op of this forward read it
        # set by _bind: the module's own forward, its point and Injection, the (shared) generated forward
        self.original = self.passes_self = self.point = self.injection = self.graph_forward = None
        self.constants: tuple = ()  # (model key, index, passes_self, output index, spec, name, given forward's number)
        self.traced_in = None  # the Dynamo trace that last reached it (see _constants)

    def take(self) -> None:
        """Record that an eager forward reached the target (a second time is an error). A slot left
        idle was armed by a compiled forward (an eager stretch between graph breaks): its graph's
        trace checked the hits."""
        state = self.state
        if state is SlotState.TAKEN:
            raise TargetNotHitError(f"target {self.target.module_name!r} was hit twice in one forward")
        if state is not SlotState.IDLE:
            self.state = SlotState.TAKEN


class _Armed:
    """Per instrumented model (an attribute named by its key), the forward in progress: per target
    ``(replacement, mask, leading_rows)`` or None (that target off). Set and cleared by the model's
    forward; the targets read their entry here, eagerly and in a compiled graph alike. In a graph the
    list is a value of the trace (never a guarded input), so the guards do not grow with the targets;
    an attribute rather than a dict item, as Dynamo would guard on the dict's keys (every model's)."""


_ARMED = _Armed()
_MODEL_KEYS = itertools.count()
_OBSERVING = [0]  # observe() contexts open: while none is, a compiled graph folds "no observers" in


def _trace_now():
    """The Dynamo trace running, or None (eagerly). Read only by the constant functions below, which
    Dynamo runs at trace time."""
    return _TracingContext.try_get()


_MODEL_TRACE = [None]  # the Dynamo trace of an instrumented model's forward in progress (see _traced_begin)


_IN_MODEL, _ONE_GRAPH, _RESUMABLE = range(3)  # how a traced target reads its entry (see _trace_kind)


@torch.compiler.assume_constant_result
def _trace_kind() -> int:
    """How the running trace reaches a target, folded into the graph with no guard at all:
    ``_IN_MODEL``, an instrumented model's forward (the slot's constants folded in); ``_ONE_GRAPH``,
    a trace that may not break (``fullgraph``: vLLM compiles the inner model, below the forward that
    arms) and reads the entry in the graph; else ``_RESUMABLE`` (a target compiled alone, a frame
    resumed after a graph break), which reads it outside the graph: in it, a guard per target would
    recompile the frame's code once per layer."""
    trace = _trace_now()
    if trace is not None and _MODEL_TRACE[0] is trace:
        return _IN_MODEL
    tx = _InstructionTranslator.current_tx()
    return _ONE_GRAPH if tx is not None and (tx.one_graph or getattr(tx, "error_on_graph_break", False)) else _RESUMABLE


@torch.compiler.assume_constant_result
def _constants(slot: _Slot) -> tuple:
    """``slot.constants``, folded into the model's graph and guarded by the slot's identity alone.
    It also records the hit (see :func:`_traced_hits`)."""
    trace = _trace_now()
    if slot.traced_in is trace:
        raise TargetNotHitError(f"target {slot.target.module_name!r} was hit twice in one forward")
    slot.traced_in = trace
    return slot.constants


@torch.compiler.assume_constant_result
def _traced_begin(state: "Instrumentation") -> int:
    """At trace time, as the model's forward arms: its targets record their hits in this trace."""
    state.trace = _MODEL_TRACE[0] = _trace_now()
    return 0


@torch.compiler.assume_constant_result
def _traced_plan(state: "Instrumentation", layout: Layout) -> tuple:
    """Per target, where a context of ``layout`` holds it: ``(group, column, mask row or -1)``, or
    None. Folded into the graph, guarded by the identities of the model's state and the (interned)
    layout: one guard each, whatever the number of targets or capture names."""
    plan = []
    for target in state.targets:
        place = layout.places.get(target.capture_name)
        rows = layout.mask_rows
        plan.append(None if place is None else (*place, -1 if rows is None else rows[target.capture_name]))
    return tuple(plan)


@torch.compiler.assume_constant_result
def _traced_hits(state: "Instrumentation") -> int:
    """At trace time, after the model's forward: every target the trace armed was reached exactly
    once. A trace cut by a graph break is checked no further (its eager stretches check their own)."""
    trace = _trace_now()
    if trace is not None and state.trace is trace:
        missed = [slot.target.module_name for slot in state.slots if slot.traced_in is not trace]
        if missed:
            raise TargetNotHitError(f"targets not reached in this forward (a replaced or fused forward may skip "
                                    f"them): {missed}")
    return 0


def _bind(module: nn.Module, point: InjectionPoint, injection: Injection, slot: _Slot) -> None:
    """Give ``module`` the forward that reads ``slot``: its class becomes a subclass whose forward
    is one function for every target of a kind, reading everything target-specific from the slot.
    A class, not a forward set on the instance: Dynamo checks a method an instance holds with a
    Python guard per target (that it is bound to that instance). One function, not one per target:
    Dynamo guards on the function a module calls, so a frame resumed after a graph break inside a
    layer would recompile once per layer. The instance's own forward, where it has one, runs from
    the slot; accelerate's wrapper is pointed at the class's forward."""
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
    if attribute == "forward":
        module.__dict__.pop("forward", None)  # the instance's own forward, now the slot's
    module.__class__ = _target_class(type(module), forward)
    _follow_class(module)


_SLOT = "_fxreplace_slot"
_SHARED_FORWARDS: dict[tuple, Callable] = {}
TARGET_CLASSES: dict[tuple, type] = {}


def _target_class(cls: type, forward: Callable) -> type:
    """``cls`` with ``forward``, under the same name (shared by every target of the class and kind)."""
    key = (cls, forward)
    if key not in TARGET_CLASSES:
        TARGET_CLASSES[key] = type(cls.__name__, (cls,), {"forward": forward, TARGET_CLASS: True,
                                                           "__module__": cls.__module__,
                                                           "__qualname__": cls.__qualname__})
    return TARGET_CLASSES[key]


def _follow_class(module: nn.Module) -> None:
    """Point accelerate's wrapper, where the module has one, at its class's forward: it calls the
    forward bound at dispatch, which would bypass the instrumented class (and keep it after
    :func:`uninstrument`)."""
    if WRAPPED_FORWARD in module.__dict__:
        module.__dict__[WRAPPED_FORWARD] = types.MethodType(type(module).forward, module)


def _unbind(module: nn.Module) -> None:
    """Undo :func:`_bind`: the module's class and the forward it was given (its class's, or the instance's own)."""
    attribute, given = forward_attribute(module), module.__dict__.pop(GIVEN_FORWARD)
    if given is None:
        module.__dict__.pop(attribute, None)
    else:
        module.__dict__[attribute] = given
    module.__dict__.pop(_SLOT, None)
    module.__class__ = given_class(module)


def _call_original(self, given: tuple, args, kwargs):
    """Call the forward the target was given: ``given`` is ``(function, whether it takes self)``."""
    original, passes_self = given
    return original(self, *args, **kwargs) if passes_self else original(*args, **kwargs)


#: the forwards targets were given, by number: a compiled graph reads a target's here by a constant
#: number, one guard per distinct forward (a class's, shared by its modules) rather than per target
_GIVEN: dict[int, Callable] = {}
_GIVEN_NUMBERS: dict[Callable, int] = {}


def _given_number(forward: Callable) -> int:
    return _GIVEN_NUMBERS.setdefault(forward, len(_GIVEN_NUMBERS))


def _call_injection(injection, computed, replacement, mask, rank=None, leading_rows=False):
    """The op a target's graph calls: its Injection arrives as an input, not as a constant of the
    code, so every target of the same structure runs the same generated code. In a compiled graph
    it is the Injection's constant spec instead (see :func:`_armed`)."""
    if type(injection) is tuple:
        spec, name, module = injection
        return inject(spec, name, module, computed, replacement, mask, rank, leading_rows)
    return injection(computed, replacement, mask, rank, leading_rows)


_OFF = (None, None, False)


def _runtime_entry(slot: _Slot):
    """This forward's ``(replacement, mask, leading_rows)`` for the target (``_OFF``: off), or None
    outside an instrumented forward, read when it runs; records the hit."""
    key, index = slot.constants[:2]
    inputs = getattr(_ARMED, key, None)
    if inputs is None:
        return None
    slot.take()
    return inputs[index] or _OFF


# in a compiled frame that may break and is not the model's trace (a target compiled alone, a frame
# resumed after a graph break) the entry is read at run time: folding it in would be a graph per target
_runtime_entry_out_of_graph = torch.compiler.disable(_runtime_entry)


def _armed(self, slot: _Slot):
    """``(given forward, output index, entry, injection)`` for a target's forward (see _runtime_entry).
    In the model's trace: the slot's constants folded in (one guard), the entry a value of the trace."""
    kind = _trace_kind() if is_dynamo_compiling() else None
    if kind == _IN_MODEL:
        key, index, passes_self, point_index, spec, name, forward = _constants(slot)
        inputs = getattr(_ARMED, key, None)
        entry = None if inputs is None else inputs[index] or _OFF
        given = (_GIVEN[forward], passes_self)
        return given, point_index, entry, slot.injection if _OBSERVING[0] else (spec, name, self)
    entry = _runtime_entry_out_of_graph(slot) if kind == _RESUMABLE else _runtime_entry(slot)
    return (slot.original, slot.passes_self), slot.point.output_index, entry, slot.injection


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
    given, _, entry, injection = _armed(self, slot)
    if entry is None:
        return _call_original(self, given, args, kwargs)
    replacement, mask, leading_rows = entry
    return slot.graph_forward(
        self, *args, **kwargs,
        fxreplace_replacement=replacement, fxreplace_mask=mask,
        fxreplace_leading_rows=leading_rows, fxreplace_injection=injection,
    )


def _routing_point_forward(self, *args, **kwargs):
    """The forward of a target whose point is the routing it is called with (see
    :func:`~fxreplace.injection.inject_routing`): the module runs on the replaced arguments."""
    slot = self._fxreplace_slot
    given, _, entry, _ = _armed(self, slot)
    if entry is None:
        return _call_original(self, given, args, kwargs)
    point = slot.point
    args, kwargs = list(args), dict(kwargs)
    routing = [args[key] if isinstance(key, int) else kwargs[key] for key in point.routing_inputs]
    routed = inject_routing(slot.injection, routing, point.num_experts, *entry)
    for key, value in zip(point.routing_inputs, routed):
        if isinstance(key, int):
            args[key] = value
        else:
            kwargs[key] = value
    return _call_original(self, given, tuple(args), kwargs)


def _output_point_forward(self, *args, **kwargs):
    """The forward of a target whose injection point is its output (or ``output[i]``).

    Eager engines call it once per target per forward, so their common case comes first:
    an eager forward armed with the fed buffers, a plain tensor at ``output`` or ``output[i]``
    of a tuple and a call the Injection has checked with those buffers take the fast path
    (:meth:`~fxreplace.injection.CheckedCalls.fed_entry`). Anything else, and any
    tracing, goes through the Injection."""
    slot = self._fxreplace_slot
    # (Dynamo may start tracing inside an eager forward: then the Injection decides)
    if not is_dynamo_compiling() and slot.state is SlotState.FED and not slot.unproven:
        point_index = slot.point.output_index
        output = _call_original(self, (slot.original, slot.passes_self), args, kwargs)
        value = output if point_index is None else output[point_index] if type(output) is tuple else None
        if type(value) is torch.Tensor and not slot.injection.observers:  # (not a subclass, e.g. a FakeTensor)
            entry = slot.injection.checked.fed_entry(value)
            if entry is not None:
                slot.state = SlotState.TAKEN
                return _with_injected(output, point_index, value, entry.inject(value))
        return _inject_output(slot, output, *_armed(self, slot)[1:])
    given, point_index, entry, injection = _armed(self, slot)
    return _inject_output(slot, _call_original(self, given, args, kwargs), point_index, entry, injection)


def _inject_output(slot: _Slot, output, point_index, entry, injection):
    """``output`` with the target's point replaced by ``entry`` (None: outside an instrumented forward)."""
    if entry is None:
        return output
    replacement, mask, leading_rows = entry
    # (the slot's name and point only on error paths: each read would be a guard per target)
    if point_index is None:
        value = output
    elif isinstance(output, (tuple, list)):
        value = output[point_index]
    else:
        raise TargetError(f"{slot.target.module_name!r}: point {slot.point.point!r} indexes the output, but the "
                          f"module returns a {type(output).__name__} (indexing would pick a row): use point='output'")
    if type(value) is not torch.Tensor:
        _check_point_value(value, slot.target.module_name, slot.point.point)
    injected = _call_injection(injection, value, replacement, mask, None, leading_rows)
    if (not is_dynamo_compiling() and slot.unproven and replacement is not None and type(injected) is torch.Tensor
            and not recording()):
        injected = _Watched.watch(injected, slot)
    return _with_injected(output, point_index, value, injected)


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
_BYPASS_HINTS: list[BypassHint] = []


def register_bypass_hint(hint: BypassHint) -> BypassHint:
    """``hint(model, module_name)`` says what skipped a target that a forward did not reach and
    what to turn off (e.g. a fused kernel a model family enables by a config flag), or None.
    Families register theirs (see ``fxreplace.models.nxd``); :class:`TargetNotHitError` shows them."""
    _BYPASS_HINTS.append(hint)
    return hint


def _bypass_hint(model: nn.Module, missed: list[str]) -> str:
    hints = [h for name in missed for h in (hint(model, name) for hint in _BYPASS_HINTS) if h]
    if not hints:
        return ""
    more = f" (and {len(hints) - 1} more like it)" if len(hints) > 1 else ""
    return f"; {hints[0]}{more}"


class _Feed:
    """The fed buffers of a model, grouped: per group a ``[max_tokens, names, ...]`` values tensor
    and a mask tensor (a copied feed: ``[names, max_tokens]``, a row per target; a bound one: the
    context's mask or mask matrix), and per target ``(group, column, mask, mask row or -1)`` or
    None. A compiled forward reads the groups (one guard each) and folds the places in (one
    identity guard on this object, which only a first feed, a bind or a move replaces)."""

    def __init__(self, storage: tuple, masks: tuple, places: tuple):
        self.storage, self.masks, self.places = storage, masks, places

    def tensors(self) -> list[torch.Tensor]:
        return [*self.storage, *self.masks]

    def moved(self, tensors: list[torch.Tensor]) -> "_Feed":
        n = len(self.storage)
        return _Feed(tuple(tensors[:n]), tuple(tensors[n:]), self.places)

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        return _views(self.storage, self.masks, self.places)

    def traced(self) -> list:
        """Per target ``(values, mask, True)`` or None, as views made in a compiled graph."""
        return [None if v is None else (*v, True) for v in _views(self.storage, self.masks, _feed_places(self))]


def _views(storage: tuple, masks: tuple, places: tuple) -> list:
    """Per target ``(values, mask)`` at its place ``(group, column, mask, mask row or -1)``, or None."""
    return [None if p is None else (storage[p[0]][:, p[1]], masks[p[2]] if p[3] < 0 else masks[p[2]][p[3]])
            for p in places]


@torch.compiler.assume_constant_result
def _feed_places(feed: _Feed) -> tuple:
    """``feed.places``, folded into a compiled graph and guarded by the feed's identity."""
    return feed.places


class Instrumentation:
    """Per-model state: resolved targets, their slots and the feed buffers."""

    def __init__(self, targets: list[ResolvedTarget], points, injections, slots, max_tokens):
        self.targets = targets
        self.points = points
        self.injections = injections
        self.slots = slots
        self.max_tokens = max_tokens
        self.fed: list[tuple[torch.Tensor, torch.Tensor]] = []  # per target (values, mask) feed buffers, once fed
        self.fed_inputs: list = [None] * len(slots)  # what a forward without replacements= arms: the fed buffers
        self.feed: _Feed | None = None  # the fed buffers, grouped
        self.last_inputs: tuple | None = None  # (weakref to the context given last, its entries): see _inputs
        self.key = f"model_{next(_MODEL_KEYS)}"  # this model's attribute of _ARMED
        self.trace = None  # the Dynamo trace of the model's forward that last planned (see _traced_plan)
        for index, (slot, injection) in enumerate(zip(slots, injections)):
            forward = _given_number(slot.original)
            _GIVEN[forward] = slot.original
            slot.constants = (self.key, index, slot.passes_self, slot.point.output_index, injection.spec,
                              slot.target.module_name, forward)
        self.running = threading.Lock()  # held by the one eager forward in progress
        self.bound = False  # whether the feed buffers are a context's own tensors (feed(bind=True))
        self.unbound_by_move: str | None = None  # where a move made copies of bound buffers (dtype, device)
        self.forced: dict[str, torch.Tensor] | None = None  # see forcing()
        self.unproven = [slot for slot in slots if slot.unproven]  # see _check_watched()

    def buffer_names(self) -> list[str]:
        """The model's buffers the feed registered (its groups' values, then their masks)."""
        return [] if self.feed is None else [f"_fxreplace_feed_{k}" for k in range(len(self.feed.tensors()))]

    def remember_buffers(self, model: nn.Module, feed: "_Feed") -> None:
        """Register ``feed``'s tensors as the model's buffers (they follow moves; not in its
        ``state_dict``) and keep each target's views at hand for forwards without ``replacements=``."""
        for name in self.buffer_names():
            model._buffers.pop(name, None)
        self.feed = feed
        for name, tensor in zip(self.buffer_names(), feed.tensors()):
            model.register_buffer(name, tensor, persistent=False)
        self.fed = feed.views()
        self.fed_inputs = [(values, mask, True) for values, mask in self.fed]

    def follow_move(self, model: nn.Module) -> None:
        """After ``model.to(...)`` (or any ``_apply``): the fed buffers are the model's new
        tensors, so the targets read those. Bound buffers are now copies of the context the
        caller writes into: forwards refuse to run until it is fed again."""
        if self.feed is None:
            return
        moved = [getattr(model, name) for name in self.buffer_names()]
        if all(a is b for a, b in zip(moved, self.feed.tensors())):
            return
        if self.bound:
            self.unbound_by_move = f"{moved[0].dtype} on {moved[0].device}"
        self.remember_buffers(model, self.feed.moved(moved))
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
        """Publish this forward's per-target entries (see ``_ARMED``) and, eagerly, mark every
        slot armed so that :meth:`finish` can tell which targets the forward reached."""
        if replacements is None and self.unbound_by_move is not None:
            raise ValueError(
                f"the model was moved or converted after feed(bind=True): its feed buffers are now copies "
                f"({self.unbound_by_move}), no longer the context you write into; feed the context again after the "
                "move, built or moved there (feed(ctx.to(device), bind=True))")
        if replacements is None and self.forced is not None:
            replacements = self.forced
        compiling = is_dynamo_compiling()
        if compiling:
            _traced_begin(self)
        if replacements is None:
            inputs = self.feed.traced() if compiling and self.feed is not None else self.fed_inputs
            # FED only eagerly: a forward that make_fx/export/jit.trace records must reach the
            # Injection, which keeps Python state out of the recorded graph
            state = SlotState.ARMED if recording() else SlotState.FED
        else:
            inputs = self._inputs(replacements, compiling)
            state = SlotState.ARMED
        if not compiling:
            for slot in self.slots:
                slot.state = state
        setattr(_ARMED, self.key, inputs)

    def _inputs(self, replacements, compiling: bool) -> list:
        """Per target ``(replacement, mask, False)`` or None, from a context or a dict. Eagerly, the
        entries of the context given last are kept (a context's tensors are fixed when it is made;
        engines pass the same one step after step, writing into it)."""
        if not compiling and type(replacements) is not dict:
            last = self.last_inputs
            if last is not None and last[0]() is replacements:
                return last[1]
        inputs = self._read_inputs(replacements, compiling)
        if not compiling and isinstance(replacements, ReplacementContext):
            self.last_inputs = (weakref.ref(replacements), inputs)
        return inputs

    def _read_inputs(self, replacements, compiling: bool) -> list:
        if not isinstance(replacements, Mapping):
            raise TypeError(f"replacements must be a ReplacementContext or a dict of tensors, got {type(replacements)}")
        if compiling and isinstance(replacements, ReplacementContext):
            # read by layout: one guard on the (interned) layout and one per group tensor, not per name
            storage, mask = replacements.storage, replacements.mask
            masks = getattr(replacements, "mask_matrix", None)
            plan = _traced_plan(self, replacements.layout)
            return [None if where is None else
                    (storage[where[0]][:, where[1]], mask if where[2] < 0 else masks[where[2]], False)
                    for where in plan]
        names = [t.capture_name for t in self.targets]
        is_context = isinstance(replacements, ReplacementContext)
        # A context is read by target name only: iterating would make a graph guard on the
        # order in which the context lists its names.
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
        inputs = []
        for name in names:
            value = tensors.get(name)
            if value is None:
                inputs.append(None)  # missing from the context: this target stays off
                continue
            mask = replacements.mask_for(name) if is_context else None
            if mask is None:
                mask = torch.ones(value.shape[0], dtype=torch.bool, device=value.device)
            inputs.append((value, mask, False))
        return inputs

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
        """Back to idle, nothing armed; returns the targets armed but not reached since :meth:`arm`."""
        setattr(_ARMED, self.key, None)
        missed = [slot.target.module_name for slot in self.slots
                  if slot.state is SlotState.FED or slot.state is SlotState.ARMED]
        for slot in self.slots:
            slot.state = SlotState.IDLE
        return missed

    def finish(self, model: nn.Module) -> None:
        """:meth:`reset` after a forward that returned; every armed target must have been reached."""
        if is_dynamo_compiling():
            setattr(_ARMED, self.key, None)
            _traced_hits(self)
            return
        if self.unproven:
            self._check_watched(model)
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
        if state.feed is not None:
            twin._fxreplace.remember_buffers(twin, state.feed.moved([getattr(twin, n) for n in state.buffer_names()]))
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
            layout = replacements.layout
            rows = layout.mask_rows
            places = tuple((*layout.places[name], 0, -1 if rows is None else rows[name]) for name in names)
            masks = (replacements.mask if rows is None else replacements.mask_matrix,)
            state.remember_buffers(self, _Feed(tuple(replacements.storage), masks, places))
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
        if not state.fed:
            state.remember_buffers(self, self._new_feed(tensors))
        for (values, mask_buf), name in zip(state.fed, names):
            value = tensors.get(name)
            mask_buf.fill_(False)
            if value is None:
                continue
            tokens = value.shape[0]
            values[:tokens].copy_(value)
            mask_buf[:tokens].copy_(mask if mask is not None else torch.ones(tokens, dtype=torch.bool, device=value.device))
        state.bound, state.unbound_by_move = False, None
        for injection, (values, mask) in zip(state.injections, state.fed):
            injection.share_fed(values, mask, hands_on=False)

    def _new_feed(self, tensors: Mapping[str, torch.Tensor]) -> _Feed:
        """Zeroed buffers for a first feed of ``tensors``, where each target computes (whatever device
        the context was built on): a group per (dtype, row shape, device) of its capture names."""
        state = self._fxreplace
        groups: dict[tuple, list[str]] = {}
        for target in state.targets:
            value = tensors[target.capture_name]
            device = computes_on(self.get_submodule(target.module_name)) or value.device
            names = groups.setdefault((value.dtype, tuple(value.shape[1:]), torch.device(device)), [])
            if target.capture_name not in names:
                names.append(target.capture_name)
        where = {name: (g, c) for g, names in enumerate(groups.values()) for c, name in enumerate(names)}
        # plain tensors even under torch.inference_mode(): later feeds and clear() may run outside it
        with torch.inference_mode(False):
            storage = tuple(torch.zeros(state.max_tokens, len(names), *row, dtype=dtype, device=device)
                            for (dtype, row, device), names in groups.items())
            masks = tuple(torch.zeros(len(names), state.max_tokens, dtype=torch.bool, device=device)
                          for (_, _, device), names in groups.items())
        places = tuple((*where[t.capture_name], *where[t.capture_name]) for t in state.targets)
        return _Feed(storage, masks, places)

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
    for name in state.buffer_names():
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
    state, skipped = model._fxreplace, set(skip)
    changed: list[tuple[str, str]] = []
    rerunning = False

    def compare(module, args, kwargs, output, name):
        nonlocal rerunning
        if rerunning or changed:  # a target inside one run again: its own call was compared
            return
        # outside an instrumented forward for the rerun: no entry to read, no slot armed or hit
        inputs, states, rerunning = getattr(_ARMED, state.key, None), [slot.state for slot in state.slots], True
        setattr(_ARMED, state.key, None)
        for slot in state.slots:
            slot.state = SlotState.IDLE
        try:
            slot = module._fxreplace_slot
            given = _call_original(module, (slot.original, slot.passes_self), args, kwargs)
        finally:
            setattr(_ARMED, state.key, inputs)
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
    _OBSERVING[0] += 1
    for target, injection in zip(state.targets, state.injections):
        observer = functools.partial(callback, target.capture_name)
        injection.observers.append(observer)
        added.append((injection, observer))
    try:
        yield
    finally:
        _OBSERVING[0] -= 1
        for injection, observer in added:
            injection.observers.remove(observer)
