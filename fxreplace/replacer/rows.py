"""The store row of every slot of a batch, planned on the host (numpy: the scheduler's metadata
lives there) from each request's prompt; request ids never reach this module.

Batches of up to ``_SMALL_BATCH`` slots (decode steps) run as plain Python, which costs less than
the dozen numpy calls of the general case; so are their arguments read (lists of ints).
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..store import ReferenceStore

_SMALL_BATCH = 64  # slots up to which the row arithmetic runs in plain Python (decode steps)
_INT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


class BatchRows(NamedTuple):
    """Where the rows of one batch's requests lie."""

    prompts: list[int]  # internal prompt per request (-1 where none), then -1 for padding
    prompt_array: np.ndarray  # the same as int64, for large batches' numpy arithmetic
    matched: bool  # any request has a prompt
    offsets: list[int]  # per request: first row in its shard (0 where it has no prompt)
    stored: list[range]  # per request: the positions it has rows for (none where it has no prompt)
    # the shard holding every matched request's rows (0 when none matched); when they lie in
    # several, each request's shard (0 where it has no prompt)
    shard: int | list[int]


class ShardBlocks(NamedTuple):
    """A batch's replaced slots grouped by the shard that holds their rows (``rows``: of each
    in that order; ``blocks``: ``(shard, start, stop)`` of each run). They fill a staging
    buffer of ``replaced + 1`` slots (the last one zeros) from which slot ``i`` of the batch
    takes staging slot ``columns[i]``."""

    rows: np.ndarray
    blocks: list[tuple[int, int, int]]
    columns: np.ndarray
    replaced: int

    @staticmethod
    def of(shard: np.ndarray, rows: np.ndarray, mask: np.ndarray) -> "ShardBlocks":
        """The plan of a batch whose replaced slots (``mask``) lie in at least two shards."""
        slots = np.flatnonzero(mask)
        slots = slots[np.argsort(shard[slots], kind="stable")]
        shard = shard[slots]
        bounds = [0, *(np.flatnonzero(shard[1:] != shard[:-1]) + 1).tolist(), len(slots)]
        columns = np.full(mask.shape[0], len(slots), dtype=np.int64)
        columns[slots] = np.arange(len(slots))
        return ShardBlocks(rows[slots], [(int(shard[a]), a, b) for a, b in zip(bounds[:-1], bounds[1:])],
                           columns, len(slots))


class RowPlanner:
    """The store's row tables on the host, and the plans of batches made from them. Each table
    ends with an entry of no rows that prompt -1 (unmatched requests, padding) indexes, so a
    large batch's mask needs no separate "matched" test."""

    def __init__(self, store: ReferenceStore, on_host: bool):
        self.on_host = on_host  # the store is on the host: numpy copies a small batch's rows
        self._offsets = np.append(store.offsets.cpu().numpy(), 0)
        self._lengths = np.append(store.lengths.cpu().numpy(), 0)
        self._shard_of = np.append(store.prompt_shard.cpu().numpy(), 0)
        self._shard_list = self._shard_of.tolist()
        self._zero_rows = np.array([s.zero_row for s in store.shards], dtype=np.int64)
        self._zero_rows_list = self._zero_rows.tolist()
        self._spans = list(zip(self._offsets.tolist(), self._lengths.tolist()))  # per prompt (first row, rows), then (0, 0)

    def small(self, n: int) -> bool:
        """Whether numpy copies the rows of a batch of ``n`` slots (a small batch of a host store)."""
        return self.on_host and n <= _SMALL_BATCH

    def lookup(self, prompts: list[int]) -> BatchRows:
        """Where the rows of requests of these internal prompts (-1 where none) lie."""
        spans = [self._spans[p] for p in prompts]
        shards = [self._shard_list[p] for p in prompts]
        touched = {s for s, p in zip(shards, prompts) if p >= 0}
        prompts = [*prompts, -1]
        return BatchRows(prompts, np.array(prompts, dtype=np.int64), max(prompts) >= 0, [o for o, _ in spans],
                         [range(length) for _, length in spans],
                         shards if len(touched) > 1 else touched.pop() if touched else 0)

    def plan(self, batch: BatchRows, counts: Sequence[int] | np.ndarray, positions: np.ndarray | list[int],
             padding: list[int] | None = None):
        """The plan and the mask of a batch: request ``i`` owns the next ``counts[i]`` slots, then
        ``padding[i]`` padding slots; the slots after the last request's are padding. The plan of a
        batch whose rows lie in one shard (every batch of a one-shard store, a prefill chunk) is
        ``(shard, rows)``, the store row of every slot (the shard's zero row where it holds none);
        that of a batch over several shards is ``(shard of every slot, rows)`` for up to
        ``_SMALL_BATCH`` slots of a host store, else its :class:`ShardBlocks`."""
        if padding is not None:
            batch, counts = _padded(batch, counts, padding)
        n, several = len(positions), type(batch.shard) is list
        if n > _SMALL_BATCH or (several and not self.on_host):  # several: numpy gathers per slot
            return self._large_plan(batch, counts, positions)
        # a plain Python loop: a fraction of the numpy calls' cost for a decode step
        pos = positions if type(positions) is list else positions.tolist()
        spans, shard_of = self._spans, self._shard_list
        shard = 0 if several else batch.shard
        rows, mask, shards = [self._zero_rows_list[shard]] * n, [False] * n, [0] * n
        s = 0
        for p, c in zip(batch.prompts, counts):
            if p >= 0:
                offset, length = spans[p]
                for j in range(s, s + c):
                    if 0 <= pos[j] < length:
                        rows[j], mask[j], shards[j] = offset + pos[j], True, shard_of[p]
            s += c
        return (shards if several else shard, rows), mask

    def _large_plan(self, batch: BatchRows, counts, positions):
        """:meth:`plan` in numpy."""
        n = len(positions)
        positions = np.asarray(positions, dtype=np.int64)
        per_request = np.asarray(counts, dtype=np.int64)
        prompt = np.repeat(batch.prompt_array, np.append(per_request, n - per_request.sum()))
        mask = (positions >= 0) & (positions < self._lengths[prompt])
        local = self._offsets[prompt] + positions
        shard = self._shard_of[prompt]
        touched = shard[mask]
        if touched.size and (touched != touched[0]).any():
            return ShardBlocks.of(shard, local, mask), mask
        first = int(touched[0]) if touched.size else 0
        return (first, np.where(mask, local, self._zero_rows[first])), mask


