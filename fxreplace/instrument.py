"""``instrument()``: make a model read replacement tensors at its targets' injection points.

How it works: each target module's class becomes a subclass whose forward reads the target's
entry of the forward in progress (:mod:`fxreplace.slots`: a graph of the target traced alone
with the replacement inputs added, or a wrapper of its output), on the *original* module, so
parameters, ``state_dict`` keys and ``load_state_dict`` are untouched. The model's own
``forward`` takes ``replacements=`` and publishes each target's tensors for that forward; fed
buffers (:mod:`fxreplace.feeding`) serve forwards without it. Tensors that reach a traced
forward this way become graph inputs, so torch.compile builds one graph for on, off and new
values.
"""

from __future__ import annotations

import copy
import functools
import operator
import threading
import weakref
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
from torch import nn
from torch.compiler import is_dynamo_compiling

from ._compat import trace_key
from .bypass import bypass_hint
from .context import ReplacementContext
from .errors import ConcurrentForwardError, TargetNotHitError
from .feeding import Feed, Feeding
from .injection import Injection, host_bytes, recording
from .liveness import check_watched
from .points import (ROUTING, check_adapter_fits, check_output_point_read, computes_linear_output, describe_forward,
                     function_copy, instance_forward, locate_injection_point)
from .slots import (ARMED, SLOT, ForwardPath, GivenForwards, Slot, SlotState, bind, follow_class, inputs_signature,
                    traced_begin, traced_hits, traced_plan, unbind)
from .targets import ResolvedTarget, TargetError, TargetLike, closest_names, resolve_targets

__all__ = ["ConcurrentForwardError", "InstrumentedModel", "TargetNotHitError", "instrument", "observe", "uninstrument"]


