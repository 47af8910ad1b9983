"""Combining stores captured by several engines into one, and a store's many small shards
into fewer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

from .format import SHARD_PATTERN, WRITER_MARKER, Shard, StoreError, _write_index, _write_shard, as_path, shard_entry
from .publish import DERIVED_DIRS, publish_directory, staging_directory
from .rules import check_extras_agree, combine_metadata, first_duplicate, per_prompt_slice
from .reference_store import ReferenceStore, verify_shard_file


def merge_stores(stores: Iterable[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Combine stores (e.g. captured by several engines) into one directory store.

    Shard files are hard-linked (copied across file systems), never rewritten. Prompt
    indices are kept when they are disjoint across the stores; otherwise they are
    renumbered 0, 1, ... in the order given (store by store).

    Refused before anything is written, naming the store: the same store given twice,
    two prompts with the same token ids (within or across stores), different capture
    names, dtypes or widths, different extras (names, dtypes, trailing shapes, e.g. logits
    of another vocabulary), and metadata that differs in any key but the per-prompt ones
    (``prompt_texts``, concatenated in merged order). ``out`` appears whole or not at all.
    Folders fxreplace derived from a store (``blame-components``) are left out: prompt
    indices change, and blame captures them again where it needs them.
    """
    if isinstance(stores, (str, bytes, os.PathLike)) or not hasattr(stores, "__iter__"):
        raise TypeError(f"stores must be a list of store paths, got {type(stores).__name__} {stores!r:.60}")
    paths = [as_path(s, f"stores[{i}]") for i, s in enumerate(stores)]
    if not paths:
        raise ValueError("merge_stores needs at least one store")
    out = as_path(out, "out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} is not an empty directory; merge_stores writes a new store")
    sources = [ReferenceStore.load(p) for p in paths]
    named = list(zip(paths, sources))
    _check_distinct(named)
    metadata = combine_metadata([(str(p), src.metadata, src.num_prompts) for p, src in named])
    _check_same_layout(named)
    if sources[0].prompt_token_ids is not None:
        duplicate = first_duplicate([(str(p), src.prompt_ids, src.prompt_token_ids) for p, src in named])
        if duplicate is not None:
            (where_a, a), (where_b, b) = duplicate
            raise StoreError(f"{where_b}: prompt {b} has the same token ids as prompt {a} of {where_a}: a request with "
                             f"these tokens could only ever get one of them; merge each prompt once")
    all_ids = [p for src in sources for p in src.prompt_ids]
    renumber = len(set(all_ids)) != len(all_ids)
    staging = staging_directory(out)
    try:
        entries, next_id = [], 0
        for src in sources:
            for s, shard in enumerate(src.shards):
                name = SHARD_PATTERN.format(len(entries))
                _link_or_copy(shard.path, staging / name)
                ids = [src.prompt_ids[i] for i in range(src.num_prompts) if int(src.prompt_shard[i]) == s]
                if renumber:
                    ids = list(range(next_id, next_id + len(ids)))
                    next_id += len(ids)
                entries.append(shard_entry(name, ids))
        _write_index(staging, entries, sources[0].groups, metadata)
        publish_directory(staging, out, replace=False)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def repack_store(store: str | os.PathLike, out: str | os.PathLike, *, shard_bytes: int = 256 << 20) -> Path:
    """Rewrite a store whose shards are small (an engine in capture mode writes one at
    every idle that finished requests) as few shards of about ``shard_bytes`` each.

    Consecutive shards are joined until the next would pass ``shard_bytes``; a shard
    already larger stays whole. Prompts, their indices and order, token ids, extras and
    metadata are unchanged, and so is every row, bit for bit. Each source shard's file is
    checked against the digests recorded when it was written before its rows are copied
    (a damaged file is refused, never rewritten with fresh digests), and a store whose
    writer has not finished is refused. Memory holds one output shard. ``out`` must be
    new or empty, and appears whole or not at all, with the folders fxreplace derived from
    the store (``blame-components``): each part there laid out like the store (see
    :meth:`ReferenceStore.join`) is repacked alike, so it stays so; any other is copied.
    """
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"shard_bytes must be a positive int (bytes per output shard), got {shard_bytes!r}")
    source = as_path(store, "store")
    out = as_path(out, "out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} is not an empty directory; repack_store writes a new store")
    if (source / WRITER_MARKER).exists():
        raise StoreError(f"a store writer is still writing {source} (a capture that has not finished): finish it "
                         f"first; if its writer died, delete {source / WRITER_MARKER} to repack what it wrote")
    src = ReferenceStore.load(source)
    runs = _runs_of_shards(src, shard_bytes)
    staging = staging_directory(out)
    try:
        _write_runs(src, runs, staging)
        for name in DERIVED_DIRS:  # same prompt indices: still this reference's
            for part in sorted((source / name).glob("*/index.json")):
                part_src, part_out = ReferenceStore.load(part.parent), staging / name / part.parent.name
                if src.layout_difference(part_src) is None:
                    part_out.mkdir(parents=True)
                    _write_runs(part_src, runs, part_out)
                else:
                    shutil.copytree(part.parent, part_out)
        publish_directory(staging, out, replace=False)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _write_runs(src: ReferenceStore, runs: list[list[int]], directory: Path) -> None:
    """Write ``src`` into ``directory`` as one shard per run of its shards, each source shard's file
    checked against its digests first."""
    members_of = [[] for _ in src.shards]  # each shard's prompts (internal indices), in store order
    for i, s in enumerate(src.prompt_shard.tolist()):
        members_of[s].append(i)
    entries = []
    for run in runs:
        for s in run:
            verify_shard_file(src.shards[s])
        tensors, index = _joined(src, run, members_of)._shard_content(0)
        name = SHARD_PATTERN.format(len(entries))
        _write_shard(directory / name, tensors, index)
        entries.append(shard_entry(name, index["prompts"]))
    _write_index(directory, entries, src.groups, src.metadata)


