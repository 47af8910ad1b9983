"""Loading shards: every field of a shard's index checked against its tensors' metadata
(O(index), the rows stay memory-mapped), then the shards assembled into one store's fields."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ..matching import TokenTable
from .format import (FORMAT_NAME, FORMAT_VERSION, _TOKEN_DTYPES, CaptureError, Group, Shard, StoreError,
                     _check_tensor_entries, _describe, _offsets, _preview, _read_header)
from .rules import check_extra_against_metadata, check_extras_agree, combine_metadata, extra_layout, first_duplicate

class _ShardCheck:
    """The checks of one shard's index against its tensors, each failure naming the file and field."""

    def __init__(self, where: str, specs: dict):
        self.where, self.specs = where, specs

    def need(self, cond: bool, fld: str, msg) -> None:
        """``msg``: a string, or a function making it (when it is costly or only valid on failure)."""
        if not cond:
            raise StoreError(f"{self.where}: field {fld!r}: {msg() if callable(msg) else msg}")

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        self.need(name in self.specs, name, "the index needs this tensor but the file has none")
        return self.specs[name]


def _load_shard(file: Path, prompt_ids: list[int] | None) -> tuple[dict, Shard, dict]:
    """Validate one shard from its metadata and per-prompt tables, then memory-map it."""
    where = _describe(file)
    header, data_start, size = _read_header(file)
    index = _shard_index(where, header)
    check = _ShardCheck(where, _check_tensor_entries(where, header, size - data_start))
    need, spec = check.need, check.spec
    for key, kind in (("groups", list), ("prompts", list), ("has_token_ids", bool), ("extras", list),
                      ("metadata", dict), ("finite_checked", bool), ("digests", dict)):
        need(isinstance(index.get(key), kind), key, f"expected a {kind.__name__}, got {index.get(key)!r:.60}")
    prompts = index["prompts"]
    need(all(isinstance(p, int) and not isinstance(p, bool) for p in prompts), "prompts", "prompt indices must be ints")
    need(len(set(prompts)) == len(prompts), "prompts", "prompt indices repeat")
    num_prompts = len(prompts)
    need(num_prompts > 0, "prompts", "the shard holds no prompts")

    # per-prompt tables: small, read them (O(index))
    for name in ("prompt.offsets", "prompt.lengths"):
        need(spec(name) == (torch.int64, (num_prompts,)), name,
             f"expected int64 [{num_prompts}] (one per prompt), got {spec(name)[0]} {list(spec(name)[1])}")
    try:
        opened = safe_open(str(file), framework="pt")
    except (OSError, RuntimeError, SafetensorError) as e:  # safetensors versions differ in what a vanished file raises
        raise StoreError(f"{where}: cannot open: {e}") from None
    with opened as f:
        offsets, lengths = f.get_tensor("prompt.offsets"), f.get_tensor("prompt.lengths")
        need(bool((lengths >= 1).all()), "prompt.lengths",
             lambda: f"prompt {prompts[int((lengths < 1).nonzero()[0])]} has {int(lengths.min())} rows")
        rows = int(lengths.sum())
        starts = _offsets(lengths.tolist())[:-1]
        if not torch.equal(offsets, starts):
            j = int((offsets != starts).nonzero()[0])
            raise StoreError(f"{where}: field 'prompt.offsets': prompt {prompts[j]} starts at row {int(offsets[j])} but "
                             f"prompts are packed back to back, so it must start at {int(starts[j])} (overlapping or gapped rows)")
        groups = _groups(check, index["groups"], rows, num_prompts)
        num_steps, prefill = _steps(check, index, prompts, lengths.tolist())
        token_ids = _token_ids(check, f, index, prompts, prefill) if index["has_token_ids"] else None
        extras = _extras(check, f, index, num_prompts)
        packed = [f.get_tensor(f"group.{g}") for g in range(len(groups))]

    if prompt_ids is not None:
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in prompt_ids):
            raise StoreError(f"{where}: index.json lists prompt indices for this shard that are not all ints")
        if len(prompt_ids) != num_prompts:
            raise StoreError(f"{where}: index.json lists {len(prompt_ids)} prompts for this shard but it holds {num_prompts}")
        prompts = list(prompt_ids)
    table = {
        "prompts": prompts, "offsets": offsets, "lengths": lengths, "token_ids": token_ids, "num_steps": num_steps,
        "prefill": prefill, "metadata": index["metadata"], "finite_checked": index["finite_checked"], "groups": groups,
    }
    return table, Shard(packed, rows, extras, Path(file)), index


