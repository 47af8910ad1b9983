"""The eager fast path of a step, in one place.

An eager engine runs the same few batch shapes step after step with the same bound
buffers. What a first call checked in full (shapes, dtypes, devices, which buffers)
stays true while those buffers stay, so later calls only read the buffers' current
contents. Two callers use this module:

* an :class:`~fxreplace.passes.Injection` (graph nodes, and output-point forwards
  through :meth:`CheckedCalls.fed_entry`) keeps a :class:`CheckedCall` per computed
  shape and lets :meth:`CheckedCall.inject` decide between the buffer's rows, the
  computed value and a ``where``;
* the :class:`~fxreplace.TensorReplacer`'s decode step reads the last batch's lookup
  (:class:`BatchLookup`) and gathers over the numpy views of :class:`HostViews`.

Every function here answers None when its case does not apply; the general path then
checks and explains everything, so nothing here decides anything differently from it.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np
import torch

CHECKED_SHAPES = 8  # batch shapes whose checked calls are kept (an engine's common batch sizes)
INT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


class CheckedCall(NamedTuple):
    """What an eager call of an Injection checked, for one computed shape: the buffers it
    was called with, the computed dtype and device, and views of the buffers' rows it reads."""

    replacement: torch.Tensor
    mask: torch.Tensor
    leading_rows: bool
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

    def share_fed(self, values: torch.Tensor | None, mask: torch.Tensor | None = None) -> None:
        """``values``/``mask`` are buffers that their feeder rewrites before every forward
        (``feed(bind=True)``): a call with them whose rows are all replaced may return the
        values' rows themselves. None: no buffers are shared."""
        self.fed = None if values is None else (values, mask)
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
        host_mask = memoryview(mask[rows].numpy()).cast("B") if mask.device.type == "cpu" and leading_rows else None
        fed = self.fed is not None and self.fed[0] is replacement and self.fed[1] is mask and host_mask is not None
        kept = {shape: c for shape, c in self.entries.items() if c.replacement is replacement}
        self.entries = kept if len(kept) < CHECKED_SHAPES else {}
        entry = self.entries[computed.shape] = CheckedCall(
            replacement, mask, leading_rows, computed.dtype, computed.get_device(), mask[rows].unsqueeze(-1),
            replacement[rows], host_mask, fed, b"\1" * tokens, bytes(tokens))
        if fed:
            if len(self.fed_entries) >= CHECKED_SHAPES:
                self.fed_entries.clear()
            self.fed_entries[computed.shape] = entry


# ---------------------------------------------------------------------- decode steps


class BatchLookup(NamedTuple):
    """One batch's request lookup (see ``TensorReplacer._lookup``)."""

    req_ids: list[str]
    generation: int  # the replacer's registration generation it was made at
    prompts: list[int]  # internal prompt per request (-1 unmatched), then -1 for padding
    prompt_array: np.ndarray  # the same as int64, for large batches' numpy arithmetic
    matched: bool  # any request matched
    offsets: list[int]  # per request: first row in its shard (0 where unmatched)
    stored: list[range]  # per request: the positions it has rows for (none where unmatched)
    # the shard holding every matched request's rows (0 when none matched); when they lie in
    # several, each request's shard (0 where unmatched)
    shard: int | list[int]


class HostViews(NamedTuple):
    """Numpy views of a host store's groups (per shard), and of a host context's storage and
    mask: a decode step's few rows are gathered and flagged through them."""

    sources: list[tuple[np.ndarray, ...]]
    storage: tuple[np.ndarray, ...]
    mask: np.ndarray


def take_step_rows(last: BatchLookup, views: HostViews, rows: list[int]) -> None:
    """A decode step's rows of ``last``'s requests into ``views.storage``: one numpy gather
    per group when they lie in one shard, else a copy per slot."""
    if type(last.shard) is int:
        take_rows(views.sources[last.shard], views.storage, rows)
    else:
        take_slot_rows(views.sources, views.storage, last.shard, rows)


def step_positions(positions) -> list[int] | None:
    """A decode step's positions as Python ints (an int tensor of one dimension, or a list
    of ints); None for anything else, which the general path checks and explains."""
    if type(positions) is torch.Tensor:
        return positions.tolist() if positions.dtype in INT_DTYPES and positions.ndim == 1 else None
    return positions if is_int_list(positions) else None


def decode_rows(last: BatchLookup, positions: list[int]) -> list[int] | None:
    """Store rows of a decode step of ``last``'s requests (one position each), or None
    unless every request matched and holds a row at its position."""
    # "p in range(rows)" is 0 <= p < rows (unmatched requests hold range(0))
    if len(positions) != len(last.stored) or not all(map(operator.contains, last.stored, positions)):
        return None
    return list(map(operator.add, last.offsets, positions))


def take_rows(sources: tuple[np.ndarray, ...], storage: tuple[np.ndarray, ...], rows) -> None:
    """``storage[g][:, i] = sources[g][:, rows[i]]`` for every group: the host gather.
    Rows are in range by construction, so ``"clip"`` (no bounds check buffer)."""
    for src, dst in zip(sources, storage):
        src.take(rows, 1, dst, "clip")


def take_slot_rows(sources: list[tuple[np.ndarray, ...]], storage: tuple[np.ndarray, ...], shards: list[int],
                   rows: list[int]) -> None:
    """``storage[g][:, i] = sources[shards[i]][g][:, rows[i]]``: the host gather of a few
    slots whose rows lie in several shards, one copy per slot."""
    for g, dst in enumerate(storage):
        for i, (shard, row) in enumerate(zip(shards, rows)):
            dst[:, i] = sources[shard][g][:, row]


def is_int_list(values) -> bool:
    return type(values) is list and set(map(type, values)) <= _INT_ONLY


_INT_ONLY = {int}
