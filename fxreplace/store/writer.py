"""Streaming prompts into a directory store, one shard at a time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .builder import _ShardBuilder
from .format import SHARD_PATTERN, WRITER_MARKER, CaptureError, _offsets, _write_index, _write_shard
from .reference_store import ReferenceStore

class StoreWriter:
    """Streams prompts into a directory store as they finish: memory holds at most one
    shard's rows and extras (``shard_bytes``), then they go to disk as ``shard-NNNNN.safetensors``.

    ``add(prompt_token_ids, captures, extras=...)`` takes one prompt's step-wise captures
    ``{capture_name: [steps]}`` (or flat ``{capture_name: Tensor[P, E]}``), its token ids and its
    per-prompt extras (e.g. generated tokens and logits); ``close()`` writes the last
    shard and ``index.json``. The result loads with :meth:`ReferenceStore.load`.
    """

    def __init__(self, directory: str | os.PathLike, *, shard_bytes: int = 256 << 20,
                 metadata: Mapping[str, Any] | None = None, allow_nonfinite: bool = False):
        self.directory = Path(directory)
        if self.directory.exists() and any(self.directory.iterdir()):
            if (self.directory / WRITER_MARKER).exists():
                raise FileExistsError(f"another store writer is writing {self.directory} (or one died there: "
                                      "capture again into a new directory)")
            raise FileExistsError(f"{self.directory} is not empty; a store writer needs a new or empty directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        # Created exclusively, so of two writers started on one directory at once (e.g. two
        # engines given the same out) one fails here instead of both writing shard-00000.
        self._marker = self.directory / WRITER_MARKER
        try:
            os.close(os.open(self._marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            raise FileExistsError(f"another store writer is writing {self.directory}") from None
        except OSError as e:
            raise OSError(f"cannot write the store to {self.directory}: {e}") from None
        self.shard_bytes = shard_bytes
        self.metadata = dict(metadata or {})
        self.allow_nonfinite = allow_nonfinite
        self._shards: list[tuple[str, dict]] = []
        self._builder = _ShardBuilder(allow_nonfinite)
        self._next_prompt = 0
        self._seen: set[int] = set()
        self._closed = False

    def add(self, prompt_token_ids: Sequence[int] | torch.Tensor | None, captures: Mapping[str, Any], *,
            prompt_idx: int | None = None, extras: Mapping[str, torch.Tensor] | None = None) -> int:
        """Add one finished prompt; returns its prompt index (default: the next integer)."""
        if self._closed:
            raise ValueError(f"the store writer for {self.directory} is closed")
        prompt = self._next_prompt if prompt_idx is None else prompt_idx
        if isinstance(prompt, bool) or not isinstance(prompt, int):
            raise CaptureError(f"prompt_idx must be an int, got {prompt!r}")
        if prompt in self._seen:
            raise CaptureError(f"prompt {prompt} was already added to {self.directory}")
        self._builder.add(prompt, captures, prompt_token_ids, extras or {})
        self._seen.add(prompt)
        self._next_prompt = max(self._next_prompt, prompt + 1)
        if self._builder.nbytes >= self.shard_bytes:
            self._flush()
        return prompt

    @property
    def pending_bytes(self) -> int:
        """Bytes of rows and extras added but not yet written (at most about ``shard_bytes``)."""
        return self._builder.nbytes

    def _flush(self) -> None:
        b = self._builder
        if not len(b):
            return
        shard = b.build_shard()
        name = SHARD_PATTERN.format(len(self._shards))
        store = ReferenceStore(b.groups, [shard], b.prompt_ids, torch.zeros(len(b), dtype=torch.long),
                               _offsets(b.lengths)[:-1], torch.tensor(b.lengths, dtype=torch.long),
                               b.token_ids if b.has_token_ids else None,
                               b.num_steps, b.prefill, self.metadata, not self.allow_nonfinite)
        tensors, index = store._shard_content(0)
        _write_shard(self.directory / name, tensors, index)
        self._shards.append((name, index))
        self._builder = b.successor()

    def sync(self) -> None:
        """Write the prompts added so far as a shard and rewrite ``index.json``: the
        directory then loads as a complete store, and adding continues (for writers
        with no natural end, such as a serving engine in capture mode when it idles)."""
        if self._closed:
            raise ValueError(f"the store writer for {self.directory} is closed")
        self._flush()
        if self._shards:
            _write_index(self.directory, self._shards, self._builder.groups, self.metadata)

    def close(self) -> Path:
        """Write the last shard and ``index.json``; returns the store directory."""
        if not self._closed:
            self._flush()
            if not self._shards:
                raise CaptureError(f"no prompts were added to {self.directory}: nothing to write")
            _write_index(self.directory, self._shards, self._builder.groups, self.metadata)
            self._marker.unlink(missing_ok=True)
            self._closed = True
        return self.directory

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()