def _shard_index(where: str, header: dict) -> dict:
    """The fxreplace index a shard's safetensors header carries, of this fxreplace's format."""
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or "fxreplace_index" not in meta:
        raise StoreError(f"{where} is a safetensors file but not an fxreplace reference store (no index in its header)")
    try:
        index = json.loads(meta["fxreplace_index"])
    except json.JSONDecodeError as e:
        raise StoreError(f"{where}: field 'fxreplace_index': the store index is not JSON ({e})") from None
    if not isinstance(index, dict):
        raise StoreError(f"{where}: field 'fxreplace_index': expected a JSON object, got {type(index).__name__}")
    if index.get("format") != FORMAT_NAME or index.get("version") != FORMAT_VERSION:
        raise StoreError(f"{where}: unsupported format {index.get('format')!r} version {index.get('version')!r} "
                         f"(this fxreplace reads {FORMAT_NAME!r} version {FORMAT_VERSION}; capture the reference again)")
    return index


def _groups(check: _ShardCheck, entries: list, rows: int, num_prompts: int) -> list[Group]:
    """The index's capture groups, each checked against its ``group.G`` tensor."""
    need, spec = check.need, check.spec
    groups = []
    seen_names = set()
    for g, grp in enumerate(entries):
        fld = f"groups[{g}]"
        need(isinstance(grp, dict) and isinstance(grp.get("modules"), list) and grp["modules"]
             and isinstance(grp.get("width"), int) and grp["width"] > 0 and isinstance(grp.get("dtype"), str),
             fld, f"expected {{dtype, width, modules}}, got {grp!r:.80}")
        dtype = getattr(torch, grp["dtype"], None)
        need(isinstance(dtype, torch.dtype) and dtype.is_floating_point, fld, f"unknown or non-float dtype {grp['dtype']!r}")
        dup = seen_names.intersection(grp["modules"])
        need(not dup and len(set(grp["modules"])) == len(grp["modules"]), fld, f"capture names repeat: {sorted(dup)[:3]}")
        seen_names.update(grp["modules"])
        got_dtype, got_shape = spec(f"group.{g}")
        want_shape = (rows + 1, len(grp["modules"]), grp["width"])
        need(got_dtype == dtype, f"group.{g}", f"the tensor is {got_dtype} but the index says {dtype}")
        need(got_shape == want_shape, f"group.{g}",
             f"shape {list(got_shape)} but the index needs [rows+1={want_shape[0]}, modules={want_shape[1]}, "
             f"width={want_shape[2]}] ({num_prompts} prompts of {rows} rows in all)")
        groups.append(Group(dtype, grp["width"], tuple(grp["modules"])))
    need(bool(groups), "groups", "the shard holds no capture names")
    stray = sorted(n for n in check.specs if n.startswith("group.") and n not in {f"group.{g}" for g in range(len(groups))})
    need(not stray, "groups", f"tensors {stray} are not in the index")
    return groups


