"""A target's slot and the forward :func:`~fxreplace.instrument.instrument` gives it.

Each target's class becomes a subclass whose forward (one per kind of point) reads the target's
entry of the forward in progress, published per model on ``ARMED``. When the injection point is
inside the module (e.g. router logits), the module is traced alone with ``torch.fx``,
:func:`~fxreplace.passes.insert_replacements` adds the replacement/mask inputs to that small
graph, and the forward runs the graph's code on the *original* module (parameters,
``state_dict`` keys and ``load_state_dict`` untouched); when the point is the module output,
the forward wraps the original one. In a compiled model's trace a target's fixed data is folded
in, named by a key in the module's ``__dict__``, its slot never read, and the entries are values of
the trace, so the guards per target are one string the plain model's guards already reach.
"""

from __future__ import annotations

import types
import weakref
from typing import Callable

import torch
from torch import nn
from torch._dynamo.symbolic_convert import InstructionTranslator as _Translator  # no public way to ask fullgraph
from torch._guards import TracingContext as _TracingContext  # no public way to tell a trace apart
from torch.compiler import is_dynamo_compiling

from ._compat import SUBSTITUTES_MODULE_METHODS, trace_key, traced
from .errors import TargetNotHitError
from .injection import Injection, call_injection, inject_routing, recording, with_element
from .liveness import Watched
from .passes import InjectionSpec, insert_replacements
from .points import (GIVEN_FORWARD, TARGET_CLASS, WRAPPED_FORWARD, InjectionPoint, forward_attribute, function_copy,
                     given_class)
from .targets import ResolvedTarget, TargetError


class SlotState:
    """Where a slot stands in its model's forward. Plain class attributes, not an Enum: a member
    of an Enum takes 0.2 us to look up, and every target looks up a few per eager forward."""

    IDLE = "idle"  # outside an instrumented forward: the target passes through
    FED = "fed"  # armed eagerly with the fed buffers (output points may take the fast path)
    GIVEN = "given"  # armed eagerly with a forward's own replacements (output points may take the fast path)
    # armed while the forward is recorded (make_fx, export, jit.trace), or by a Dynamo trace begun inside an eager
    # forward that armed no slot (see retire_given_forwards)
    ARMED = "armed"
    TAKEN = "taken"  # consumed: a second take in the same forward is an error


class ForwardPath:
    """What the output points of an eager forward run, decided once per forward by the model's arm and
    shared by its slots (``Slot.forward_path``): beside the slot states, not one of them, as a graph
    compiled inside the forward reads the states (and would be compiled again for each path)."""

    GENERAL = None  # each target's point reaches the Injection (which checks it, or reuses its check of the same call)
    OFF = "off"  # the forward replaces no row: each target runs its own forward
    # every target was checked by an earlier forward and none is observed, watched, proven or recorded:
    # each output point applies the call the Injection checked for its computed shape (see Slot.checked_output)
    CHECKED = "checked"
    # the same, on the inputs (the context, or the fed buffers) of the last such forward, in which every
    # target applied a checked call or had nothing to replace: each applies that call again where its
    # output fits it (shape, dtype, device), with nothing to look up (an engine's steady state)
    REPLAY = "replay"


