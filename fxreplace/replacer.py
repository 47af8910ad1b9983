"""TensorReplacer: from scheduler metadata to the replacement tensors of one forward pass.

Every builder reduces the batch to two per-slot arrays, the owning request of each
slot and its position, computes the store row of every slot on the host (numpy: the
scheduler's metadata lives there), then copies those rows from each group of the
:class:`~fxreplace.store.ReferenceStore` (per touched shard) on the store's device with the
primitives of :mod:`fxreplace.gather`. Python loops over requests (to look up their prompt);
over slots only in batches of at most ``_SMALL_BATCH`` slots (decode steps), where that
costs less than numpy calls. An engine's steady decode step takes :meth:`TensorReplacer.decode_into`.

What the replacer remembers between builds (the last batch's lookup, the ``out=`` contexts
it checked, buffers of dropped contexts) lives here: a context is plain data.

Thread safety: registration, release, ``requests`` and building may be called from
several threads; building into the same ``out=`` context from two threads at once
is the caller's race.
"""

from __future__ import annotations

import operator
import threading
import weakref
from typing import Any, Collection, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from .config import OnUnknown, ReplacementConfig, check_on_unknown
from .context import ReplacementContext, same_device
from .gather import host_bits, index_select_rows, take_rows, take_slot_rows
from .matching import PromptIndex
from .store import CaptureError, ReferenceStore, load_captures, load_token_ids

_UNMATCHED = -1  # a registered request whose prompt is not in the reference
_MISSING = -2  # a request that was never registered
_SMALL_BATCH = 64  # slots up to which the row arithmetic runs in plain Python (decode steps)
_SPARE_BUFFERS = 4  # context buffers kept for reuse once their context is dropped
_CHECKED_OUTS = 64  # out= contexts whose check is remembered (an engine keeps one per batch size)
_NARROWED_LAYOUTS = 16  # layouts of selections (build_context's names) kept: a blame round's few
_INT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


try:  # a buffer nobody but the replacer holds has the use count of a lone tensor
    _UNSHARED = _use_count(torch.empty(1))
except AttributeError:  # no use counts in this torch: never recycle
    _UNSHARED = None


