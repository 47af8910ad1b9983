"""A captured reference: target tensors per position plus the reference's own generation.

It is a :class:`~fxreplace.store.ReferenceStore` whose per-prompt extras hold the
greedy tokens and the logits of every generated step, so the store's shards
(memory-mapped on load) carry everything validation needs. A
:class:`~fxreplace.store.StoreWriter` writes the same extras prompt by prompt.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .store import GENERATED_LOGITS as LOGITS
from .store import GENERATED_TOKENS as TOKENS
from .store import ReferenceStore


class Reference:
    def __init__(self, store: ReferenceStore):
        missing = [k for k in (TOKENS, LOGITS) if k not in store.extra_names]
        if missing:
            raise ValueError(f"the store holds no reference generation ({missing} missing): it was not written by capture_reference")
        if store.prompt_token_ids is None:
            raise ValueError("the reference store holds no prompt token ids")
        self.store = store

    @staticmethod
    def extras(tokens: list[int] | torch.Tensor, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """One prompt's generation as store extras (for :meth:`StoreWriter.add`)."""
        return {TOKENS: torch.as_tensor(tokens, dtype=torch.long).reshape(-1), LOGITS: logits}

    @classmethod
    def from_parts(cls, captures, prompt_token_ids, tokens: list[list[int]], logits: list[torch.Tensor], metadata: dict) -> "Reference":
        per_prompt = [cls.extras(t, lg) for t, lg in zip(tokens, logits)]
        extras = {TOKENS: [e[TOKENS] for e in per_prompt], LOGITS: [e[LOGITS] for e in per_prompt]}
        return cls(ReferenceStore.from_captures(captures, prompt_token_ids=prompt_token_ids, metadata=metadata, extras=extras))

    @property
    def num_prompts(self) -> int:
        return self.store.num_prompts

    @property
    def metadata(self) -> dict:
        return self.store.metadata

    @property
    def vocab_size(self) -> int:
        return self.store.shards[0].extras[LOGITS][0].shape[-1]

    def prompt_tokens(self, p: int) -> list[int]:
        return list(self.store.prompt_token_ids[self.store.internal_index(p)])

    def num_generated(self, p: int) -> int:
        return self.store.extra(TOKENS, p).shape[0]

    def tokens(self, p: int) -> list[int]:
        return self.store.extra(TOKENS, p).tolist()

    def logits(self, p: int) -> torch.Tensor:
        return self.store.extra(LOGITS, p)

    def save(self, directory: str | os.PathLike) -> Path:
        return self.store.save(directory)


def save_reference(reference: Reference, directory: str | os.PathLike) -> Path:
    return reference.save(directory)


def load_reference(directory: str | os.PathLike) -> Reference:
    return Reference(ReferenceStore.load(directory))
