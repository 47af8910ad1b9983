"""Buffers of fresh contexts: lent to the context a build returns, handed back explicitly.

A fresh allocation of a large context costs more in page faults than the gather itself, so a
replacer reuses buffers. Which buffers nobody reads any more, torch does not say publicly; the
one who built the context does, by releasing it (:meth:`fxreplace.TensorReplacer.release`).
Releasing says that the releaser reads nothing of the context any more; the pool still waits
until the context is gone elsewhere too: a released set is reused once its storage tensors, which
the context and every ``select()`` of it hold, are unreachable (weak references), so a context
that another holder still reads is never overwritten. Views made from the storage (capture
tensors, slices, ``leading()``, numpy arrays) are not seen: a weak reference per capture name
would cost a small fresh build several percent. A context never released is never reused.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch

from ..context import ReplacementContext
from .layouts import ContextLayout

_SPARE_BUFFERS = 4  # released buffer sets kept for reuse (the oldest is dropped)


class BufferPool:
    """The buffer sets lent to living contexts and those released. Plain tuples and dicts: a
    fresh build pays for this bookkeeping when its caches are cold from the gather."""

    def __init__(self, device: torch.device):
        self._device = device
        # id(context) -> (weak reference to it, its buffers' shapes, its buffers) while it lives unreleased:
        # a context dropped unreleased drops its entry (and its buffers) with it
        self._lent: dict[int, tuple] = {}
        # (shapes, buffers, weak references to the released context's storage), oldest first
        self._returned: list[tuple] = []
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
        key = id(context)
        self._lent[key] = (weakref.ref(context, functools.partial(self._lent.pop, key)), shapes, buffers)
        return context

    def release(self, context: ReplacementContext) -> bool:
        """Take back the buffers of ``context`` if this pool lent them and they were not taken back
        already; the ``_SPARE_BUFFERS`` sets released last wait for reuse."""
        # a living context's id is its own (an entry of a dropped one went with it): one atomic pop
        # finds its entry, and a second release finds none
        entry = self._lent.pop(id(context), None)
        if entry is None:
            return False
        held = tuple(map(weakref.ref, context.storage))
        with self._lock:
            self._returned.append((entry[1], entry[2], held))
            del self._returned[:-_SPARE_BUFFERS]
        return True

    def _take(self, shapes: list) -> tuple[torch.Tensor, ...] | None:
        """A released set of these shapes whose context's storage is gone, removed from the pool."""
        for k, (returned, buffers, held) in enumerate(self._returned):
            if returned == shapes and all(r() is None for r in held):
                del self._returned[k]
                return buffers
        return None
