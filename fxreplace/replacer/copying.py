"""A row plan of :mod:`.rows` carried out into a context's group tensors with the primitives of
:mod:`fxreplace.gather`, and the ``out=`` contexts a replacer checked once."""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import numpy as np
import torch

from ..context import ReplacementContext
from ..gather import host_bits, index_select_rows, take_rows, take_slot_rows
from .layouts import ContextLayout
from .rows import ShardBlocks

_CHECKED_OUTS = 64  # out= contexts whose check is remembered (an engine keeps one per batch size)


def run(layout: ContextLayout, plan, storage: tuple[torch.Tensor, ...], storage_bits: tuple[np.ndarray, ...] | None,
        device: torch.device) -> None:
    """Carry out a plan into ``storage``. ``storage_bits`` (its numpy views) is given for a small
    batch of a host store: numpy copies its few rows for less than a torch call costs. Anything
    else is ``index_select`` on ``device`` (the store's): rows of one shard straight into
    ``storage``; rows of several shards first into a staging buffer, a block of slots per
    touched shard, then the batch's slots from it."""
    if not isinstance(plan, ShardBlocks):
        shard, rows = plan
        if storage_bits is None:
            index = index_tensor(rows, device)
            for src, dst in zip(layout.sources[shard], storage):
                index_select_rows(src, dst, index)
        elif type(shard) is int:
            take_rows(layout.source_bits[shard], storage_bits, rows)
        else:  # the shard of each slot
            take_slot_rows(layout.source_bits, storage_bits, shard, rows)
        return
    rows, columns = index_tensor(plan.rows, device), index_tensor(plan.columns, device)
    for g, dst in enumerate(storage):
        _, m, e = dst.shape
        staging = torch.empty(plan.replaced + 1, m, e, dtype=dst.dtype, device=dst.device)
        staging[plan.replaced].zero_()  # the padding's and unmatched slots' row
        for shard, start, stop in plan.blocks:
            index_select_rows(layout.sources[shard][g], staging[start:stop], rows[start:stop])
        index_select_rows(staging, dst, columns)


def index_tensor(rows, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(device)


class CheckedOut(NamedTuple):
    """How a context was checked as ``out=``: the context (weakly: its id may be reused once
    it is dropped), its slots, whether it lives on the store's device (the gather then writes
    it directly), and numpy views of its storage and mask for a host context of a host store."""

    context: Any  # weakref.ref to the context
    slots: int
    layout: ContextLayout
    on_device: bool
    bits: tuple[np.ndarray, ...] | None
    mask_bits: np.ndarray | None


class OutChecks(dict):
    """``id(out)`` -> its :class:`CheckedOut`. A context's shapes and device never change, so
    each ``out=`` is checked once (a steady decode step reads its check with one ``get``)."""

    def __init__(self, device: torch.device, on_host: bool):
        super().__init__()
        self.device = device
        self.on_host = on_host

    def check(self, out: ReplacementContext, n: int, layout: ContextLayout) -> CheckedOut:
        """``out``'s check, made now unless it was made for these slots and layout already."""
        checked = self.get(id(out))
        if checked is None or checked.context() is not out or checked.slots != n or checked.layout is not layout:
            want = [(n, m, e, dt) for m, e, dt in layout.shapes]
            got = [(*s.shape, s.dtype) for s in out.storage]
            if got != want or out.mask.shape[0] != n or out.places != layout.places:
                raise ValueError(
                    f"out must be a context built by this replacer (build_context, warmup_context or .leading()) for {n} "
                    f"slots and the same names; got {out!r}"
                )
            on_device = out.mask.device == self.device
            host = on_device and self.on_host
            checked = CheckedOut(weakref.ref(out), n, layout, on_device, tuple(map(host_bits, out.storage)) if host else None,
                                 out.mask.numpy() if host else None)
            if len(self) >= _CHECKED_OUTS:  # forget the dropped ones (or all, if none was)
                for key in [k for k, c in list(self.items()) if c.context() is None]:
                    self.pop(key, None)  # another thread may forget it first
                if len(self) >= _CHECKED_OUTS:
                    self.clear()
            self[id(out)] = checked
        return checked