class TensorReplacer:
    """Builds a :class:`ReplacementContext` per forward pass.

    Args:
        reference_captures: step-wise captures (list of ``{capture_name: [steps]}``), flat
            captures (``{prompt_idx: {capture_name: Tensor[P, E]}}``) or a ReferenceStore.
        prompt_token_ids: token ids of each captured prompt (needed to match
            requests by content; without them every request needs a ``prompt_idx``).
        device: where the reference lives and gathers run (default: where the store is).
        on_unknown: ``"error"`` raises KeyError for requests that are not registered
            or match no prompt; ``"passthrough"`` leaves their slots unreplaced.
        allow_nonfinite: accept NaN/Inf in the captures (a store records whether its
            writer checked; the rows are never read here).

    Construction costs O(index): a store stays memory-mapped and is not read.
    """

    def __init__(
        self,
        reference_captures: Any,
        prompt_token_ids: Sequence[Sequence[int]] | Mapping[int, Sequence[int]] | None = None,
        *,
        device: torch.device | str | None = None,
        on_unknown: OnUnknown = "error",
        allow_nonfinite: bool = False,
    ):
        check_on_unknown(on_unknown)
        if not isinstance(allow_nonfinite, bool):
            raise TypeError(f"allow_nonfinite must be True or False, got {allow_nonfinite!r}")
        if isinstance(reference_captures, ReferenceStore):
            store = reference_captures
            if prompt_token_ids is not None and prompt_token_ids is not store.prompt_token_ids:
                store = store.with_token_ids(prompt_token_ids)
            if not allow_nonfinite and not store.finite_checked:
                raise CaptureError(
                    "the reference store was written with allow_nonfinite=True, so its rows were not checked for "
                    "NaN/Inf; pass allow_nonfinite=True (or check it: `fxreplace inspect --verify`, ReferenceStore.check_finite())"
                )
        else:
            store = ReferenceStore.from_captures(
                reference_captures, prompt_token_ids=prompt_token_ids, allow_nonfinite=allow_nonfinite
            )
        self.store = store.to(device)
        self.on_unknown = on_unknown
        self._index = PromptIndex(store.prompt_token_ids) if store.prompt_token_ids is not None else None
        self._device = self.store.packed[0].device
        self._on_host = self._device.type == "cpu"
        # host-side tables: the row arithmetic of every build runs in numpy. Each ends with an
        # entry of no rows that prompt -1 (unmatched requests, padding) indexes, so a large
        # batch's mask needs no separate "matched" test
        self._offsets = np.append(store.offsets.cpu().numpy(), 0)
        self._lengths = np.append(store.lengths.cpu().numpy(), 0)
        self._shard_of = np.append(store.prompt_shard.cpu().numpy(), 0)
        self._shard_list = self._shard_of.tolist()
        self._zero_rows = np.array([s.zero_row for s in store.shards], dtype=np.int64)
        self._spans = list(zip(self._offsets.tolist(), self._lengths.tolist()))  # per prompt (first row, rows), then (0, 0)
        self._zero_rows_list = self._zero_rows.tolist()
        self._layout = _Layout.of([tuple(s.packed) for s in self.store.shards],
                                  {m: (c.group, c.index) for m, c in self.store.columns.items()}, self._on_host)
        self._narrowed: dict[frozenset, _Layout] = {}  # the layouts of the selections built lately
        self._lock = threading.Lock()
        self._prompt_of: dict[str, int] = {}  # request id -> internal prompt (or _UNMATCHED)
        self._registered_as: dict[str, tuple] = {}  # request id -> (token ids, prompt_idx) it was registered with
        self._spare: list[tuple[torch.Tensor, ...]] = []  # buffers of dropped contexts, any layout
        self._checked_outs: dict[int, _CheckedOut] = {}  # id(out) -> how it was checked
        self._generation = 0  # bumped by every registration and release: invalidates _last_batch
        # the last batch looked up: an engine's consecutive decode steps run the same requests
        self._last_batch = BatchLookup([], -1, [], np.zeros(0, np.int64), False, [], [], 0)

    @classmethod
    def from_config(cls, config: ReplacementConfig, **kwargs) -> "TensorReplacer":
        """The replacer over a config's reference (``on_unknown`` the config's unless given:
        an engine that refuses unknown prompts before they reach the replacer passes
        ``"passthrough"``)."""
        tensors, token_ids = reference_source(config)
        kwargs.setdefault("on_unknown", config.on_unknown)
        return cls(tensors, prompt_token_ids=token_ids, **kwargs)

    @property
    def capture_names(self) -> list[str]:
        return self.store.capture_names

    @property
    def requests(self) -> dict[str, int | None]:
        """Registered request ids and the prompt (user's index) each resolved to (a snapshot)."""
        with self._lock:
            items = list(self._prompt_of.items())
        return {r: (None if i == _UNMATCHED else self.store.prompt_ids[i]) for r, i in items}

    # ------------------------------------------------------------------ requests

    def register_request(self, req_id: str, token_ids: Sequence[int] | None = None, prompt_idx: int | None = None) -> int | None:
        """Map ``req_id`` to a stored prompt; returns the prompt index (None if unmatched).

        ``prompt_idx`` wins over matching; otherwise the longest stored prompt that
        is a verified prefix of ``token_ids``. Registering a known id again with the
        same arguments is a no-op; with other tokens or another prompt it is an error.
        """
        if token_ids is not None:
            ids = np.asarray(token_ids.detach().cpu() if isinstance(token_ids, torch.Tensor) else token_ids).reshape(-1)
            if ids.size and ids.dtype.kind not in "iu":
                raise ValueError(f"request {req_id!r}: token ids must be integers, got {ids.dtype} ({ids[:4].tolist()} ...)")
            token_ids = ids.astype(np.int64, copy=False)
        key = (None if token_ids is None else token_ids.tobytes(), prompt_idx)
        with self._lock:
            if req_id in self._prompt_of:
                return self._same_registration(req_id, key)
        if prompt_idx is not None:
            i = self.store.internal_index(prompt_idx)
        else:
            if self._index is None:
                raise ValueError(
                    f"request {req_id!r}: no prompt_token_ids were given for the reference, so requests can only be "
                    f"registered with an explicit prompt_idx"
                )
            if token_ids is None:
                raise ValueError(f"request {req_id!r}: give token_ids or prompt_idx")
            i = self._index.longest_prefix(token_ids)
            if i is None:
                if self.on_unknown == "error":
                    raise KeyError(
                        f"request {req_id!r}: its {len(token_ids)} tokens start with no stored prompt "
                        f"(first tokens {token_ids[:8].tolist()}); pass prompt_idx or on_unknown='passthrough'"
                    )
                i = _UNMATCHED
        with self._lock:
            if req_id in self._prompt_of:  # registered by another thread meanwhile
                return self._same_registration(req_id, key)
            self._prompt_of[req_id] = i
            self._registered_as[req_id] = key
            self._generation += 1
        return None if i == _UNMATCHED else self.store.prompt_ids[i]

    def _same_registration(self, req_id: str, key: tuple) -> int | None:
        old_tokens, old_hint = self._registered_as[req_id]
        if key != (old_tokens, old_hint):
            def describe(tokens, hint):
                n = "no tokens" if tokens is None else f"{len(tokens) // 8} tokens"
                return n if hint is None else f"{n}, prompt_idx {hint}"
            raise ValueError(
                f"request {req_id!r} is already registered ({describe(old_tokens, old_hint)}) and is now registered again "
                f"with other arguments ({describe(*key)}); release_request({req_id!r}) first or use a new id"
            )
        i = self._prompt_of[req_id]
        return None if i == _UNMATCHED else self.store.prompt_ids[i]

    def release_request(self, req_id: str) -> bool:
        """Forget a finished or aborted request; returns whether it was registered."""
        with self._lock:
            self._registered_as.pop(req_id, None)
            self._generation += 1
            return self._prompt_of.pop(req_id, None) is not None

    def any_matched(self, req_ids: Sequence[str]) -> bool:
        """Whether any of these requests resolved to a stored prompt (a batch
        without one needs no context: replacement stays off)."""
        last = self._last_lookup(req_ids)
        if last is not None:
            return last.matched
        get = self._prompt_of.get
        return any(get(r, _UNMATCHED) != _UNMATCHED for r in req_ids)

    # ------------------------------------------------------------------ contexts

    def build_context(
        self,
        req_ids: Sequence[str],
        positions: Sequence[int] | torch.Tensor,
        is_prefill: bool,
        device: torch.device | str | None = None,
        tokens_per_req: int = 1,
        out: ReplacementContext | None = None,
        names: Collection[str] | None = None,
    ) -> ReplacementContext:
        """Neuron-style layouts.

        Prefill: one request; its tokens are the consecutive run of positions that
        starts at slot 0, and the first slot that is not previous + 1 starts padding
        (a chunk may start at any position). Decode: slot ``s`` belongs to request
        ``s // tokens_per_req``; slots past ``len(req_ids) * tokens_per_req`` are padding,
        and a batch with fewer slots than that is an error.

        ``out``: a context this replacer built earlier with the same number of slots
        (on any device) and ``names``, overwritten in place instead of allocating.

        ``names``: the capture names the context holds (default: every one the store has).
        A forward that replaces a few components then gathers and holds only their rows; the
        targets of the others find nothing in the context and stay off. A compiled graph
        takes a context's tensors as inputs, so engines with compiled graphs keep the
        default: one context layout, one graph for every selection (:meth:`ReplacementContext.select`).
        """
        positions = np.asarray(_as_index_array(positions, "positions"), dtype=np.int64)
        n = positions.shape[0]
        if is_prefill:
            if len(req_ids) != 1:
                raise ValueError(f"a prefill batch holds exactly one request, got {len(req_ids)}: {list(req_ids)[:4]}")
            breaks = np.flatnonzero(positions[1:] != positions[:-1] + 1)
            counts = [int(breaks[0]) + 1 if breaks.size else n]
        else:
            if isinstance(tokens_per_req, bool) or not isinstance(tokens_per_req, (int, np.integer)) or tokens_per_req < 1:
                raise ValueError(f"tokens_per_req must be an int >= 1, got {tokens_per_req!r}")
            needed = len(req_ids) * tokens_per_req
            if n < needed:
                raise ValueError(
                    f"a decode batch of {len(req_ids)} requests x {tokens_per_req} tokens needs {needed} slots but has "
                    f"{n} positions: requests {list(req_ids)[n // tokens_per_req:][:4]} would be dropped"
                )
            counts = np.full(len(req_ids), tokens_per_req, dtype=np.int64)
        return self._gather(req_ids, counts, positions, device, out, names)

    def build_context_for_batch(
        self,
        req_ids: Sequence[str],
        num_scheduled_tokens: Sequence[int] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor,
        device: torch.device | str | None = None,
        out: ReplacementContext | None = None,
        names: Collection[str] | None = None,
    ) -> ReplacementContext:
        """Mixed batches (vLLM-style): request ``i`` owns the next ``num_scheduled_tokens[i]``
        slots, in order; the rest of ``positions`` is padding. ``out`` and ``names`` as in :meth:`build_context`.
        An engine tries :meth:`decode_into` first and builds here when it declines."""
        counts = num_scheduled_tokens
        positions = _as_index_array(positions, "positions")
        if not _is_int_list(counts):  # engines pass a list of ints: used as it is
            counts = _as_index_array(counts, "num_scheduled_tokens").tolist()
        if len(counts) != len(req_ids):
            raise ValueError(f"got {len(counts)} num_scheduled_tokens for {len(req_ids)} requests")
        if counts and min(counts) < 0:
            raise ValueError(f"num_scheduled_tokens must be >= 0, got {counts}")
        if sum(counts) > len(positions):
            raise ValueError(f"requests schedule {sum(counts)} tokens but the batch has only {len(positions)} positions")
        return self._gather(req_ids, counts, positions, device, out, names)

    def warmup_context(self, num_tokens: int, device: torch.device | str | None = None,
                       names: Collection[str] | None = None) -> ReplacementContext:
        """Zeros with the real shapes and dtypes and an all-False mask: replacement off.
        Its buffers are its own (never recycled): engines bind them to the graph.
        ``names`` as in :meth:`build_context`."""
        layout = self._layout_of(names)
        with torch.inference_mode(False):  # a feed outlives the mode it is made in: an inference tensor made
            # under torch.inference_mode() could not be filled or cleared outside it
            storage = tuple(torch.zeros(num_tokens, m, e, dtype=dt, device=self._device) for m, e, dt in layout.shapes)
            mask = torch.zeros(num_tokens, dtype=torch.bool, device=self._device)
            return ReplacementContext.from_storage(storage, mask, layout.places).to(device)

    # ------------------------------------------------------------------ internals

    def _layout_of(self, names: Collection[str] | None) -> "_Layout":
        """The layout of a context holding ``names`` (every column for None)."""
        if names is None:
            return self._layout
        key = frozenset(names)
        layout = self._narrowed.get(key)
        if layout is None:
            places = self._layout.places
            if isinstance(names, str) or not key <= places.keys():
                unknown = [names] if isinstance(names, str) else sorted(key - places.keys())
                raise KeyError(f"names: the reference holds no capture name {unknown}; it holds {sorted(places)[:8]} "
                               f"({len(places)} in all)")
            layout = self._layout if len(key) == len(places) else self._layout.narrowed(key)
            if len(self._narrowed) >= _NARROWED_LAYOUTS:
                self._narrowed.clear()
            self._narrowed[key] = layout
        return layout

    def _lookup(self, req_ids: Sequence[str]) -> BatchLookup:
        """The batch's lookup: internal prompt per request (-1 where unmatched, plus a trailing
        -1 for padding slots), and where their rows lie."""
        last = self._last_lookup(req_ids)
        if last is not None:
            return last
        generation = self._generation  # read first: a registration meanwhile makes this entry stale
        get = self._prompt_of.get
        prompts = [get(r, _MISSING) for r in req_ids]
        if _MISSING in prompts:
            missing = req_ids[prompts.index(_MISSING)]
            if self.on_unknown == "error":
                raise KeyError(f"request {missing!r} is not registered; call register_request first (or on_unknown='passthrough')")
            prompts = [_UNMATCHED if p == _MISSING else p for p in prompts]
        prompts.append(_UNMATCHED)
        # per request: first row in its shard, stored rows and shard (0 where unmatched), for decode steps
        spans = [self._spans[p] for p in prompts[:-1]]
        shards = [self._shard_list[p] for p in prompts[:-1]]
        touched = {s for s, p in zip(shards, prompts) if p >= 0}
        lookup = self._last_batch = BatchLookup(
            list(req_ids), generation, prompts, np.array(prompts, dtype=np.int64), max(prompts) >= 0, [o for o, _ in spans],
            [range(length) for _, length in spans], shards if len(touched) > 1 else touched.pop() if touched else 0)
        return lookup

    def _last_lookup(self, req_ids: Sequence[str]) -> BatchLookup | None:
        """The last batch's lookup when ``req_ids`` is that batch and nothing was registered
        or released since."""
        last = self._last_batch
        if last.generation == self._generation and type(req_ids) is list and last.req_ids == req_ids:
            return last
        return None

    def decode_into(self, req_ids: list[str], positions: torch.Tensor | list[int], out: ReplacementContext) -> bool:
        """An engine's steady decode step, request ``i`` decoding one token at ``positions[i]``,
        written straight into ``out`` (rows, mask, ``num_replaced``): the common case of
        :meth:`build_context_for_batch`, at a few Python operations and one numpy ``take`` per
        group (a copy per slot when the requests' rows lie in several shards). An engine calls
        it first at every step and builds with :meth:`build_context_for_batch` when it returns
        False, so a steady step runs none of the general path's checks. It applies only when
        the step is exactly that case: the batch of the last lookup (nothing registered or
        released since), every request with a stored row at its position, no padding, a host
        store and a host ``out`` of ``len(req_ids)`` slots that an earlier build checked.
        Otherwise it returns False having written nothing, and :meth:`build_context_for_batch`
        handles, checks and explains every case."""
        last = self._last_batch
        checked = self._checked_outs.get(id(out))
        if (checked is None or checked.bits is None or checked.context() is not out or last.generation != self._generation
                or last.req_ids != req_ids):
            return False
        positions = _step_positions(positions)
        rows = None if positions is None else _decode_rows(last, positions)
        if rows is None or checked.slots != len(rows):
            return False
        self._run(checked.layout, (last.shard, rows), out.storage, checked.bits)
        checked.mask_bits.fill(True)
        out.num_replaced = len(rows)
        return True

    def _slot_rows(self, lookup: BatchLookup, counts: Sequence[int] | np.ndarray, positions: np.ndarray | list[int]):
        """The plan and the mask of a batch. The plan of a batch whose rows lie in one shard
        (every batch of a one-shard store, a prefill chunk) is ``(shard, rows)``, the store row
        of every slot (the shard's zero row where it holds none); that of a batch over several
        shards is ``(shard of every slot, rows)`` for up to ``_SMALL_BATCH`` slots of a host
        store, else its :class:`_ShardBlocks`. Request ``i`` owns the next ``counts[i]`` slots;
        the slots after them are padding.

        Batches of up to ``_SMALL_BATCH`` slots run as a plain Python loop, which costs a
        fraction of the dozen numpy calls of the general case."""
        n, prompts = len(positions), lookup.prompts
        several = type(lookup.shard) is list
        if n <= _SMALL_BATCH and (not several or self._on_host):  # several: numpy gathers per slot
            pos = positions if type(positions) is list else positions.tolist()
            spans, shard_of = self._spans, self._shard_list
            shard = 0 if several else lookup.shard
            rows, mask, shards = [self._zero_rows_list[shard]] * n, [False] * n, [0] * n
            s = 0
            for p, c in zip(prompts, counts):
                if p >= 0:
                    offset, length = spans[p]
                    for j in range(s, s + c):
                        if 0 <= pos[j] < length:
                            rows[j], mask[j], shards[j] = offset + pos[j], True, shard_of[p]
                s += c
            return (shards if several else shard, rows), mask
        positions = np.asarray(positions, dtype=np.int64)
        per_request = np.asarray(counts, dtype=np.int64)
        prompt = np.repeat(lookup.prompt_array, np.append(per_request, n - per_request.sum()))
        mask = (positions >= 0) & (positions < self._lengths[prompt])
        local = self._offsets[prompt] + positions
        shard = self._shard_of[prompt]
        touched = shard[mask]
        if touched.size and (touched != touched[0]).any():
            return _ShardBlocks.of(shard, local, mask), mask
        first = int(touched[0]) if touched.size else 0
        return (first, np.where(mask, local, self._zero_rows[first])), mask

    def _gather(self, req_ids, counts: Sequence[int] | np.ndarray, positions: np.ndarray | list[int], device, out,
                names) -> ReplacementContext:
        """Request ``i`` owns the next ``counts[i]`` slots, the rest is padding -> context."""
        layout = self._layout_of(names)
        plan, mask = self._slot_rows(self._lookup(req_ids), counts, positions)
        n = len(positions)
        small = self._on_host and n <= _SMALL_BATCH  # numpy copies its rows
        replaced = mask.count(True) if type(mask) is list else int(np.count_nonzero(mask))
        if out is None:
            ctx = self._fresh_context(layout, n)
            self._run(layout, plan, ctx.storage, tuple(map(host_bits, ctx.storage)) if small else None)
            ctx.mask.copy_(torch.from_numpy(np.asarray(mask, dtype=bool)))
            ctx.num_replaced = replaced
            return ctx.to(device)
        checked = self._checked_out(out, n, layout)
        if device is not None and not same_device(out.mask.device, device):
            raise ValueError(f"out= is on {out.mask.device}; it cannot also move the context to {device}")
        if checked.on_device:
            self._run(layout, plan, out.storage, checked.bits if small else None)
        else:  # gather where the reference lives, then one copy per group
            staged = self._fresh_context(layout, n)
            self._run(layout, plan, staged.storage, tuple(map(host_bits, staged.storage)) if small else None)
            for src, dst in zip(staged.storage, out.storage):
                dst.copy_(src, non_blocking=True)
        if checked.mask_bits is not None:
            checked.mask_bits[:] = mask  # no tensor made for a handful of flags
        else:
            out.mask.copy_(torch.from_numpy(np.asarray(mask, dtype=bool)))
        out.num_replaced = replaced
        return out

    def _run(self, layout: "_Layout", plan, storage: tuple[torch.Tensor, ...],
             storage_bits: tuple[np.ndarray, ...] | None) -> None:
        """Carry out a plan of :meth:`_slot_rows` into ``storage``. ``storage_bits`` (its numpy
        views) is given for a small batch of a host store: numpy copies its few rows for less
        than a torch call costs. Anything else is ``index_select``: rows of one shard straight
        into ``storage``; rows of several shards first into a staging buffer, a block of slots
        per touched shard, then the batch's slots from it."""
        if not isinstance(plan, _ShardBlocks):
            shard, rows = plan
            if storage_bits is None:
                index = self._index_tensor(rows)
                for src, dst in zip(layout.sources[shard], storage):
                    index_select_rows(src, dst, index)
            elif type(shard) is int:
                take_rows(layout.source_bits[shard], storage_bits, rows)
            else:  # the shard of each slot
                take_slot_rows(layout.source_bits, storage_bits, shard, rows)
            return
        rows, columns = self._index_tensor(plan.rows), self._index_tensor(plan.columns)
        for g, dst in enumerate(storage):
            _, m, e = dst.shape
            staging = torch.empty(plan.replaced + 1, m, e, dtype=dst.dtype, device=dst.device)
            staging[plan.replaced].zero_()  # the padding's and unmatched slots' row
            for shard, start, stop in plan.blocks:
                index_select_rows(layout.sources[shard][g], staging[start:stop], rows[start:stop])
            index_select_rows(staging, dst, columns)

    def _index_tensor(self, rows) -> torch.Tensor:
        return torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(self._device)

    def _fresh_context(self, layout: "_Layout", n: int) -> ReplacementContext:
        """A context of ``n`` slots on the store's device, reusing the buffers of a dropped
        context of the same shapes when there is one (a fresh allocation of a large context
        costs more in page faults than the gather itself)."""
        mask = torch.empty(n, dtype=torch.bool, device=self._device)
        shapes = [((n, m, e), dt) for m, e, dt in layout.shapes]
        with self._lock:  # views are made under the lock, so no two builds take the same buffers
            for k, bufs in enumerate(self._spare):
                if ([(b.shape, b.dtype) for b in bufs] == shapes and _UNSHARED is not None
                        and all(_use_count(b) == _UNSHARED for b in bufs)):
                    self._spare.append(self._spare.pop(k))
                    break
            else:
                bufs = tuple(torch.empty(shape, dtype=dt, device=self._device) for shape, dt in shapes)
                self._spare.append(bufs)
                del self._spare[:-_SPARE_BUFFERS]
            # the context holds views, not the buffers themselves: their use count says while it lives
            return ReplacementContext.from_storage(tuple(b.view_as(b) for b in bufs), mask, layout.places)

    def _checked_out(self, out: ReplacementContext, n: int, layout: "_Layout") -> "_CheckedOut":
        """Check ``out`` once: a context's shapes and device never change, so the replacer
        remembers the check (and, for a host context of a host store, numpy views of it)."""
        checked = self._checked_outs.get(id(out))
        if checked is None or checked.context() is not out or checked.slots != n or checked.layout is not layout:
            want = [(n, m, e, dt) for m, e, dt in layout.shapes]
            got = [(*s.shape, s.dtype) for s in out.storage]
            if got != want or out.mask.shape[0] != n or out.places != layout.places:
                raise ValueError(
                    f"out must be a context built by this replacer (build_context, warmup_context or .leading()) for {n} "
                    f"slots and the same names; got {out!r}"
                )
            on_device = out.mask.device == self._device
            host = on_device and self._on_host
            checked = _CheckedOut(weakref.ref(out), n, layout, on_device, tuple(map(host_bits, out.storage)) if host else None,
                                  out.mask.numpy() if host else None)
            if len(self._checked_outs) >= _CHECKED_OUTS:  # forget the dropped ones (or all, if none was)
                self._checked_outs = {k: c for k, c in self._checked_outs.items() if c.context() is not None}
                if len(self._checked_outs) >= _CHECKED_OUTS:
                    self._checked_outs = {}
            self._checked_outs[id(out)] = checked
        return checked


