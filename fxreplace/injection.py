"""The runtime op of a replacement: ``where(mask, adapter(shard(replacement)), computed)``.

:class:`Injection` is what the graph pass (:mod:`fxreplace.passes`) inserts into graphs as
a ``call_function`` and what output-point forwards (:mod:`fxreplace.instrument`) call
directly, so both paths share one implementation, and its eager cache: an eager engine
runs the same few batch shapes step after step with the same bound buffers, and what a
first call checked in full (shapes, dtypes, devices, which buffers) stays true while those
buffers stay, so later calls only read the buffers' current contents. Nothing of the
cache is used while a graph is recorded (it would become a guard or a constant).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn
from torch._C import _len_torch_dispatch_stack as _dispatch_modes  # no public way to ask (make_fx, export)
from torch.compiler import is_dynamo_compiling

from .adapters import Adapter, get_adapter, identity, routing_matrix, routing_pair
from .sharding import ShapeError, ShardSpec, layout_hint, require, rows_before_sharding, shard_columns, shard_rows
from .targets import TargetError


def host_bytes(mask: torch.Tensor) -> memoryview | None:
    """The bytes of a host mask (contiguous), read with no op and no kernel, else None (a device
    mask would be a sync); a view, so a later read sees what was written into the mask since."""
    return memoryview(mask.numpy()).cast("B") if mask.device.type == "cpu" and mask.is_contiguous() else None


def recording() -> bool:
    """Whether the running code is traced into a graph by Dynamo, or recorded by
    make_fx/export/AOTAutograd (a dispatch mode) or torch.jit.trace (torch_neuronx.trace)."""
    return is_dynamo_compiling() or bool(_dispatch_modes()) or torch.jit.is_tracing()


class Injection:
    """``where(mask, adapter(shard(replacement)), computed)`` for one target.

    The callable that the pass inserts into graphs (as a ``call_function``
    target) and that output-point wrappers call directly, so both paths share one
    implementation. ``replacement=None`` passes ``computed`` through unchanged.
    With ``leading_rows=True`` the replacement and mask are max-size buffers and
    only their leading rows (as many as the tokens of this call) are read. ``observers`` see the
    computed value first (reference capture, router agreement).

    Eager calls with buffers it checked before take the fast path of
    the eager cache (``checked``): with such buffers on the host, a call that
    replaces no row returns ``computed`` and, with the buffers of :meth:`share_fed`, a call
    that replaces every row returns the buffer's leading rows themselves (no copy, no kernel)
    when they are contiguous.
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
        self.spec = spec_number(self.adapter, shard)

    def share_fed(self, values: torch.Tensor | None, mask: torch.Tensor | None = None, hands_on: bool = True) -> None:
        """See :meth:`CheckedCalls.share_fed`."""
        self.checked.share_fed(values, mask, hands_on)

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
        return inject(self.spec, self.module_name, self.module, computed, replacement, mask, rank, leading_rows)


#: an Injection's (adapter, shard) by its spec number: a compiled graph reads them here by a
#: constant number, one guard per distinct spec rather than per target
_SPECS: dict[int, tuple[Adapter, ShardSpec | None]] = {}
_SPEC_NUMBERS: dict[tuple, int] = {}


def spec_number(adapter: Adapter, shard: ShardSpec | None) -> int:
    """The number of ``(adapter, shard)``, the same for equal specs."""
    key = (adapter, None if shard is None else (shard.mode, shard.world_size,
                                                 shard.rank if isinstance(shard.rank, int) else id(shard.rank)))
    number = _SPEC_NUMBERS.get(key)
    if number is None:
        number = _SPEC_NUMBERS[key] = len(_SPEC_NUMBERS)
        _SPECS[number] = (adapter, shard)
    return number