class _Steps:
    """The steps of a target's forward that read nothing of the target's slot. In a compiled
    model's trace a target's forward runs them on one shared object (``_STEPS``, see :class:`_Start`)
    with the constants its trace folded in (see :func:`_traced_slot`) and never reads its slot: each
    slot a trace reads adds guards per target, and cold ones, as the compiled call never touches a slot.
    Methods of an object with ``__slots__``: no guard of their own (see :class:`Slot`)."""

    __slots__ = ()

    def call_original(self, module: nn.Module, given: tuple, args, kwargs):
        """Call the forward the target was given: ``given`` is ``(function, whether it takes self)``."""
        original, passes_self = given
        return original(module, *args, **kwargs) if passes_self else original(*args, **kwargs)

    def inject_output(self, module: nn.Module, output, point_index, entry, injection):
        """``output`` with the target's point replaced by ``entry`` (None: outside an instrumented forward)."""
        if entry is None:
            return output
        replacement, mask, leading_rows = entry
        if point_index is None:
            value = output
        elif isinstance(output, (tuple, list)):
            value = output[point_index]
        else:
            raise _point_error(module, f"indexes the output, but the module returns a {type(output).__name__} "
                                       "(indexing would pick a row): use point='output'")
        if type(value) is not torch.Tensor:
            _check_point_value(value, module)
        injected = self.watched(call_injection(injection, value, replacement, mask, None, leading_rows), replacement)
        return self.with_injected(output, point_index, value, injected)

    def watched(self, injected, replacement):
        """``injected``, watched where the target's slot asks for it (see :meth:`Slot.watched`)."""
        return injected

    def with_injected(self, output, index: int | None, value, injected):
        """``output`` with its point (``output[index]``, or all of it) now ``injected``."""
        if index is None:
            return injected
        if injected is value:  # nothing replaced: the module's own output
            return output
        return with_element(output, index, injected)


class _Start(_Steps):
    """Where every target's forward starts (``_STEPS.entered``): which steps run it, the model's
    shared ones or the target's slot."""

    __slots__ = ()

    def entered(self, module: nn.Module) -> tuple:
        """``(steps, given forward, point data, entry, injection)`` for the target's forward (see
        :meth:`Slot.armed`); ``steps``: this object in the model's trace, else the target's slot.
        Eagerly, a forward that replaces nothing (see :meth:`Slot.skipped`) gets no entry."""
        if is_dynamo_compiling():
            kind, constants = _traced_slot(module._fxreplace_key)
            if kind == _IN_MODEL:
                return (self, *self.in_model(module, constants))
            slot = module._fxreplace_slot
        else:
            slot, kind = module._fxreplace_slot, None
            if slot.skipped():
                return slot, slot.given, slot.point_data, None, slot.injection
        return (slot, *slot.armed(kind))

    def in_model(self, module: nn.Module, constants: tuple) -> tuple:
        """``(given forward, point data, entry, injection)`` in the model's trace: the target's
        constants folded in, the entry a value of the trace, and for the Injection the constants
        :func:`~fxreplace.injection.inject` reads (the Injection itself where the model is observed)."""
        key, index, passes_self, spec, name, forward, point_data, observed = constants
        inputs = getattr(ARMED, key, None)
        entry = None if inputs is None else inputs[index] or _OFF
        injection = module._fxreplace_slot.injection if observed else (spec, name, module)
        return (_FORWARDS[forward], passes_self), point_data, entry, injection


_STEPS = _Start()


