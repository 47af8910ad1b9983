"""ReplacementContext: the replacement tensors for one forward pass, as plain data.

Nothing in a context changes when it is read: a compiled graph that reads one guards on
what it holds (its names, its tensors' shapes), and any state that changed on a read would
become a recompile reason. What a :class:`~fxreplace.TensorReplacer` remembers about the
contexts it builds into lives in the replacer."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Iterator

import torch

from ._compat import trace_key


class Layout(Mapping):
    """Where a context keeps each capture name: ``places[name]`` is ``(group, column)`` of its
    ``storage``, and ``mask_rows[name]`` (a :class:`SelectedContext`'s) the row of its mask matrix
    (None: every name reads the one ``mask``). Interned: equal layouts are one object, so a compiled
    graph checks a context's whole layout with one identity guard instead of one per capture name."""

    __slots__ = ("places", "mask_rows", "trace_key", "__weakref__")
    _interned: dict[tuple, "Layout"] = {}
    _by_names: dict[frozenset, "Layout"] = {}  # the latest layout of each set of names (see _pack)
    _lock = threading.Lock()

    def __init__(self, places: dict[str, tuple[int, int]], mask_rows: dict[str, int] | None):
        self.places = places
        self.mask_rows = mask_rows
        self.trace_key = trace_key(self)

    @classmethod
    def of(cls, places: Mapping[str, tuple[int, int]], mask_rows: Mapping[str, int] | None = None) -> "Layout":
        if isinstance(places, Layout) and mask_rows is None and places.mask_rows is None:
            return places
        key = (tuple((n, tuple(p)) for n, p in places.items()), None if mask_rows is None else tuple(mask_rows.items()))
        with cls._lock:
            layout = cls._interned.get(key)
            if layout is None:
                layout = cls._interned[key] = Layout({n: p for n, p in key[0]},
                                                     None if mask_rows is None else dict(key[1]))
            if mask_rows is None:  # the latest asked for, even when interned before (a replacer's, made anew)
                cls._by_names[frozenset(layout.places)] = layout
        return layout

    def __getitem__(self, name: str) -> tuple[int, int]:
        return self.places[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.places)

    def __len__(self) -> int:
        return len(self.places)

    def __eq__(self, other) -> bool:
        return self is other if isinstance(other, Layout) else Mapping.__eq__(self, other)

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"Layout({self.places!r}, mask_rows={self.mask_rows!r})"


class ReplacementContext(Mapping):
    """``{capture_name: Tensor[num_tokens, E]}`` plus ``mask``, a bool ``[num_tokens]``.

    ``mask[s]`` is True exactly where slot ``s`` holds a reference row; every other
    row is zero. A context whose mask is all False turns replacement off without
    changing any shape, so a compiled graph serves "on" and "off" alike.

    Built by a :class:`~fxreplace.TensorReplacer`, the tensors are columns of
    ``storage``: one position-major ``[num_tokens, capture names, E]`` tensor per group of
    the store, laid out like the store's own group tensors, so one gather per group fills
    every capture name at once (``places[name]`` is ``(group, column)``; capture ``name``'s
    tensor is ``storage[group][:, column]``, a ``[num_tokens, E]`` view whose rows are
    ``capture names x E`` apart). Position-major because a decode step reads one store row
    per request at random: in this layout each is one contiguous read of every capture
    name's values (48 x E=128 bf16: 12 KiB), where a name-major layout scatters it into one
    256-byte read per capture name, which the memory's latency bounds at about a third of
    the speed. Made by hand (``ReplacementContext({name: [num_tokens, E]}, mask)``), the tensors
    are copied into the same layout, grouped by dtype and row shape, in the order of a context of
    the same names seen before (a replacer's): a compiled graph guards on its inputs' strides and on
    the context's ``layout`` (one identity guard, see :class:`Layout`), and one graph serves
    hand-made and built contexts alike. Write into a
    context's own tensors (``ctx[name]``), not into the ones it was made from.
    ``num_replaced`` counts the mask's True rows as the last build wrote them
    (None for a context made by hand).
    """

    __slots__ = ("tensors", "mask", "storage", "places", "layout", "num_replaced", "__weakref__")

    def __init__(self, tensors: Mapping[str, torch.Tensor], mask: torch.Tensor, storage: tuple[torch.Tensor, ...] = (),
                 places: Mapping[str, tuple[int, int]] | None = None):
        if mask.dtype != torch.bool or mask.dim() != 1:
            raise ValueError(f"mask must be a 1-D bool tensor, got {mask.dtype} of shape {tuple(mask.shape)}")
        for name, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"replacement for {name!r} must be a tensor, got {type(value).__name__}")
        # the tensors of a context built over storage are its groups' blocks: a group's rows are theirs
        shapes = ((f"group {g}", s.shape) for g, s in enumerate(storage)) if storage else (
            (repr(name), t.shape) for name, t in tensors.items())
        for what, shape in shapes:
            if len(shape) < 1 or shape[0] != mask.shape[0]:
                raise ValueError(f"replacement for {what} has shape {tuple(shape)}; expected "
                                 f"[{mask.shape[0]}, ...] to match the mask")
        places = Layout.of(places or {})
        if not storage and tensors:
            storage, places = _pack(tensors)
            tensors = {}
        self.places = self.layout = places  # a SelectedContext's layout adds its mask rows
        if storage and not tensors:
            columns = [s.unbind(1) for s in storage]
            tensors = {name: columns[g][i] for name, (g, i) in self.places.items()}
        self.tensors = dict(tensors)
        self.mask = mask
        self.storage = storage  # per group [num_tokens, capture names, E], when built by a TensorReplacer
        self.num_replaced: int | None = None

    @classmethod
    def from_storage(cls, storage: tuple[torch.Tensor, ...], mask: torch.Tensor,
                     places: Mapping[str, tuple[int, int]]) -> "ReplacementContext":
        """The context whose tensors are the columns ``storage[g][:, i]`` named by ``places``."""
        return cls({}, mask, storage, places)

    def leading(self, num_tokens: int) -> "ReplacementContext":
        """The first ``num_tokens`` slots, sharing this context's memory: an ``out=``
        target for a smaller batch (engines keep one max-size context bound to the graph)."""
        if not self.storage:
            return ReplacementContext({m: t[:num_tokens] for m, t in self.tensors.items()}, self.mask[:num_tokens])
        return ReplacementContext.from_storage(tuple(s[:num_tokens] for s in self.storage), self.mask[:num_tokens],
                                               self.places)

    def mask_for(self, name: str) -> torch.Tensor:
        """The rows replaced at capture ``name`` (a :class:`SelectedContext` narrows them per capture name)."""
        return self.mask

    def select(self, names) -> "SelectedContext":
        """These rows, replaced only at the capture names in ``names`` (see :class:`SelectedContext`);
        a mapping ``{name: rows}`` (bool ``[num_tokens]``) narrows each name to its own rows."""
        return SelectedContext(self, names)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def num_tokens(self) -> int:
        return self.mask.shape[0]

    def to(self, device: torch.device | str | None) -> "ReplacementContext":
        """This context on ``device``: itself when it is already there (its buffers stay
        usable as ``out=``), else a copy that keeps the one-buffer-per-group layout."""
        if device is None or same_device(self.mask.device, device):
            return self
        if self.storage:
            moved = ReplacementContext.from_storage(tuple(s.to(device) for s in self.storage), self.mask.to(device),
                                                    self.places)
        else:
            moved = ReplacementContext({k: v.to(device) for k, v in self.tensors.items()}, self.mask.to(device))
        moved.num_replaced = self.num_replaced
        return moved

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in self.items())
        return f"ReplacementContext({{{shapes}}}, active={int(self.mask.sum())}/{self.num_tokens})"


