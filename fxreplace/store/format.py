"""The store's file format and the checks on it: names, constants, the in-memory layout
(:class:`Group`, :class:`Shard`), shard headers written and read back with their digests.
:mod:`fxreplace.store.rules` holds the consistency rules on metadata and extras,
:mod:`fxreplace.store.publish` how a whole store directory is placed.

The lowest layer of :mod:`fxreplace.store`: it imports nothing else from the package.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors.torch import save_file

from ..dtypes import dtype_name
from ..errors import CaptureError, StoreError

FORMAT_NAME = "fxreplace-reference"
FORMAT_VERSION = 3  # 3: group tensors position-major [rows + 1, capture names, E] (2 was name-major)
TENSORS_FILE = "reference.safetensors"
INDEX_FILE = "index.json"
SHARD_PATTERN = "shard-{:05d}.safetensors"
WRITER_MARKER = ".fxreplace-writing"  # present while a StoreWriter owns the directory
_MAX_HEADER_BYTES = 256 << 20  # a header beyond this is not a store (safetensors itself caps at 100 MB)

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_TOKEN_DTYPES = (torch.int64, torch.int32)


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


def as_path(value, what: str) -> Path:
    """``value`` as a Path, refusing what is not a path (a number, None, a list)."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"{what} must be a path (str or os.PathLike), got {type(value).__name__} {value!r:.60}")
    return Path(value)
