"""The store's file format and the checks on it: names, constants, the in-memory layout
(:class:`Group`, :class:`Shard`), shard headers written and read back with their digests.

The lowest layer of :mod:`fxreplace.store`: it imports nothing else from the package.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import stat
import struct
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
from safetensors.torch import save_file

from ..dtypes import dtype_name
from ..matching import TokenTable

FORMAT_NAME = "fxreplace-reference"
FORMAT_VERSION = 3  # 3: group tensors position-major [rows + 1, capture names, E] (2 was name-major)
TENSORS_FILE = "reference.safetensors"
INDEX_FILE = "index.json"
SHARD_PATTERN = "shard-{:05d}.safetensors"
WRITER_MARKER = ".fxreplace-writing"  # present while a StoreWriter owns the directory
#: Folders fxreplace adds inside a store, derived from its prompts (``fxreplace blame --clean``
#: keeps the components it captured there, laid out like it): part of the reference, replaced
#: with it, repacked alike by repack (same prompt indices), left out by a merge (indices change;
#: blame captures again).
BLAME_COMPONENTS_DIR = "blame-components"
DERIVED_DIRS = (BLAME_COMPONENTS_DIR,)
#: A vLLM capture's counts, written beside its store (fxreplace.engines.vllm.capture).
CAPTURE_STATS_FILE = "capture.json"
#: The file in a reference directory that holds its noise floors, by dtype, each with its own metadata
#: (the store's own metadata is written when its capture starts, before the floor can be measured):
#: part of the reference, replaced with it by a new capture into the same folder.
FLOOR_FILE = "noise_floors.json"
_MAX_HEADER_BYTES = 256 << 20  # a header beyond this is not a store (safetensors itself caps at 100 MB)

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_TOKEN_DTYPES = (torch.int64, torch.int32)


class CaptureError(ValueError):
    """Captures that cannot be flattened; the message names prompt, capture name and step."""


class StoreError(CaptureError):
    """A store file that does not hold what its index says; the message names the file and the field."""


@dataclass(frozen=True)
class CaptureColumns:
    """Where one capture name's rows live: row block ``index`` of group ``group``."""

    group: int
    index: int


@dataclass(frozen=True)
class Group:
    """Capture names sharing one ``[rows + 1, len(capture_names), width]`` tensor."""

    dtype: torch.dtype
    width: int
    capture_names: tuple[str, ...]


@dataclass
class Shard:
    """One file's (or one in-memory build's) tensors. ``packed[g]`` is ``[rows + 1, M_g, E_g]``,
    position-major: a store row is one contiguous run of every capture name's values, so a
    decode step's scattered rows are one read each (see :mod:`fxreplace.context`);
    ``extras[name]`` is ``(values, offsets)``: prompt ``j`` of the shard owns
    ``values[offsets[j] : offsets[j + 1]]``."""

    packed: list[torch.Tensor]
    rows: int
    extras: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    path: Path | None = None

    @property
    def zero_row(self) -> int:
        return self.rows



def _offsets(lengths: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.long)
    torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0, out=out[1:])
    return out



def _preview(items: Sequence, n: int = 8) -> str:
    items = list(items)
    return ", ".join(map(str, items[:n])) + (f", ... ({len(items)} in all)" if len(items) > n else "")



# ---------------------------------------------------------------------- writing files


def _shard_index(groups, prompts, num_steps, prefill, has_token_ids, extras, metadata, finite_checked) -> dict:
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "groups": [{"dtype": dtype_name(g.dtype), "width": g.width, "modules": list(g.capture_names)} for g in groups],
        "prompts": list(prompts),
        "num_steps": num_steps,
        "prefill": prefill,
        "has_token_ids": has_token_ids,
        "extras": list(extras),
        "metadata": dict(metadata),
        "finite_checked": finite_checked,
    }


def _tensor_digest(t: torch.Tensor) -> str:
    t = t.contiguous()
    data = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    return hashlib.sha256(data.numpy() if data.numel() else b"").hexdigest()


