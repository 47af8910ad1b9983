"""The consistency rules the store's builder, loader and merge share: what metadata can be stored and how
the parts of one store combine theirs, the extras' layouts, and prompts with identical token ids."""

from __future__ import annotations

import hashlib
import json
from typing import Mapping, Sequence

import numpy as np
import torch

from ..matching import TokenTable
from .format import CaptureError, StoreError


GENERATED_TOKENS, GENERATED_LOGITS = "generated.tokens", "generated.logits"  # the reference generation's extras
#: Metadata keys holding one entry per prompt, in the store's prompt order; every other key describes the whole store.
PER_PROMPT_METADATA = ("prompt_texts",)


def check_metadata(metadata, what: str = "metadata") -> dict:
    """A copy of ``metadata`` after checking it can be stored: a dict with string keys that JSON can write."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise CaptureError(f"{what} must be a dict, got {type(metadata).__name__} {metadata!r:.60}")
    bad = [k for k in metadata if not isinstance(k, str)]
    if bad:
        raise CaptureError(f"{what}: keys must be strings, got {bad[:3]}")
    try:
        json.dumps(dict(metadata))
    except (TypeError, ValueError) as e:
        raise CaptureError(f"{what}: must be JSON-serializable (it is written into the store's index): {e}") from None
    vocab = metadata.get("vocab_size")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
        raise CaptureError(f"{what}['vocab_size'] must be a positive int, got {vocab!r}")
    return dict(metadata)


def combine_metadata(parts: Sequence[tuple[str, Mapping, int]]) -> dict:
    """The metadata of a store made of ``parts`` (``(where, metadata, number of prompts)`` in
    prompt order: a store's shards, or the stores merged into one). Per-prompt keys
    (:data:`PER_PROMPT_METADATA`) are concatenated, a part without one contributing a None
    per prompt; every other key must be present in every part with the same value."""
    first_where, first, _ = parts[0]
    for where, meta, _ in parts[1:]:
        for key in sorted(set(first) | set(meta)):
            if key in PER_PROMPT_METADATA:
                continue
            if key not in first or key not in meta or first[key] != meta[key]:
                show = lambda m: repr(m[key])[:80] if key in m else "absent"  # noqa: E731
                raise StoreError(f"{where}: metadata {key!r} is {show(meta)} but {first_where} has {show(first)}; "
                                 f"parts of one store must describe the same reference")
    out = {k: v for k, v in first.items() if k not in PER_PROMPT_METADATA}
    for key in PER_PROMPT_METADATA:
        if not any(key in meta for _, meta, _ in parts):
            continue
        values = []
        for where, meta, n in parts:
            entries = meta.get(key, [None] * n)
            if not isinstance(entries, list) or len(entries) != n:
                raise StoreError(f"{where}: metadata {key!r} must be a list of one entry per prompt ({n}), got "
                                 f"{len(entries) if isinstance(entries, list) else type(entries).__name__}")
            values.extend(entries)
        out[key] = values
    return out


def per_prompt_slice(metadata: Mapping, members: Sequence[int]) -> dict:
    """``metadata`` for the prompts at positions ``members``: per-prompt keys cut to their entries."""
    return {k: ([v[i] for i in members] if k in PER_PROMPT_METADATA and isinstance(v, list) else v)
            for k, v in metadata.items()}


def check_per_prompt_metadata(metadata: Mapping, num_prompts: int, what: str = "metadata") -> None:
    for key in PER_PROMPT_METADATA:
        if key in metadata and (not isinstance(metadata[key], list) or len(metadata[key]) != num_prompts):
            raise CaptureError(f"{what}[{key!r}] must be a list of one entry per prompt ({num_prompts} prompts), "
                               f"got {metadata[key]!r:.80}")


def extra_layout(t_dtype: torch.dtype, shape: Sequence[int]) -> tuple[torch.dtype, tuple[int, ...]]:
    """What every prompt's part of an extra shares: its dtype and the shape after the per-item dim."""
    return t_dtype, tuple(shape[1:])


def check_extra_against_metadata(name: str, layout: tuple[torch.dtype, tuple[int, ...]], metadata: Mapping,
                                 where: str) -> None:
    """The reference's logits must be as wide as the vocabulary its metadata records."""
    vocab = metadata.get("vocab_size")
    if name == GENERATED_LOGITS and isinstance(vocab, int) and layout[1][-1:] != (vocab,):
        raise CaptureError(f"{where}: extra {name!r} has rows of width {list(layout[1])} but the store's vocab_size "
                           f"is {vocab}: logits of another vocabulary")


def token_key(ids) -> bytes:
    """A prompt's identity for duplicate detection (its token ids' digest)."""
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()


def first_duplicate(tables: Sequence[tuple[str, Sequence[int], TokenTable]]) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """The first two prompts with identical token ids across ``(where, prompt ids, token table)``
    parts: a request with those tokens could only ever get one of them."""
    seen: dict[bytes, tuple[str, int]] = {}
    for where, prompt_ids, table in tables:
        for p, i in zip(prompt_ids, range(len(table))):
            key = token_key(table.array(i))
            if key in seen:
                return seen[key], (where, p)
            seen[key] = (where, p)
    return None


def check_extras_agree(where: str, extras: Mapping[str, torch.Tensor], first_where: str,
                       first: Mapping[str, torch.Tensor]) -> None:
    """Two parts of one store hold the same extras with the same dtype and trailing shape
    (``{name: values}``; e.g. logits of one vocabulary)."""
    if set(extras) != set(first):
        raise StoreError(f"{where}: extras {sorted(extras)} differ from {first_where}'s {sorted(first)}")
    for name, values in extras.items():
        got, want = extra_layout(values.dtype, values.shape), extra_layout(first[name].dtype, first[name].shape)
        if got != want:
            raise StoreError(f"{where}: extra {name!r} holds {got[0]} rows of shape {list(got[1])} but "
                             f"{first_where} holds {want[0]} {list(want[1])}")