def _steps(check: _ShardCheck, index: dict, prompts: list[int], lengths: list[int]) -> tuple[list, list]:
    """Each prompt's step count and prefill, checked against its rows."""
    need = check.need
    num_steps, prefill = index.get("num_steps"), index.get("prefill")
    for key, value in (("num_steps", num_steps), ("prefill", prefill)):
        need(isinstance(value, list) and len(value) == len(prompts), key, f"expected a list of {len(prompts)} entries")
    for p, n, steps, pre in zip(prompts, lengths, num_steps, prefill):
        if not (isinstance(steps, int) and steps >= 1):
            need(False, "num_steps", f"prompt {p}: {steps!r} is not a step count")
        if pre is not None and not (isinstance(pre, int) and pre >= 1 and pre + steps - 1 == n):
            need(False, "prefill", f"prompt {p}: a prefill of {pre} positions plus {steps - 1} decode steps is not its {n} rows")
    return num_steps, prefill


def _token_ids(check: _ShardCheck, f, index: dict, prompts: list[int], prefill: list) -> TokenTable:
    """The shard's token ids per prompt, checked (non-negative, below the vocabulary, covering the prefill)."""
    need, spec = check.need, check.spec
    num_prompts = len(prompts)
    vdtype, vshape = spec("tokens.values")
    need(vdtype in _TOKEN_DTYPES and len(vshape) == 1, "tokens.values",
         f"token ids must be a 1-D integer tensor, got {vdtype} {list(vshape)}")
    need(spec("tokens.offsets") == (torch.int64, (num_prompts + 1,)), "tokens.offsets",
         f"expected int64 [{num_prompts + 1}], got {spec('tokens.offsets')[0]} {list(spec('tokens.offsets')[1])}")
    values, toffs = f.get_tensor("tokens.values"), f.get_tensor("tokens.offsets")
    counts = toffs.diff()
    need(int(toffs[0]) == 0 and int(toffs[-1]) == vshape[0] and bool((counts >= 1).all()), "tokens.offsets",
         lambda: f"must rise from 0 to {vshape[0]} with at least one token per prompt, got {_preview(toffs.tolist())}")
    need(values.numel() == 0 or int(values.min()) >= 0, "tokens.values",
         lambda: f"token ids must be non-negative, found {int(values.min())}")
    vocab = index["metadata"].get("vocab_size")
    if isinstance(vocab, int) and values.numel():
        need(int(values.max()) < vocab, "tokens.values", lambda: f"token id {int(values.max())} is not below the vocab size {vocab}")
    for p, c, pre in zip(prompts, counts.tolist(), prefill):
        if pre is not None and c < pre:
            need(False, "tokens.values", f"prompt {p} has {c} token ids but its capture's prefill covers {pre} positions")
    return TokenTable(values.numpy(), toffs.numpy())


def _extras(check: _ShardCheck, f, index: dict, num_prompts: int) -> dict:
    """The shard's extras (per-prompt items beside the rows), each checked against the metadata."""
    need, spec = check.need, check.spec
    extras = {}
    for name in index["extras"]:
        vfld, ofld = f"extra.{name}.values", f"extra.{name}.offsets"
        vdtype, vshape = spec(vfld)
        need(len(vshape) >= 1, vfld, "an extra needs a leading per-item dimension")
        need(spec(ofld) == (torch.int64, (num_prompts + 1,)), ofld, f"expected int64 [{num_prompts + 1}]")
        eoffs = f.get_tensor(ofld)
        need(int(eoffs[0]) == 0 and int(eoffs[-1]) == vshape[0] and bool((eoffs.diff() >= 0).all()), ofld,
             lambda: f"must rise from 0 to {vshape[0]}, got {_preview(eoffs.tolist())}")
        try:
            check_extra_against_metadata(name, extra_layout(vdtype, vshape), index["metadata"], where=check.where)
        except CaptureError as e:
            raise StoreError(str(e)) from None
        extras[name] = (f.get_tensor(vfld), eoffs)
    return extras

