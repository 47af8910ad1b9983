"""A captured reference: target tensors per position plus the reference's own generation.

It is a :class:`~fxreplace.store.ReferenceStore` whose extras hold, per prompt, the
greedy tokens and the logits of every generated step, so one safetensors file
(memory-mapped on load) carries everything validation needs.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .store import ReferenceStore, _offsets

TOKENS, LOGITS, OFFSETS = "generated.tokens", "generated.logits", "generated.offsets"


class Reference:
    def __init__(self, store: ReferenceStore):
        missing = [k for k in (TOKENS, LOGITS, OFFSETS) if k not in store.extras]
        if missing:
            raise ValueError(f"the store holds no reference generation ({missing} missing): it was not written by capture_reference")
        if store.prompt_token_ids is None:
            raise ValueError("the reference store holds no prompt token ids")
        self.store = store
        self._offsets = store.extras[OFFSETS].tolist()

    @classmethod
    def from_parts(cls, captures, prompt_token_ids, tokens: list[list[int]], logits: list[torch.Tensor], metadata: dict) -> "Reference":
        extras = {
            TOKENS: torch.tensor([t for seq in tokens for t in seq], dtype=torch.long),
            LOGITS: torch.cat(logits) if logits else torch.zeros(0),
            OFFSETS: _offsets([len(t) for t in tokens]),
        }
        return cls(ReferenceStore.from_captures(captures, prompt_token_ids=prompt_token_ids, metadata=metadata, extras=extras))

    @property
    def num_prompts(self) -> int:
        return self.store.num_prompts

    @property
    def metadata(self) -> dict:
        return self.store.metadata

    @property
    def vocab_size(self) -> int:
        return self.store.extras[LOGITS].shape[-1]

    def prompt_tokens(self, p: int) -> list[int]:
        return list(self.store.prompt_token_ids[p])

    def num_generated(self, p: int) -> int:
        return self._offsets[p + 1] - self._offsets[p]

    def tokens(self, p: int) -> list[int]:
        return self.store.extras[TOKENS][self._offsets[p] : self._offsets[p + 1]].tolist()

    def logits(self, p: int) -> torch.Tensor:
        return self.store.extras[LOGITS][self._offsets[p] : self._offsets[p + 1]]

    def save(self, directory: str | os.PathLike) -> Path:
        return self.store.save(directory)


def save_reference(reference: Reference, directory: str | os.PathLike) -> Path:
    return reference.save(directory)


def load_reference(directory: str | os.PathLike) -> Reference:
    return Reference(ReferenceStore.load(directory))
