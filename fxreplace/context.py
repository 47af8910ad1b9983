"""ReplacementContext: the replacement tensors for one forward pass, and the
context-local "active context" used by hand-instrumented models."""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class CheckedOut(NamedTuple):
    """How a :class:`~fxreplace.TensorReplacer` checked a context as ``out=`` (its shapes
    and device never change, so once is enough)."""

    replacer: Any  # the TensorReplacer that checked it (None: none did)
    slots: int
    on_device: bool  # on the replacer's device: it gathers straight into the context
    views: Any  # fastpath.HostViews of a host context of a host store, else None


_UNCHECKED = CheckedOut(None, 0, False, None)


def host_bits(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor's bits, whatever its dtype (bfloat16 and float8
    included): copies between such views move the values exactly."""
    return tensor.view(_SAME_SIZE_INT[tensor.element_size()]).numpy()


class ReplacementContext(Mapping):
    """``{capture_name: Tensor[num_tokens, E]}`` plus ``mask``, a bool ``[num_tokens]``.

    ``mask[s]`` is True exactly where slot ``s`` holds a reference row; every other
    row is zero. A context whose mask is all False turns replacement off without
    changing any shape, so a compiled graph serves "on" and "off" alike.

    Built by a :class:`~fxreplace.TensorReplacer`, the tensors are blocks of
    ``storage``: one ``[capture names, num_tokens, E]`` tensor per group of the store, so
    each capture name's tensor is contiguous and one gather per group fills them all.
    ``places[name]`` is ``(group, block)``, and a name's tensor is made when first read:
    a context whose reader takes ``storage`` whole (an engine's bound feed) makes none.
    ``num_replaced`` counts the mask's True rows as the build wrote them (None for a context
    made by hand).
    """

    __slots__ = ("_tensors", "mask", "storage", "places", "_mask_array", "_storage_bits", "checked_by", "num_replaced",
                 "__weakref__")

    def __init__(self, tensors: Mapping[str, torch.Tensor], mask: torch.Tensor, storage: tuple[torch.Tensor, ...] = (),
                 places: Mapping[str, tuple[int, int]] | None = None):
        if mask.dtype != torch.bool or mask.dim() != 1:
            raise ValueError(f"mask must be a 1-D bool tensor, got {mask.dtype} of shape {tuple(mask.shape)}")
        # the tensors of a context built over storage are its groups' blocks: a group's rows are theirs
        shapes = ((f"group {g}", s.shape[1:]) for g, s in enumerate(storage)) if storage else (
            (repr(name), t.shape) for name, t in tensors.items())
        for what, shape in shapes:
            if len(shape) < 1 or shape[0] != mask.shape[0]:
                raise ValueError(f"replacement for {what} has shape {tuple(shape)}; expected "
                                 f"[{mask.shape[0]}, ...] to match the mask")
        self._tensors = dict(tensors)
        self.mask = mask
        self.storage = storage  # per group [capture names, num_tokens, E], when built by a TensorReplacer
        self.places = dict(places or {})
        self._mask_array = None
        self._storage_bits = None
        self.checked_by = _UNCHECKED  # a CheckedOut once a TensorReplacer checked it as out=
        self.num_replaced: int | None = None  # mask's True rows as its TensorReplacer build wrote them (None: not built)

    @classmethod
    def from_storage(cls, storage: tuple[torch.Tensor, ...], mask: torch.Tensor,
                     places: Mapping[str, tuple[int, int]]) -> "ReplacementContext":
        """The context whose tensors are the blocks ``storage[g][i]`` named by ``places``."""
        return cls({}, mask, storage, places)

    def leading(self, num_tokens: int) -> "ReplacementContext":
        """The first ``num_tokens`` slots, sharing this context's memory: an ``out=``
        target for a smaller batch (engines keep one max-size context bound to the graph)."""
        if not self.storage:
            return ReplacementContext({m: t[:num_tokens] for m, t in self._tensors.items()}, self.mask[:num_tokens])
        return ReplacementContext.from_storage(tuple(s[:, :num_tokens] for s in self.storage), self.mask[:num_tokens],
                                               self.places)

    def mask_array(self):
        """The mask as a numpy array sharing its memory (host masks only): engines set
        and clear a few flags per step through it at a fraction of a torch call's cost."""
        if self._mask_array is None:
            self._mask_array = self.mask.numpy()
        return self._mask_array

    def storage_bits(self) -> tuple[np.ndarray, ...]:
        """``storage`` as numpy views of its bits (host contexts only; see :func:`host_bits`):
        a gather of a few rows into them costs less than a torch call."""
        if self._storage_bits is None:
            self._storage_bits = tuple(host_bits(s) for s in self.storage)
        return self._storage_bits

    def mask_for(self, name: str) -> torch.Tensor:
        """The rows replaced at capture ``name`` (a :class:`SelectedContext` narrows them per capture name)."""
        return self.mask

    def select(self, names) -> "SelectedContext":
        """These rows, replaced only at the capture names in ``names`` (see :class:`SelectedContext`);
        a mapping ``{name: rows}`` (bool ``[num_tokens]``) narrows each name to its own rows."""
        return SelectedContext(self, names)

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            g, i = self.places[name]  # KeyError: no such capture name
            tensor = self._tensors[name] = self.storage[g][i]
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.places if self.storage else self._tensors)

    def __len__(self) -> int:
        return len(self.places if self.storage else self._tensors)

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
            moved = ReplacementContext({k: v.to(device) for k, v in self._tensors.items()}, self.mask.to(device))
        moved.num_replaced = self.num_replaced
        return moved

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in self.items())
        return f"ReplacementContext({{{shapes}}}, active={int(self.mask.sum())}/{self.num_tokens})"


def same_device(have: torch.device, want: torch.device | str) -> bool:
    """Whether ``have`` is ``want`` (``"cuda"`` without an index matches any CUDA device)."""
    want = torch.device(want)
    return have.type == want.type and (want.index is None or have.index == want.index)


class SelectedContext(ReplacementContext):
    """A context replaced only at the capture names in ``selected``; the others get an all-False mask.

    Every capture name gets a mask tensor of its own whatever the selection, so a compiled
    graph sees the same inputs for every selection and one graph serves them all
    (the search of :mod:`fxreplace.blame` replaces a different set each pass).
    """

    __slots__ = ("selected", "rows", "masks")

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
        self.masks = {m: (context.mask & self.rows[m].to(context.mask.device) if m in self.rows else context.mask.clone())
                      if m in self.selected else torch.zeros_like(context.mask) for m in context}

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


_active: contextvars.ContextVar[ReplacementContext | None] = contextvars.ContextVar(
    "fxreplace_active_context", default=None
)


def set_active_context(ctx: ReplacementContext | None) -> None:
    """Make ``ctx`` the context that :func:`get_replacement_tensor` reads.

    Context-local (``contextvars``): concurrent forward passes in different
    threads or asyncio tasks each see their own context.
    """
    _active.set(ctx)


def get_active_context() -> ReplacementContext | None:
    return _active.get()


def get_replacement_tensor(name: str) -> torch.Tensor | None:
    """The active context's tensor for ``name``, or None when there is none."""
    ctx = _active.get()
    if ctx is None:
        return None
    return ctx.get(name)
