"""Reference store: captured tensors flattened to one row per token position.

Captures arrive step-wise, as the reference model produced them::

    [ {capture_name: [step_0 [1, L, E], step_1 [1, L+1, E] or [1, 1, E], ...]}, ... ]   # one dict per prompt

or already flat, ``{prompt_idx: {capture_name: Tensor[P, E]}}``. A *capture name* is
the name a reference tensor is stored under (e.g. ``"model.layers.0.mlp.gate"``).
The store flattens them into *groups*: the capture names of one (dtype, width) share
one name-major tensor ``[capture names, rows + 1, E]``. Prompt ``p`` owns rows
``offsets[p] : offsets[p] + lengths[p]`` of every capture name and the last row is
zeros, so one ``index_select`` on the row dimension serves every capture name of a
group for a whole batch (padding slots point at the zero row) and each name's result
is a contiguous ``[T, E]`` tensor.

A store is one or more *shards*. Each shard is a self-contained safetensors file:
its groups, its prompts' row offsets/lengths, token ids and per-prompt extras (e.g.
generated tokens and logits), and a JSON index in its header with a SHA-256 digest
of every tensor. A directory store lists its shards in ``index.json``. Loading reads
headers and the per-prompt tables only (O(index)) and memory-maps the groups; the
index is validated against the tensors' metadata, never by reading the rows.
:class:`StoreWriter` streams prompts into shards as they finish; :func:`merge_stores`
combines stores captured by several engines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pickle
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .matching import TokenTable

FORMAT_NAME = "fxreplace-reference"
FORMAT_VERSION = 2
TENSORS_FILE = "reference.safetensors"
INDEX_FILE = "index.json"
SHARD_PATTERN = "shard-{:05d}.safetensors"
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
    """Capture names sharing one ``[len(capture_names), rows + 1, width]`` tensor."""

    dtype: torch.dtype
    width: int
    capture_names: tuple[str, ...]


@dataclass
class Shard:
    """One file's (or one in-memory build's) tensors. ``packed[g]`` is ``[M_g, rows + 1, E_g]``;
    ``extras[name]`` is ``(values, offsets)``: prompt ``j`` of the shard owns
    ``values[offsets[j] : offsets[j + 1]]``."""

    packed: list[torch.Tensor]
    rows: int
    extras: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    path: Path | None = None

    @property
    def zero_row(self) -> int:
        return self.rows


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
        return shard.packed[col.group][col.index, start : start + int(self.lengths[i])]

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
        try:
            return self._by_prompt_id[prompt_idx]
        except KeyError:
            raise KeyError(f"prompt {prompt_idx} is not in the reference store (prompts: {_preview(self.prompt_ids)})") from None

    def with_token_ids(self, token_ids: Sequence[Sequence[int]] | Mapping[int, Sequence[int]]) -> "ReferenceStore":
        """The same rows matched by other token ids (checked like captured ones)."""
        seqs = _align(token_ids, self.prompt_ids, "prompt_token_ids")
        prefill = self.prefill or [None] * self.num_prompts
        checked = [_check_token_ids(p, ids, pre) for p, ids, pre in zip(self.prompt_ids, seqs, prefill)]
        return dataclasses.replace(self, prompt_token_ids=TokenTable.from_lists(checked))

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
    ) -> "ReferenceStore":
        """Validate and flatten step-wise (list) or flat (dict) captures.

        ``extras``: per-prompt tensors, ``{name: [one tensor per prompt]}`` (or a dict by
        prompt index); prompt ``p``'s tensor comes back from :meth:`extra`.
        """
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
        prompt_ids = [p for p, _ in items]
        token_ids = _align(prompt_token_ids, prompt_ids, "prompt_token_ids")
        per_prompt_extras = {name: _align(values, prompt_ids, f"extras[{name!r}]") for name, values in (extras or {}).items()}
        builder = _ShardBuilder(allow_nonfinite=allow_nonfinite)
        for n, (prompt, per_name) in enumerate(items):
            builder.add(prompt, per_name, None if token_ids is None else token_ids[n],
                        {name: values[n] for name, values in per_prompt_extras.items()})
        return builder.build_store(metadata)

    def check_finite(self, chunk_rows: int = 4096) -> None:
        """Read every row (in chunks); raise naming the first prompt, capture name and position holding NaN or Inf."""
        shard_of = self.prompt_shard.tolist()
        for s, shard in enumerate(self.shards):
            members = [i for i, k in enumerate(shard_of) if k == s]
            starts = self.offsets[members]
            for grp, packed in zip(self.groups, shard.packed):
                for a in range(0, shard.rows, chunk_rows):
                    bad = (~torch.isfinite(packed[:, a : min(a + chunk_rows, shard.rows)])).any(dim=2).nonzero()
                    if bad.numel():
                        name, row = grp.capture_names[int(bad[0, 0])], a + int(bad[0, 1])
                        j = int(torch.searchsorted(starts, torch.tensor(row), right=True)) - 1
                        raise CaptureError(
                            f"prompt {self.prompt_ids[members[j]]}, capture {name!r}, position {row - int(starts[j])}: "
                            f"capture holds NaN or Inf (pass allow_nonfinite=True to accept it)"
                        )

    # ------------------------------------------------------------------ disk

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the shards (one: ``reference.safetensors``) and ``index.json`` listing them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        single = len(self.shards) == 1
        files = []
        for s in range(len(self.shards)):
            name = TENSORS_FILE if single else SHARD_PATTERN.format(s)
            tensors, index = self._shard_content(s)
            _write_shard(directory / name, tensors, index)
            files.append((name, index))
        _write_index(directory, files, self.groups, self.metadata)
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
            self.prompt_token_ids is not None, list(shard.extras), self.metadata, self.finite_checked,
        )
        return tensors, index

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ReferenceStore":
        """Memory-map a store: a directory (``index.json`` and its shards) or one shard file.

        Reads headers and per-prompt tables only; every field of the index is checked
        against the tensors' metadata and errors name the file and the field.
        """
        path = Path(path)
        if path.is_dir():
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
        return _assemble([_load_shard(f, ids) for f, ids in zip(shard_files, prompt_ids)])

    def verify(self) -> dict[str, Any]:
        """Read every byte of every shard: compare each tensor's SHA-256 with the digest
        recorded at write, then check every row is finite unless the writer allowed
        otherwise. Raises :class:`StoreError` naming the file and tensor; returns a summary."""
        if any(s.path is None for s in self.shards):
            raise ValueError("verify() checks files on disk; this store was built in memory")
        checked_bytes = 0
        for shard in self.shards:
            header, data_start, _ = _read_header(shard.path)
            digests = json.loads(header["__metadata__"]["fxreplace_index"]).get("digests", {})
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
        if self.finite_checked:
            self.check_finite()
        return {"shards": len(self.shards), "bytes": checked_bytes, "prompts": self.num_prompts,
                "finite": self.finite_checked}


# ---------------------------------------------------------------------- building shards


class _ShardBuilder:
    """Accumulates validated prompts; packs them into a :class:`Shard`.

    The first prompt fixes the layout (capture names, dtypes, widths); every later prompt
    must match it. Used by :meth:`ReferenceStore.from_captures` (one shard in memory)
    and :class:`StoreWriter` (one shard per file).
    """

    def __init__(self, allow_nonfinite: bool = False):
        self.allow_nonfinite = allow_nonfinite
        self.groups: list[Group] | None = None  # fixed by the first prompt (of the first shard)
        self.first_prompt: int | None = None
        self.has_token_ids: bool | None = None
        self.extra_names: set[str] | None = None
        self.prompt_ids: list[int] = []
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.lengths: list[int] = []
        self.num_steps: list[int] = []
        self.prefill: list[int | None] = []
        self.token_ids: list[list[int]] = []
        self.extras: dict[str, list[torch.Tensor]] = {}
        self.nbytes = 0

    def successor(self) -> "_ShardBuilder":
        """An empty builder for the next shard, bound to this one's layout."""
        nxt = _ShardBuilder(self.allow_nonfinite)
        nxt.groups, nxt.first_prompt, nxt.has_token_ids, nxt.extra_names = (
            self.groups, self.first_prompt, self.has_token_ids, self.extra_names)
        return nxt

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def add(self, prompt: int, per_name: Any, token_ids: Any, extras: Mapping[str, torch.Tensor]) -> None:
        if not isinstance(per_name, Mapping) or not per_name:
            raise CaptureError(f"prompt {prompt}: expected a non-empty {{capture_name: tensors}} dict, got {per_name!r:.80}")
        flat, steps, prefill = {}, None, None
        prompt_len = None
        for m, value in per_name.items():
            rows, steps, prefill = _flatten_one(prompt, m, value)
            if prompt_len is not None and rows.shape[0] != prompt_len[1]:
                raise CaptureError(
                    f"prompt {prompt}: capture {m!r} has {rows.shape[0]} positions but capture {prompt_len[0]!r} has {prompt_len[1]}"
                )
            prompt_len = (m, rows.shape[0])
            flat[m] = rows
        groups = self.groups or _layout(flat)
        self._check_layout(prompt, flat, groups, self.first_prompt if self.groups else prompt)
        if not self.allow_nonfinite:
            for m, rows in flat.items():
                bad = (~torch.isfinite(rows)).any(dim=1).nonzero()
                if bad.numel():
                    raise CaptureError(
                        f"prompt {prompt}, capture {m!r}, position {int(bad[0])}: capture holds NaN or Inf "
                        f"(pass allow_nonfinite=True to accept it)"
                    )
        if self.has_token_ids is not None and (token_ids is not None) != self.has_token_ids:
            raise CaptureError(f"prompt {prompt}: token ids must be given for every prompt or for none")
        ids = None
        if token_ids is not None:
            ids = _check_token_ids(prompt, token_ids, prefill)
        extras = dict(extras)
        if self.extra_names is not None and set(extras) != self.extra_names:
            raise CaptureError(f"prompt {prompt}: extras {sorted(extras)} differ from the first prompt's {sorted(self.extra_names)}")
        for name, t in extras.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise CaptureError(f"prompt {prompt}: extra {name!r} must be a tensor with a leading per-item dim, got {t!r:.60}")
        # all checks passed: record the prompt
        if self.groups is None:
            self.groups, self.first_prompt = groups, prompt
        self.has_token_ids, self.extra_names = ids is not None, set(extras)
        if ids is not None:
            self.token_ids.append(ids)
        for name, t in extras.items():
            self.extras.setdefault(name, []).append(t.detach().cpu())
            self.nbytes += t.numel() * t.element_size()  # extras (e.g. logits) count toward the shard size
        for m, rows in flat.items():
            self.rows.setdefault(m, []).append(rows.detach())
            self.nbytes += rows.numel() * rows.element_size()
        self.prompt_ids.append(prompt)
        self.lengths.append(prompt_len[1])
        self.num_steps.append(steps)
        self.prefill.append(prefill)

    @staticmethod
    def _check_layout(prompt: int, flat: Mapping[str, torch.Tensor], groups: list[Group], first_prompt: int) -> None:
        expected = {m: (g.dtype, g.width) for g in groups for m in g.capture_names}
        missing = [m for m in expected if m not in flat]
        extra = [m for m in flat if m not in expected]
        if missing or extra:
            raise CaptureError(f"prompt {prompt}: capture names differ from prompt {first_prompt}: missing {missing}, unexpected {extra}")
        for m, rows in flat.items():
            dtype, width = expected[m]
            if rows.shape[1] != width or rows.dtype != dtype:
                raise CaptureError(
                    f"prompt {prompt}: capture {m!r} has feature dim {rows.shape[1]} ({rows.dtype}) but "
                    f"prompt {first_prompt} has {width} ({dtype})"
                )

    def build_shard(self) -> Shard:
        total = sum(self.lengths)
        packed = []
        for g in self.groups:
            out = torch.empty(len(g.capture_names), total + 1, g.width, dtype=g.dtype)
            for i, m in enumerate(g.capture_names):
                torch.cat(self.rows.pop(m), out=out[i, :total])  # pop: hold each capture's rows once
            out[:, total].zero_()
            packed.append(out)
        extras = {}
        for name, values in self.extras.items():
            try:
                extras[name] = (torch.cat(values), _offsets([v.shape[0] for v in values]))
            except RuntimeError as e:
                raise CaptureError(f"extra {name!r}: per-prompt tensors do not concatenate: {e}") from None
        return Shard(packed, total, extras)

    def build_store(self, metadata: Mapping[str, Any] | None) -> ReferenceStore:
        shard = self.build_shard()
        return ReferenceStore(
            groups=self.groups,
            shards=[shard],
            prompt_ids=list(self.prompt_ids),
            prompt_shard=torch.zeros(len(self.prompt_ids), dtype=torch.long),
            offsets=_offsets(self.lengths)[:-1],
            lengths=torch.tensor(self.lengths, dtype=torch.long),
            prompt_token_ids=self.token_ids if self.has_token_ids else None,
            num_steps=list(self.num_steps),
            prefill=list(self.prefill),
            metadata=dict(metadata or {}),
            finite_checked=not self.allow_nonfinite,
        )