class _CheckedOut(NamedTuple):
    """How the replacer checked a context as ``out=``: the context (weakly: its id may be
    reused once it is dropped), its slots, whether it lives on the store's device (the
    gather then writes it directly), and numpy views of its storage and mask for a host
    context of a host store."""

    context: Any  # weakref.ref to the context
    slots: int
    layout: "_Layout"
    on_device: bool
    bits: tuple[np.ndarray, ...] | None
    mask_bits: np.ndarray | None


class _Layout(NamedTuple):
    """Where a context's groups read the store: per shard, per group of the context, a
    ``[rows + 1, capture names, E]`` tensor (the store's own groups, or for a context of a
    few names the runs of their columns: views, nothing copied), numpy views of them for
    small host batches, and each capture name's place ``(group, column)`` in the context."""

    sources: list[tuple[torch.Tensor, ...]]
    source_bits: list[tuple[np.ndarray, ...]] | None
    shapes: list[tuple[int, int, torch.dtype]]  # per group: capture names, E, dtype
    places: dict[str, tuple[int, int]]

    @staticmethod
    def of(sources: list[tuple[torch.Tensor, ...]], places: dict[str, tuple[int, int]], on_host: bool) -> "_Layout":
        shapes = [(t.shape[1], t.shape[2], t.dtype) for t in sources[0]] if sources else []
        return _Layout(sources, [tuple(map(host_bits, src)) for src in sources] if on_host else None, shapes, places)

    def narrowed(self, names: frozenset) -> "_Layout":
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
        return _Layout.of(sources, places, self.source_bits is not None)


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