class Slot(_Steps):
    """One target's part of its model's forwards: what is fixed at instrument time (its point, its
    Injection, the forward it was given, and ``constants``: the plain values a compiled model's
    graph folds in, see :func:`_traced_slot`) and, eagerly, whether this forward reached it.

    The steps of a target's forward are the slot's methods, and the slot has ``__slots__``: a trace
    that reads the slot (vLLM's inner model, a frame resumed after a graph break) guards its type
    once per target, and a method of an object without a ``__dict__`` needs no guard of its own,
    where each module-level function a trace calls costs a guard on every call of the compiled model."""

    __slots__ = ("target", "state", "unproven", "checked", "forward_path", "applied", "read", "given", "own", "point",
                 "point_data", "injection", "constants", "trace_key", "__weakref__")

    def __init__(self, target: ResolvedTarget):
        self.target = target
        self.state = SlotState.IDLE
        self.unproven = False  # an output[i] that no graph showed read: the next eager forward watches it
        self.checked = False  # an eager forward reached it by the general path, which checks what the point reads
        self.forward_path = [ForwardPath.GENERAL]  # shared by the model's slots (see ForwardPath)
        # what the target's last checked output applied: a CheckedCall, NOTHING_APPLIED (its entry off), None (neither)
        self.applied = None
        self.read: bool | None = None  # while watched: whether an op of this forward read it
        # set by bind: the forward the module was given, as ``(function, whether it takes self)`` and bound to the
        # module (``own``: what eager forwards call, no frame of fxreplace's between), its point and Injection,
        # what its forward reads of the point
        self.given = self.own = self.point = self.point_data = self.injection = None
        self.constants: tuple = ()  # (model key, index, passes_self, spec, name, given forward's number, point_data)
        self.trace_key = trace_key(self)

    def take(self) -> None:
        """Record that a forward reached the target (a second time is an error): eagerly, or traced
        in a graph that may not break (Dynamo replays the change). A slot left idle was armed by a
        compiled forward (an eager stretch between graph breaks): its graph's trace checked the hits."""
        state = self.state
        if state is SlotState.TAKEN:
            raise TargetNotHitError(f"target {self.target.module_name!r} was hit twice in one forward")
        if state is not SlotState.IDLE:
            self.state = SlotState.TAKEN

    def settle(self, key: str, index: int, forward_path: list) -> None:
        """Fix ``constants`` once bound: the slot is entry ``index`` of model ``key``'s (see ``ARMED``)."""
        self.forward_path = forward_path
        original, passes_self = self.given
        self.constants = (key, index, passes_self, self.injection.spec, self.target.module_name,
                          _forward_number(original), self.point_data)

    def runtime_entry(self):
        """This forward's ``(replacement, mask, leading_rows)`` for the target (``_OFF``: off), or None
        outside an instrumented forward, read when it runs; records the hit."""
        key, index = self.constants[:2]
        inputs = getattr(ARMED, key, None)
        if inputs is None:
            return None
        self.take()
        return inputs[index] or _OFF

    def armed(self, kind) -> tuple:
        """``(given forward, point data, entry, injection)`` for the target's forward outside its
        model's trace (``kind``: see :func:`_traced_slot`, None eagerly): the entry read as eagerly,
        a guard per target in a trace that may not break (vLLM's inner model), or outside the graph
        in one that may (see :data:`_runtime_entry_out_of_graph`)."""
        entry = _runtime_entry_out_of_graph(self) if kind == _RESUMABLE else self.runtime_entry()
        return self.given, self.point_data, entry, self.injection

    def skipped(self) -> bool:
        """Eagerly, whether this forward replaces nothing (see :class:`ForwardPath`): then the hit is
        recorded and the target runs its own forward, at the cost of a plain call."""
        if self.forward_path[0] is ForwardPath.OFF and self.state is not SlotState.TAKEN:
            self.state = SlotState.TAKEN
            return True
        return False

    def replayed(self, output):
        """An eager output point's ``output`` in a replayed forward (see :class:`ForwardPath`): the call
        its target applied last, applied again where the output fits it; None where it does not."""
        point_index = self.point_data
        if point_index is None:
            return self.applied.replayed(output)
        value = _point_value(output, point_index)
        injected = self.applied.replayed(value)
        return None if injected is None else self.with_injected(output, point_index, value, injected)

    def checked_output(self, module: nn.Module, output, fed: bool):
        """An eager output point's ``output`` in a forward whose targets were all checked (see
        :class:`ForwardPath`): its entry applied by the call the Injection checked for the computed shape
        (fed buffers: by shape alone); a call not checked yet goes through the Injection."""
        point_index = self.point_data
        entry = getattr(ARMED, self.constants[0])[self.constants[1]]
        if entry is None or entry[0] is None:
            self.applied = NOTHING_APPLIED
            return output
        self.applied = None
        value = _point_value(output, point_index)
        if type(value) is torch.Tensor:  # (not a subclass, e.g. a FakeTensor)
            checked = self.injection.checked
            call = checked.fed_entry(value) if fed else checked.lookup(value, *entry)
            if call is not None:
                self.applied = call
                return self.with_injected(output, point_index, value, call.inject(value))
        return self.inject_output(module, output, point_index, entry, self.injection)

    def watched(self, injected, replacement):
        """Eagerly, an output the slot is unproven for (see ``unproven``) is watched for reads."""
        if (not is_dynamo_compiling() and self.unproven and replacement is not None
                and type(injected) is torch.Tensor and not recording()):
            return Watched.watch(injected, self)
        return injected


