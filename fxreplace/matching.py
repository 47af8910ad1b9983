"""Prompt resolution: which stored prompt does an incoming request continue?

Teacher-forcing retries arrive as new requests whose tokens are a stored prompt
plus generated tokens, so we look for the *longest* stored prompt that is a
prefix of the request, verifying token content (a hash only nominates).

Cost per lookup is O(request length), independent of how many prompts are
stored: the request's prefix hashes are computed in one vectorised pass
(position-keyed multipliers, uint64 wrap-around), and only prefix lengths that
some stored prompt has are looked up in a hash table of full-prompt hashes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_SEED = 0x5EED_F00D


class PromptIndex:
    def __init__(self, prompts: Sequence[Sequence[int]]):
        self._prompts = [np.asarray(p, dtype=np.int64) for p in prompts]
        for i, p in enumerate(self._prompts):
            if p.ndim != 1 or p.size == 0:
                raise ValueError(f"prompt {i}: token ids must be a non-empty 1-D sequence, got shape {p.shape}")
        rng = np.random.Generator(np.random.PCG64(_SEED))
        max_len = max(p.size for p in self._prompts)
        self._multipliers = rng.integers(1, 2**62, size=max_len, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._by_hash: dict[int, list[int]] = {}
        for i, p in enumerate(self._prompts):
            self._by_hash.setdefault(int(self._prefix_hashes(p)[-1]), []).append(i)
        self._lengths = np.unique(np.array([p.size for p in self._prompts], dtype=np.int64))

    def __len__(self) -> int:
        return len(self._prompts)

    def prompt(self, i: int) -> np.ndarray:
        return self._prompts[i]

    def longest_prefix(self, tokens: Sequence[int]) -> int | None:
        """Index of the longest stored prompt that ``tokens`` starts with, or None.

        Identical stored prompts resolve to the lowest index.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1:
            raise ValueError(f"token ids must be 1-D, got shape {tokens.shape}")
        n = tokens.size
        candidates = self._lengths[: np.searchsorted(self._lengths, n, side="right")]
        if candidates.size == 0:
            return None
        hashes = self._prefix_hashes(tokens[: candidates[-1]])[candidates - 1].tolist()
        for length, h in zip(reversed(candidates.tolist()), reversed(hashes)):
            for i in self._by_hash.get(h, ()):
                p = self._prompts[i]
                if p.size == length and np.array_equal(p, tokens[:length]):
                    return i
        return None

    def _prefix_hashes(self, tokens: np.ndarray) -> np.ndarray:
        """Hash of every prefix; ``tokens`` is never longer than the longest stored prompt."""
        with np.errstate(over="ignore"):
            mixed = (tokens.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)) * self._multipliers[: tokens.size]
            return np.cumsum(mixed, dtype=np.uint64)