def _padded(batch: BatchRows, counts: list[int], padding: list[int]) -> tuple[BatchRows, list[int]]:
    """``batch`` and ``counts`` with the padding after each request as a run of slots of no prompt,
    which the plans then treat as any slot without a row (the plans read prompts and counts only:
    the per-request offsets, stored positions and shards stay the requests')."""
    prompts = [x for p in batch.prompts[:-1] for x in (p, -1)] + [-1]
    counts = [x for c, pad in zip(counts, padding) for x in (c, pad)]
    return batch._replace(prompts=prompts, prompt_array=np.array(prompts, dtype=np.int64)), counts


def decode_rows(batch: BatchRows, positions: list[int]) -> list[int] | None:
    """Store rows of a decode step of ``batch``'s requests (one position each), or None
    unless every request matched and holds a row at its position."""
    # "p in range(rows)" is 0 <= p < rows (unmatched requests hold range(0))
    if len(positions) != len(batch.stored) or not all(map(operator.contains, batch.stored, positions)):
        return None
    return list(map(operator.add, batch.offsets, positions))


def as_index_array(values, what: str) -> np.ndarray | list[int]:
    """A 1-D int64 array, or for at most ``_SMALL_BATCH`` values a list of Python ints
    (engines' decode steps: numpy costs more than the work for a handful of values);
    floats and bools are refused (a fractional position has no row)."""
    if type(values) is list and len(values) <= _SMALL_BATCH and is_int_list(values):
        return values
    if isinstance(values, torch.Tensor):
        if values.dtype not in _INT_DTYPES:
            raise ValueError(f"{what} must be integers, got a {values.dtype} tensor")
        if values.dim() == 1 and values.shape[0] <= _SMALL_BATCH:
            return values.tolist()
        try:
            arr = values.numpy()
        except (RuntimeError, TypeError):  # on an accelerator, or part of an autograd graph
            arr = values.detach().cpu().numpy()
    else:
        arr = np.asarray(values)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        elif arr.dtype.kind not in "iu":
            raise ValueError(f"{what} must be integers, got {arr.dtype} values such as {arr.reshape(-1)[:4].tolist()}")
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D [num_slots], got shape {tuple(arr.shape)}")
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)


def layout_counts(req_ids: Sequence[str], positions: np.ndarray | list[int], is_prefill: bool,
                  tokens_per_req) -> list[int]:
    """The token counts of a Neuron-style layout (see :meth:`fxreplace.TensorReplacer.build_context`): a prefill's
    one request computes the run of consecutive positions from slot 0, a decode request ``tokens_per_req`` slots;
    a decode batch with fewer slots than its requests need is an error naming the requests it would drop."""
    n = len(positions)
    if is_prefill:
        if len(req_ids) != 1:
            raise ValueError(f"a prefill batch holds exactly one request, got {len(req_ids)}: {list(req_ids)[:4]}")
        positions = np.asarray(positions, dtype=np.int64)
        breaks = np.flatnonzero(positions[1:] != positions[:-1] + 1)
        return [int(breaks[0]) + 1 if breaks.size else n]
    if isinstance(tokens_per_req, bool) or not isinstance(tokens_per_req, (int, np.integer)) or tokens_per_req < 1:
        raise ValueError(f"tokens_per_req must be an int >= 1, got {tokens_per_req!r}")
    needed = len(req_ids) * tokens_per_req
    if n < needed:
        raise ValueError(
            f"a decode batch of {len(req_ids)} requests x {tokens_per_req} tokens needs {needed} slots but has "
            f"{n} positions: requests {list(req_ids)[n // tokens_per_req:][:4]} would be dropped"
        )
    return [int(tokens_per_req)] * len(req_ids)


def step_positions(positions) -> list[int] | None:
    """A decode step's positions as Python ints (an int tensor of one dimension, or a list
    of ints); None for anything else, which the general path checks and explains."""
    if type(positions) is torch.Tensor:
        return positions.tolist() if positions.dtype in _INT_DTYPES and positions.ndim == 1 else None
    return positions if is_int_list(positions) else None


def is_int_list(values) -> bool:
    return type(values) is list and set(map(type, values)) <= {int}