def _shard_nbytes(shard: Shard) -> int:
    tensors = [*shard.packed, *(t for pair in shard.extras.values() for t in pair)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _runs_of_shards(src: ReferenceStore, shard_bytes: int) -> list[list[int]]:
    """The source shards of each output shard: consecutive ones while they fit ``shard_bytes``."""
    runs, size = [], 0
    for s, shard in enumerate(src.shards):
        nbytes = _shard_nbytes(shard)
        if not runs or size + nbytes > shard_bytes:
            runs.append([])
            size = 0
        runs[-1].append(s)
        size += nbytes
    return runs


def _joined(src: ReferenceStore, run: list[int], members_of: list[list[int]]) -> ReferenceStore:
    """A one-shard store in memory of the prompts of ``src``'s shards ``run`` (``members_of``:
    each shard's prompts), in store order."""
    members, offsets, rows = [], [], 0
    for s in run:
        members += members_of[s]
        offsets.append(src.offsets[members_of[s]] + rows)
        rows += src.shards[s].rows
    shards = [src.shards[s] for s in run]
    packed = []
    for g, group in enumerate(src.groups):
        zero_row = torch.zeros(1, len(group.capture_names), group.width, dtype=group.dtype)
        packed.append(torch.cat([shard.packed[g][:shard.rows] for shard in shards] + [zero_row]))
    extras = {}
    for name in src.extra_names:
        values = [shard.extras[name][0] for shard in shards]
        starts = torch.tensor([0] + [v.shape[0] for v in values]).cumsum(0)
        extra_offsets = [shard.extras[name][1][:-1] + start for shard, start in zip(shards, starts)]
        extras[name] = (torch.cat(values), torch.cat(extra_offsets + [starts[-1:]]))
    tokens = src.prompt_token_ids
    return ReferenceStore(
        src.groups, [Shard(packed, rows, extras)], [src.prompt_ids[i] for i in members],
        torch.zeros(len(members), dtype=torch.long), torch.cat(offsets), src.lengths[members],
        None if tokens is None else [tokens.array(i) for i in members],
        [src.num_steps[i] for i in members] if src.num_steps else None,
        [src.prefill[i] for i in members] if src.prefill else None,
        per_prompt_slice(src.metadata, members), src.finite_checked)


def _check_distinct(named: list[tuple[Path, ReferenceStore]]) -> None:
    """No shard file given twice (the same store by two paths, a link, or a store inside another)."""
    seen: dict[tuple[int, int], Path] = {}
    for name, store in named:
        for shard in store.shards:
            st = os.stat(shard.path)
            key = (st.st_dev, st.st_ino)
            if key in seen:
                raise StoreError(f"{name}: shard {shard.path.name} is the same file as one of {seen[key]}: "
                                 f"the same store is given twice")
            seen[key] = name


def _check_same_layout(named: list[tuple[Path, ReferenceStore]]) -> None:
    first_name, first = named[0]
    for name, other in named[1:]:
        if other.groups != first.groups:
            raise StoreError(f"{name}: capture names/dtypes/widths differ from {first_name}; stores of different targets cannot be merged")
        if (other.prompt_token_ids is None) != (first.prompt_token_ids is None):
            raise StoreError(f"{name}: holds token ids where {first_name} does not (or the reverse)")
        check_extras_agree(str(name), {e: v for e, (v, _) in other.shards[0].extras.items()}, str(first_name),
                           {e: v for e, (v, _) in first.shards[0].extras.items()})

def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
