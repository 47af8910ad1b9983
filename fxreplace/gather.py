"""Store rows into a context: ``dst[i] = src[rows[i]]``, a row being every capture name's
values at one position (``[capture names, E]``, contiguous in both: the layout is
position-major, see :mod:`fxreplace.context`).

Two primitives, chosen by the batch: numpy's ``take`` over the tensors' bits for a small
host batch (a decode step: a few rows cost less through numpy than through a torch call),
torch's ``index_select`` for everything else (prefill chunks and scattered decode rows
alike move at about the speed of a plain copy: every row is one contiguous read)."""

from __future__ import annotations

import numpy as np
import torch

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host_bits(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor's bits, whatever its dtype (bfloat16 and float8
    included): copies between such views move the values exactly."""
    return tensor.view(_SAME_SIZE_INT[tensor.element_size()]).numpy()


def take_rows(sources: tuple[np.ndarray, ...], storage: tuple[np.ndarray, ...], rows) -> None:
    """``storage[g][i] = sources[g][rows[i]]`` for every group, over :func:`host_bits`
    views. Rows are in range by construction, so ``"clip"`` (no bounds-check buffer)."""
    for src, dst in zip(sources, storage):
        src.take(rows, 0, dst, "clip")


def index_select_rows(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[i] = src[rows[i]]`` for ``[rows, capture names, E]`` tensors, ``rows`` an int64
    tensor on ``src``'s device; ``dst`` may be the leading rows of a larger context (``leading()``)."""
    torch.index_select(src, 0, rows, out=dst)


def take_slot_rows(sources: list[tuple[np.ndarray, ...]], storage: tuple[np.ndarray, ...], shards: list[int],
                   rows: list[int]) -> None:
    """``storage[g][i] = sources[shards[i]][g][rows[i]]``: a small host batch whose rows lie
    in several shards (a store an engine wrote shard by shard), a numpy copy per slot."""
    for g, dst in enumerate(storage):
        for i, (shard, row) in enumerate(zip(shards, rows)):
            dst[i] = sources[shard][g][row]