class _Armed:
    """Per instrumented model (an attribute named by its key), the forward in progress: per target
    ``(replacement, mask, leading_rows)`` or None (that target off). Set and cleared by the model's
    forward; the targets read their entry here, eagerly and in a compiled graph alike. In a graph the
    list is a value of the trace (never a guarded input), so the guards do not grow with the targets;
    an attribute rather than a dict item, as Dynamo would guard on the dict's keys (every model's)."""


ARMED = _Armed()


def _trace_now():
    """The Dynamo trace running, or None (eagerly). Read only by the constant functions below, which
    Dynamo runs at trace time."""
    return _TracingContext.try_get()


_MODEL_TRACE = [None]  # the Dynamo trace of an instrumented model's forward in progress (see traced_begin)
# The Dynamo trace that last reached each slot and last armed each model, by trace key: kept off the
# objects a module holds, which torch 2.9's dict-tag guards would then see change under a graph
# compiled before (a spurious recompile); held weakly, as a trace holds its whole graph
_TRACED_IN: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# per model key, whether observe() was open on the model as its latest trace began: a graph of a
# model nobody observes folds "no observers" in (a model's own flag: a capture observing its model
# for its whole life leaves the graphs of every other model alone)
_OBSERVED: dict[str, bool] = {}
_IN_MODEL, _ONE_GRAPH, _RESUMABLE = range(3)  # how a traced target reads its entry (see _traced_slot)


@torch.compiler.assume_constant_result
def _traced_slot(key: str) -> tuple:
    """``(how the running trace reaches the slot named key, its constants)``, folded into the graph
    and guarded by that key alone. The kind: ``_IN_MODEL``, an instrumented model's forward, with
    ``slot.constants`` and whether the model is observed (the hit recorded, see :func:`traced_hits`);
    ``_ONE_GRAPH``, a trace that may not break (``fullgraph``: vLLM compiles the inner model, below
    the forward that arms), which reads the entry in the graph; else ``_RESUMABLE`` (a target
    compiled alone, a frame resumed after a graph break), which reads it outside the graph: in it, a
    guard per target would recompile the frame's code once per layer."""
    trace = _trace_now()
    if trace is not None and _MODEL_TRACE[0] is trace:
        slot = traced(key)
        if _TRACED_IN.get(key) is trace:
            raise TargetNotHitError(f"target {slot.target.module_name!r} was hit twice in one forward")
        _TRACED_IN[key] = trace
        return _IN_MODEL, (*slot.constants, _OBSERVED.get(slot.constants[0], False))
    retire_given_forwards(traced(key).constants[0])
    tx = _Translator.current_tx()
    one_graph = tx is not None and (tx.one_graph or getattr(tx, "error_on_graph_break", False))
    return (_ONE_GRAPH if one_graph else _RESUMABLE), ()


@torch.compiler.assume_constant_result
def traced_begin(key: str, observed: bool) -> int:
    """At trace time, as the model's forward arms: its targets record their hits in this trace
    and read whether it is ``observed`` (``key``: the model's
    :class:`~fxreplace.instrument.Instrumentation`)."""
    given = traced(key).given_forwards
    if given is not None:  # withdrawn before the trace reads a target (see GivenForwards)
        given.retire()
        given.withdraw()
    _OBSERVED[key] = observed
    trace = _MODEL_TRACE[0] = _trace_now()
    if trace is not None:
        _TRACED_IN[key] = trace
    return 0