def _layout(flat: Mapping[str, torch.Tensor]) -> list[Group]:
    """Modules grouped by (dtype, width), in first-seen order."""
    groups: dict[tuple[torch.dtype, int], list[str]] = {}
    for m, rows in flat.items():
        groups.setdefault((rows.dtype, rows.shape[1]), []).append(m)
    return [Group(dtype, width, tuple(names)) for (dtype, width), names in groups.items()]


def _flatten_one(prompt: int, name: str, value: Any) -> tuple[torch.Tensor, int, int | None]:
    """Rows ``[positions, E]`` of one (prompt, capture name), the number of steps and the
    prefill length (None for flat captures, whose rows may include generated positions)."""
    where = f"prompt {prompt}, capture {name!r}"
    if isinstance(value, torch.Tensor):
        if value.dim() != 2:
            raise CaptureError(f"{where}: a flat capture must be [positions, E], got shape {tuple(value.shape)}")
        if value.shape[0] == 0:
            raise CaptureError(f"{where}: flat capture has no positions")
        return value, 1, None
    if not isinstance(value, (list, tuple)) or not value:
        raise CaptureError(f"{where}: expected a non-empty list of step tensors, got {type(value).__name__}")
    rows = []
    prompt_len = None
    for step, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            raise CaptureError(f"{where}, step {step}: expected a tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise CaptureError(f"{where}, step {step}: expected [1, tokens, E], got rank {t.dim()} shape {tuple(t.shape)}")
        if t.shape[0] != 1:
            raise CaptureError(f"{where}, step {step}: batch dim must be 1, got shape {tuple(t.shape)}")
        if step == 0:
            if t.shape[1] == 0:
                raise CaptureError(f"{where}, step 0: prefill has no tokens")
            prompt_len = t.shape[1]
            rows.append(t[0])
            continue
        if t.shape[2] != value[0].shape[2]:
            raise CaptureError(f"{where}, step {step}: feature dim {t.shape[2]} differs from step 0's {value[0].shape[2]}")
        if t.shape[1] == prompt_len + step:  # full recompute: only the last row is new
            rows.append(t[0, -1:])
        elif t.shape[1] == 1:  # KV-cache form
            rows.append(t[0])
        else:
            raise CaptureError(
                f"{where}, step {step}: decode step has {t.shape[1]} tokens; expected "
                f"{prompt_len + step} (full recompute) or 1 (KV cache)"
            )
    return torch.cat(rows), len(value), prompt_len


def _offsets(lengths: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.long)
    torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0, out=out[1:])
    return out