def inject(spec: int, module_name: str, module: nn.Module, computed, replacement, mask, rank=None, leading_rows=False):
    """``where(mask, adapter(shard(replacement)), computed)`` for the Injection of spec number ``spec``
    at ``module`` (``module_name`` for errors); ``replacement=None`` passes ``computed`` through."""
    if replacement is None:
        return computed
    adapter, shard = _SPECS[spec]
    parts = tuple(computed) if isinstance(computed, (tuple, list)) else (computed,)
    flats = [part.reshape(-1, part.shape[-1]) for part in parts]
    tokens = rows_before_sharding(flats[0].shape[0], shard)
    _check_dtype_and_device(replacement, mask, flats[0], leading_rows, lambda: module_name)
    if leading_rows:
        replacement, mask = replacement[:tokens], mask[:tokens]
    require(
        replacement.dim() == 2 and replacement.shape[0] == tokens,
        lambda: (f"{module_name} computes {_shapes(parts)} here, more rows than the {replacement.shape[0]} of the "
                 "feed buffers: instrument(..., max_tokens=N) sizes them, N the most tokens one forward computes"
                 if leading_rows and replacement.dim() == 2 and replacement.shape[0] < tokens else
                 f"replacement for {module_name} has shape {tuple(replacement.shape)}, but the module computes "
                 f"{_shapes(parts)} here, so it needs [{tokens}, E]"
                 + layout_hint(shard, replacement.shape, flats[0].shape)),
    )
    require(
        mask.dtype == torch.bool and mask.dim() == 1 and mask.shape[0] == tokens,
        lambda: f"mask for {module_name} must be bool [{tokens}], got {mask.dtype} {tuple(mask.shape)}",
    )
    if rank is None and shard is not None:
        rank = shard.rank
    replacement = shard_rows(replacement, shard, rank,
                             lambda: f"tokens of the replacement for {module_name} ({shard})")
    mask = shard_rows(mask, shard, rank, lambda: f"tokens of the mask for {module_name} ({shard})").unsqueeze(-1)
    full = adapter(replacement, module)
    values = tuple(full) if isinstance(full, (tuple, list)) else (full,)
    if len(values) != len(parts):
        raise TargetError(f"the adapter for {module_name} returns {len(values)} tensor(s) "
                         f"{_shapes(values)}, but the point computes {len(parts)}: {_shapes(parts)}; pick one "
                         "with point='output[i]' or use a pair adapter (e.g. 'topk_softmax_pairs') for a (weights, "
                         "ids) point")
    if len(values) > 1 and shard is not None and shard.mode == "expert":
        raise ShapeError(f"{module_name}: expert sharding slices dense [T, E] values; top-k pairs hold "
                         "global expert ids, so give this rank the full pairs (no shard spec)")
    out = []
    for full_value, flat, part in zip(values, flats, parts):
        value = shard_columns(full_value, shard, rank, lambda: f"experts of {module_name} ({shard})")
        require(
            tuple(value.shape) == tuple(flat.shape),
            lambda: f"replacement for {module_name} becomes {tuple(value.shape)} after shard/adapter, but "
            f"the module computes {tuple(flat.shape)} (from {tuple(part.shape)})"
            + layout_hint(shard, full_value.shape, flat.shape),
        )
        out.append(torch.where(mask, value.to(flat.dtype), flat).reshape(part.shape))
    return rebuild(computed, out) if isinstance(computed, (tuple, list)) else out[0]


def call_injection(injection, computed, replacement, mask, rank=None, leading_rows=False):
    """Call a target's Injection, or in a compiled model's trace what stands for it: ``(spec, module
    name, module)``, the constants :func:`inject` reads (an Injection object would be guarded per target)."""
    if type(injection) is tuple:
        spec, name, module = injection
        return inject(spec, name, module, computed, replacement, mask, rank, leading_rows)
    return injection(computed, replacement, mask, rank, leading_rows)


def _name_of(injection: Injection | tuple) -> str:
    """The target's name, for errors only (in a trace each read of an Injection is a guard)."""
    return injection[1] if type(injection) is tuple else injection.module_name


