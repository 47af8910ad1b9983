"""TensorReplacer: from scheduler metadata to the replacement tensors of one forward pass.

Every build is :meth:`TensorReplacer.build`: request ``i`` owns the next
``num_scheduled_tokens[i]`` slots, then ``padding[i]`` padding slots. The facade reads each request's prompt from the table of
:mod:`.requests` and hands on prompts alone: :mod:`.rows` computes the store row of every slot
on the host (numpy: the scheduler's metadata lives there), :mod:`.copying` copies those rows
from each group of the :class:`~fxreplace.store.ReferenceStore` (per touched shard) on the
store's device with the primitives of :mod:`fxreplace.gather`, into an ``out=`` context or
buffers of :mod:`.pool`. Python loops over requests (to look up their prompt); over slots only
in batches of at most 64 slots (decode steps), where that costs less than numpy calls. An
engine's step is :meth:`TensorReplacer.step_into`, which writes a steady decode step by a shortcut
(``_decode_into``). :mod:`.sources` reads a config's reference.

What the replacer remembers between builds (the last batch's lookup, the ``out=`` contexts
it checked, buffers of released contexts) lives here: a context is plain data.

Thread safety: registering and releasing requests, ``requests``, building and releasing
contexts may be called from several threads; building into the same ``out=`` context from two threads at once
is the caller's race.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from ..config import OnUnknown, ReplacementConfig, check_on_unknown
from ..context import ReplacementContext, same_device
from ..gather import host_bits
from .copying import OutChecks, run
from .layouts import ContextLayout, Layouts
from .pool import BufferPool
from .requests import MISSING, UNMATCHED, RequestTable, StepLayout
from .rows import BatchRows, RowPlanner, as_index_array, decode_rows, is_int_list, layout_counts, step_positions
from .sources import reference_source, reference_store


class _Batch(NamedTuple):
    """The last batch looked up: its request ids, the registration generation it was read at
    (a registration or release since makes it stale) and where its rows lie."""

    req_ids: list[str]
    generation: int
    rows: BatchRows


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
        self.store = reference_store(reference_captures, prompt_token_ids, allow_nonfinite).to(device)
        self.on_unknown = on_unknown
        self._device = self.store.packed[0].device
        on_host = self._device.type == "cpu"
        self._requests = RequestTable(self.store, on_unknown)
        self._rows = RowPlanner(self.store, on_host)
        self._layouts = Layouts(self.store, on_host)
        self._outs = OutChecks(self._device, on_host)
        self._pool = BufferPool(self._device)
        # the last batch looked up: an engine's consecutive decode steps run the same requests
        self._last = _Batch([], -1, self._rows.lookup([]))

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
        return self._requests.snapshot()

    # ------------------------------------------------------------------ requests

    def register_request(self, req_id: str, token_ids: Sequence[int] | None = None, prompt_idx: int | None = None) -> int | None:
        """Map ``req_id`` to a stored prompt; returns the prompt index (None if unmatched).

        ``prompt_idx`` wins over matching; otherwise the longest stored prompt that
        is a verified prefix of ``token_ids``. Registering a known id again with the
        same arguments is a no-op; with other tokens or another prompt it is an error.
        """
        return self._requests.register(req_id, token_ids, prompt_idx)

    def release_request(self, req_id: str) -> bool:
        """Forget a finished or aborted request; returns whether it was registered."""
        return self._requests.release(req_id)

    def any_matched(self, req_ids: Sequence[str]) -> bool:
        """Whether any of these requests resolved to a stored prompt (a batch
        without one needs no context: replacement stays off)."""
        last = self._last_lookup(req_ids)
        if last is not None:
            return last.rows.matched
        get = self._requests.prompt_of.get
        return any(get(r, UNMATCHED) != UNMATCHED for r in req_ids)

    # ------------------------------------------------------------------ contexts

    def build(
        self,
        req_ids: Sequence[str],
        num_scheduled_tokens: Sequence[int] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor,
        padding: Sequence[int] | None = None,
        *,
        out: ReplacementContext | None = None,
        device: torch.device | str | None = None,
        names: Collection[str] | None = None,
    ) -> ReplacementContext:
        """The context of one forward: request ``i`` computes ``num_scheduled_tokens[i]`` tokens
        in consecutive slots, followed by ``padding[i]`` padding slots (None: none between
        requests); every slot after the last request's is padding, and a padding slot's mask is
        False. ``positions`` holds every slot's position, padding included.

        ``out``: a context this replacer built earlier with the same number of slots (on any
        device) and ``names``, overwritten in place instead of allocating. Without it, the
        context is new, on the store's device unless ``device`` says otherwise; hand it back
        with :meth:`release` when done so that a later build reuses its buffers.

        ``names``: the capture names the context holds (default: every one the store has).
        A forward that replaces a few components then gathers and holds only their rows; the
        targets of the others find nothing in the context and stay off. A compiled graph
        takes a context's tensors as inputs, so engines with compiled graphs keep the
        default: one context layout, one graph for every selection (:meth:`ReplacementContext.select`).
        """
        counts = num_scheduled_tokens
        positions = as_index_array(positions, "positions")
        if not is_int_list(counts):  # engines pass a list of ints: used as it is
            counts = as_index_array(counts, "num_scheduled_tokens").tolist()
        if len(counts) != len(req_ids):
            raise ValueError(f"got {len(counts)} num_scheduled_tokens for {len(req_ids)} requests")
        if counts and min(counts) < 0:
            raise ValueError(f"num_scheduled_tokens must be >= 0, got {counts}")
        padding = None if padding is None else _checked_padding(padding, len(req_ids))
        used = sum(counts) + (sum(padding) if padding else 0)
        if used > len(positions):
            raise ValueError(f"requests schedule {used} {'tokens' if padding is None else 'slots (tokens and padding)'} "
                             f"but the batch has only {len(positions)} positions")
        return self._build(req_ids, counts, positions, padding, out, device, names)

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
        """Neuron-style layouts, built as :meth:`build` builds their token counts.

        Prefill: one request; its tokens are the consecutive run of positions that
        starts at slot 0, and the first slot that is not previous + 1 starts padding
        (a chunk may start at any position). Decode: slot ``s`` belongs to request
        ``s // tokens_per_req``; slots past ``len(req_ids) * tokens_per_req`` are padding,
        and a batch with fewer slots than that is an error.

        ``out``, ``device`` and ``names`` as in :meth:`build`.
        """
        positions = as_index_array(positions, "positions")
        counts = layout_counts(req_ids, positions, is_prefill, tokens_per_req)
        return self.build(req_ids, counts, positions, out=out, device=device, names=names)

    def build_context_for_batch(
        self,
        req_ids: Sequence[str],
        num_scheduled_tokens: Sequence[int] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor,
        device: torch.device | str | None = None,
        out: ReplacementContext | None = None,
        names: Collection[str] | None = None,
    ) -> ReplacementContext:
        """Mixed batches (vLLM-style): :meth:`build` without padding between requests (request
        ``i`` owns the next ``num_scheduled_tokens[i]`` slots, in order; the rest of ``positions``
        is padding). ``out``, ``device`` and ``names`` as in :meth:`build`."""
        return self.build(req_ids, num_scheduled_tokens, positions, out=out, device=device, names=names)

    def warmup_context(self, num_tokens: int, device: torch.device | str | None = None,
                       names: Collection[str] | None = None) -> ReplacementContext:
        """Zeros with the real shapes and dtypes and an all-False mask: replacement off.
        Its buffers are its own (never lent, never released): engines bind them to the graph.
        ``names`` as in :meth:`build`."""
        layout = self._layouts.of(names)
        with torch.inference_mode(False):  # a feed outlives the mode it is made in: an inference tensor made
            # under torch.inference_mode() could not be filled or cleared outside it
            storage = tuple(torch.zeros(num_tokens, m, e, dtype=dt, device=self._device) for m, e, dt in layout.shapes)
            mask = torch.zeros(num_tokens, dtype=torch.bool, device=self._device)
            return ReplacementContext.from_storage(storage, mask, layout.places).to(device)

    def release(self, context: ReplacementContext) -> bool:
        """Hand back the buffers of a context that a build without ``out=`` returned, once done
        reading it and everything taken from it: a later build of the same shapes writes into them
        instead of allocating (a large allocation costs more in page faults than the gather). They
        wait until the context is gone elsewhere too: while another holder keeps the context, a
        ``select()`` of it or its storage, they are not reused, so a context released by one reader
        (the embedded runner after its forward) and kept by another is not overwritten. Views of
        its memory (capture tensors ``ctx[name]``, slices, ``leading()``, numpy arrays) are not
        seen: clone what you keep past the release. A context never released is never reused.
        Returns False, doing nothing, for any other context (warm-up and ``out=`` contexts,
        ``leading()`` and ``select()`` views, copies moved to another device) and for one
        released already."""
        return self._pool.release(context)

    def step_into(self, layout: StepLayout, out: ReplacementContext) -> ReplacementContext | None:
        """An engine's step: the context of ``layout`` (a :class:`~fxreplace.replacer.requests.StepLayout`:
        requests, their token counts and padding, every slot's position) written into ``out``, a
        context of ``layout.num_slots`` slots. A steady decode step (one token per request, no
        padding) tries :meth:`_decode_into` first; a step none of whose requests matched a stored
        prompt writes nothing and returns None (the engine turns replacement off); any other is
        :meth:`build`."""
        req_ids, counts, padding = layout.req_ids, layout.counts, layout.padding
        # one token per request and no padding between them (_decode_into checks the slots: one per request)
        if (not (padding and any(padding)) and type(counts) is list and counts.count(1) == len(req_ids)
                and self._decode_into(req_ids, layout.positions, out)):
            return out
        if not self.any_matched(req_ids):
            return None
        return self.build(req_ids, counts, layout.positions, padding=padding, out=out)

    def _decode_into(self, req_ids: list[str], positions: torch.Tensor | list[int], out: ReplacementContext) -> bool:
        """An engine's steady decode step, request ``i`` decoding one token at ``positions[i]``,
        written straight into ``out`` (rows, mask, ``num_replaced``): the common case of
        :meth:`build`, at a few Python operations and one numpy ``take`` per group (a copy per
        slot when the requests' rows lie in several shards). :meth:`step_into` calls it first at
        every steady decode step, so such a step runs none of the general path's checks. It applies only
        when the step is exactly that case: the batch of the last lookup (nothing registered or
        released since), every request with a stored row at its position, no padding, a host
        store and a host ``out`` of ``len(req_ids)`` slots that an earlier build checked.
        Otherwise it returns False having written nothing, and :meth:`build` handles, checks and
        explains every case."""
        last = self._last
        checked = self._outs.get(id(out))
        if (checked is None or checked.bits is None or checked.context() is not out
                or last.generation != self._requests.generation or last.req_ids != req_ids):
            return False
        positions, batch = step_positions(positions), last.rows
        rows = None if positions is None else decode_rows(batch, positions)
        if rows is None or checked.slots != len(rows):
            return False
        run(checked.layout, (batch.shard, rows), out.storage, checked.bits, self._device)
        checked.mask_bits.fill(True)
        out.num_replaced = len(rows)
        return True

    # ------------------------------------------------------------------ internals

    def _lookup(self, req_ids: Sequence[str]) -> _Batch:
        """The batch's prompts (read from the request table: the ids go no further) and where
        their rows lie."""
        last = self._last_lookup(req_ids)
        if last is not None:
            return last
        generation = self._requests.generation  # read first: a registration meanwhile makes this entry stale
        get = self._requests.prompt_of.get
        prompts = [get(r, MISSING) for r in req_ids]
        if MISSING in prompts:
            missing = req_ids[prompts.index(MISSING)]
            if self.on_unknown == "error":
                raise KeyError(f"request {missing!r} is not registered; call register_request first (or on_unknown='passthrough')")
            prompts = [UNMATCHED if p == MISSING else p for p in prompts]
        batch = self._last = _Batch(list(req_ids), generation, self._rows.lookup(prompts))
        return batch

    def _last_lookup(self, req_ids: Sequence[str]) -> _Batch | None:
        """The last batch's lookup when ``req_ids`` is that batch and nothing was registered
        or released since."""
        last = self._last
        if last.generation == self._requests.generation and type(req_ids) is list and last.req_ids == req_ids:
            return last
        return None

    def _build(self, req_ids, counts, positions: np.ndarray | list[int], padding: list[int] | None, out, device,
               names) -> ReplacementContext:
        """The one build, of arguments checked already (see :meth:`build`)."""
        layout = self._layouts.of(names)
        plan, mask = self._rows.plan(self._lookup(req_ids).rows, counts, positions, padding)
        n = len(positions)
        small = self._rows.small(n)
        replaced = mask.count(True) if type(mask) is list else int(np.count_nonzero(mask))
        if out is None:
            ctx = self._fresh(layout, plan, n, small)
            ctx.mask.copy_(torch.from_numpy(np.asarray(mask, dtype=bool)))
            ctx.num_replaced = replaced
            moved = ctx.to(device)
            if moved is not ctx:  # the copy is the caller's; the buffers it was copied from are free again
                self._pool.release(ctx)
            return moved
        checked = self._outs.check(out, n, layout)
        if device is not None and not same_device(out.mask.device, device):
            raise ValueError(f"out= is on {out.mask.device}; it cannot also move the context to {device}")
        if checked.on_device:
            run(layout, plan, out.storage, checked.bits if small else None, self._device)
        else:  # gather where the reference lives, then one copy per group
            staged = self._fresh(layout, plan, n, small)
            for src, dst in zip(staged.storage, out.storage):
                dst.copy_(src, non_blocking=True)
            self._pool.release(staged)
        if checked.mask_bits is not None:
            checked.mask_bits[:] = mask  # no tensor made for a handful of flags
        else:
            out.mask.copy_(torch.from_numpy(np.asarray(mask, dtype=bool)))
        out.num_replaced = replaced
        return out

    def _fresh(self, layout: ContextLayout, plan, n: int, small: bool) -> ReplacementContext:
        """A context of the pool's holding the plan's rows (its mask unwritten)."""
        ctx = self._pool.lend(layout, n)
        run(layout, plan, ctx.storage, tuple(map(host_bits, ctx.storage)) if small else None, self._device)
        return ctx


def _checked_padding(padding, num_requests: int) -> list[int] | None:
    """``padding`` as a list of ints >= 0, one per request (None for none at all)."""
    padding = as_index_array(padding, "padding")
    padding = padding if type(padding) is list else padding.tolist()
    if len(padding) != num_requests:
        raise ValueError(f"got {len(padding)} padding counts for {num_requests} requests")
    if padding and min(padding) < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    return padding if any(padding) else None