def _write_shard(file: Path, tensors: dict[str, torch.Tensor], index: dict) -> None:
    """Write one shard atomically, recording every tensor's SHA-256 in its index."""
    index = dict(index, digests={name: _tensor_digest(t) for name, t in tensors.items()})
    tmp = file.with_name(file.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"fxreplace_index": json.dumps(index)})
    os.replace(tmp, file)


def shard_entry(name: str, prompts: Sequence[int]) -> str:
    """One shard's line in ``index.json``: its file and prompt indices, encoded once (a
    writer rewrites the index at every sync, and keeps the lines of the shards it wrote)."""
    return json.dumps({"file": name, "prompts": list(prompts)})


def _write_index(directory: Path, shard_entries: Sequence[str], groups: list[Group], metadata: Mapping) -> None:
    """``index.json``: the shard files in order with their prompts (the loader's list, one
    :func:`shard_entry` line each), plus a readable summary, one line per module and per
    metadata key. ``json.dumps(indent=...)`` would run the pure-Python encoder over a line
    per prompt index, milliseconds per thousand prompts at every sync of a writer."""
    modules = [f"{json.dumps(m)}: {json.dumps([str(g.dtype).removeprefix('torch.'), g.width])}"
               for g in groups for m in g.capture_names]
    lines = [f'"format": {json.dumps(FORMAT_NAME)}', f'"version": {json.dumps(FORMAT_VERSION)}',
             f'"shards": {_block("[", shard_entries, "]")}', f'"modules": {_block("{", modules, "}")}',
             f'"metadata": {_block("{", [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in metadata.items()], "}")}']
    tmp = directory / (INDEX_FILE + ".tmp")
    tmp.write_text(_block("{", lines, "}", indent=" ") + "\n")
    os.replace(tmp, directory / INDEX_FILE)


def _block(opening: str, lines: Sequence[str], closing: str, indent: str = "  ") -> str:
    """A JSON list or object of already encoded entries, one per line."""
    if not lines:
        return opening + closing
    return f"{opening}\n{indent}" + f",\n{indent}".join(lines) + f"\n{indent[:-1]}{closing}"


# ---------------------------------------------------------------------- reading files


def _describe(file: Path) -> str:
    """The file as the user gave it, plus where a link points."""
    return f"{file} (a link to {os.path.realpath(file)})" if os.path.islink(file) else str(file)