def inject_routing(injection: Injection | tuple, values: list[torch.Tensor], num_experts: int | None, replacement,
                   mask, leading_rows=False) -> list[torch.Tensor]:
    """The routing a module is called with (point ``"routing"``), replaced. One value is a dense
    ``[T, E]`` matrix and goes through ``injection`` as it is. A (top-k weights, expert ids) pair, in
    either order, goes through it as the dense matrix it stands for (so a capture records, and a
    replacement holds, ``[T, E]`` rows); rows the injection changed are read back as their top-k,
    the others keep the pair as computed, bit for bit and in its order. ``injection``: as
    :func:`call_injection` takes it."""
    if len(values) == 1:
        if not values[0].is_floating_point():
            raise TargetError(f"{_name_of(injection)!r}: point 'routing': the one argument computed from a top-k "
                              f"is {values[0].dtype} {tuple(values[0].shape)}, expert ids without their weights (the "
                              "module takes weights from elsewhere and picks the chosen ones itself); target the router "
                              "instead")
        return [call_injection(injection, values[0], replacement, mask, None, leading_rows)]
    floats = [v.is_floating_point() for v in values]
    if floats.count(True) != 1 or values[0].shape != values[1].shape:
        raise TargetError(f"{_name_of(injection)!r}: point 'routing' is called with "
                          f"{', '.join(f'{v.dtype} {tuple(v.shape)}' for v in values)}; a routing pair is float "
                          "weights and integer expert ids of one shape [T, k]")
    w, i = (0, 1) if floats[0] else (1, 0)
    weights, ids = values[w], values[i]
    k = weights.shape[-1]
    flat_weights, flat_ids = weights.reshape(-1, k), ids.reshape(-1, k)
    dense = routing_matrix(flat_weights, flat_ids, num_experts)
    injected = call_injection(injection, dense, replacement, mask, None, leading_rows)
    if injected is dense:  # nothing replaced: the pair as computed
        return values
    changed = ((injected != dense) & ~(injected.isnan() & dense.isnan())).any(-1, keepdim=True)
    new_weights, new_ids = routing_pair(injected, k)
    out = [None, None]
    out[w] = torch.where(changed, new_weights.to(weights.dtype), flat_weights).reshape(weights.shape)
    out[i] = torch.where(changed, new_ids.to(ids.dtype), flat_ids).reshape(ids.shape)
    return out


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


def _check_dtype_and_device(replacement: torch.Tensor, mask: torch.Tensor, computed: torch.Tensor, fed: bool,
                            module_name: Callable[[], str]) -> None:
    """Float replacements are cast to the computed dtype; anything else would be a
    silent change of meaning (token ids, a truncated int). Devices must agree: ``fed``
    (the max-size feed buffers) says the fix is a feed after the move, not the context.
    ``module_name`` is called on failure only: a frame Dynamo resumes after a graph break
    holds the name, and torch 2.9 guards on a string passed on (a recompile per target)."""
    if computed.dtype.is_floating_point and not replacement.dtype.is_floating_point:
        raise TypeError(f"replacement for {module_name()} is {replacement.dtype}, but the module computes "
                        f"{computed.dtype}: give floating-point values (the captured tensor), not a cast of them")
    for what, tensor in (("replacement", replacement), ("mask", mask)):
        if tensor.device != computed.device:
            fix = ("feed() again after moving the model (the buffers follow moves of the instrumented model itself, "
                   "not of a module inside it)" if fed else f"build the context with device={str(computed.device)!r}")
            raise ValueError(f"{what} for {module_name()} is on {tensor.device}, but the module computes on "
                             f"{computed.device}: {fix}")


def _shapes(tensors) -> str:
    return ", ".join(str(tuple(t.shape)) for t in tensors)


# ---------------------------------------------------------------------- the eager cache

CHECKED_SHAPES = 8  # batch shapes whose checked calls are kept (an engine's common batch sizes)


