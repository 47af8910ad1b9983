"""Which stored prompt each request id resolved to: registration, release and a snapshot.

A request is matched once, when it is registered (the longest stored prompt that prefixes its
tokens, :mod:`fxreplace.matching`); every build after that reads :attr:`RequestTable.prompt_of`
without the lock (a dict read is atomic) and trusts a batch it looked up before only while
:attr:`RequestTable.generation`, bumped by every registration and release, has not moved.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..config import OnUnknown
from ..matching import PromptIndex
from ..store import ReferenceStore

UNMATCHED = -1  # a registered request whose prompt is not in the reference (the row tables' prompt of no rows)
MISSING = -2  # a request that was never registered


@dataclass(slots=True)  # made at every step of a serving engine: slots make it cheaper to make and read
class StepLayout:
    """One forward's slots: request ``i`` computes ``counts[i]`` tokens in consecutive slots,
    followed by ``padding[i]`` padding slots (None: no padding between requests); every slot
    after the last request's is padding. ``positions`` (host, int64) holds every slot's position,
    padding included (whatever the runner put there: Neuron repeats a prefill's last position
    and pads decode with 0). Plain data: :meth:`~fxreplace.TensorReplacer.step_into` builds
    the step's context from it, its padding off."""

    req_ids: list[str]
    counts: list[int]
    positions: torch.Tensor
    padding: list[int] | None = None

    @property
    def num_slots(self) -> int:
        return self.positions.shape[0]

    def check(self) -> None:
        """Refuse a layout whose requests need more slots than the forward has."""
        used = sum(self.counts) + (sum(self.padding) if self.padding else 0)
        if len(self.counts) != len(self.req_ids) or (self.padding is not None and len(self.padding) != len(self.req_ids)):
            raise ValueError(f"a step layout of {len(self.req_ids)} requests has {len(self.counts)} token counts"
                             f"{'' if self.padding is None else f' and {len(self.padding)} padding counts'}")
        if used > self.num_slots:
            raise ValueError(f"requests {self.req_ids[:4]} schedule {used} slots (tokens and padding) but the forward "
                             f"has {self.num_slots} positions")

    def starts(self) -> list[int]:
        """The first slot of each request."""
        starts, slot = [], 0
        for i, count in enumerate(self.counts):
            starts.append(slot)
            slot += count + (self.padding[i] if self.padding else 0)
        return starts


class RequestTable:
    """Request id -> internal prompt index (or :data:`UNMATCHED`), and what each id was registered with."""

    def __init__(self, store: ReferenceStore, on_unknown: OnUnknown):
        self.store = store
        self.on_unknown = on_unknown
        self.prompt_of: dict[str, int] = {}  # written under the lock, read by builds without it
        self.generation = 0
        self._index = PromptIndex(store.prompt_token_ids) if store.prompt_token_ids is not None else None
        self._registered_as: dict[str, tuple] = {}  # request id -> (token ids' bytes, prompt_idx)
        self._lock = threading.Lock()

    def user_index(self, i: int) -> int | None:
        """The user's index of internal prompt ``i`` (None for an unmatched request)."""
        return None if i == UNMATCHED else self.store.prompt_ids[i]

    def snapshot(self) -> dict[str, int | None]:
        with self._lock:
            items = list(self.prompt_of.items())
        return {r: self.user_index(i) for r, i in items}

    def register(self, req_id: str, token_ids, prompt_idx: int | None) -> int | None:
        """See :meth:`fxreplace.TensorReplacer.register_request`. Matching runs outside the lock:
        another thread registering the same id meanwhile wins, and this one is checked against it."""
        token_ids = _token_array(req_id, token_ids)
        key = (None if token_ids is None else token_ids.tobytes(), prompt_idx)
        with self._lock:
            if req_id in self.prompt_of:
                return self._same_registration(req_id, key)
        i = self._resolve(req_id, token_ids, prompt_idx)
        with self._lock:
            if req_id in self.prompt_of:  # registered by another thread meanwhile
                return self._same_registration(req_id, key)
            self.prompt_of[req_id] = i
            self._registered_as[req_id] = key
            self.generation += 1
        return self.user_index(i)

    def release(self, req_id: str) -> bool:
        with self._lock:
            self._registered_as.pop(req_id, None)
            self.generation += 1
            return self.prompt_of.pop(req_id, None) is not None

    def _resolve(self, req_id: str, token_ids: np.ndarray | None, prompt_idx: int | None) -> int:
        """The internal prompt ``req_id`` continues: ``prompt_idx``'s, else the longest stored prompt
        that prefixes ``token_ids`` (UNMATCHED, or KeyError with ``on_unknown="error"``, for none)."""
        if prompt_idx is not None:
            return self.store.internal_index(prompt_idx)
        if self._index is None:
            raise ValueError(
                f"request {req_id!r}: no prompt_token_ids were given for the reference, so requests can only be "
                f"registered with an explicit prompt_idx"
            )
        if token_ids is None:
            raise ValueError(f"request {req_id!r}: give token_ids or prompt_idx")
        i = self._index.longest_prefix(token_ids)
        if i is not None:
            return i
        if self.on_unknown == "error":
            raise KeyError(
                f"request {req_id!r}: its {len(token_ids)} tokens start with no stored prompt "
                f"(first tokens {token_ids[:8].tolist()}); pass prompt_idx or on_unknown='passthrough'"
            )
        return UNMATCHED

    def _same_registration(self, req_id: str, key: tuple) -> int | None:
        """A second registration of ``req_id``: a no-op with the same arguments, else an error naming both."""
        old_tokens, old_hint = self._registered_as[req_id]
        if key != (old_tokens, old_hint):
            def describe(tokens, hint):
                n = "no tokens" if tokens is None else f"{len(tokens) // 8} tokens"
                return n if hint is None else f"{n}, prompt_idx {hint}"
            raise ValueError(
                f"request {req_id!r} is already registered ({describe(old_tokens, old_hint)}) and is now registered again "
                f"with other arguments ({describe(*key)}); release_request({req_id!r}) first or use a new id"
            )
        return self.user_index(self.prompt_of[req_id])


def _token_array(req_id: str, token_ids: Sequence[int] | torch.Tensor | None) -> np.ndarray | None:
    """A request's token ids as one int64 array (refusing floats: a fractional token id matches nothing)."""
    if token_ids is None:
        return None
    ids = np.asarray(token_ids.detach().cpu() if isinstance(token_ids, torch.Tensor) else token_ids).reshape(-1)
    if ids.size and ids.dtype.kind not in "iu":
        raise ValueError(f"request {req_id!r}: token ids must be integers, got {ids.dtype} ({ids[:4].tolist()} ...)")
    return ids.astype(np.int64, copy=False)
