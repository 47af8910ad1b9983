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
from typing import Callable, NamedTuple, Sequence

import torch
from torch import fx, nn
from torch._C import _is_tracing as _jit_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes
from torch.compiler import is_dynamo_compiling as _is_dynamo_compiling

from .adapters import Adapter, get_adapter, identity
from .points import find_injection_node
from .sharding import ShapeError, ShardSpec, layout_hint, require, rows_before_sharding, shard_columns, shard_rows
from .targets import Point, TargetError


_CHECKED_SHAPES = 8  # batch shapes whose checked views an Injection keeps (an engine's common batch sizes)


def recording() -> bool:
    """Whether the running code is traced into a graph by Dynamo, or recorded by
    make_fx/export/AOTAutograd (a dispatch mode) or torch.jit.trace (torch_neuronx.trace)."""
    return _is_dynamo_compiling() or bool(_dispatch_modes()) or _jit_tracing()


class CheckedCall(NamedTuple):
    """What an eager call of an :class:`Injection` checked, for one computed shape: the
    buffers it was called with, the computed dtype and device, and views of the buffers'
    rows it reads (``all_replaced`` is None unless the rows may be returned as they are)."""

    replacement: torch.Tensor
    mask: torch.Tensor
    leading_rows: bool
    dtype: torch.dtype
    device: int
    mask_column: torch.Tensor
    rows: torch.Tensor
    host_mask: memoryview | None
    all_replaced: bytes | None
    none_replaced: bytes


class Injection:
    """``where(mask, adapter(shard(replacement)), computed)`` for one target.

    The callable that the pass inserts into graphs (as a ``call_function``
    target) and that output-point wrappers call directly, so both paths share one
    implementation. ``replacement=None`` passes ``computed`` through unchanged.
    With ``leading_rows=True`` the replacement and mask are max-size buffers and
    only their leading rows (as many as the tokens of this call) are read. ``observers`` see the
    computed value first (reference capture, router agreement).

    Eagerly, with such buffers on the host, a call that replaces no row returns
    ``computed`` and, with the buffers of :meth:`share_fed`, a call that replaces every
    row returns the buffer's leading rows themselves (no copy, no kernel).
    """

    def __init__(self, module_name: str, module: nn.Module, adapter=None, shard: ShardSpec | None = None):
        self.module_name = module_name
        self.module = module
        self.adapter: Adapter = get_adapter(adapter)
        self.shard = shard
        self.observers: list[Callable[[torch.Tensor], None]] = []
        self.__name__ = "fxreplace_inject"  # name hint for FX code generation
        # Eager engines call this once per target per forward with the same bound buffers, at
        # batch sizes that vary from step to step: per computed shape, the checked views of a
        # call with the current replacement, reused while the buffers stay the same.
        self._checked: dict[torch.Size, CheckedCall] = {}
        self.fed: tuple[torch.Tensor, torch.Tensor] | None = None
        # the entries of calls with the fed buffers (read directly by instrument's output-point
        # forwards, which skip this call while nothing observes)
        self.fed_rows: dict[torch.Size, CheckedCall] = {}

    def share_fed(self, values: torch.Tensor | None, mask: torch.Tensor | None = None) -> None:
        """``values``/``mask`` are buffers that their feeder rewrites before every forward
        (``feed(bind=True)``): a call with them whose rows are all replaced may return the
        values' rows themselves. None: no buffers are shared."""
        self.fed = None if values is None else (values, mask)
        self._checked.clear()
        self.fed_rows.clear()

    def __call__(self, computed, replacement=None, mask=None, rank=None, leading_rows=False):
        if self.observers:
            for observe in self.observers:
                observe(computed)
        if replacement is None:
            return computed
        if recording():  # no Python state, which would become a guard or a constant of the graph
            return self._inject(computed, replacement, mask, rank, leading_rows)
        if type(computed) is torch.Tensor:
            entry = self._checked.get(computed.shape)
            if (entry is not None and entry.replacement is replacement and entry.mask is mask
                    and entry.leading_rows is leading_rows and entry.dtype is computed.dtype
                    and entry.device == computed.get_device()):
                if entry.host_mask is not None:  # a host mask is read without a kernel: none or all replaced is common
                    if entry.host_mask == entry.all_replaced:
                        return entry.rows
                    if entry.host_mask == entry.none_replaced:
                        return computed
                return torch.where(entry.mask_column, entry.rows, computed)
        out = self._inject(computed, replacement, mask, rank, leading_rows)
        if (self.adapter is identity and self.shard is None and type(computed) is torch.Tensor and computed.dim() == 2
                and replacement.dtype == computed.dtype):
            self._remember(computed, replacement, mask, leading_rows)
        return out

    def _remember(self, computed: torch.Tensor, replacement, mask, leading_rows) -> None:
        """Keep the checked views of a call that :meth:`_inject` accepted: everything it checked
        depends only on these buffers and shapes, and the views are of the buffers, so later
        calls read their current contents. Entries of other replacements are dropped (none
        holds a tensor of an earlier call), and at most ``_CHECKED_SHAPES`` are kept."""
        tokens = computed.shape[0]
        rows = slice(0, tokens) if leading_rows else slice(None)
        # the host mask's bytes, compared with all-True and all-False bytes (no call per forward)
        host_mask = memoryview(mask[rows].numpy()).cast("B") if mask.device.type == "cpu" and leading_rows else None
        fed = self.fed is not None and self.fed[0] is replacement and self.fed[1] is mask and host_mask is not None
        kept = {shape: c for shape, c in self._checked.items() if c.replacement is replacement}
        self._checked = kept if len(kept) < _CHECKED_SHAPES else {}
        entry = self._checked[computed.shape] = CheckedCall(
            replacement, mask, leading_rows, computed.dtype, computed.get_device(), mask[rows].unsqueeze(-1),
            replacement[rows], host_mask, b"\1" * tokens if fed else None, bytes(tokens))
        if fed:
            if len(self.fed_rows) >= _CHECKED_SHAPES:
                self.fed_rows.clear()  # in place: output-point forwards hold this dict
            self.fed_rows[computed.shape] = entry

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
        if not isinstance(computed, (tuple, list)):
            return out[0]
        return type(computed)(*out) if hasattr(computed, "_fields") else type(computed)(out)  # namedtuple or not


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