class CheckedCall(NamedTuple):
    """What an eager call of an Injection checked, for one computed shape: the buffers it
    was called with, the computed shape, dtype and device, and views of the buffers' rows it reads."""

    replacement: torch.Tensor
    mask: torch.Tensor
    leading_rows: bool
    shape: torch.Size
    dtype: torch.dtype
    device: int
    mask_column: torch.Tensor
    rows: torch.Tensor
    host_mask: memoryview | None  # the mask's bytes, when it lives on the host (read without a kernel)
    hands_rows_on: bool  # the rows are fed buffers that their feeder rewrites: a call replacing every row may return them
    all_replaced: bytes
    none_replaced: bytes

    def matches(self, computed: torch.Tensor, replacement, mask, leading_rows) -> bool:
        return (self.replacement is replacement and self.mask is mask and self.leading_rows is leading_rows
                and self.dtype is computed.dtype and self.device == computed.get_device())

    def replayed(self, computed) -> torch.Tensor | None:
        """This call applied again to ``computed`` where it is what the call was checked for (a plain
        tensor of the same shape, dtype and device; the buffers being the same), else None."""
        if (type(computed) is torch.Tensor and computed.shape == self.shape and computed.dtype is self.dtype
                and computed.get_device() == self.device):
            return self.inject(computed)
        return None

    def inject(self, computed: torch.Tensor) -> torch.Tensor:
        """``where(mask, rows, computed)``; a host mask that replaces no row, or every row
        of buffers that may be handed on, needs no kernel."""
        host = self.host_mask
        if host is not None:
            if self.hands_rows_on and host == self.all_replaced:
                return self.rows
            if host == self.none_replaced:
                return computed
        return torch.where(self.mask_column, self.rows, computed)


class CheckedCalls:
    """One Injection's checked calls, per computed shape; those made with the fed buffers
    (see :meth:`share_fed`) also by shape alone, for output points armed with them."""

    def __init__(self):
        self.entries: dict[torch.Size, CheckedCall] = {}
        self.fed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.fed_entries: dict[torch.Size, CheckedCall] = {}

    def share_fed(self, values: torch.Tensor | None, mask: torch.Tensor | None = None, hands_on: bool = True) -> None:
        """``values``/``mask`` are the fed buffers a forward without replacements reads: a call with
        them is found by shape alone. ``hands_on``: their feeder rewrites them before every forward
        (``feed(bind=True)``), so a call whose rows are all replaced may return the values' rows
        themselves (contiguous ones); a copied feed's persist, so a model that writes into what a
        target returns must get a copy. None: no buffers are shared."""
        self.fed = None if values is None else (values, mask, hands_on)
        self.entries.clear()
        self.fed_entries.clear()

    def lookup(self, computed: torch.Tensor, replacement, mask, leading_rows) -> CheckedCall | None:
        entry = self.entries.get(computed.shape)
        return entry if entry is not None and entry.matches(computed, replacement, mask, leading_rows) else None

    def fed_entry(self, value: torch.Tensor) -> CheckedCall | None:
        """The checked call of the fed buffers for ``value``'s shape (host buffers only)."""
        entry = self.fed_entries.get(value.shape)
        return entry if entry is not None and entry.dtype is value.dtype and value.is_cpu else None

    def remember(self, computed: torch.Tensor, replacement, mask, leading_rows) -> None:
        """Keep the checked views of a call the general path accepted: the views are of the
        buffers, so later calls read their current contents. Entries of other replacements
        are dropped (none holds a tensor of an earlier call), and at most ``CHECKED_SHAPES`` kept."""
        tokens = computed.shape[0]
        rows = slice(0, tokens) if leading_rows else slice(None)
        read = mask[rows]  # a host mask is read without a kernel: a call replacing no row is no kernel at all
        host_mask = host_bytes(read)
        fed = self.fed is not None and self.fed[0] is replacement and self.fed[1] is mask and host_mask is not None
        kept = {shape: c for shape, c in self.entries.items() if c.replacement is replacement}
        self.entries = kept if len(kept) < CHECKED_SHAPES else {}
        entry = self.entries[computed.shape] = CheckedCall(
            replacement, mask, leading_rows, computed.shape, computed.dtype, computed.get_device(), mask[rows].unsqueeze(-1),
            # rows handed on only when contiguous: a built feed's are a column of its position-major storage,
            # and a kernel reading the module's output (a fused top-k) may take rows to be E apart
            replacement[rows], host_mask, fed and self.fed[2] and replacement[rows].is_contiguous(), b"\1" * tokens,
            bytes(tokens))
        if fed:
            if len(self.fed_entries) >= CHECKED_SHAPES:
                self.fed_entries.clear()
            self.fed_entries[computed.shape] = entry