class _ShardBlocks(NamedTuple):
    """A batch's replaced slots grouped by the shard that holds their rows (``rows``: of each
    in that order; ``blocks``: ``(shard, start, stop)`` of each run). They fill a staging
    buffer of ``replaced + 1`` slots (the last one zeros) from which slot ``i`` of the batch
    takes staging slot ``columns[i]``."""

    rows: np.ndarray
    blocks: list[tuple[int, int, int]]
    columns: np.ndarray
    replaced: int

    @staticmethod
    def of(shard: np.ndarray, rows: np.ndarray, mask: np.ndarray) -> "_ShardBlocks":
        """The plan of a batch whose replaced slots (``mask``) lie in at least two shards."""
        slots = np.flatnonzero(mask)
        slots = slots[np.argsort(shard[slots], kind="stable")]
        shard = shard[slots]
        bounds = [0, *(np.flatnonzero(shard[1:] != shard[:-1]) + 1).tolist(), len(slots)]
        columns = np.full(mask.shape[0], len(slots), dtype=np.int64)
        columns[slots] = np.arange(len(slots))
        return _ShardBlocks(rows[slots], [(int(shard[a]), a, b) for a, b in zip(bounds[:-1], bounds[1:])],
                            columns, len(slots))


def _as_index_array(values, what: str) -> np.ndarray | list[int]:
    """A 1-D int64 array, or for at most ``_SMALL_BATCH`` values a list of Python ints
    (engines' decode steps: numpy costs more than the work for a handful of values);
    floats and bools are refused (a fractional position has no row)."""
    if type(values) is list and len(values) <= _SMALL_BATCH and _is_int_list(values):
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