class Instrumentation:
    """Per-model state: resolved targets, their slots and the feed buffers. With ``__slots__``, as
    a compiled model's trace calls its methods: a method of an object with a ``__dict__`` costs a
    guard per call of the compiled model (that the instance does not shadow it)."""

    __slots__ = ("targets", "points", "injections", "slots", "max_tokens", "fed", "fed_inputs", "feed", "last_inputs",
                 "key", "observers", "forward_path", "host_masks", "running", "bound", "unbound_by_move", "forced",
                 "unproven", "unchecked", "proofs", "given_forwards", "replay_inputs", "__weakref__")

    def __init__(self, targets: list[ResolvedTarget], points, injections, slots, max_tokens,
                 given_forwards: GivenForwards | None):
        self.targets = targets
        self.points = points
        self.injections = injections
        self.slots = slots
        self.max_tokens = max_tokens
        self.fed: list[tuple[torch.Tensor, torch.Tensor]] = []  # per target (values, mask) feed buffers, once fed
        self.fed_inputs: list = [None] * len(slots)  # what a forward without replacements= arms: the fed buffers
        self.feed: Feed | None = None  # the fed buffers, grouped
        self.last_inputs: tuple | None = None  # (weakref to the context given last, its entries): see _inputs
        self.key = trace_key(self)  # this model's attribute of ARMED, and its name at trace time
        self.observers = 0  # observe() contexts open on this model
        self.forward_path = [ForwardPath.GENERAL]  # shared by the slots (see ForwardPath)
        self.host_masks = _HostMasks()
        for index, slot in enumerate(slots):
            slot.settle(self.key, index, self.forward_path)
        self.running = threading.Lock()  # held by the one eager forward in progress
        self.bound = False  # whether the feed buffers are a context's own tensors (feed(bind=True))
        self.unbound_by_move: str | None = None  # where a move made copies of bound buffers (dtype, device)
        self.forced: dict[str, torch.Tensor] | None = None  # see forcing()
        self.unproven = [slot for slot in slots if slot.unproven]  # see _check_watched()
        self.unchecked = list(slots)  # not yet reached by an eager forward's general path (see finish)
        self.proofs = 0  # open proving() contexts
        self.given_forwards = given_forwards  # put in place by forwards that replace nothing (see arm)
        # the inputs of the last forward whose every target applied a checked call or had nothing to replace:
        # a forward on the same ones replays those calls (see ForwardPath.REPLAY)
        self.replay_inputs: list | None = None

    def buffer_names(self) -> list[str]:
        """The model's buffers the feed registered (its groups' values, then their masks)."""
        return [] if self.feed is None else [f"_fxreplace_feed_{k}" for k in range(len(self.feed.tensors()))]

    def remember_buffers(self, model: nn.Module, feed: "Feed") -> None:
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

    @contextmanager
    def proving(self):
        """While inside, every eager forward runs the targets' instrumented forwards through their
        general path, even one that replaces nothing (which would run the forwards they were given,
        see :class:`~fxreplace.slots.ForwardPath`): what a proof of them needs."""
        self.proofs += 1
        try:
            yield
        finally:
            self.proofs -= 1

    @contextmanager
    def observing(self, callback: Callable[[str, torch.Tensor], None]):
        """See :func:`observe` (which checks the model; :mod:`~fxreplace.liveness` calls this)."""
        added = []
        self.observers += 1
        for target, injection in zip(self.targets, self.injections):
            observer = functools.partial(callback, target.capture_name)
            injection.observers.append(observer)
            added.append((injection, observer))
        try:
            yield
        finally:
            self.observers -= 1
            for injection, observer in added:
                injection.observers.remove(observer)

    def arm(self, model: nn.Module, replacements, compiling: bool, args: tuple, kwargs: dict) -> None:
        """Publish this forward's per-target entries (see ``ARMED``) and, eagerly, mark every
        slot armed so that :meth:`finish` can tell which targets the forward reached
        (``compiling``: the forward is traced by Dynamo; ``args``, ``kwargs``: the model's inputs)."""
        if replacements is None and self.unbound_by_move is not None:
            raise ValueError(
                f"the model was moved or converted after feed(bind=True): its feed buffers are now copies "
                f"({self.unbound_by_move}), no longer the context you write into; feed the context again after the "
                "move, built or moved there (feed(ctx.to(device), bind=True))")
        if replacements is None and self.forced is not None:
            replacements = self.forced
        if compiling:
            traced_begin(self.key, self.observers > 0)
        if replacements is None:
            inputs = self.feed.traced() if compiling and self.feed is not None else self.fed_inputs
        else:
            inputs = self._inputs(replacements, compiling)
        if not compiling:
            recorded = recording()
            # (an unproven output[i] is watched on every forward until one proves it, and a proof runs
            # the instrumented forwards it proves: neither takes a lean path)
            checked = (self.observers == 0 and not self.unchecked and not self.unproven and not self.proofs
                       and not recorded)
            off = checked and self.host_masks.all_off(self._masks(replacements))
            replay = checked and not off and inputs is self.replay_inputs
            given = self.given_forwards
            if given is not None:
                # a replayed forward takes no signature (an engine's steady step, whose host work is all of its
                # cost): the first forward of its signature that replaces nothing records it (see hits_checked)
                given.signature = None if given.retired or replay else inputs_signature(args, kwargs)
                if off and given.place():
                    # the targets run the forwards they were given: no slot armed, no hit checked (see finish);
                    # the entries published for a compiled region inside, whose trace arms the slots (see
                    # retire_given_forwards)
                    setattr(ARMED, self.key, inputs)
                    return
                given.withdraw()
            # FED or GIVEN only unrecorded: a forward that make_fx/export/jit.trace records must reach the
            # Injection, which keeps Python state out of the recorded graph
            state = SlotState.ARMED if recorded else SlotState.FED if replacements is None else SlotState.GIVEN
            path = (ForwardPath.OFF if off else ForwardPath.GENERAL if not checked
                    else ForwardPath.REPLAY if replay else ForwardPath.CHECKED)
            if path is ForwardPath.CHECKED:
                self.replay_inputs = None  # the targets' applied calls are this forward's from now on
            self.forward_path[0] = path
            for slot in self.slots:
                slot.state = state
        setattr(ARMED, self.key, inputs)

    def _masks(self, replacements) -> tuple | None:
        """The masks this forward's entries read (None: a dict's, made per entry)."""
        if replacements is None:
            return () if self.feed is None else self.feed.masks
        if isinstance(replacements, ReplacementContext):
            matrix = getattr(replacements, "mask_matrix", None)
            return (replacements.mask,) if matrix is None else (matrix,)
        return None

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
        if compiling and isinstance(replacements, ReplacementContext):
            # read by layout: one guard on the (interned) layout and one per group tensor, not per name
            storage, mask = replacements.storage, replacements.mask
            masks = getattr(replacements, "mask_matrix", None)
            plan = traced_plan(self.key, replacements.layout.trace_key)
            return [None if where is None else
                    (storage[where[0]][:, where[1]], mask if where[2] < 0 else masks[where[2]], False)
                    for where in plan]
        if not isinstance(replacements, Mapping):
            raise TypeError(f"replacements must be a ReplacementContext or a dict of tensors, got {type(replacements)}")
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

    def reset(self) -> tuple[list[str], bool]:
        """Back to idle, nothing armed. Returns what the forward left, read in the same pass over the
        slots: the targets armed but not reached since :meth:`arm`, and whether every target applied a
        checked call or had nothing to replace (see ``replay_inputs``)."""
        setattr(ARMED, self.key, None)
        self.forward_path[0] = ForwardPath.GENERAL
        missed, replayable = [], True
        for slot in self.slots:
            state = slot.state
            if state is not SlotState.IDLE and state is not SlotState.TAKEN:
                missed.append(slot.target.module_name)
            if slot.applied is None:
                replayable = False
            slot.state = SlotState.IDLE
        return missed, replayable

    def abandon(self) -> None:
        """After a forward that raised: :meth:`reset` (no replacement left armed for later calls), and no
        forward replays the calls of the one before (a target whose replay did not fit may have dropped its
        call on the way to the error: an engine's next step, on the same context, is checked anew)."""
        self.reset()
        self.replay_inputs = None

    def _mark_checked(self) -> None:
        """After an eager forward returned: the targets it reached took the general path, which
        checked what each point reads; later forwards may take the fast paths."""
        for slot in self.unchecked:
            if slot.state is SlotState.TAKEN:
                slot.checked = True
        self.unchecked = [slot for slot in self.unchecked if not slot.checked]

    def finish(self, model: nn.Module, compiling: bool) -> None:
        """:meth:`reset` after a forward that returned; every armed target must have been reached."""
        if compiling:
            setattr(ARMED, self.key, None)
            traced_hits(self.key)
            return
        given = self.given_forwards
        if given is not None and given.placed:
            # the targets ran the forwards they were given, which record no hit (a forward that replaces
            # nothing computes the given model however often it reaches one; the first forward and every
            # one that may replace check the hits); only the entries were armed, and the slots by a trace
            # that retired the given forwards
            if given.retired:
                self.reset()
            else:
                setattr(ARMED, self.key, None)
            return
        if self.unproven:
            check_watched(self, model)
        if self.unchecked:
            self._mark_checked()
        path, inputs = self.forward_path[0], getattr(ARMED, self.key)
        missed, replayable = self.reset()
        if not missed and (path is ForwardPath.CHECKED or path is ForwardPath.REPLAY):
            self.replay_inputs = inputs if replayable else None
        if not missed and self.given_forwards is not None and not self.given_forwards.retired:
            self.given_forwards.hits_checked()
        if missed:
            raise TargetNotHitError(
                f"targets not reached in this forward (a replaced or fused forward may skip them): {missed}"
                + bypass_hint(model, missed))


