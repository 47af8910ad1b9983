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

import functools
import inspect
import math
import re
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

from .context import ReplacementContext
from .passes import Injection, InjectionSpec, find_injection_node, insert_replacements, parse_output_point
from .sharding import ShapeError
from .targets import Point, ResolvedTarget, TargetError, TargetLike, closest_names, resolve_targets


class TargetNotHitError(RuntimeError):
    """A target's injection point ran zero or several times in one forward,
    e.g. because a kernel-replaced forward skips the router."""


@dataclass
class InjectionPoint:
    """Where one module's replacement goes.

    ``graph_module`` is set when the point is a node inside the module: the
    module traced alone, and ``point`` selects the node in it. Otherwise the
    point is the module output (``output_index`` picks ``output[i]``), checked
    to be a tensor at run time (an untraceable module with ``"auto"`` lands here).
    """

    module_name: str
    point: Point
    graph_module: fx.GraphModule | None = None
    output_index: int | None = None


def trace_alone(module: nn.Module) -> fx.GraphModule:
    """``torch.fx`` trace of one module; parameters are shared, not copied."""
    return fx.symbolic_trace(module)


def locate_injection_point(module: nn.Module, module_name: str, point: Point = "auto") -> InjectionPoint:
    """Resolve ``point`` for ``module`` (see :class:`~fxreplace.Target`) without
    changing anything. Shared by :func:`instrument` and reference capture."""
    is_output, index = parse_output_point(point)
    if is_output:
        return InjectionPoint(module_name, point, output_index=index)
    try:
        gm = trace_alone(module)
    except Exception as exc:
        if point == "auto":
            return InjectionPoint(module_name, "output")
        raise TargetError(f"cannot trace {module_name!r} alone to apply point {point!r}: {exc}") from exc
    try:
        node = find_injection_node(gm, "", point)
    except TargetError as exc:
        children = [f"{module_name}.{name}" for name, _ in module.named_modules() if name]
        raise TargetError(f"{module_name!r}: {exc}; closest qualified names: "
                          f"{closest_names(module_name, children) or children[:5]}") from None
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if node is output:
        return InjectionPoint(module_name, "output")
    return InjectionPoint(module_name, point, graph_module=gm)


class _Slot:
    """Hands one forward's replacement to one target and records that the target
    consumed it. States: idle (outside an instrumented call: pass through),
    armed, taken (a second take in the same forward is an error)."""

    def __init__(self, target: ResolvedTarget):
        self.target = target
        self.reset()

    def reset(self):
        self.state = "idle"
        self.replacement = None
        self.mask = None
        self.prefix = False

    def arm(self, replacement, mask, prefix=False):
        self.state = "armed"
        self.replacement = replacement
        self.mask = mask
        self.prefix = prefix

    def take(self) -> bool:
        """True when called inside an instrumented forward."""
        if self.state == "idle":
            return False
        if self.state == "taken":
            raise TargetNotHitError(f"target {self.target.module_name!r} was hit twice in one forward")
        self.state = "taken"
        return True


def _bind(module: nn.Module, point: InjectionPoint, injection: Injection, slot: _Slot) -> None:
    """Give ``module`` an instance-level forward that reads ``slot``."""
    original = module.forward
    if point.graph_module is not None:
        insert_replacements(
            point.graph_module,
            [InjectionSpec("", point.point, injection, "fxreplace_replacement")],
            prefix_input="fxreplace_prefix",
        )
        graph_forward = type(point.graph_module).forward

        def forward(*args, **kwargs):
            if not slot.take():
                return original(*args, **kwargs)
            return graph_forward(
                module, *args, **kwargs,
                fxreplace_replacement=slot.replacement, fxreplace_mask=slot.mask,
                fxreplace_prefix=slot.prefix,
            )
    else:
        index = point.output_index

        def forward(*args, **kwargs):
            output = original(*args, **kwargs)
            if not slot.take():
                return output
            value = output if index is None else output[index]
            pair = isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value)
            if not isinstance(value, torch.Tensor) and not pair:
                raise TargetError(
                    f"{point.module_name!r}: point {point.point!r} is a {type(value).__name__}, not a tensor; "
                    "use point='output[i]' or a callable point"
                )
            value = injection(value, slot.replacement, slot.mask, prefix=slot.prefix)
            if index is None:
                return value
            return type(output)((*output[:index], value, *output[index + 1:]))

    module.forward = forward


