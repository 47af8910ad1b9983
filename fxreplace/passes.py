"""The graph pass: at each target's injection node insert
``replacement -> shard slice -> adapter -> where(mask, ., computed)`` and rewire
the node's users to the result.

:func:`insert_replacements` is a pure function over a ``GraphModule``: it works on
a graph traced from one module (every node belongs to the target) and on a
whole-model graph from ``torch.export`` or Dynamo (nodes are attributed to
modules through ``meta["nn_module_stack"]``). The replacement, mask and rank
arrive as new graph inputs, so one compiled graph serves replacement on, off
(mask all False) and new values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import fx, nn
from torch._C import _is_tracing as _jit_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes
from torch.compiler import is_dynamo_compiling as _is_dynamo_compiling

from .adapters import Adapter, get_adapter, identity
from .fastpath import CheckedCalls
from .points import find_injection_node
from .sharding import ShapeError, ShardSpec, layout_hint, require, rows_before_sharding, shard_columns, shard_rows
from .targets import Point, TargetError


def recording() -> bool:
    """Whether the running code is traced into a graph by Dynamo, or recorded by
    make_fx/export/AOTAutograd (a dispatch mode) or torch.jit.trace (torch_neuronx.trace)."""
    return _is_dynamo_compiling() or bool(_dispatch_modes()) or _jit_tracing()


class Injection:
    """``where(mask, adapter(shard(replacement)), computed)`` for one target.

    The callable that the pass inserts into graphs (as a ``call_function``
    target) and that output-point wrappers call directly, so both paths share one
    implementation. ``replacement=None`` passes ``computed`` through unchanged.
    With ``leading_rows=True`` the replacement and mask are max-size buffers and
    only their leading rows (as many as the tokens of this call) are read. ``observers`` see the
    computed value first (reference capture, router agreement).

    Eager calls with buffers it checked before take the fast path of
    :mod:`fxreplace.fastpath` (``checked``): with such buffers on the host, a call that
    replaces no row returns ``computed`` and, with the buffers of :meth:`share_fed`, a call
    that replaces every row returns the buffer's leading rows themselves (no copy, no kernel).
    """

    def __init__(self, module_name: str, module: nn.Module, adapter=None, shard: ShardSpec | None = None):
        self.module_name = module_name
        self.module = module
        self.adapter: Adapter = get_adapter(adapter)
        self.shard = shard
        self.observers: list[Callable[[torch.Tensor], None]] = []
        self.__name__ = "fxreplace_inject"  # name hint for FX code generation
        # eager engines call this once per target per forward with the same bound buffers
        self.checked = CheckedCalls()

    def share_fed(self, values: torch.Tensor | None, mask: torch.Tensor | None = None) -> None:
        """See :meth:`~fxreplace.fastpath.CheckedCalls.share_fed`."""
        self.checked.share_fed(values, mask)

    def __call__(self, computed, replacement=None, mask=None, rank=None, leading_rows=False):
        if self.observers:
            for observe in self.observers:
                observe(computed)
        if replacement is None:
            return computed
        if recording():  # no Python state, which would become a guard or a constant of the graph
            return self._inject(computed, replacement, mask, rank, leading_rows)
        if type(computed) is torch.Tensor:
            entry = self.checked.lookup(computed, replacement, mask, leading_rows)
            if entry is not None:
                return entry.inject(computed)
        out = self._inject(computed, replacement, mask, rank, leading_rows)
        if (self.adapter is identity and self.shard is None and type(computed) is torch.Tensor and computed.dim() == 2
                and replacement.dtype == computed.dtype):
            self.checked.remember(computed, replacement, mask, leading_rows)
        return out

    def _inject(self, computed, replacement, mask, rank, leading_rows):
        name, spec = self.module_name, self.shard
        parts = tuple(computed) if isinstance(computed, (tuple, list)) else (computed,)
        flats = [part.reshape(-1, part.shape[-1]) for part in parts]
        tokens = rows_before_sharding(flats[0].shape[0], self.shard)
        _check_dtype_and_device(name, replacement, mask, flats[0])
        if leading_rows:
            replacement, mask = replacement[:tokens], mask[:tokens]
        require(
            replacement.dim() == 2 and replacement.shape[0] == tokens,
            lambda: f"replacement for {name} has shape {tuple(replacement.shape)}, but the module computes "
            f"{_shapes(parts)} here, so it needs [{tokens}, E]"
            + layout_hint(spec, replacement.shape, flats[0].shape),
        )
        require(
            mask.dtype == torch.bool and mask.dim() == 1 and mask.shape[0] == tokens,
            lambda: f"mask for {name} must be bool [{tokens}], got {mask.dtype} {tuple(mask.shape)}",
        )
        if rank is None and self.shard is not None:
            rank = self.shard.rank
        replacement = shard_rows(replacement, spec, rank, f"tokens of the replacement for {name} ({spec})")
        mask = shard_rows(mask, spec, rank, f"tokens of the mask for {name} ({spec})").unsqueeze(-1)
        full = self.adapter(replacement, self.module)
        values = tuple(full) if isinstance(full, (tuple, list)) else (full,)
        if len(values) != len(parts):
            raise TargetError(f"the adapter for {name} returns {len(values)} tensor(s) {_shapes(values)}, but the "
                             f"point computes {len(parts)}: {_shapes(parts)}; pick one with point='output[i]' or use a "
                             "pair adapter (e.g. 'topk_softmax_pairs') for a (weights, ids) point")
        if len(values) > 1 and spec is not None and spec.mode == "expert":
            raise ShapeError(f"{name}: expert sharding slices dense [T, E] values; top-k pairs hold global expert "
                             "ids, so give this rank the full pairs (no shard spec)")
        out = []
        for full_value, flat, part in zip(values, flats, parts):
            value = shard_columns(full_value, spec, rank, f"experts of {name} ({spec})")
            require(
                tuple(value.shape) == tuple(flat.shape),
                lambda: f"replacement for {name} becomes {tuple(value.shape)} after shard/adapter, but the module "
                f"computes {tuple(flat.shape)} (from {tuple(part.shape)})"
                + layout_hint(spec, full_value.shape, flat.shape),
            )
            out.append(torch.where(mask, value.to(flat.dtype), flat).reshape(part.shape))
        return rebuild(computed, out) if isinstance(computed, (tuple, list)) else out[0]


def rebuild(like: tuple | list, parts: list):
    """``parts`` as a sequence of ``like``'s type (a namedtuple takes its fields as arguments)."""
    return type(like)(*parts) if hasattr(like, "_fields") else type(like)(parts)