class InstrumentedModel(Feeding):
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
        compiling = is_dynamo_compiling()
        exclusive = not compiling
        if exclusive and not state.running.acquire(blocking=False):
            raise ConcurrentForwardError(
                f"this instrumented {type(self).__name__} is already running a forward (in another thread): one "
                "instrumented model runs one forward at a time; give each thread its own copy.deepcopy(model)")
        try:
            try:
                state.arm(self, replacements, compiling, args, kwargs)
                output = super().forward(*args, **kwargs)
            except BaseException:
                state.abandon()
                raise
            state.finish(self, compiling)
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
            if SLOT in module.__dict__:  # the copied instance forward reads this model's slot
                unbind(module)
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


def _instrumented_class(cls: type) -> type:
    """A subclass of ``cls`` for one model, with the same name (so e.g. ``save_pretrained`` records the
    original architecture), whose forward is :meth:`InstrumentedModel.forward` on a code object of its
    own: Dynamo keeps compiled graphs per code object and compiles at most ``recompile_limit`` (8) for
    one, and each instrumented model compiles its own graphs (their guards name its slots), so on a
    shared code object the ninth instrumented model compiled in a process would run eagerly."""
    return type(cls.__name__, (InstrumentedModel, cls), {"forward": function_copy(InstrumentedModel.forward),
                                                         "__module__": cls.__module__,
                                                         "__qualname__": cls.__qualname__})


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
        slot = Slot(target)
        slot.unproven = not proven
        points.append(point)
        injections.append(injection)
        slots.append(slot)
    modules = [model.get_submodule(target.module_name) for target in resolved]
    for module, point, injection, slot in zip(modules, points, injections, slots):
        bind(module, point, injection, slot)
    model._fxreplace = Instrumentation(resolved, points, injections, slots, max_tokens, GivenForwards.of(modules))
    model.__class__ = _instrumented_class(type(model))
    follow_class(model)
    return model


def uninstrument(model: nn.Module) -> nn.Module:
    """Undo :func:`instrument`: the targets' own forwards and the model's class come back."""
    if not isinstance(model, InstrumentedModel):
        raise ValueError("model is not instrumented")
    state = model._fxreplace
    for target in state.targets:
        unbind(model.get_submodule(target.module_name))
    for name in state.buffer_names():
        model._buffers.pop(name, None)
    del model._fxreplace
    model.__class__ = type(model).__bases__[1]
    follow_class(model)
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
    with model._fxreplace.observing(callback):
        yield


class _HostMasks:
    """Whether a forward's masks replace no row, read on the host with no op: through byte views
    of the masks seen last (engines write a context's mask in place, step after step)."""

    def __init__(self):
        self.masks: tuple = ()
        self.views: list = []

    def all_off(self, masks: tuple | None) -> bool:
        if masks is None:
            return False
        if len(masks) != len(self.masks) or not all(map(operator.is_, masks, self.masks)):
            views = [host_bytes(m) if m.dtype == torch.bool else None for m in masks]
            if any(view is None for view in views):
                return False
            self.masks = masks
            self.views = [(view, bytes(len(view))) for view in views]
        for view, zeros in self.views:
            # a copy and a memcmp: comparing the view itself unpacks it byte by byte (30x slower on an
            # engine's [48 names, 8192 tokens] mask)
            if view.tobytes() != zeros:
                return False
        return True
