"""Combining stores captured by several engines into one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable

from .format import (SHARD_PATTERN, StoreError, _write_index, as_path, check_extras_agree, combine_metadata, first_duplicate,
                     publish_directory, shard_entry, staging_directory)
from .reference_store import ReferenceStore


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