@torch.compiler.assume_constant_result
def traced_plan(key: str, layout_key: str) -> tuple:
    """Per target, where a context of ``layout`` holds it: ``(group, column, mask row or -1)``, or
    None. Folded into the graph, guarded by the identities of the model's state and the (interned)
    layout: one guard each, whatever the number of targets or capture names."""
    state, layout = traced(key), traced(layout_key)
    plan = []
    for target in state.targets:
        place = layout.places.get(target.capture_name)
        rows = layout.mask_rows
        plan.append(None if place is None else (*place, -1 if rows is None else rows[target.capture_name]))
    return tuple(plan)


@torch.compiler.assume_constant_result
def traced_hits(key: str) -> int:
    """At trace time, after the model's forward: every target the trace armed was reached exactly
    once. A trace cut by a graph break is checked no further (its eager stretches check their own)."""
    state = traced(key)
    trace = _trace_now()
    if trace is not None and _TRACED_IN.get(key) is trace:
        missed = [slot.target.module_name for slot in state.slots if _TRACED_IN.get(slot.trace_key) is not trace]
        if missed:
            raise TargetNotHitError(f"targets not reached in this forward (a replaced or fused forward may skip "
                                    f"them): {missed}")
    return 0


def bind(module: nn.Module, point: InjectionPoint, injection: Injection, slot: Slot) -> None:
    """Give ``module`` the forward that reads ``slot``: its class becomes a subclass whose forward
    is one function for every target of a kind, reading everything target-specific from the slot.
    A class, not a forward set on the instance: Dynamo checks a method an instance holds with a
    Python guard per target (that it is bound to that instance). One function, not one per target:
    Dynamo guards on the function a module calls, so a frame resumed after a graph break inside a
    layer would recompile once per layer. The instance's own forward, where it has one, runs from
    the slot; accelerate's wrapper is pointed at the class's forward."""
    attribute = forward_attribute(module)
    module.__dict__[GIVEN_FORWARD] = module.__dict__.get(attribute)  # what :func:`unbind` puts back
    original = getattr(module, attribute)
    own = isinstance(original, types.MethodType) and original.__self__ is module
    # a method's function (the class's is shared by every module of the class) rather than a method bound to this one
    slot.given = (original.__func__, True) if own else (original, False)
    slot.own = original
    slot.injection, slot.point = injection, point
    if point.graph_module is not None:
        slot.point_data, forward = _forward_number(_shared_graph_forward(point, injection)), _graph_point_forward
    elif point.routing_inputs is not None:
        slot.point_data, forward = (point.routing_inputs, point.num_experts), _routing_point_forward
    else:
        slot.point_data, forward = point.output_index, _output_point_forward
    module.__dict__[SLOT] = slot
    module.__dict__[KEY] = slot.trace_key  # what the model's trace reads, never the slot (see _Steps)
    if attribute == "forward":
        module.__dict__.pop("forward", None)  # the instance's own forward, now the slot's
    module.__class__ = _target_class(type(module), forward)
    follow_class(module)


SLOT = "_fxreplace_slot"
KEY = "_fxreplace_key"
_SHARED_FORWARDS: dict[tuple, Callable] = {}
_TARGET_CLASSES: dict[tuple, type] = {}


def _target_class(cls: type, forward: Callable) -> type:
    """``cls`` with ``forward``, under the same name (shared by every target of the class and kind)."""
    key = (cls, forward)
    if key not in _TARGET_CLASSES:
        _TARGET_CLASSES[key] = type(cls.__name__, (cls,), {"forward": forward, TARGET_CLASS: True,
                                                           "__module__": cls.__module__,
                                                           "__qualname__": cls.__qualname__})
    return _TARGET_CLASSES[key]