def _align(values: Any, prompt_ids: list[int], what: str) -> list | None:
    """Per-prompt values from a list aligned with the prompts or a dict by prompt index."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        values = list(values) if values.dim() == 2 else [values]
    if isinstance(values, Mapping):
        missing = [p for p in prompt_ids if p not in values]
        if missing:
            raise CaptureError(f"{what} lacks prompts {_preview(missing)}")
        return [values[p] for p in prompt_ids]
    values = list(values)
    if len(values) != len(prompt_ids):
        raise CaptureError(f"got {len(values)} {what} for {len(prompt_ids)} prompts in the captures")
    return values


def _check_token_ids(prompt: int, ids: Any, prefill: int | None) -> np.ndarray:
    """A prompt's token ids as a 1-D int64 array of non-negative ids; floats are refused, never
    truncated, and so are fewer ids than the captured prefill (a request differing at a later
    position would get this prompt's rows)."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise CaptureError(f"prompt {prompt}: token ids must be integers, got dtype {ids.dtype}")
        ids = ids.detach().cpu().numpy()
    elif isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise CaptureError(f"prompt {prompt}: token ids must be integers, got dtype {ids.dtype}")
    else:
        ids = list(ids)
        arr = np.asarray(ids) if ids else np.zeros(0, np.int64)
        if arr.dtype.kind not in "iu":  # floats, bools, strings, mixed or huge values
            bad = [t for t in (x for row in ids for x in (row if isinstance(row, list) else [row]))
                   if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
            raise CaptureError(f"prompt {prompt}: token ids must be non-negative integers, got {bad[:5]}")
        ids = arr
    if ids.ndim == 2:  # [1, L] batch of one
        if ids.shape[0] != 1:
            raise CaptureError(f"prompt {prompt}: token ids have batch size {ids.shape[0]}, expected 1")
        ids = ids[0]
    if ids.ndim != 1 or ids.size == 0:
        raise CaptureError(f"prompt {prompt}: token ids are empty" if ids.size == 0 else
                           f"prompt {prompt}: token ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.min() < 0:
        raise CaptureError(f"prompt {prompt}: token ids must be non-negative integers, got {ids[ids < 0][:5].tolist()}")
    if prefill is not None and ids.size < prefill:
        raise CaptureError(f"prompt {prompt}: {ids.size} token ids but the capture's prefill covers {prefill} positions")
    return ids.astype(np.int64, copy=False)


def _preview(items: Sequence, n: int = 8) -> str:
    items = list(items)
    return ", ".join(map(str, items[:n])) + (f", ... ({len(items)} in all)" if len(items) > n else "")


# ---------------------------------------------------------------------- writing files


def _shard_index(groups, prompts, num_steps, prefill, has_token_ids, extras, metadata, finite_checked) -> dict:
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "groups": [{"dtype": str(g.dtype).removeprefix("torch."), "width": g.width, "modules": list(g.capture_names)} for g in groups],
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


def _write_index(directory: Path, shards: Sequence[tuple[str, dict]], groups: list[Group], metadata: Mapping) -> None:
    """``index.json``: the shard files in order with their prompts (the loader's list), plus a readable summary."""
    index = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "shards": [{"file": name, "prompts": idx["prompts"]} for name, idx in shards],
        "modules": {m: [str(g.dtype).removeprefix("torch."), g.width] for g in groups for m in g.capture_names},
        "metadata": dict(metadata),
    }
    tmp = directory / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, directory / INDEX_FILE)


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
            raise FileExistsError(f"{self.directory} is not empty; a store writer needs a new or empty directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        probe = self.directory / ".fxreplace-write-test"
        try:
            probe.write_bytes(b"")
            probe.unlink()
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
            self._closed = True
        return self.directory

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()


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
        import shutil

        shutil.copyfile(src, dst)


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


def _load_shard(file: Path, prompt_ids: list[int] | None) -> tuple[dict, Shard, dict]:
    """Validate one shard from its metadata and per-prompt tables, then memory-map it."""
    where = _describe(file)
    header, data_start, size = _read_header(file)
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
    specs = _check_tensor_entries(where, header, size - data_start)

    def need(cond: bool, fld: str, msg) -> None:
        """``msg``: a string, or a function making it (when it is costly or only valid on failure)."""
        if not cond:
            raise StoreError(f"{where}: field {fld!r}: {msg() if callable(msg) else msg}")

    def spec(name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        need(name in specs, name, "the index needs this tensor but the file has none")
        return specs[name]

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
    with safe_open(str(file), framework="pt") as f:
        offsets, lengths = f.get_tensor("prompt.offsets"), f.get_tensor("prompt.lengths")
        need(bool((lengths >= 1).all()), "prompt.lengths",
             lambda: f"prompt {prompts[int((lengths < 1).nonzero()[0])]} has {int(lengths.min())} rows")
        rows = int(lengths.sum())
        starts = _offsets(lengths.tolist())[:-1]
        if not torch.equal(offsets, starts):
            j = int((offsets != starts).nonzero()[0])
            raise StoreError(f"{where}: field 'prompt.offsets': prompt {prompts[j]} starts at row {int(offsets[j])} but "
                             f"prompts are packed back to back, so it must start at {int(starts[j])} (overlapping or gapped rows)")

        groups = []
        seen_names = set()
        for g, grp in enumerate(index["groups"]):
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
            want_shape = (len(grp["modules"]), rows + 1, grp["width"])
            need(got_dtype == dtype, f"group.{g}", f"the tensor is {got_dtype} but the index says {dtype}")
            need(got_shape == want_shape, f"group.{g}",
                 f"shape {list(got_shape)} but the index needs [modules={want_shape[0]}, rows+1={want_shape[1]}, "
                 f"width={want_shape[2]}] ({num_prompts} prompts of {rows} rows in all)")
            groups.append(Group(dtype, grp["width"], tuple(grp["modules"])))
        need(bool(groups), "groups", "the shard holds no capture names")
        stray = sorted(n for n in specs if n.startswith("group.") and n not in {f"group.{g}" for g in range(len(groups))})
        need(not stray, "groups", f"tensors {stray} are not in the index")

        lengths_list = lengths.tolist()
        num_steps, prefill = index.get("num_steps"), index.get("prefill")
        for key, value in (("num_steps", num_steps), ("prefill", prefill)):
            need(isinstance(value, list) and len(value) == num_prompts, key, f"expected a list of {num_prompts} entries")
        for p, n, steps, pre in zip(prompts, lengths_list, num_steps, prefill):
            if not (isinstance(steps, int) and steps >= 1):
                need(False, "num_steps", f"prompt {p}: {steps!r} is not a step count")
            if pre is not None and not (isinstance(pre, int) and pre >= 1 and pre + steps - 1 == n):
                need(False, "prefill", f"prompt {p}: a prefill of {pre} positions plus {steps - 1} decode steps is not its {n} rows")

        token_ids = None
        if index["has_token_ids"]:
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
            token_ids = TokenTable(values.numpy(), toffs.numpy())

        extras = {}
        for name in index["extras"]:
            vfld, ofld = f"extra.{name}.values", f"extra.{name}.offsets"
            vdtype, vshape = spec(vfld)
            need(len(vshape) >= 1, vfld, "an extra needs a leading per-item dimension")
            need(spec(ofld) == (torch.int64, (num_prompts + 1,)), ofld, f"expected int64 [{num_prompts + 1}]")
            eoffs = f.get_tensor(ofld)
            need(int(eoffs[0]) == 0 and int(eoffs[-1]) == vshape[0] and bool((eoffs.diff() >= 0).all()), ofld,
                 lambda: f"must rise from 0 to {vshape[0]}, got {_preview(eoffs.tolist())}")
            extras[name] = (f.get_tensor(vfld), eoffs)
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


def _assemble(loaded: list[tuple[dict, Shard, dict]]) -> ReferenceStore:
    first, _, _ = loaded[0]
    first_file = loaded[0][1].path
    for table, shard, _ in loaded[1:]:
        where = _describe(shard.path)
        if table["groups"] != first["groups"]:
            raise StoreError(f"{where}: field 'groups': capture names, dtypes or widths differ from {first_file}")
        if (table["token_ids"] is None) != (first["token_ids"] is None):
            raise StoreError(f"{where}: field 'has_token_ids' differs from {first_file}")
        if set(shard.extras) != set(loaded[0][1].extras):
            raise StoreError(f"{where}: field 'extras' {sorted(shard.extras)} differs from {first_file}'s {sorted(loaded[0][1].extras)}")
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
        tables = [t["token_ids"] for t, _, _ in loaded]
        starts = np.cumsum([0] + [tb.values.size for tb in tables[:-1]])
        token_ids = TokenTable(np.concatenate([tb.values for tb in tables]),
                               np.concatenate([tb.offsets[:-1] + s0 for tb, s0 in zip(tables, starts)] + [[sum(tb.values.size for tb in tables)]]))
    return ReferenceStore(
        groups=first["groups"],
        shards=[s for _, s, _ in loaded],
        prompt_ids=prompt_ids,
        prompt_shard=torch.cat([torch.full((len(t["prompts"]),), k, dtype=torch.long) for k, (t, _, _) in enumerate(loaded)]),
        offsets=torch.cat([t["offsets"] for t, _, _ in loaded]),
        lengths=torch.cat([t["lengths"] for t, _, _ in loaded]),
        prompt_token_ids=token_ids,
        num_steps=[n for t, _, _ in loaded for n in t["num_steps"]],
        prefill=[n for t, _, _ in loaded for n in t["prefill"]],
        metadata=first["metadata"],
        finite_checked=all(t["finite_checked"] for t, _, _ in loaded),
    )


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


# ---------------------------------------------------------------------- legacy files


def load_legacy(path: str | os.PathLike) -> Any:
    """Read a ``torch.save`` file of the existing tool with ``weights_only=True``.

    A pickle that needs anything beyond tensors and plain containers is refused
    (never executed): reference files may be handed to a server by path.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CaptureError(
            f"refusing to load {path}: it is not a plain tensors/containers pickle and loading it would run "
            f"arbitrary code. Re-save it with fxreplace.save_reference (safetensors). Details: {str(e).splitlines()[0]}"
        ) from None


def load_captures(path: str | os.PathLike) -> ReferenceStore | Any:
    """A reference store (directory or .safetensors) or legacy captures (torch.save)."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".safetensors":
        return ReferenceStore.load(path)
    return load_legacy(path)


def load_token_ids(path: str | os.PathLike) -> list[list[int]]:
    """Prompt token ids from JSON (a list of lists) or a legacy torch.save file."""
    path = Path(path)
    if path.suffix == ".json":
        data = json.loads(path.read_text())
    elif path.is_dir() or path.suffix == ".safetensors":
        data = ReferenceStore.load(path).prompt_token_ids
        if data is None:
            raise CaptureError(f"reference store {path} holds no prompt token ids")
    else:
        data = load_legacy(path)
    if isinstance(data, torch.Tensor):
        data = data.tolist()
    if not isinstance(data, list):
        raise CaptureError(f"{path}: expected a list of token id lists, got {type(data).__name__}")
    return [ids.tolist() if isinstance(ids, torch.Tensor) else ids for ids in data]