def with_element(sequence: tuple | list, index: int, value):
    """``sequence`` with element ``index`` replaced by ``value``, of the same type."""
    if type(sequence) is tuple:
        return sequence[:index] + (value,) + sequence[index + 1:]
    parts = list(sequence)
    parts[index] = value
    return rebuild(sequence, parts)


def _check_dtype_and_device(name: str, replacement: torch.Tensor, mask: torch.Tensor, computed: torch.Tensor) -> None:
    """Float replacements are cast to the computed dtype; anything else would be a
    silent change of meaning (token ids, a truncated int). Devices must agree."""
    if computed.dtype.is_floating_point and not replacement.dtype.is_floating_point:
        raise TypeError(f"replacement for {name} is {replacement.dtype}, but the module computes {computed.dtype}: "
                        "give floating-point values (the captured tensor), not a cast of them")
    for what, tensor in (("replacement", replacement), ("mask", mask)):
        if tensor.device != computed.device:
            raise ValueError(f"{what} for {name} is on {tensor.device}, but the module computes on "
                             f"{computed.device}: build the context with device={str(computed.device)!r}")


def _shapes(tensors) -> str:
    return ", ".join(str(tuple(t.shape)) for t in tensors)


@dataclass(frozen=True)
class InjectionSpec:
    """One rewrite: ``module_name`` (``""`` for a graph traced from the target
    alone), where in it (``point``), and the :class:`Injection` to insert; the
    replacement arrives as graph input ``input_name``."""

    module_name: str
    point: Point
    injection: Injection
    input_name: str


@dataclass
class PassResult:
    """What :func:`insert_replacements` changed: per module the node whose users
    now read the injected value, and the graph inputs it added, in order."""

    rewired: dict[str, str] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)


def _add_inputs(graph: fx.Graph, names: list[str], optional: bool) -> dict[str, fx.Node]:
    """Append placeholders after the existing ones but before ``*args``/``**kwargs``,
    so the generated signature stays valid."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    varargs = [n for n in placeholders if n.target.startswith("*")]
    anchor = placeholders[-1] if placeholders else None
    added = {}
    for name in names:
        if varargs:
            where = graph.inserting_before(varargs[0])
        elif anchor is not None:
            where = graph.inserting_after(anchor)
        else:
            where = graph.inserting_before(next(iter(graph.nodes)))
        with where:
            anchor = added[name] = graph.placeholder(name, default_value=None) if optional else graph.placeholder(name)
    return added


def insert_replacements(
    gm: fx.GraphModule,
    specs: Sequence[InjectionSpec],
    *,
    mask_input: str = "fxreplace_mask",
    rank_input: str | None = None,
    leading_rows_input: str | None = None,
    optional_inputs: bool = True,
) -> PassResult:
    """Rewrite ``gm`` in place so each spec's injection node is replaced by
    ``spec.injection(node, <input_name>, <mask_input>, rank=<rank_input>, leading_rows=<leading_rows_input>)``.

    With ``optional_inputs`` new inputs default to None (replacement off), so
    existing callers keep working. Raises :class:`TargetError` if a point cannot be found or a node
    was not rewired exactly once.
    """
    graph = gm.graph
    located = [(spec, find_injection_node(gm, spec.module_name, spec.point)) for spec in specs]
    seen = [node for _, node in located]
    if len(set(seen)) != len(seen):
        raise TargetError("two targets resolve to the same injection node")

    result = PassResult()
    new_inputs = [spec.input_name for spec in specs] + [mask_input]
    new_inputs += [n for n in (rank_input, leading_rows_input) if n is not None]
    placeholders = _add_inputs(graph, new_inputs, optional_inputs)
    result.inputs.extend(new_inputs)

    for spec, node in located:
        with graph.inserting_after(node):
            injected = graph.call_function(
                spec.injection,
                (node, placeholders[spec.input_name], placeholders[mask_input]),
                {
                    "rank": placeholders.get(rank_input),
                    "leading_rows": placeholders.get(leading_rows_input, False),
                },
            )
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in node.meta:
                injected.meta[key] = node.meta[key]
        node.replace_all_uses_with(injected, delete_user_cb=lambda user: user is not injected)
        result.rewired[spec.module_name] = node.name

    graph.lint()
    gm.recompile()
    for spec, node in located:
        injected = [u for u in node.users if u.op == "call_function" and isinstance(u.target, Injection)]
        if len(injected) != 1 or len(node.users) != 1:
            raise TargetError(f"{spec.module_name or 'target'}: node {node.name} was not rewired exactly once")
    return result