def follow_class(module: nn.Module) -> None:
    """Point accelerate's wrapper, where the module has one, at its class's forward: it calls the
    forward bound at dispatch, which would bypass the instrumented class (and keep it after
    :func:`~fxreplace.instrument.uninstrument`)."""
    if WRAPPED_FORWARD in module.__dict__:
        module.__dict__[WRAPPED_FORWARD] = types.MethodType(type(module).forward, module)


def unbind(module: nn.Module) -> None:
    """Undo :func:`bind`: the module's class and the forward it was given (its class's, or the instance's own)."""
    attribute, given = forward_attribute(module), module.__dict__.pop(GIVEN_FORWARD)
    if given is None:
        module.__dict__.pop(attribute, None)
    else:
        module.__dict__[attribute] = given
    module.__dict__.pop(SLOT, None)
    module.__dict__.pop(KEY, None)
    module.__class__ = given_class(module)


class GivenForwards:
    """The forwards the targets were given, put in place of their instrumented ones (in each target's
    ``__dict__``) for the eager forwards that replace nothing: such a forward then costs what the
    given model's does, no frame of fxreplace's per target. Placed by such a forward and left in place
    until a forward that may replace a row (or is recorded, observed or proven) withdraws them: a write
    per target, paid when a run of forwards changes kind. Safe in any Dynamo trace, however it starts
    (torch.compile, an AOT full-graph capture as vLLM's, a compiled region inside the forward): each
    placed forward is a stand-in that every trace runs as the instrumented forward (see
    :func:`_stand_in`). A trace that reaches the model (its forward, or a target: a compiled region
    inside it) retires them: its guards check each target's ``__dict__``, so a compiled call after a
    forward that placed them would compile the other state again. A forward with the given forwards in
    place checks no hit: they are placed only for inputs of a signature (see :func:`inputs_signature`)
    that a forward checking every hit has run, so a path first taken (a decode step after the prefill,
    where a fused kernel skips a target) is checked."""

    __slots__ = ("places", "placed", "retired", "checked", "signature")

    def __init__(self, places: list[tuple[dict, str, types.MethodType, object]]):
        # per target: its __dict__, the attribute its forward is called from, the given forward's
        # stand-in bound to it, and what the attribute holds withdrawn (None: nothing, the class's forward)
        self.places = places
        self.placed = False
        self.retired = False
        self.checked: set[tuple] = set()  # the input signatures of forwards that checked every hit
        self.signature: tuple | None = None  # the forward in progress's

    @classmethod
    def of(cls, modules: list[nn.Module]) -> "GivenForwards | None":
        """The targets' (``modules``, bound) given forwards; None where one has no stand-in (not a
        Python function taking the module: that model keeps a frame per target, see :meth:`Slot.skipped`),
        and on a torch whose traces would run a stand-in as the given forward."""
        if not SUBSTITUTES_MODULE_METHODS:
            return None
        places = []
        for module in modules:
            function, passes_self = module.__dict__[SLOT].given
            if not passes_self or type(function) is not types.FunctionType:
                return None
            attribute = forward_attribute(module)
            places.append((module.__dict__, attribute, types.MethodType(_stand_in(function), module),
                           module.__dict__.get(attribute)))
        return cls(places)

    def place(self) -> bool:
        """Put the given forwards in place for the forward in progress (unless retired, or its signature
        is new); whether they are. A target whose forward attribute now holds something else (a forward
        set on it, hooks dispatched after instrument()) is left as it is, and the given forwards are
        placed no more."""
        if self.retired or self.signature not in self.checked:
            return False
        if not self.placed:
            if any(namespace.get(attribute) is not withdrawn for namespace, attribute, _, withdrawn in self.places):
                self.retired = True
                return False
            for namespace, attribute, given, _ in self.places:
                namespace[attribute] = given
            self.placed = True
        return self.placed

    def withdraw(self) -> None:
        """The instrumented forwards back in place (where a given one still is)."""
        if self.placed:
            for namespace, attribute, given, withdrawn in self.places:
                if namespace.get(attribute) is not given:
                    continue
                if withdrawn is None:
                    del namespace[attribute]
                else:
                    namespace[attribute] = withdrawn
            self.placed = False

    def hits_checked(self) -> None:
        """The forward in progress checked every hit: its signature's later forwards may place them
        (a forward that took no signature, a replayed one, records none)."""
        if self.signature is None:
            return
        if len(self.checked) >= _SIGNATURES_KEPT:
            self.checked.clear()
        self.checked.add(self.signature)

    def retire(self) -> None:
        """Never place them again; those in place stay until the next forward or trace of the model
        withdraws them (a trace that read one checks, as it ends, that it is still there)."""
        self.retired = True