def _pack(tensors: Mapping[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], Layout]:
    """Hand-made tensors copied into the layout a :class:`~fxreplace.TensorReplacer` builds: one
    position-major ``[num_tokens, names, ...]`` tensor per (dtype, row shape, device). A compiled graph
    guards on its inputs' strides and on the context's layout, so a context made by hand takes the
    layout a context of the same names already has (a replacer's), where its groups fit it, and
    one graph serves both; else its names in first-seen order."""
    def group(name):
        value = tensors[name]
        return (value.dtype, tuple(value.shape[1:]), value.device)

    places = _known_places(tensors, group)
    if places is None:
        groups: dict[tuple, list[str]] = {}
        for name in tensors:
            groups.setdefault(group(name), []).append(name)
        places = {n: (g, i) for g, names in enumerate(groups.values()) for i, n in enumerate(names)}
    columns: list[list[str]] = []
    for name, (g, i) in sorted(places.items(), key=lambda item: item[1]):
        if g == len(columns):
            columns.append([])
        columns[g].append(name)
    storage = tuple(torch.stack([tensors[n].detach() for n in names], dim=1) for names in columns)
    return storage, Layout.of(places)


def _known_places(tensors: Mapping[str, torch.Tensor], group) -> dict[str, tuple[int, int]] | None:
    """The places of the latest layout of exactly these names, when each of its groups holds
    names of one (dtype, row shape, device)."""
    known = Layout._by_names.get(frozenset(tensors))
    if known is None:
        return None
    kinds: dict[int, tuple] = {}
    for name, (g, _) in known.places.items():
        if kinds.setdefault(g, group(name)) != group(name):
            return None
    return dict(known.places) if len(set(kinds.values())) == len(kinds) else None


