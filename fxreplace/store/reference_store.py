"""The :class:`ReferenceStore`: per (prompt, capture name) rows, built from captures,
saved to and loaded from disk."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..matching import TokenTable
from .builder import _align, _check_token_ids, _ShardBuilder
from .format import (INDEX_FILE, SHARD_PATTERN, TENSORS_FILE, CaptureColumns, CaptureError, Group, Shard, StoreError,
                     _describe, _file_digest, _offsets, _preview, _read_header, _shard_index, _write_index,
                     _write_shard, as_path, shard_entry)
from .publish import publish_directory, staging_directory
from .rules import check_metadata, check_per_prompt_metadata, first_duplicate, per_prompt_slice
from .reader import _assemble, _load_shard, _read_directory_index

@dataclass
class ReferenceStore:
    """Flattened reference tensors plus what is needed to index and match them.

    ``prompt_ids[i]`` is the user's index of internal prompt ``i`` (list position for
    step-wise captures, the dict key for flat ones). Prompt ``i`` lives in shard
    ``prompt_shard[i]`` at rows ``offsets[i] : offsets[i] + lengths[i]``.
    ``finite_checked`` records that every row was checked for NaN/Inf where it was written.
    """

    groups: list[Group]
    shards: list[Shard]
    prompt_ids: list[int]
    prompt_shard: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    prompt_token_ids: TokenTable | None = None
    num_steps: list[int] | None = None
    prefill: list[int | None] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    finite_checked: bool = True

    def __post_init__(self):
        if self.prompt_token_ids is not None:
            self.prompt_token_ids = TokenTable.from_lists(self.prompt_token_ids)
        self._by_prompt_id = {p: i for i, p in enumerate(self.prompt_ids)}
        self.columns = {m: CaptureColumns(g, i) for g, grp in enumerate(self.groups) for i, m in enumerate(grp.capture_names)}
        shard_of = self.prompt_shard.tolist()
        self._local = [0] * len(shard_of)  # each prompt's position within its shard
        seen = [0] * len(self.shards)
        for i, s in enumerate(shard_of):
            self._local[i] = seen[s]
            seen[s] += 1

    @property
    def capture_names(self) -> list[str]:
        return list(self.columns)

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_ids)

    @property
    def packed(self) -> list[torch.Tensor]:
        """Every shard's group tensors, shard by shard."""
        return [t for s in self.shards for t in s.packed]

    @property
    def extra_names(self) -> list[str]:
        return list(self.shards[0].extras) if self.shards else []

    def feature_dim(self, name: str) -> int:
        return self.groups[self.columns[name].group].width

    def dtype(self, name: str) -> torch.dtype:
        return self.groups[self.columns[name].group].dtype

    def rows(self, prompt_idx: int, name: str) -> torch.Tensor:
        """The ``[positions, E]`` reference of capture ``name`` for one prompt (by the user's index)."""
        i = self.internal_index(prompt_idx)
        col = self.columns[name]
        start = int(self.offsets[i])
        shard = self.shards[int(self.prompt_shard[i])]
        return shard.packed[col.group][start : start + int(self.lengths[i]), col.index]

    def extra(self, name: str, prompt_idx: int) -> torch.Tensor:
        """Prompt ``prompt_idx``'s part of a per-prompt extra (e.g. its generated logits)."""
        i = self.internal_index(prompt_idx)
        shard = self.shards[int(self.prompt_shard[i])]
        if name not in shard.extras:
            raise KeyError(f"the store holds no extra {name!r} (extras: {self.extra_names})")
        values, offsets = shard.extras[name]
        j = self._local[i]
        return values[int(offsets[j]) : int(offsets[j + 1])]

    def internal_index(self, prompt_idx: int) -> int:
        """Internal row of a prompt given by the user's index."""
        if isinstance(prompt_idx, bool) or not hasattr(type(prompt_idx), "__index__"):  # "3" read like 3 in the error
            raise TypeError(f"a prompt index must be an int, got {type(prompt_idx).__name__} {prompt_idx!r}")
        try:
            return self._by_prompt_id[prompt_idx]
        except KeyError:
            raise KeyError(f"prompt {prompt_idx} is not in the reference store (prompts: {_preview(self.prompt_ids)})") from None

    def with_token_ids(self, token_ids: Sequence[Sequence[int]] | Mapping[int, Sequence[int]]) -> "ReferenceStore":
        """The same rows matched by other token ids (checked like captured ones)."""
        seqs = _align(token_ids, self.prompt_ids, "prompt_token_ids")
        prefill = self.prefill or [None] * self.num_prompts
        checked = TokenTable.from_lists([_check_token_ids(p, ids, pre) for p, ids, pre in zip(self.prompt_ids, seqs, prefill)])
        duplicate = first_duplicate([("", self.prompt_ids, checked)])
        if duplicate is not None:
            (_, a), (_, b) = duplicate
            raise CaptureError(f"prompt_token_ids: prompts {a} and {b} have the same token ids: a request with these "
                               f"tokens could only ever get one of them")
        return dataclasses.replace(self, prompt_token_ids=checked)

    def to(self, device: torch.device | str | None) -> "ReferenceStore":
        if device is None or all(t.device == torch.device(device) for t in self.packed):
            return self
        shards = [Shard([t.to(device) for t in s.packed], s.rows, s.extras, s.path) for s in self.shards]
        return dataclasses.replace(self, shards=shards)

    # ------------------------------------------------------------------ building

    @classmethod
    def from_captures(
        cls,
        captures: Sequence[Mapping[str, Any]] | Mapping[int, Mapping[str, Any]],
        *,
        prompt_token_ids: Sequence[Sequence[int]] | Mapping[int, Sequence[int]] | None = None,
        allow_nonfinite: bool = False,
        metadata: Mapping[str, Any] | None = None,
        extras: Mapping[str, Sequence[torch.Tensor] | Mapping[int, torch.Tensor]] | None = None,
        shard_sizes: Sequence[int] | None = None,
    ) -> "ReferenceStore":
        """Validate and flatten step-wise (list) or flat (dict) captures.

        ``extras``: per-prompt tensors, ``{name: [one tensor per prompt]}`` (or a dict by
        prompt index); prompt ``p``'s tensor comes back from :meth:`extra`.
        ``shard_sizes``: the prompts of each shard, in order (default: one shard), e.g. those
        of a store the result is to be :meth:`join`-ed to.

        Two prompts with the same token ids are refused (even with equal tensors: a request
        could only ever get the first, and its prompt index would silently stand for both).
        """
        if not isinstance(allow_nonfinite, bool):
            raise TypeError(f"allow_nonfinite must be True or False, got {allow_nonfinite!r}")
        metadata = check_metadata(metadata)
        if extras is not None and not isinstance(extras, Mapping):
            raise CaptureError(f"extras must be a dict {{name: [one tensor per prompt]}}, got {type(extras).__name__}")
        items = _prompt_items(captures)
        prompt_ids = [p for p, _ in items]
        token_ids = _align(prompt_token_ids, prompt_ids, "prompt_token_ids")
        per_prompt_extras = {name: _align(values, prompt_ids, f"extras[{name!r}]") for name, values in (extras or {}).items()}
        check_per_prompt_metadata(metadata, len(items))
        sizes = _shard_sizes(shard_sizes, len(items))
        builder = _ShardBuilder(allow_nonfinite=allow_nonfinite, metadata=metadata)
        builders, shards, end = [], [], 0
        for size in sizes:
            for n in range(end, end + size):
                builder.add(items[n][0], items[n][1], None if token_ids is None else token_ids[n],
                            {name: values[n] for name, values in per_prompt_extras.items()})
            end += size
            builders.append(builder)
            shards.append(builder.build_shard())
            builder = builder.successor()
        return cls(
            groups=builder.groups,
            shards=shards,
            prompt_ids=[p for b in builders for p in b.prompt_ids],
            prompt_shard=torch.cat([torch.full((len(b),), s, dtype=torch.long) for s, b in enumerate(builders)]),
            offsets=torch.cat([_offsets(b.lengths)[:-1] for b in builders]),
            lengths=torch.tensor([n for b in builders for n in b.lengths], dtype=torch.long),
            prompt_token_ids=[ids for b in builders for ids in b.token_ids] if builder.has_token_ids else None,
            num_steps=[n for b in builders for n in b.num_steps],
            prefill=[n for b in builders for n in b.prefill],
            metadata=metadata,
            finite_checked=not allow_nonfinite,
        )

    def layout_difference(self, other: "ReferenceStore") -> str | None:
        """How ``other`` lays its prompts out otherwise than this store (None when alike: the same
        prompts and token ids, each prompt's rows in the same shard at the same row), i.e. why
        the two cannot be :meth:`join`-ed."""
        if self.prompt_ids != other.prompt_ids:
            return f"its prompts are {_preview(other.prompt_ids)}, not {_preview(self.prompt_ids)}"
        if len(other.shards) != len(self.shards):
            return f"it has {len(other.shards)} shards, not {len(self.shards)}"
        here, there = (torch.stack([s.prompt_shard, s.offsets, s.lengths], 1) for s in (self, other))
        differ = (here != there).any(1).nonzero()
        if differ.numel():
            i = int(differ[0])
            (s, row, n), (s0, row0, n0) = there[i].tolist(), here[i].tolist()
            return (f"its prompt {self.prompt_ids[i]} has {n} rows from row {row} of shard {s}, not {n0} rows from "
                    f"row {row0} of shard {s0}")
        if (other.prompt_token_ids is None) != (self.prompt_token_ids is None):
            return "it holds no token ids" if other.prompt_token_ids is None else "it holds token ids, the other none"
        if self.prompt_token_ids is not None:
            i = next((i for i in range(self.num_prompts)
                      if not np.array_equal(self.prompt_token_ids.array(i), other.prompt_token_ids.array(i))), None)
            if i is not None:
                return f"its prompt {self.prompt_ids[i]} has other token ids"
        return None

    @classmethod
    def join(cls, stores: Sequence["ReferenceStore"]) -> "ReferenceStore":
        """One store holding every store's capture names (and extras) side by side, without
        copying a row: its shard ``s`` lists the group tensors of every store's shard ``s``, so
        memory-mapped ones stay mapped where they lie. The stores must be laid out alike (see
        :meth:`layout_difference`) and hold distinct capture names and extras; the prompts'
        steps and the metadata are the first store's. Blame joins a reference with the parts it
        captures on demand, so the engine reads them all with no copy made."""
        first, *others = stores
        taken: dict[str, set[str]] = {"capture names": set(first.capture_names), "extras": set(first.extra_names)}
        for k, other in enumerate(others, 1):
            difference = first.layout_difference(other)
            if difference:
                raise StoreError(f"store {k} is laid out otherwise than store 0, so they cannot be joined: {difference}")
            for kind, names in (("capture names", other.capture_names), ("extras", other.extra_names)):
                overlap = taken[kind].intersection(names)
                if overlap:
                    raise StoreError(f"store {k} holds {kind} an earlier store holds too: {_preview(sorted(overlap))}")
                taken[kind].update(names)
        if not others:
            return first
        shards = [Shard([t for store in stores for t in store.shards[s].packed], shard.rows,
                        {name: pair for store in stores for name, pair in store.shards[s].extras.items()})
                  for s, shard in enumerate(first.shards)]
        return dataclasses.replace(first, groups=[g for store in stores for g in store.groups], shards=shards,
                                   finite_checked=all(store.finite_checked for store in stores))

    def check_finite(self, chunk_rows: int = 4096) -> None:
        """Read every row (in chunks); raise naming the first prompt, capture name and position holding NaN or Inf."""
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        shard_of = self.prompt_shard.tolist()
        for s, shard in enumerate(self.shards):
            members = [i for i, k in enumerate(shard_of) if k == s]
            starts = self.offsets[members]
            for grp, packed in zip(self.groups, shard.packed):
                for a in range(0, shard.rows, chunk_rows):
                    bad = (~torch.isfinite(packed[a : min(a + chunk_rows, shard.rows)])).any(dim=2).nonzero()
                    if bad.numel():
                        row, name = a + int(bad[0, 0]), grp.capture_names[int(bad[0, 1])]
                        j = int(torch.searchsorted(starts, torch.tensor(row), right=True)) - 1
                        raise CaptureError(
                            f"prompt {self.prompt_ids[members[j]]}, capture {name!r}, position {row - int(starts[j])}: "
                            f"capture holds NaN or Inf (pass allow_nonfinite=True to accept it)"
                        )

    # ------------------------------------------------------------------ disk

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the shards (one: ``reference.safetensors``) and ``index.json`` listing them.

        Atomic per directory: the store is written into a new sibling directory, then renamed
        into place, so of concurrent savers each leaves a complete store and the directory
        holds one of them, never a mix. An existing directory is replaced when it holds only
        a store's files; one holding anything else is refused."""
        directory = as_path(directory, "directory")
        staging = staging_directory(directory)
        try:
            single = len(self.shards) == 1
            files = []
            for s in range(len(self.shards)):
                name = TENSORS_FILE if single else SHARD_PATTERN.format(s)
                tensors, index = self._shard_content(s)
                _write_shard(staging / name, tensors, index)
                files.append(shard_entry(name, index["prompts"]))
            _write_index(staging, files, self.groups, self.metadata)
            publish_directory(staging, directory, replace=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone after a rename; a failed save's part otherwise
        return directory

    def _shard_content(self, s: int) -> tuple[dict[str, torch.Tensor], dict]:
        members = [i for i, k in enumerate(self.prompt_shard.tolist()) if k == s]
        shard = self.shards[s]
        tensors = {f"group.{g}": t.contiguous().cpu() for g, t in enumerate(shard.packed)}
        tensors["prompt.offsets"] = self.offsets[members].cpu()
        tensors["prompt.lengths"] = self.lengths[members].cpu()
        if self.prompt_token_ids is not None:
            ids = TokenTable.from_lists([self.prompt_token_ids.array(i) for i in members])
            tensors["tokens.values"] = torch.from_numpy(ids.values)
            tensors["tokens.offsets"] = torch.from_numpy(ids.offsets)
        for name, (values, offsets) in shard.extras.items():
            tensors[f"extra.{name}.values"] = values.contiguous().cpu()
            tensors[f"extra.{name}.offsets"] = offsets.cpu()
        index = _shard_index(
            self.groups, [self.prompt_ids[i] for i in members],
            [self.num_steps[i] for i in members] if self.num_steps else None,
            [self.prefill[i] for i in members] if self.prefill else None,
            self.prompt_token_ids is not None, list(shard.extras), per_prompt_slice(self.metadata, members),
            self.finite_checked,
        )
        return tensors, index

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ReferenceStore":
        """Memory-map a store: a directory (``index.json`` and its shards) or one shard file.

        Reads headers and per-prompt tables only; every field of the index is checked
        against the tensors' metadata and errors name the file and the field. Every shard
        must agree with the first (capture names, dtypes, widths, extras, metadata; no two
        prompts with the same token ids).
        """
        path = as_path(path, "path")
        try:
            before = os.stat(path)  # one look: a store being replaced may come and go
        except OSError:
            before = None
        is_dir = before is not None and stat.S_ISDIR(before.st_mode)
        if is_dir:
            index_file = path / INDEX_FILE
            if index_file.exists():
                shard_files, prompt_ids = _read_directory_index(index_file)
            elif (path / TENSORS_FILE).exists():
                shard_files, prompt_ids = [path / TENSORS_FILE], [None]
            else:
                raise FileNotFoundError(f"no reference store at {path} (expected {index_file} or {path / TENSORS_FILE})")
        elif path.exists() or path.is_symlink():
            shard_files, prompt_ids = [path], [None]
        else:
            raise FileNotFoundError(f"no reference store at {path} (expected a directory or a .safetensors file)")
        loaded = [_load_shard(f, ids) for f, ids in zip(shard_files, prompt_ids)]
        if before is not None and not _same_file(path, before):  # saves replace a store whole (a rename): no mix
            raise StoreError(f"{path} was replaced while it loaded (saved again meanwhile); load it again")
        return cls(**_assemble(loaded))

    def verify(self) -> dict[str, Any]:
        """Read every byte of every shard: compare each tensor's SHA-256 with the digest
        recorded at write, then check every row is finite unless the writer allowed
        otherwise. Raises :class:`StoreError` naming the file and tensor; returns a summary."""
        if any(s.path is None for s in self.shards):
            raise ValueError("verify() checks files on disk; this store was built in memory")
        checked_bytes = sum(map(verify_shard_file, self.shards))
        if self.finite_checked:
            self.check_finite()
        return {"shards": len(self.shards), "bytes": checked_bytes, "prompts": self.num_prompts,
                "finite": self.finite_checked}



def _prompt_items(captures: Any) -> list[tuple[int, Any]]:
    """``(prompt index, captures)`` per prompt of step-wise (list) or flat (dict by prompt index) captures."""
    if isinstance(captures, Mapping):
        items = list(captures.items())
        for key, _ in items:
            if isinstance(key, bool) or not isinstance(key, int):
                raise CaptureError(f"flat captures must be keyed by integer prompt index, got key {key!r}")
    elif isinstance(captures, Sequence) and not isinstance(captures, (str, bytes)):
        items = list(enumerate(captures))
    else:
        raise CaptureError(
            f"captures must be a list of {{capture_name: [steps]}} dicts or a {{prompt_idx: {{capture_name: Tensor}}}} dict, "
            f"got {type(captures).__name__}"
        )
    if not items:
        raise CaptureError("captures are empty: no prompts")
    return items


def _shard_sizes(shard_sizes: Sequence[int] | None, prompts: int) -> list[int]:
    """The prompts of each shard (default: one shard of all), checked to add up to ``prompts``."""
    sizes = [prompts] if shard_sizes is None else list(shard_sizes)
    if sum(sizes) != prompts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise CaptureError(f"shard_sizes must be positive ints adding up to the {prompts} prompts, got {_preview(sizes)}")
    return sizes


def verify_shard_file(shard: Shard) -> int:
    """Compare each tensor of ``shard``'s file with the SHA-256 recorded when it was written;
    raise :class:`StoreError` naming the file and tensor, else return the bytes read."""
    header, data_start, _ = _read_header(shard.path)
    digests = json.loads(header["__metadata__"]["fxreplace_index"]).get("digests", {})
    checked_bytes = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        got = _file_digest(shard.path, data_start + begin, end - begin)
        if digests.get(name) != got:
            raise StoreError(
                f"{_describe(shard.path)}: tensor {name!r}: content digest {got[:16]}... differs from the "
                f"{str(digests.get(name))[:16]}... recorded when it was written: the file is corrupted"
            )
        checked_bytes += end - begin
    return checked_bytes


def _same_file(path: Path, before: os.stat_result) -> bool:
    """Whether ``path`` is still what ``before`` saw (not replaced, not gone)."""
    try:
        return os.path.samestat(before, os.stat(path))
    except OSError:
        return False