_SIGNATURES_KEPT = 1024  # an engine's distinct batch shapes; past that, each is checked again


def inputs_signature(args: tuple, kwargs: dict) -> tuple:
    """What decides a forward's path that the host sees before it runs: its tensors' shapes and its
    plain flags (a fused kernel that skips a target is chosen by a shape, e.g. one token a sequence, or a flag)."""
    signature = tuple(map(_signature_of, args))
    return signature + tuple(zip(kwargs, map(_signature_of, kwargs.values()))) if kwargs else signature


def _signature_of(value):
    if isinstance(value, torch.Tensor):
        return value.shape
    return value if value is None or type(value) in (bool, int, str) else type(value)


def retire_given_forwards(model_key: str) -> None:
    """At trace time, as a Dynamo trace reaches a target of the model named ``model_key``: no given
    forward placed from now on. A trace begun inside an eager forward that placed them (which armed
    no slot, only published the entries) arms the slots, so that its graph records each hit, as it
    would in any other forward."""
    state = traced(model_key)
    given = state.given_forwards
    if given is not None:
        if given.placed and not given.retired and getattr(ARMED, model_key, None) is not None:
            for slot in state.slots:
                slot.state = SlotState.ARMED
        given.retire()


def _instrumented_forward(self, *args, **kwargs):
    """What a Dynamo trace runs where a target's given forward is in place: its instrumented forward."""
    return type(self).forward(self, *args, **kwargs)


_STAND_INS: dict[types.FunctionType, types.FunctionType] = {}


def _stand_in(function: types.FunctionType) -> types.FunctionType:
    """A copy of ``function`` (its code, globals, defaults and cells): called, it is the function; in
    any Dynamo trace, it is :func:`_instrumented_forward` (``torch.compiler.substitute_in_graph``, which
    Dynamo applies wherever it meets the copy: a module's ``__dict__`` included). One per function,
    kept for the process, as Dynamo knows it by identity."""
    stand_in = _STAND_INS.get(function)
    if stand_in is None:
        stand_in = function_copy(function)
        torch.compiler.substitute_in_graph(stand_in, skip_signature_check=True)(_instrumented_forward)
        _STAND_INS[function] = stand_in
    return stand_in


#: the forwards targets were given and the graph forwards of inner points, by number: a compiled
#: graph reads a target's here by a constant number, one guard per distinct forward (a class's,
#: shared by its modules) rather than per target
_FORWARDS: dict[int, Callable] = {}
_FORWARD_NUMBERS: dict[Callable, int] = {}


def _forward_number(forward: Callable) -> int:
    number = _FORWARD_NUMBERS.setdefault(forward, len(_FORWARD_NUMBERS))
    _FORWARDS[number] = forward
    return number


_OFF = (None, None, False)


class _NothingApplied:
    """A slot's ``applied`` where its entry was off: replayed, its output is left as computed."""

    __slots__ = ()

    def replayed(self, computed):
        return computed


NOTHING_APPLIED = _NothingApplied()