class Instrumentation:
    """Per-model state: resolved targets, their slots and the feed buffers."""

    def __init__(self, targets: list[ResolvedTarget], points, injections, slots, max_tokens):
        self.targets = targets
        self.points = points
        self.injections = injections
        self.slots = slots
        self.max_tokens = max_tokens
        self.feeding = False

    def buffer_names(self, i: int) -> tuple[str, str]:
        return f"_fxreplace_feed_{i}", f"_fxreplace_feed_mask_{i}"

    def arm(self, model: nn.Module, replacements) -> None:
        if replacements is None:
            for i, slot in enumerate(self.slots):
                if self.feeding:
                    values, mask = self.buffer_names(i)
                    slot.arm(getattr(model, values), getattr(model, mask), prefix=True)
                else:
                    slot.arm(None, None)
            return
        if not isinstance(replacements, Mapping):
            raise TypeError(f"replacements must be a ReplacementContext or a dict of tensors, got {type(replacements)}")
        tensors = {name: replacements[name] for name in replacements}
        names = [t.capture_name for t in self.targets]
        if tensors and not any(name in tensors for name in names):
            raise KeyError(f"no replacement name {sorted(tensors)} matches a target capture name {names}")
        is_context = isinstance(replacements, ReplacementContext)
        for slot, name in zip(self.slots, names):
            value = tensors.get(name)
            if value is None:
                slot.arm(None, None)  # missing from the context: this target stays off
                continue
            mask = replacements.mask_for(name) if is_context else None
            if mask is None:
                mask = torch.ones(value.shape[0], dtype=torch.bool, device=value.device)
            slot.arm(value, mask)

    def finish(self) -> None:
        missed = [slot.target.module_name for slot in self.slots if slot.state != "taken"]
        for slot in self.slots:
            slot.reset()
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
        None (plain model, or the fed buffers after :meth:`feed`)."""
        self._fxreplace.arm(self, replacements)
        output = super().forward(*args, **kwargs)
        self._fxreplace.finish()
        return output

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
        mask (a ReplacementContext of ``max_tokens`` rows holding every target).
        Writing into that context in place afterwards, e.g. with
        ``TensorReplacer.build_context_for_batch(..., out=<its first T rows>)``,
        is then the whole feed; :meth:`clear` still turns replacement off."""
        state = self._fxreplace
        if state.max_tokens is None:
            raise ValueError("feed() needs instrument(..., max_tokens=N) to size its buffers")
        tensors = {name: replacements[name] for name in replacements}
        mask = replacements.mask if isinstance(replacements, ReplacementContext) else None
        if bind:
            if mask is None or tuple(mask.shape) != (state.max_tokens,):
                raise ShapeError(f"feed(bind=True) needs a ReplacementContext of max_tokens={state.max_tokens} rows")
            for i, target in enumerate(state.targets):
                value = tensors.get(target.capture_name)
                if value is None or value.shape[0] != state.max_tokens:
                    raise ShapeError(f"feed(bind=True): {target.capture_name!r} is missing or not "
                                     f"{state.max_tokens} rows")
                values_name, mask_name = state.buffer_names(i)
                self.register_buffer(values_name, value, persistent=False)
                self.register_buffer(mask_name, mask, persistent=False)
            state.feeding = True
            return
        for i, target in enumerate(state.targets):
            values_name, mask_name = state.buffer_names(i)
            value = tensors.get(target.capture_name)
            if not state.feeding:
                if value is None:
                    raise KeyError(f"the first feed() must hold every target; {target.capture_name!r} is missing")
                self.register_buffer(values_name, value.new_zeros(state.max_tokens, *value.shape[1:]), persistent=False)
                self.register_buffer(mask_name, torch.zeros(state.max_tokens, dtype=torch.bool, device=value.device),
                                     persistent=False)
            values_buf, mask_buf = getattr(self, values_name), getattr(self, mask_name)
            mask_buf.fill_(False)
            if value is None:
                continue
            tokens = value.shape[0]
            if tokens > state.max_tokens or value.shape[1:] != values_buf.shape[1:]:
                raise ShapeError(f"feed for {target.capture_name}: shape {tuple(value.shape)} does not fit the "
                                 f"buffer {tuple(values_buf.shape)}")
            values_buf[:tokens].copy_(value)
            mask_buf[:tokens].copy_(mask if mask is not None else torch.ones(tokens, dtype=torch.bool, device=value.device))
        state.feeding = True

    @torch.no_grad()
    def clear(self) -> None:
        """Turn fed replacement off (mask all False); the same graph keeps running."""
        state = self._fxreplace
        if state.feeding:
            for i in range(len(state.targets)):
                getattr(self, state.buffer_names(i)[1]).fill_(False)


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
    points, injections, slots = [], [], []
    for target in resolved:
        module = model.get_submodule(target.module_name)
        point = locate_injection_point(module, target.module_name, target.point)
        injection = Injection(target.module_name, module, target.adapter, target.shard)
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
    return model


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


