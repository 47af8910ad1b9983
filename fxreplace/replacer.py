"""TensorReplacer: from scheduler metadata to the replacement tensors of one forward pass.

Every builder reduces the batch to two per-slot tensors, the owning request of
each slot and its position, then does one vectorised gather from the
:class:`~fxreplace.store.ReferenceStore`. Python only loops over requests (to look
up their prompt), never over slots or positions.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Sequence

import torch

from .context import ReplacementContext
from .matching import PromptIndex
from .store import ReferenceStore, _align_token_ids

OnUnknown = Literal["error", "passthrough"]
_UNMATCHED = -1  # a registered request whose prompt is not in the reference


class TensorReplacer:
    """Builds a :class:`ReplacementContext` per forward pass.

    Args:
        reference_captures: step-wise captures (list of ``{module: [steps]}``), flat
            captures (``{prompt_idx: {module: Tensor[P, E]}}``) or a ReferenceStore.
        prompt_token_ids: token ids of each captured prompt (needed to match
            requests by content; without them every request needs a ``prompt_idx``).
        device: where the reference lives and gathers run (default: CPU).
        on_unknown: ``"error"`` raises KeyError for requests that are not registered
            or match no prompt; ``"passthrough"`` leaves their slots unreplaced.
        allow_nonfinite: accept NaN/Inf in the captures.
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
        if on_unknown not in ("error", "passthrough"):
            raise ValueError(f"on_unknown must be 'error' or 'passthrough', got {on_unknown!r}")
        if isinstance(reference_captures, ReferenceStore):
            store = reference_captures
            if prompt_token_ids is not None:
                store.prompt_token_ids = _align_token_ids(prompt_token_ids, store.prompt_ids)
            if not allow_nonfinite:
                store.check_finite()
        else:
            store = ReferenceStore.from_captures(
                reference_captures, prompt_token_ids=prompt_token_ids, allow_nonfinite=allow_nonfinite
            )
        self.store = store.to(device)
        self.on_unknown = on_unknown
        self._index = PromptIndex(store.prompt_token_ids) if store.prompt_token_ids is not None else None
        self._requests: dict[str, int] = {}
        self._device = self.store.offsets.device

    @property
    def modules(self) -> list[str]:
        return self.store.modules

    @property
    def requests(self) -> dict[str, int | None]:
        """Registered request ids and the prompt (user's index) each resolved to."""
        return {r: (None if i == _UNMATCHED else self.store.prompt_ids[i]) for r, i in self._requests.items()}

    # ------------------------------------------------------------------ requests

    def register_request(self, req_id: str, token_ids: Sequence[int] | None = None, prompt_idx: int | None = None) -> int | None:
        """Map ``req_id`` to a stored prompt; returns the prompt index (None if unmatched).

        ``prompt_idx`` wins over matching; otherwise the longest stored prompt that
        is a verified prefix of ``token_ids``. Registering a known id again is a no-op.
        """
        if req_id in self._requests:
            i = self._requests[req_id]
            return None if i == _UNMATCHED else self.store.prompt_ids[i]
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
            if isinstance(token_ids, torch.Tensor):
                token_ids = token_ids.flatten().tolist()
            found = self._index.longest_prefix(token_ids)
            if found is None:
                if self.on_unknown == "error":
                    raise KeyError(
                        f"request {req_id!r}: its {len(token_ids)} tokens start with no stored prompt "
                        f"(first tokens {list(token_ids[:8])}); pass prompt_idx or on_unknown='passthrough'"
                    )
                found = _UNMATCHED
            i = found
        self._requests[req_id] = i
        return None if i == _UNMATCHED else self.store.prompt_ids[i]

    def release_request(self, req_id: str) -> bool:
        """Forget a finished or aborted request; returns whether it was registered."""
        return self._requests.pop(req_id, None) is not None

    def any_matched(self, req_ids: Sequence[str]) -> bool:
        """Whether any of these requests resolved to a stored prompt (a batch
        without one needs no context: replacement stays off)."""
        return any(self._requests.get(r, _UNMATCHED) != _UNMATCHED for r in req_ids)

    # ------------------------------------------------------------------ contexts

    def build_context(
        self,
        req_ids: Sequence[str],
        positions: Sequence[int] | torch.Tensor,
        is_prefill: bool,
        device: torch.device | str | None = None,
        tokens_per_req: int = 1,
        out: ReplacementContext | None = None,
    ) -> ReplacementContext:
        """Neuron-style layouts.

        Prefill: one request; its tokens are the consecutive run of positions that
        starts at slot 0, and the first slot that is not previous + 1 starts padding
        (a chunk may start at any position). Decode: slot ``s`` belongs to request
        ``s // tokens_per_req``; slots past ``len(req_ids) * tokens_per_req`` are padding.

        ``out``: a context this replacer built earlier with the same number of slots,
        overwritten in place instead of allocating (engines reusing one per bucket).
        """
        positions = self._as_positions(positions)
        n = positions.shape[0]
        if is_prefill:
            if len(req_ids) != 1:
                raise ValueError(f"a prefill batch holds exactly one request, got {len(req_ids)}: {list(req_ids)[:4]}")
            in_run = torch.ones(n, dtype=torch.bool, device=self._device)
            if n > 1:
                in_run[1:] = torch.cumprod(positions[1:] == positions[:-1] + 1, 0).bool()
            slot_req = torch.where(in_run, 0, 1)
        else:
            if tokens_per_req < 1:
                raise ValueError(f"tokens_per_req must be >= 1, got {tokens_per_req}")
            slot_req = torch.arange(n, device=self._device) // tokens_per_req
        return self._gather(req_ids, slot_req, positions, device, out)

    def build_context_for_batch(
        self,
        req_ids: Sequence[str],
        num_scheduled_tokens: Sequence[int] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor,
        device: torch.device | str | None = None,
        out: ReplacementContext | None = None,
    ) -> ReplacementContext:
        """Mixed batches (vLLM-style): request ``i`` owns the next ``num_scheduled_tokens[i]``
        slots, in order; the rest of ``positions`` is padding. ``out`` as in :meth:`build_context`."""
        positions = self._as_positions(positions)
        counts = torch.as_tensor(num_scheduled_tokens, dtype=torch.long, device=self._device).flatten()
        if counts.shape[0] != len(req_ids):
            raise ValueError(f"got {counts.shape[0]} num_scheduled_tokens for {len(req_ids)} requests")
        if bool((counts < 0).any()):
            raise ValueError(f"num_scheduled_tokens must be >= 0, got {counts.tolist()}")
        total = int(counts.sum())
        if total > positions.shape[0]:
            raise ValueError(f"requests schedule {total} tokens but the batch has only {positions.shape[0]} positions")
        slot_req = torch.full((positions.shape[0],), len(req_ids), dtype=torch.long, device=self._device)
        slot_req[:total] = torch.repeat_interleave(torch.arange(len(req_ids), device=self._device), counts)
        return self._gather(req_ids, slot_req, positions, device, out)

    def warmup_context(self, num_tokens: int, device: torch.device | str | None = None) -> ReplacementContext:
        """Zeros with the real shapes and dtypes and an all-False mask: replacement off."""
        mask = torch.zeros(num_tokens, dtype=torch.bool, device=self._device)
        rows = torch.full((num_tokens,), self.store.zero_row, dtype=torch.long, device=self._device)
        return self._context(rows, mask).to(device)

    # ------------------------------------------------------------------ internals

    def _as_positions(self, positions) -> torch.Tensor:
        positions = torch.as_tensor(positions, dtype=torch.long, device=self._device)
        if positions.dim() != 1:
            raise ValueError(f"positions must be 1-D [num_slots], got shape {tuple(positions.shape)}")
        return positions

    def _prompt_rows(self, req_ids: Sequence[str]) -> torch.Tensor:
        """Internal prompt per request (-1 where unmatched), plus a trailing -1 for padding slots."""
        rows = []
        for r in req_ids:
            i = self._requests.get(r)
            if i is None:
                if self.on_unknown == "error":
                    raise KeyError(f"request {r!r} is not registered; call register_request first (or on_unknown='passthrough')")
                i = _UNMATCHED
            rows.append(i)
        rows.append(_UNMATCHED)
        return torch.tensor(rows, dtype=torch.long, device=self._device)

    def _gather(self, req_ids, slot_req: torch.Tensor, positions: torch.Tensor, device, out=None) -> ReplacementContext:
        """slot_req[s] in [0, len(req_ids)] (len = padding) → context."""
        prompt = self._prompt_rows(req_ids)[slot_req.clamp(max=len(req_ids))]
        known = prompt >= 0
        prompt = prompt.clamp(min=0)
        mask = known & (positions >= 0) & (positions < self.store.lengths[prompt])
        rows = torch.where(mask, self.store.offsets[prompt] + positions, self.store.zero_row)
        if out is not None:
            return self._gather_into(out, rows, mask, device)
        return self._context(rows, mask).to(device)

    def _context(self, rows: torch.Tensor, mask: torch.Tensor) -> ReplacementContext:
        gathered = tuple(p.index_select(0, rows) for p in self.store.packed)
        tensors = {m: gathered[c.group][:, c.start : c.stop] for m, c in self.store.columns.items()}
        return ReplacementContext(tensors, mask, storage=gathered)

    def _gather_into(self, out: ReplacementContext, rows: torch.Tensor, mask: torch.Tensor, device) -> ReplacementContext:
        shapes = [(rows.shape[0], p.shape[1], p.dtype, p.device) for p in self.store.packed]
        if [(s.shape[0], s.shape[1], s.dtype, s.device) for s in out.storage] != shapes:
            raise ValueError(
                f"out must be a context built by this replacer for {rows.shape[0]} slots on {self._device}; "
                f"got {out!r}"
            )
        if device is not None and torch.device(device) != self._device:
            raise ValueError(f"out= reuses memory on {self._device}; it cannot also move the context to {device}")
        for src, dst in zip(self.store.packed, out.storage):
            torch.index_select(src, 0, rows, out=dst)
        out.mask.copy_(mask)
        return out
