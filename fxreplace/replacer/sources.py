"""Where a replacer's reference comes from: what it was given (a store or captures to pack), or
a config's tensors and token ids, read without packing what the caller does not need."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..config import ReplacementConfig
from ..store import CaptureError, ReferenceStore, load_captures, load_token_ids


def reference_store(reference_captures: Any, prompt_token_ids: Sequence[Sequence[int]] | Mapping[int, Sequence[int]] | None,
                    allow_nonfinite: bool) -> ReferenceStore:
    """A :class:`ReferenceStore` of ``reference_captures`` (a store stays memory-mapped and unread;
    captures are packed): the store a :class:`~fxreplace.TensorReplacer` reads."""
    if not isinstance(allow_nonfinite, bool):
        raise TypeError(f"allow_nonfinite must be True or False, got {allow_nonfinite!r}")
    if not isinstance(reference_captures, ReferenceStore):
        return ReferenceStore.from_captures(reference_captures, prompt_token_ids=prompt_token_ids,
                                            allow_nonfinite=allow_nonfinite)
    store = reference_captures
    if prompt_token_ids is not None and prompt_token_ids is not store.prompt_token_ids:
        store = store.with_token_ids(prompt_token_ids)
    if not allow_nonfinite and not store.finite_checked:
        raise CaptureError(
            "the reference store was written with allow_nonfinite=True, so its rows were not checked for "
            "NaN/Inf; pass allow_nonfinite=True (or check it: `fxreplace inspect --verify`, ReferenceStore.check_finite())"
        )
    return store


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