def _read_header(file: Path) -> tuple[dict, int, int]:
    """The safetensors header of ``file``, its data start and the file size; every
    structural problem is a :class:`StoreError` naming the file."""
    where = _describe(file)
    try:
        st = os.stat(file)
    except OSError as e:
        raise StoreError(f"{where}: cannot read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"{where}: not a regular file; a reference store is a safetensors file")
    size = st.st_size
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise StoreError(f"{where}: truncated: {size} bytes, too short for a safetensors header")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise StoreError(f"{where}: header length field says {header_len} bytes but the file has only {size} "
                                 f"(truncated, or not a safetensors file)")
            if header_len > _MAX_HEADER_BYTES:
                raise StoreError(f"{where}: header of {header_len} bytes is too large for a reference store")
            raw = f.read(header_len)
    except OSError as e:
        raise StoreError(f"{where}: cannot read: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreError(f"{where}: the safetensors header is not JSON ({e}); not a reference store") from None
    if not isinstance(header, dict):
        raise StoreError(f"{where}: the safetensors header is not a JSON object; not a reference store")
    return header, 8 + header_len, size


def _check_tensor_entries(where: str, header: dict, data_size: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """dtype, shape and byte range of every tensor: known dtype, size = numel * itemsize,
    ranges inside the data section and not overlapping."""
    specs, ranges = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise StoreError(f"{where}: tensor {name!r}: header entry needs dtype, shape and data_offsets, got {entry!r:.80}")
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise StoreError(f"{where}: tensor {name!r}: unknown dtype {entry['dtype']!r}")
        shape, offs = entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise StoreError(f"{where}: tensor {name!r}: shape must be a list of non-negative ints, got {shape!r:.60}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs) and 0 <= offs[0] <= offs[1]):
            raise StoreError(f"{where}: tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offs!r:.60}")
        nbytes = math.prod(shape) * dtype.itemsize
        if offs[1] - offs[0] != nbytes:
            raise StoreError(f"{where}: tensor {name!r}: {entry['dtype']} {shape} needs {nbytes} bytes but data_offsets "
                             f"{offs} span {offs[1] - offs[0]}")
        if offs[1] > data_size:
            raise StoreError(f"{where}: tensor {name!r}: data_offsets {offs} run past the end of the file's data "
                             f"({data_size} bytes): the file is truncated")
        specs[name] = (dtype, tuple(shape))
        ranges.append((offs[0], offs[1], name))
    ranges.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise StoreError(f"{where}: tensors {n0!r} {[b0, e0]} and {n1!r} {[b1, e1]}: data_offsets overlap")
    return specs



def _file_digest(file: Path, start: int, length: int, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        f.seek(start)
        while length > 0:
            data = f.read(min(chunk, length))
            if not data:
                break
            h.update(data)
            length -= len(data)
    return h.hexdigest()



# ---------------------------------------------------------------------- consistency rules shared by builder, loader, merge

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


# ---------------------------------------------------------------------- directories placed whole


def as_path(value, what: str) -> Path:
    """``value`` as a Path, refusing what is not a path (a number, None, a list)."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"{what} must be a path (str or os.PathLike), got {type(value).__name__} {value!r:.60}")
    return Path(value)


def staging_directory(directory: Path) -> Path:
    """A new empty sibling of ``directory`` to write a whole store into before :func:`publish_directory`."""
    if directory.is_symlink():
        directory = directory.resolve()
    if _is_file(directory):
        raise NotADirectoryError(f"{directory} is a file, not a directory; a store is written into a directory")
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = directory.parent / f".{directory.name}.writing-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
    except OSError as e:
        raise OSError(f"cannot write a store at {directory}: {e.strerror or e}") from None
    return staging


def _is_file(path: Path) -> bool:
    """Whether ``path`` exists as something other than a directory, in one look: a store
    directory that another saver is replacing is missing for a moment, which is no file."""
    try:
        return not stat.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


def is_store_entry(name: str) -> bool:
    """Whether a directory entry of this name is part of a store (its files, or a folder
    fxreplace derived from it): anything else is someone else's and never replaced."""
    return (name in (TENSORS_FILE, INDEX_FILE, CAPTURE_STATS_FILE, FLOOR_FILE, *DERIVED_DIRS)
            or re.fullmatch(r"shard-\d{5,}\.safetensors(\.tmp)?", name) is not None)


def foreign_entries(directory: Path) -> list[str]:
    """The entries of ``directory`` that are not a store's (see :func:`is_store_entry`)."""
    return sorted(p.name for p in directory.iterdir() if not is_store_entry(p.name))


def publish_directory(staging: Path, directory: Path, *, replace: bool) -> None:
    """Rename the complete store in ``staging`` to ``directory`` in one step, so a reader or
    another saver sees a whole store or none, never a mix. An existing non-empty
    ``directory`` is replaced only with ``replace`` and when it holds nothing but store
    files (its old content is moved aside first, then deleted)."""
    if directory.is_symlink():
        directory = directory.resolve()
    old_ones = []
    try:
        for _ in range(100):
            try:
                os.rename(staging, directory)  # replaces a missing or empty directory atomically
                return
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise
            if _is_file(directory):
                raise NotADirectoryError(f"{directory} is a file, not a directory; a store is written into a directory")
            if not replace:
                raise FileExistsError(f"{directory} is not empty; a new store needs a new or empty directory")
            try:
                foreign = foreign_entries(directory)
            except FileNotFoundError:
                continue  # another saver moved it aside meanwhile
            if foreign:
                raise FileExistsError(f"{directory} holds files that are not a store's ({foreign[:3]}); "
                                      "save into a new or empty directory")
            old = staging.with_name(f"{staging.name}.old{len(old_ones)}")
            try:
                os.rename(directory, old)
            except FileNotFoundError:
                continue
            old_ones.append(old)
        raise OSError(f"could not place the store at {directory}: other processes kept replacing it")
    finally:
        for old in old_ones:
            shutil.rmtree(old, ignore_errors=True)


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
