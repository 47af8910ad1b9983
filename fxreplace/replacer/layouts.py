"""Where a context's group tensors read the store: every capture name, or the few a forward
replaces (``names=``), whose context then holds only the runs of their columns."""

from __future__ import annotations

import operator
from typing import Collection, NamedTuple

import torch

from ..context import Layout
from ..gather import host_bits
from ..store import ReferenceStore

_NARROWED_LAYOUTS = 16  # layouts of selections (build_context's names) kept: a blame round's few


class ContextLayout(NamedTuple):
    """Per shard, per group of the context, a ``[rows + 1, capture names, E]`` tensor (the
    store's own groups, or for a context of a few names the runs of their columns: views,
    nothing copied), numpy views of them for small host batches, and each capture name's
    place ``(group, column)`` in the context."""

    sources: list[tuple[torch.Tensor, ...]]
    source_bits: list[tuple] | None
    shapes: list[tuple[int, int, torch.dtype]]  # per group: capture names, E, dtype
    places: Layout

    @staticmethod
    def of(sources: list[tuple[torch.Tensor, ...]], places: dict[str, tuple[int, int]], on_host: bool) -> "ContextLayout":
        shapes = [(t.shape[1], t.shape[2], t.dtype) for t in sources[0]] if sources else []
        return ContextLayout(sources, [tuple(map(host_bits, src)) for src in sources] if on_host else None, shapes,
                             Layout.of(places))  # interned once here, not per context built

    def narrowed(self, names: frozenset) -> "ContextLayout":
        """The layout of a context holding ``names`` only: a group per run of adjacent columns."""
        runs: list[tuple[int, int, int]] = []  # (group, first column, columns)
        places = {}
        for name, (g, i) in sorted(((n, self.places[n]) for n in names), key=operator.itemgetter(1)):
            if runs and runs[-1][0] == g and sum(runs[-1][1:]) == i:
                runs[-1] = (g, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((g, i, 1))
            places[name] = (len(runs) - 1, i - runs[-1][1])
        sources = [tuple(src[g][:, i : i + k] for g, i, k in runs) for src in self.sources]
        return ContextLayout.of(sources, places, self.source_bits is not None)


class Layouts:
    """The layout of every capture name, and those of the selections built lately."""

    def __init__(self, store: ReferenceStore, on_host: bool):
        self.full = ContextLayout.of([tuple(s.packed) for s in store.shards],
                                     {m: (c.group, c.index) for m, c in store.columns.items()}, on_host)
        self._narrowed: dict[frozenset, ContextLayout] = {}

    def of(self, names: Collection[str] | None) -> ContextLayout:
        """The layout of a context holding ``names`` (every capture name for None)."""
        if names is None:
            return self.full
        key = frozenset(names)
        layout = self._narrowed.get(key)
        if layout is None:
            places = self.full.places
            if isinstance(names, str) or not key <= places.keys():
                unknown = [names] if isinstance(names, str) else sorted(key - places.keys())
                raise KeyError(f"names: the reference holds no capture name {unknown}; it holds {sorted(places)[:8]} "
                               f"({len(places)} in all)")
            layout = self.full if len(key) == len(places) else self.full.narrowed(key)
            if len(self._narrowed) >= _NARROWED_LAYOUTS:
                self._narrowed.clear()
            self._narrowed[key] = layout
        return layout