def _read_directory_index(index_file: Path) -> tuple[list[Path], list[list[int] | None]]:
    where = _describe(index_file)
    try:
        index = json.loads(index_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreError(f"{where}: not a JSON store index ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME or index.get("version") != FORMAT_VERSION:
        fmt = (index.get("format"), index.get("version")) if isinstance(index, dict) else None
        raise StoreError(f"{where}: unsupported store index {fmt!r} (this fxreplace reads {FORMAT_NAME!r} version "
                         f"{FORMAT_VERSION}; capture the reference again)")
    shards = index.get("shards")
    if not isinstance(shards, list) or not shards:
        raise StoreError(f"{where}: field 'shards': expected a non-empty list of shard files")
    files, ids = [], []
    for k, entry in enumerate(shards):
        if not (isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("prompts"), list)):
            raise StoreError(f"{where}: field 'shards[{k}]': expected {{file, prompts}}, got {entry!r:.80}")
        name = entry["file"]
        if Path(name).name != name:
            raise StoreError(f"{where}: field 'shards[{k}].file': {name!r} must be a file name inside the store directory")
        files.append(index_file.parent / name)
        ids.append(entry["prompts"])
    return files, ids


def _assemble(loaded: list[tuple[dict, Shard, dict]]) -> dict:
    """The fields of one :class:`~fxreplace.store.ReferenceStore` from its loaded shards, checked to agree."""
    first, _, _ = loaded[0]
    first_file = loaded[0][1].path
    metadata = combine_metadata([(_describe(s.path), t["metadata"], len(t["prompts"])) for t, s, _ in loaded])
    for table, shard, _ in loaded[1:]:
        where = _describe(shard.path)
        if table["groups"] != first["groups"]:
            raise StoreError(f"{where}: field 'groups': capture names, dtypes or widths differ from {first_file}")
        if (table["token_ids"] is None) != (first["token_ids"] is None):
            raise StoreError(f"{where}: field 'has_token_ids' differs from {first_file}")
        check_extras_agree(where, {e: v for e, (v, _) in shard.extras.items()}, str(first_file),
                           {e: v for e, (v, _) in loaded[0][1].extras.items()})
    prompt_ids = [p for t, _, _ in loaded for p in t["prompts"]]
    if len(set(prompt_ids)) != len(prompt_ids):
        seen, dup = set(), None
        for p in prompt_ids:
            if p in seen:
                dup = p
                break
            seen.add(p)
        raise StoreError(f"{first_file.parent}: prompt {dup} appears in more than one shard")
    token_ids = None
    if first["token_ids"] is not None:
        duplicate = first_duplicate([(_describe(s.path), t["prompts"], t["token_ids"]) for t, s, _ in loaded])
        if duplicate is not None:
            (where_a, a), (where_b, b) = duplicate
            raise StoreError(f"{where_b}: prompt {b} has the same token ids as prompt {a} of {where_a}: a request with "
                             f"these tokens could only ever get one of them")
        tables = [t["token_ids"] for t, _, _ in loaded]
        starts = np.cumsum([0] + [tb.values.size for tb in tables[:-1]])
        token_ids = TokenTable(np.concatenate([tb.values for tb in tables]),
                               np.concatenate([tb.offsets[:-1] + s0 for tb, s0 in zip(tables, starts)] + [[sum(tb.values.size for tb in tables)]]))
    return dict(
        groups=first["groups"],
        shards=[s for _, s, _ in loaded],
        prompt_ids=prompt_ids,
        prompt_shard=torch.cat([torch.full((len(t["prompts"]),), k, dtype=torch.long) for k, (t, _, _) in enumerate(loaded)]),
        offsets=torch.cat([t["offsets"] for t, _, _ in loaded]),
        lengths=torch.cat([t["lengths"] for t, _, _ in loaded]),
        prompt_token_ids=token_ids,
        num_steps=[n for t, _, _ in loaded for n in t["num_steps"]],
        prefill=[n for t, _, _ in loaded for n in t["prefill"]],
        metadata=metadata,
        finite_checked=all(t["finite_checked"] for t, _, _ in loaded),
    )

