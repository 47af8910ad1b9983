"""Fed buffers: static max-size replacement buffers that forwards without ``replacements=`` read.

For engines that own the forward call or replay captured graphs: :meth:`Feeding.feed` copies a
context into the buffers (or binds a context's own tensors), :meth:`Feeding.clear` turns them
off, and a compiled forward reads them as one tensor per group, their places folded in.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ._compat import trace_key, traced
from .context import ReplacementContext
from .devices import computes_on
from .sharding import ShapeError


class Feed:
    """The fed buffers of a model, grouped: per group a ``[max_tokens, names, ...]`` values tensor
    and a mask tensor (a copied feed: ``[names, max_tokens]``, a row per target; a bound one: the
    context's mask or mask matrix), and per target ``(group, column, mask, mask row or -1)`` or
    None. A compiled forward reads the groups (one guard each) and folds the places in (one
    identity guard on this object, which only a first feed, a bind or a move replaces). With
    ``__slots__``: a compiled forward calls :meth:`traced`, and a method of an object with a
    ``__dict__`` costs a guard per call (that the instance does not shadow it)."""

    __slots__ = ("storage", "masks", "places", "trace_key", "__weakref__")

    def __init__(self, storage: tuple, masks: tuple, places: tuple):
        self.storage, self.masks, self.places = storage, masks, places
        self.trace_key = trace_key(self)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.storage, *self.masks]

    def moved(self, tensors: list[torch.Tensor]) -> "Feed":
        n = len(self.storage)
        return Feed(tuple(tensors[:n]), tuple(tensors[n:]), self.places)

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        return _views(self.storage, self.masks, self.places)

    def traced(self) -> list:
        """Per target ``(values, mask, True)`` or None, as views made in a compiled graph."""
        places = _feed_places(self.trace_key)
        return [None if v is None else (*v, True) for v in _views(self.storage, self.masks, places)]


def _views(storage: tuple, masks: tuple, places: tuple) -> list:
    """Per target ``(values, mask)`` at its place ``(group, column, mask, mask row or -1)``, or None."""
    return [None if p is None else (storage[p[0]][:, p[1]], masks[p[2]] if p[3] < 0 else masks[p[2]][p[3]])
            for p in places]


@torch.compiler.assume_constant_result
def _feed_places(key: str) -> tuple:
    """``places`` of the feed named ``key``, folded into a compiled graph and guarded by that key."""
    return traced(key).places


class Feeding:
    """The feed methods of an instrumented model (a mixin of
    :class:`~fxreplace.instrument.InstrumentedModel`; its state is ``self._fxreplace``)."""

    @torch.no_grad()
    def feed(self, replacements, *, bind: bool = False) -> None:
        """Copy a context into static max-size buffers that forwards without
        ``replacements=`` read (first T rows). For engines that own the forward
        call or replay CUDA graphs: buffers keep their storage, so a compiled or
        captured graph sees new values. Feed (e.g. a warmup context) before
        compiling.

        ``bind=True``: no copy; the buffers *become* the context's tensors and its
        mask (a ReplacementContext of ``max_tokens`` rows holding every target; a
        :class:`~fxreplace.context.SelectedContext` binds each target to its own mask).
        Writing into that context in place afterwards, e.g. with
        ``TensorReplacer.build_context_for_batch(..., out=<its first T rows>)``,
        is then the whole feed, before every forward: an eager forward on the host
        whose rows are all replaced reads contiguous ones without a copy, so a model that
        modifies activations in place may write into them (a replacer's contexts hold
        strided columns, which go through ``where``). :meth:`clear` still
        turns replacement off."""
        state = self._fxreplace
        if state.max_tokens is None:
            raise ValueError("feed() needs instrument(..., max_tokens=N) to size its buffers")
        if not isinstance(replacements, Mapping):
            raise TypeError(f"feed() needs a ReplacementContext or a dict of tensors, got {type(replacements).__name__}")
        tensors = {name: replacements[name] for name in replacements}
        mask = replacements.mask if isinstance(replacements, ReplacementContext) else None
        names = [t.capture_name for t in state.targets]
        # Every check comes before the first write: a refused feed leaves the previous one in force.
        unknown = [] if mask is not None else [n for n in tensors if n not in names]
        if unknown or (tensors and not any(n in tensors for n in names)):
            raise KeyError(f"feed(): replacement name(s) {unknown or sorted(tensors)} match no target; capture names: {names}")
        if bind:
            self._bind_feed(replacements, tensors, names)
            return
        for i, name in enumerate(names):
            value = tensors.get(name)
            if not state.fed and value is None:
                raise KeyError(f"the first feed() must hold every target; {name!r} is missing")
            if value is None:
                continue
            shape = (state.max_tokens, *value.shape[1:]) if not state.fed else tuple(state.fed[i][0].shape)
            if value.shape[0] > state.max_tokens or tuple(value.shape[1:]) != shape[1:]:
                raise ShapeError(f"feed for {name}: shape {tuple(value.shape)} does not fit the buffer {shape}")
        if not state.fed:
            state.remember_buffers(self, self._new_feed(tensors))
        for (values, mask_buf), name in zip(state.fed, names):
            value = tensors.get(name)
            mask_buf.fill_(False)
            if value is None:
                continue
            tokens = value.shape[0]
            values[:tokens].copy_(value)
            mask_buf[:tokens].copy_(mask if mask is not None else torch.ones(tokens, dtype=torch.bool, device=value.device))
        state.bound, state.unbound_by_move = False, None
        for injection, (values, mask) in zip(state.injections, state.fed):
            injection.share_fed(values, mask, hands_on=False)

    def _bind_feed(self, replacements, tensors: dict, names: list[str]) -> None:
        """``feed(bind=True)``: the context's own storage and mask become the buffers."""
        state = self._fxreplace
        mask = replacements.mask if isinstance(replacements, ReplacementContext) else None
        if mask is None or tuple(mask.shape) != (state.max_tokens,):
            raise ShapeError(f"feed(bind=True) needs a ReplacementContext of max_tokens={state.max_tokens} rows")
        for name in names:
            value = tensors.get(name)
            if value is None or value.shape[0] != state.max_tokens:
                raise ShapeError(f"feed(bind=True): {name!r} is missing or not {state.max_tokens} rows")
        layout = replacements.layout
        rows = layout.mask_rows
        places = tuple((*layout.places[name], 0, -1 if rows is None else rows[name]) for name in names)
        masks = (replacements.mask if rows is None else replacements.mask_matrix,)
        state.remember_buffers(self, Feed(tuple(replacements.storage), masks, places))
        state.bound, state.unbound_by_move = True, None
        for injection, (values, fed_mask) in zip(state.injections, state.fed):
            injection.share_fed(values, fed_mask)

    def _new_feed(self, tensors: Mapping[str, torch.Tensor]) -> Feed:
        """Zeroed buffers for a first feed of ``tensors``, where each target computes (whatever device
        the context was built on): a group per (dtype, row shape, device) of its capture names."""
        state = self._fxreplace
        groups: dict[tuple, list[str]] = {}
        for target in state.targets:
            value = tensors[target.capture_name]
            device = computes_on(self.get_submodule(target.module_name)) or value.device
            names = groups.setdefault((value.dtype, tuple(value.shape[1:]), torch.device(device)), [])
            if target.capture_name not in names:
                names.append(target.capture_name)
        where = {name: (g, c) for g, names in enumerate(groups.values()) for c, name in enumerate(names)}
        # plain tensors even under torch.inference_mode(): later feeds and clear() may run outside it
        with torch.inference_mode(False):
            storage = tuple(torch.zeros(state.max_tokens, len(names), *row, dtype=dtype, device=device)
                            for (dtype, row, device), names in groups.items())
            masks = tuple(torch.zeros(len(names), state.max_tokens, dtype=torch.bool, device=device)
                          for (_, _, device), names in groups.items())
        places = tuple((*where[t.capture_name], *where[t.capture_name]) for t in state.targets)
        return Feed(storage, masks, places)

    def _apply(self, fn, *args, **kwargs):
        """``to()``, ``cuda()``, ``half()``...: the fed buffers move with the model and the targets read them there."""
        out = super()._apply(fn, *args, **kwargs)
        self._fxreplace.follow_move(self)
        return out

    @torch.no_grad()
    def clear(self) -> None:
        """Turn fed replacement off (mask all False); the same graph keeps running."""
        if not torch.is_inference_mode_enabled() and any(mask.is_inference() for _, mask in self._fxreplace.fed):
            raise ValueError("clear(): the fed masks are the tensors of a context built under torch.inference_mode() "
                             "(feed(bind=True)), which only change inside it: call clear() inside inference_mode too, "
                             "or build the bound context outside it")
        for _, mask in self._fxreplace.fed:
            mask.fill_(False)
