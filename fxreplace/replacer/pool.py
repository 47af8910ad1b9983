"""Buffers of fresh contexts: lent to the context a build returns, handed back explicitly.

A fresh allocation of a large context costs more in page faults than the gather itself, so a
replacer reuses buffers. Which buffers nobody reads any more, torch does not say publicly; the
one who built the context does, by releasing it (:meth:`fxreplace.TensorReplacer.release`).
A released set is reused once nothing the pool can see holds it any more (the context, a
``select()`` of it, its storage, a capture tensor read from it: weak references), so a context
released while someone still reads it is never overwritten. Views made from those (slices,
``leading()``, numpy arrays) are not seen. A context never released is never reused.
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

import torch

from ..context import ReplacementContext
from .layouts import ContextLayout

_SPARE_BUFFERS = 4  # released buffer sets kept for reuse (the oldest is dropped)


class _Returned(NamedTuple):
    """A released context's buffers: their shapes, views of them no context holds, and weak
    references to what of the context the pool can see (all dead: the set is free)."""

    shapes: list[tuple[tuple[int, ...], torch.dtype]]
    buffers: tuple[torch.Tensor, ...]
    held: tuple[weakref.ref, ...]


class BufferPool:
    """The buffer sets lent to living contexts (known by the context) and those released."""

    def __init__(self, device: torch.device):
        self._device = device
        self._lent: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(context) -> context
        self._returned: list[_Returned] = []  # oldest first
        self._lock = threading.Lock()

    def lend(self, layout: ContextLayout, n: int) -> ReplacementContext:
        """A context of ``n`` slots on the pool's device (mask and rows unwritten), on a free
        released set of its shapes when there is one, else on new buffers."""
        shapes = [((n, m, e), dt) for m, e, dt in layout.shapes]
        with self._lock:  # taken under the lock: no two builds get the same set
            buffers = self._take(shapes)
        if buffers is None:
            buffers = tuple(torch.empty(shape, dtype=dt, device=self._device) for shape, dt in shapes)
        mask = torch.empty(n, dtype=torch.bool, device=self._device)
        context = ReplacementContext.from_storage(tuple(b.view_as(b) for b in buffers), mask, layout.places)
        with self._lock:
            self._lent[id(context)] = context
        return context

    def release(self, context: ReplacementContext) -> bool:
        """Take back the buffers of ``context`` if this pool lent them and they were not taken back
        already; the ``_SPARE_BUFFERS`` sets released last wait for reuse."""
        with self._lock:
            if self._lent.get(id(context)) is not context:
                return False
            del self._lent[id(context)]
            storage = context.storage
            held = tuple(map(weakref.ref, (*storage, *context.tensors.values())))
            self._returned.append(_Returned([(tuple(s.shape), s.dtype) for s in storage],
                                            tuple(s.view_as(s) for s in storage), held))
            del self._returned[:-_SPARE_BUFFERS]
        return True

    def _take(self, shapes: list) -> tuple[torch.Tensor, ...] | None:
        """A released set of these shapes that nothing the pool sees holds any more, removed from the pool."""
        for k, returned in enumerate(self._returned):
            if returned.shapes == shapes and all(r() is None for r in returned.held):
                del self._returned[k]
                return returned.buffers
        return None
