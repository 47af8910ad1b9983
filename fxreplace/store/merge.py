"""Combining stores captured by several engines into one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable

from .format import SHARD_PATTERN, StoreError, _write_index
from .reference_store import ReferenceStore

def merge_stores(stores: Iterable[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Combine stores (e.g. captured by several engines) into one directory store.

    Shard files are hard-linked (copied across file systems), never rewritten. Prompt
    indices are kept when they are disjoint across the stores; otherwise they are
    renumbered 0, 1, ... in the order given (store by store).
    """
    paths = [Path(s) for s in stores]
    if not paths:
        raise ValueError("merge_stores needs at least one store")
    sources = [ReferenceStore.load(p) for p in paths]
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; merge_stores writes a new store")
    _check_same_layout(list(zip(paths, sources)))
    all_ids = [p for src in sources for p in src.prompt_ids]
    renumber = len(set(all_ids)) != len(all_ids)
    out.mkdir(parents=True, exist_ok=True)
    entries, next_id = [], 0
    for src in sources:
        for s, shard in enumerate(src.shards):
            name = SHARD_PATTERN.format(len(entries))
            _link_or_copy(shard.path, out / name)
            ids = [src.prompt_ids[i] for i in range(src.num_prompts) if int(src.prompt_shard[i]) == s]
            if renumber:
                ids = list(range(next_id, next_id + len(ids)))
                next_id += len(ids)
            entries.append((name, {"prompts": ids}))
    _write_index(out, entries, sources[0].groups, sources[0].metadata)
    return out


def _check_same_layout(named: list[tuple[Path, ReferenceStore]]) -> None:
    first_name, first = named[0]
    for name, other in named[1:]:
        if other.groups != first.groups:
            raise StoreError(f"{name}: capture names/dtypes/widths differ from {first_name}; stores of different targets cannot be merged")
        if (other.prompt_token_ids is None) != (first.prompt_token_ids is None):
            raise StoreError(f"{name}: holds token ids where {first_name} does not (or the reverse)")
        if set(other.extra_names) != set(first.extra_names):
            raise StoreError(f"{name}: extras {other.extra_names} differ from {first_name}'s {first.extra_names}")


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)

