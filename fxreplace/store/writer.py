"""Streaming prompts into a directory store, one shard at a time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .builder import _ShardBuilder
from .format import (SHARD_PATTERN, WRITER_MARKER, CaptureError, _offsets, _write_index, _write_shard, as_path,
                     shard_entry)
from .rules import PER_PROMPT_METADATA, check_metadata
from .reference_store import ReferenceStore


class StoreWriter:
    """Streams prompts into a directory store as they finish: memory holds at most one
    shard's rows and extras (``shard_bytes``), then they go to disk as ``shard-NNNNN.safetensors``.

    ``add(prompt_token_ids, captures, extras=...)`` takes one prompt's step-wise captures
    ``{capture_name: [steps]}`` (or flat ``{capture_name: Tensor[P, E]}``), its token ids and its
    per-prompt extras (e.g. generated tokens and logits); ``close()`` writes the last
    shard and ``index.json``. The result loads with :meth:`ReferenceStore.load`.

    Every ``add()`` is checked against the first prompt (capture names, dtypes and widths,
    each extra's dtype and trailing shape), the ``metadata`` (token ids below its
    ``vocab_size``, ``generated.logits`` that wide) and the prompts added before (no two with
    the same token ids); a refused ``add()`` changes nothing, so every prompt accepted before
    it is still written. A per-prompt metadata key (``prompt_texts``) is a list indexed by
    prompt index. ``close()`` again, or after a failed write, is harmless.

    ``shard_bytes=None``: a shard ends only where :meth:`sync` ends it, e.g. after the same
    prompts as another store's shards (a store laid out like it, :meth:`ReferenceStore.join`).
    """

    def __init__(self, directory: str | os.PathLike, *, shard_bytes: int | None = 256 << 20,
                 metadata: Mapping[str, Any] | None = None, allow_nonfinite: bool = False):
        self.directory = as_path(directory, "directory")
        if shard_bytes is not None and (isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1):
            raise ValueError(f"shard_bytes must be a positive int (bytes held before a shard is written) or None, "
                             f"got {shard_bytes!r}")
        if not isinstance(allow_nonfinite, bool):
            raise TypeError(f"allow_nonfinite must be True or False, got {allow_nonfinite!r}")
        metadata = check_metadata(metadata)
        for key in PER_PROMPT_METADATA:
            if key in metadata and not isinstance(metadata[key], list):
                raise CaptureError(f"metadata[{key!r}] must be a list indexed by prompt index, got {metadata[key]!r:.60}")
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(f"{self.directory} is a file; a store writer needs a new or empty directory")
        if self.directory.exists() and any(self.directory.iterdir()):
            if (self.directory / WRITER_MARKER).exists():
                raise FileExistsError(f"another store writer is writing {self.directory} (or one died there: "
                                      "capture again into a new directory)")
            raise FileExistsError(f"{self.directory} is not empty; a store writer needs a new or empty directory")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"cannot write the store to {self.directory}: {e.strerror or e}") from None
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
        self.metadata = metadata
        self.allow_nonfinite = allow_nonfinite
        self._shard_entries: list[str] = []  # index.json's line of each shard written
        self._indexed = 0  # shards listed in the index.json on disk
        self._written: list[int] = []  # prompt indices of the written shards, in store order
        self._builder = _ShardBuilder(allow_nonfinite, metadata)
        self._packed = None  # the current shard once packed, until it is on disk (a failed write loses nothing)
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
        if self._packed is not None:
            raise CaptureError(f"the last shard of {self.directory} could not be written; close() again to retry")
        for key in PER_PROMPT_METADATA:
            if key in self.metadata and not 0 <= prompt < len(self.metadata[key]):
                raise CaptureError(f"prompt {prompt} has no entry in metadata[{key!r}] ({len(self.metadata[key])} entries, "
                                   f"one per prompt index)")
        self._builder.add(prompt, captures, prompt_token_ids, extras or {})
        self._seen.add(prompt)
        self._next_prompt = max(self._next_prompt, prompt + 1)
        if self.shard_bytes is not None and self._builder.nbytes >= self.shard_bytes:
            self._flush()
            self._write_index()  # a writer killed later leaves this shard loadable (and its marker: unfinished)
        return prompt

    @property
    def pending_bytes(self) -> int:
        """Bytes of rows and extras added but not yet written (at most about ``shard_bytes``)."""
        return self._builder.nbytes

    def _flush(self) -> None:
        b = self._builder
        if not len(b):
            return
        if self._packed is None:
            self._packed = b.build_shard()  # releases the builder's rows: from here the shard lives in _packed
        name = SHARD_PATTERN.format(len(self._shard_entries))
        metadata = self._metadata_of(b.prompt_ids)
        store = ReferenceStore(b.groups, [self._packed], b.prompt_ids, torch.zeros(len(b), dtype=torch.long),
                               _offsets(b.lengths)[:-1], torch.tensor(b.lengths, dtype=torch.long),
                               b.token_ids if b.has_token_ids else None,
                               b.num_steps, b.prefill, metadata, not self.allow_nonfinite)
        tensors, index = store._shard_content(0)
        _write_shard(self.directory / name, tensors, index)
        self._shard_entries.append(shard_entry(name, b.prompt_ids))
        self._written.extend(b.prompt_ids)
        self._packed = None
        self._builder = b.successor()

    def _metadata_of(self, prompts: Sequence[int]) -> dict:
        """The metadata of a store of ``prompts`` (per-prompt keys cut to their entries, in that
        order): of one shard, and of the shards written so far as the loader combines them."""
        return {k: ([v[p] for p in prompts] if k in PER_PROMPT_METADATA else v) for k, v in self.metadata.items()}

    def _write_index(self) -> None:
        """Rewrite ``index.json`` when a shard was written since it was last written (an
        engine syncs at every idle, most of them with nothing new)."""
        if self._indexed < len(self._shard_entries):
            _write_index(self.directory, self._shard_entries, self._builder.groups, self._metadata_of(self._written))
            self._indexed = len(self._shard_entries)

    def sync(self) -> None:
        """Write the prompts added so far as a shard and rewrite ``index.json``: the
        directory then loads as a complete store, and adding continues (for writers
        with no natural end, such as a serving engine in capture mode when it idles, and
        for shards ending where another store's end)."""
        if self._closed:
            raise ValueError(f"the store writer for {self.directory} is closed")
        self._flush()
        self._write_index()

    def close(self) -> Path:
        """Write the last shard and ``index.json``; returns the store directory."""
        if not self._closed:
            self._flush()
            if not self._shard_entries:
                raise CaptureError(f"no prompts were added to {self.directory}: nothing to write")
            self._write_index()
            self._marker.unlink(missing_ok=True)
            self._closed = True
        return self.directory

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()



def unfinished(directory: str | os.PathLike) -> bool:
    """Whether a store writer still owns ``directory`` or died before closing it: the
    store then holds only the shards written so far (it loads, but lacks later prompts)."""
    return (as_path(directory, "directory") / WRITER_MARKER).exists()