# in a compiled frame that may break and is not the model's trace (a target compiled alone, a frame
# resumed after a graph break) the entry is read at run time: folding it in would be a graph per target
_runtime_entry_out_of_graph = torch.compiler.disable(Slot.runtime_entry)


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
    # the Injection an input, not a constant of the code: targets of one structure share the code
    node.target, node.args = call_injection, (given, *node.args)
    gm.recompile()
    forward = type(gm).forward
    used = forward.__code__.co_names
    key = (gm.code, tuple((name, id(value)) for name, value in forward.__globals__.items() if name in used))
    return _SHARED_FORWARDS.setdefault(key, forward)


def _graph_point_forward(self, *args, **kwargs):
    """The forward of a target whose point is a node inside it: its graph's code on the module."""
    steps, given, graph_forward, entry, injection = _STEPS.entered(self)
    if entry is None:
        return steps.call_original(self, given, args, kwargs)
    replacement, mask, leading_rows = entry
    return _FORWARDS[graph_forward](
        self, *args, **kwargs,
        fxreplace_replacement=replacement, fxreplace_mask=mask,
        fxreplace_leading_rows=leading_rows, fxreplace_injection=injection,
    )


def _routing_point_forward(self, *args, **kwargs):
    """The forward of a target whose point is the routing it is called with (see
    :func:`~fxreplace.injection.inject_routing`): the module runs on the replaced arguments."""
    steps, given, (routing_inputs, num_experts), entry, injection = _STEPS.entered(self)
    if entry is None:
        return steps.call_original(self, given, args, kwargs)
    args, kwargs = list(args), dict(kwargs)
    routing = [args[key] if isinstance(key, int) else kwargs[key] for key in routing_inputs]
    routed = inject_routing(injection, routing, num_experts, *entry)
    for key, value in zip(routing_inputs, routed):
        if isinstance(key, int):
            args[key] = value
        else:
            kwargs[key] = value
    return steps.call_original(self, given, tuple(args), kwargs)


def _output_point_forward(self, *args, **kwargs):
    """The forward of a target whose injection point is its output (or ``output[i]``).

    Eager engines call it once per target per forward, so their common cases come first: an eager
    forward that replaces nothing runs the target's own forward, one whose targets were all checked
    applies the checked call (or replays the last one, see :class:`ForwardPath`), each recording the hit (a second hit takes the
    general path, which says so). Anything else, and any tracing, goes through the Injection."""
    if not is_dynamo_compiling():  # (Dynamo may start tracing inside an eager forward: then the Injection decides)
        slot = self._fxreplace_slot
        path, state = slot.forward_path[0], slot.state
        if path is not ForwardPath.GENERAL and state is not SlotState.TAKEN:
            slot.state = SlotState.TAKEN
            output = slot.own(*args, **kwargs)
            if path is ForwardPath.OFF:
                return output
            if path is ForwardPath.REPLAY:
                replayed = slot.replayed(output)
                if replayed is not None:
                    return replayed
            return slot.checked_output(self, output, state is SlotState.FED)
    steps, given, point_index, entry, injection = _STEPS.entered(self)
    return steps.inject_output(self, steps.call_original(self, given, args, kwargs), point_index, entry, injection)


def _point_value(output, point_index: int | None):
    """What an output point reads of ``output`` on the checked paths: all of it, or element
    ``point_index`` of a tuple (None for anything else: the Injection's path says what is wrong)."""
    return output if point_index is None else output[point_index] if type(output) is tuple else None


def _check_point_value(value, module: nn.Module) -> None:
    """An output point reads a tensor or a pair of tensors; anything else is an error."""
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return
    raise _point_error(module, f"is a {type(value).__name__}, not a tensor; use point='output[i]' or a callable point")


def _point_error(module: nn.Module, problem: str) -> TargetError:
    """The error of the target ``module``'s point, named: read from its slot, on error paths only
    (a trace that reads a slot guards it, see :class:`_Steps`)."""
    slot = module._fxreplace_slot
    where = slot.point.point
    fallback = " (it cannot be traced alone, so 'auto' means its output)" if where == "auto" else ""
    return TargetError(f"{slot.target.module_name!r}: point {where!r}{fallback} {problem}")
