"""Prompt resolution: which stored prompt does an incoming request continue?

Teacher-forcing retries arrive as new requests whose tokens are a stored prompt
plus generated tokens, so we look for the *longest* stored prompt that is a
prefix of the request, verifying token content (a hash only nominates).

Cost per lookup is O(request length), independent of how many prompts are
stored: the request's prefix hashes are computed in one vectorised pass
(position-keyed multipliers, uint64 wrap-around), and only prefix lengths that
some stored prompt has are looked up in a hash table of full-prompt hashes.
Building the index is vectorised over all prompts' tokens at once.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import numpy.random  # noqa: F401 - imported here, not on the first index build

_SEED = 0x5EED_F00D
_MIX = np.uint64(0x9E3779B97F4A7C15)


class TokenTable(Sequence):
    """Token ids of many prompts as one flat int64 array plus offsets (prompt ``i`` is
    ``values[offsets[i]:offsets[i + 1]]``); items read back as lists of ints."""

    def __init__(self, values: np.ndarray, offsets: np.ndarray):
        self.values = np.asarray(values, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)

    @classmethod
    def from_lists(cls, seqs: Sequence[Sequence[int]]) -> "TokenTable":
        if isinstance(seqs, TokenTable):
            return seqs
        arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in seqs]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([a.size for a in arrays], out=offsets[1:])
        return cls(np.concatenate(arrays) if arrays else np.zeros(0, np.int64), offsets)

    def __len__(self) -> int:
        return self.offsets.size - 1

    def array(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"prompt {i} out of range for {len(self)} prompts")
        return self.array(i).tolist()

    def __eq__(self, other) -> bool:
        if isinstance(other, TokenTable):
            return np.array_equal(self.values, other.values) and np.array_equal(self.offsets, other.offsets)
        return isinstance(other, Sequence) and list(self) == [list(o) for o in other]

    def __repr__(self) -> str:
        return f"TokenTable({len(self)} prompts, {self.values.size} tokens)"


class PromptIndex:
    def __init__(self, prompts: Sequence[Sequence[int]]):
        self._table = TokenTable.from_lists(prompts)
        lengths = np.diff(self._table.offsets)
        if lengths.size == 0 or lengths.min() == 0:
            i = int(np.argmin(lengths)) if lengths.size else 0
            raise ValueError(f"prompt {i}: token ids must be a non-empty 1-D sequence")
        rng = np.random.Generator(np.random.PCG64(_SEED))
        self._multipliers = rng.integers(1, 2**62, size=int(lengths.max()), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        # every prompt's full hash at once: each token mixed with its position's multiplier, summed per prompt
        starts = self._table.offsets[:-1]
        within = np.arange(self._table.values.size) - np.repeat(starts, lengths)
        with np.errstate(over="ignore"):
            mixed = (self._table.values.astype(np.uint64) + _MIX) * self._multipliers[within]
            full = np.add.reduceat(mixed, starts) if mixed.size else mixed
        self._by_hash: dict[int, list[int]] = {}
        for i, h in enumerate(full.tolist()):
            self._by_hash.setdefault(h, []).append(i)
        self._lengths = np.unique(lengths)
        self._lengths_list = self._lengths.tolist()

    def __len__(self) -> int:
        return len(self._table)

    def prompt(self, i: int) -> np.ndarray:
        return self._table.array(i)

    def longest_prefix(self, tokens: Sequence[int]) -> int | None:
        """Index of the longest stored prompt that ``tokens`` starts with, or None.

        Identical stored prompts resolve to the lowest index.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1:
            raise ValueError(f"token ids must be 1-D, got shape {tokens.shape}")
        count = bisect.bisect_right(self._lengths_list, tokens.size)  # stored lengths <= the request's
        if count == 0:
            return None
        candidates = self._lengths[:count]
        hashes = self._prefix_hashes(tokens[: candidates[-1]])[candidates - 1].tolist()
        for length, h in zip(reversed(self._lengths_list[:count]), reversed(hashes)):
            for i in self._by_hash.get(h, ()):
                p = self._table.array(i)
                if p.size == length and p.tobytes() == tokens[:length].tobytes():
                    return i
        return None

    def _prefix_hashes(self, tokens: np.ndarray) -> np.ndarray:
        """Hash of every prefix; ``tokens`` is never longer than the longest stored prompt.
        (uint64 array arithmetic wraps around silently.)"""
        mixed = (tokens.astype(np.uint64) + _MIX) * self._multipliers[: tokens.size]
        return np.cumsum(mixed, dtype=np.uint64)