def _step_positions(positions) -> list[int] | None:
    """A decode step's positions as Python ints (an int tensor of one dimension, or a list
    of ints); None for anything else, which the general path checks and explains."""
    if type(positions) is torch.Tensor:
        return positions.tolist() if positions.dtype in _INT_DTYPES and positions.ndim == 1 else None
    return positions if _is_int_list(positions) else None


def _decode_rows(last: BatchLookup, positions: list[int]) -> list[int] | None:
    """Store rows of a decode step of ``last``'s requests (one position each), or None
    unless every request matched and holds a row at its position."""
    # "p in range(rows)" is 0 <= p < rows (unmatched requests hold range(0))
    if len(positions) != len(last.stored) or not all(map(operator.contains, last.stored, positions)):
        return None
    return list(map(operator.add, last.offsets, positions))


def _is_int_list(values) -> bool:
    return type(values) is list and set(map(type, values)) <= {int}


# ------------------------------------------------------------------ a config's reference


def reference_source(config: ReplacementConfig) -> tuple[Any, Any]:
    """``(tensors, prompt_token_ids)`` of a config, loading files where paths were given
    (token ids None when only a store holds them: it keeps its own)."""
    tensors = config.tensors if config.tensors is not None else load_captures(config.tensors_path)
    token_ids = config.prompt_token_ids
    if config.prompt_token_ids_path is not None:
        token_ids = load_token_ids(config.prompt_token_ids_path)
    return tensors, token_ids


def reference_token_ids(config: ReplacementConfig) -> Any:
    """The reference prompts' token ids (None when the reference has none), without
    reading the tensors when the token ids are given on their own."""
    if config.prompt_token_ids is not None:
        return config.prompt_token_ids
    if config.prompt_token_ids_path is not None:
        return load_token_ids(config.prompt_token_ids_path)
    if config.tensors is None and config.tensors_path is None:  # no reference source: nothing to match
        return None
    tensors = reference_source(config)[0]  # a store (memory-mapped) carries its token ids
    return tensors.prompt_token_ids if isinstance(tensors, ReferenceStore) else None


def reference_capture_names(config: ReplacementConfig) -> list[str]:
    """The reference's capture names, without packing its tensors (a store's come from its
    index; captures name theirs in every prompt: the first prompt's are read)."""
    tensors = reference_source(config)[0]
    if isinstance(tensors, ReferenceStore):
        return tensors.capture_names
    first = next(iter(tensors.values() if isinstance(tensors, Mapping) else tensors), {})
    return list(first) if isinstance(first, Mapping) else []