def export_input_name(capture_name: str) -> str:
    """The exported program's input name for one target's replacement."""
    return "fxreplace_" + re.sub(r"\W", "_", capture_name)


def export(
    model: nn.Module,
    example_inputs: Mapping | Sequence,
    targets: Iterable[TargetLike],
    *,
    dynamic_shapes=None,
    strict: bool = False,
) -> torch.export.ExportedProgram:
    """``torch.export`` the plain model, apply :func:`~fxreplace.passes.insert_replacements`
    to the whole-model graph (nodes found through ``nn_module_stack``), and
    export the result again so it is ATen IR ready for AOTInductor.

    The program takes the model's inputs (``example_inputs``: a dict of keyword
    arguments or a tuple of positional ones, flattened to keywords named as in
    the model's signature), then one ``[T, E]`` replacement per target named
    :func:`export_input_name` (capture name), then ``fxreplace_mask`` (bool
    ``[T]``) and, when a target's shard rank is a tensor, ``fxreplace_rank``.
    Mask all False turns replacement off in the same program.

    ``dynamic_shapes`` is :func:`torch.export.export`'s, for the model's inputs
    (a dict by argument name, or a tuple matching positional ``example_inputs``);
    the token dimension of the replacement and mask inputs then follows them
    (``Dim.AUTO``: export derives ``T`` from the model's shapes and checks it at
    run time).
    """
    kwargs = dict(example_inputs) if isinstance(example_inputs, Mapping) else {}
    args = () if isinstance(example_inputs, Mapping) else tuple(example_inputs)
    resolved = resolve_targets(model, targets)
    program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict)
    gm = program.module()
    specs = [
        InjectionSpec(
            t.module_name, t.point,
            Injection(t.module_name, model.get_submodule(t.module_name), t.adapter, t.shard),
            export_input_name(t.capture_name),
        )
        for t in resolved
    ]
    tensor_rank = any(t.shard is not None and isinstance(t.shard.rank, torch.Tensor) for t in resolved)
    located = [find_injection_node(gm, s.module_name, s.point).meta["val"] for s in specs]
    # The graph must take the old and new inputs as flat keywords.
    old_inputs = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    new_inputs = [s.input_name for s in specs] + ["fxreplace_mask"] + (["fxreplace_rank"] if tensor_rank else [])
    names = old_inputs + new_inputs
    info = gm.graph._codegen.pytree_info
    gm.graph._codegen.pytree_info = info._replace(
        orig_args=names, in_spec=torch.utils._pytree.tree_structure(((), {n: 0 for n in names}))
    )
    gm._forward_pre_hooks.clear()  # they check inputs against the old signature
    for node in [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        gm.graph.erase_node(node)  # re-export derives its own guards
    insert_replacements(gm, specs, rank_input="fxreplace_rank" if tensor_rank else None, optional_inputs=False)

    # Example values for the new inputs, shaped like what each target computes.
    examples = {}
    for target, spec, value in zip(resolved, specs, located):
        shard = target.shard
        shape = [guarding_hint_or_throw(size) for size in value.shape]  # the example's sizes when shapes are dynamic
        rows = math.prod(shape) // shape[-1]
        columns = shape[-1]
        if shard is not None and shard.mode == "sequence":
            rows *= shard.world_size
        if shard is not None and shard.mode == "expert":
            columns *= shard.world_size
        examples[spec.input_name] = torch.zeros(rows, columns, dtype=value.dtype, device=value.device)
    tokens = {v.shape[0] for v in examples.values()}
    if len(tokens) != 1:
        raise ShapeError(f"targets see different token counts {tokens}; export them separately")
    examples["fxreplace_mask"] = torch.zeros(tokens.pop(), dtype=torch.bool, device=next(iter(examples.values())).device)
    if tensor_rank:
        examples["fxreplace_rank"] = next(t.shard.rank for t in resolved if t.shard and isinstance(t.shard.rank, torch.Tensor))

    signature = inspect.signature(model.forward)
    given = signature.bind_partial(*args, **kwargs).arguments
    inputs = {name: given[name] for name in old_inputs} | examples
    if dynamic_shapes is None:
        return torch.export.export(gm, (), inputs, strict=False)
    if not isinstance(dynamic_shapes, Mapping):
        dynamic_shapes = signature.bind_partial(*dynamic_shapes).arguments
    follows = {name: ({0: torch.export.Dim.AUTO} if name != "fxreplace_rank" else None) for name in examples}
    shapes = {name: dynamic_shapes.get(name) for name in old_inputs} | follows
    return torch.export.export(gm, (), inputs, dynamic_shapes=shapes, strict=False)