def same_device(have: torch.device, want: torch.device | str) -> bool:
    """Whether ``have`` is ``want`` (``"cuda"`` without an index matches any CUDA device)."""
    want = torch.device(want)
    return have.type == want.type and (want.index is None or have.index == want.index)


class SelectedContext(ReplacementContext):
    """A context replaced only at the capture names in ``selected``; the others get an all-False mask.

    Every capture name gets a mask of its own whatever the selection: a row of one bool
    ``[capture names, num_tokens]`` matrix (``mask_matrix``), so a compiled graph sees the same
    inputs for every selection, one tensor whatever the number of names, and one graph serves
    them all (the search of :mod:`fxreplace.blame` replaces a different set each pass).
    """

    __slots__ = ("selected", "rows", "mask_matrix", "masks")

    def __init__(self, context: ReplacementContext, names):
        super().__init__(dict(context.items()), context.mask, context.storage, context.places)
        self.selected = frozenset(names)
        # per name the rows it replaces (requests of one batch testing different selections)
        self.rows = dict(names) if isinstance(names, Mapping) else {}
        unknown = sorted(self.selected - set(context))
        if unknown:
            raise KeyError(f"select(): no replacement tensors for {unknown}; the context holds {sorted(context)}")
        for m, rows in self.rows.items():
            if rows.dtype != torch.bool or rows.shape != context.mask.shape:
                raise ValueError(f"select(): the rows of {m!r} must be a bool tensor of shape {tuple(context.mask.shape)}, "
                                 f"got {rows.dtype} of shape {tuple(rows.shape)}")
        names = list(context)
        self.mask_matrix = torch.zeros(len(names), *context.mask.shape, dtype=torch.bool, device=context.mask.device)
        for j, m in enumerate(names):
            if m in self.selected:
                rows = context.mask & self.rows[m].to(context.mask.device) if m in self.rows else context.mask
                self.mask_matrix[j] = rows
        self.masks = dict(zip(names, self.mask_matrix.unbind(0)))
        self.layout = Layout.of(self.places, {m: j for j, m in enumerate(names)})

    def mask_for(self, name: str) -> torch.Tensor:
        return self.masks[name]

    def to(self, device: torch.device | str | None) -> "SelectedContext":
        if device is None or same_device(self.mask.device, device):
            return self
        plain = ReplacementContext(dict(self.items()), self.mask, self.storage, self.places)
        return SelectedContext(plain.to(device), self.rows or self.selected)


class PerRequest(tuple):
    """One selection of capture names per request of a ``generate`` call: copies of the same
    prompts test different hypotheses side by side in one batch (see :mod:`fxreplace.blame`)."""

    def __new__(cls, selections=()):
        return super().__new__(cls, (frozenset(s) for s in selections))
