"""Reference store: captured tensors flattened to one row per token position.

Captures arrive step-wise, as the reference model produced them::

    [ {module: [step_0 [1, L, E], step_1 [1, L+1, E] or [1, 1, E], ...]}, ... ]   # one dict per prompt

or already flat, ``{prompt_idx: {module: Tensor[P, E]}}``. The store flattens them
once into a packed ``[rows + 1, sum(E)]`` tensor per dtype: prompt ``p`` owns rows
``offsets[p] : offsets[p] + lengths[p]``, each module a column range, and the last
row is zeros. One ``index_select`` then serves every module of a whole batch, and
padding slots simply point at the zero row.

On disk: one safetensors file holding the packed tensors, the prompt token ids and
extra tensors (e.g. reference logits), with the JSON index in its header, plus the
same index as ``index.json`` for people and tools. Loading memory-maps the file,
so a store with thousands of prompts need not fit in RAM.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT_NAME = "fxreplace-reference"
FORMAT_VERSION = 1
TENSORS_FILE = "reference.safetensors"
INDEX_FILE = "index.json"


class CaptureError(ValueError):
    """Captures that cannot be flattened; the message names prompt, module and step."""


@dataclass(frozen=True)
class ModuleColumns:
    """Where one module's features live in the packed tensors."""

    group: int
    start: int
    stop: int

    @property
    def width(self) -> int:
        return self.stop - self.start


@dataclass
class ReferenceStore:
    """Flattened reference tensors plus what is needed to index and match them.

    ``prompt_ids[i]`` is the user's index of internal prompt ``i`` (list position
    for step-wise captures, the dict key for flat ones).
    """

    packed: list[torch.Tensor]
    columns: dict[str, ModuleColumns]
    prompt_ids: list[int]
    offsets: torch.Tensor
    lengths: torch.Tensor
    prompt_token_ids: list[list[int]] | None = None
    num_steps: list[int] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        self._by_prompt_id = {p: i for i, p in enumerate(self.prompt_ids)}

    @property
    def modules(self) -> list[str]:
        return list(self.columns)

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_ids)

    @property
    def zero_row(self) -> int:
        return self.packed[0].shape[0] - 1

    def feature_dim(self, module: str) -> int:
        return self.columns[module].width

    def dtype(self, module: str) -> torch.dtype:
        return self.packed[self.columns[module].group].dtype

    def rows(self, prompt_idx: int, module: str) -> torch.Tensor:
        """The ``[positions, E]`` reference of one prompt (by the user's index)."""
        i = self.internal_index(prompt_idx)
        col = self.columns[module]
        start = int(self.offsets[i])
        return self.packed[col.group][start : start + int(self.lengths[i]), col.start : col.stop]

    def internal_index(self, prompt_idx: int) -> int:
        """Internal row of a prompt given by the user's index."""
        try:
            return self._by_prompt_id[prompt_idx]
        except KeyError:
            raise KeyError(f"prompt {prompt_idx} is not in the reference store (prompts: {_preview(self.prompt_ids)})") from None

    def to(self, device: torch.device | str | None) -> "ReferenceStore":
        if device is None:
            return self
        return dataclasses.replace(
            self,
            packed=[p.to(device) for p in self.packed],
            offsets=self.offsets.to(device),
            lengths=self.lengths.to(device),
        )

    # ------------------------------------------------------------------ building

    @classmethod
    def from_captures(
        cls,
        captures: Sequence[Mapping[str, Any]] | Mapping[int, Mapping[str, Any]],
        *,
        prompt_token_ids: Sequence[Sequence[int]] | Mapping[int, Sequence[int]] | None = None,
        allow_nonfinite: bool = False,
        metadata: Mapping[str, Any] | None = None,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> "ReferenceStore":
        """Validate and flatten step-wise (list) or flat (dict) captures."""
        if isinstance(captures, Mapping):
            items = list(captures.items())
            for key, _ in items:
                if isinstance(key, bool) or not isinstance(key, int):
                    raise CaptureError(f"flat captures must be keyed by integer prompt index, got key {key!r}")
        elif isinstance(captures, Sequence) and not isinstance(captures, (str, bytes)):
            items = list(enumerate(captures))
        else:
            raise CaptureError(
                f"captures must be a list of {{module: [steps]}} dicts or a {{prompt_idx: {{module: Tensor}}}} dict, "
                f"got {type(captures).__name__}"
            )
        if not items:
            raise CaptureError("captures are empty: no prompts")

        first_prompt, first_modules = items[0]
        if not isinstance(first_modules, Mapping) or not first_modules:
            raise CaptureError(f"prompt {first_prompt}: expected a non-empty {{module: tensors}} dict, got {first_modules!r:.80}")
        modules = list(first_modules)
        flat: dict[str, list[torch.Tensor]] = {m: [] for m in modules}
        lengths: list[int] = []
        num_steps: list[int] = []
        for prompt, per_module in items:
            if not isinstance(per_module, Mapping):
                raise CaptureError(f"prompt {prompt}: expected a {{module: tensors}} dict, got {type(per_module).__name__}")
            missing = [m for m in modules if m not in per_module]
            extra = [m for m in per_module if m not in flat]
            if missing or extra:
                raise CaptureError(
                    f"prompt {prompt}: modules differ from prompt {first_prompt}: "
                    f"missing {missing}, unexpected {extra}"
                )
            prompt_len = None
            for m in modules:
                rows, steps = _flatten_one(prompt, m, per_module[m])
                if prompt_len is not None and rows.shape[0] != prompt_len[1]:
                    raise CaptureError(
                        f"prompt {prompt}: module {m!r} has {rows.shape[0]} positions but "
                        f"module {prompt_len[0]!r} has {prompt_len[1]}"
                    )
                prompt_len = (m, rows.shape[0])
                ref = flat[m][0] if flat[m] else None
                if ref is not None and (rows.shape[1] != ref.shape[1] or rows.dtype != ref.dtype):
                    raise CaptureError(
                        f"prompt {prompt}: module {m!r} has feature dim {rows.shape[1]} ({rows.dtype}) but "
                        f"prompt {first_prompt} has {ref.shape[1]} ({ref.dtype})"
                    )
                flat[m].append(rows)
            lengths.append(prompt_len[1])
            num_steps.append(steps)

        prompt_ids = [p for p, _ in items]
        columns, packed = _pack(flat, lengths)
        store = cls(
            packed=packed,
            columns=columns,
            prompt_ids=prompt_ids,
            offsets=_offsets(lengths),
            lengths=torch.tensor(lengths, dtype=torch.long),
            prompt_token_ids=_align_token_ids(prompt_token_ids, prompt_ids),
            num_steps=num_steps,
            metadata=dict(metadata or {}),
            extras=dict(extras or {}),
        )
        if not allow_nonfinite:
            store.check_finite()
        return store

    def check_finite(self) -> None:
        """Raise naming the first prompt, module and position holding NaN or Inf."""
        for group, packed in enumerate(self.packed):
            bad_rows = (~torch.isfinite(packed)).any(dim=1).nonzero()
            if bad_rows.numel() == 0:
                continue
            row = int(bad_rows[0])
            i = int(torch.searchsorted(self.offsets, torch.tensor(row), right=True)) - 1
            bad_cols = (~torch.isfinite(packed[row])).nonzero()
            col = int(bad_cols[0])
            module = next(m for m, c in self.columns.items() if c.group == group and c.start <= col < c.stop)
            raise CaptureError(
                f"prompt {self.prompt_ids[i]}, module {module!r}, position {row - int(self.offsets[i])}: "
                f"capture holds NaN or Inf (pass allow_nonfinite=True to accept it)"
            )

    # ------------------------------------------------------------------ disk

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``reference.safetensors`` (tensors + index) and ``index.json``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {f"packed.{g}": p.contiguous() for g, p in enumerate(self.packed)}
        tensors["prompt.offsets"] = self.offsets.cpu()
        tensors["prompt.lengths"] = self.lengths.cpu()
        if self.prompt_token_ids is not None:
            tensors["tokens.values"] = torch.tensor([t for ids in self.prompt_token_ids for t in ids], dtype=torch.long)
            tensors["tokens.offsets"] = _offsets([len(ids) for ids in self.prompt_token_ids])
        for name, t in self.extras.items():
            tensors[f"extra.{name}"] = t.contiguous()
        index = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "modules": {m: [c.group, c.start, c.stop] for m, c in self.columns.items()},
            "groups": [str(p.dtype).removeprefix("torch.") for p in self.packed],
            "prompts": self.prompt_ids,
            "num_steps": self.num_steps,
            "has_token_ids": self.prompt_token_ids is not None,
            "extras": sorted(self.extras),
            "metadata": self.metadata,
        }
        text = json.dumps(index)
        tmp = directory / (TENSORS_FILE + ".tmp")
        save_file({k: v.cpu() for k, v in tensors.items()}, str(tmp), metadata={"fxreplace_index": text})
        os.replace(tmp, directory / TENSORS_FILE)
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
        return directory

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ReferenceStore":
        """Memory-map a store written by :meth:`save` (a directory or its .safetensors file)."""
        path = Path(path)
        file = path / TENSORS_FILE if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no reference store at {path} (expected {file})")
        with safe_open(str(file), framework="pt") as f:
            header = f.metadata() or {}
            if "fxreplace_index" not in header:
                raise CaptureError(f"{file} is a safetensors file but not an fxreplace reference store (no index in its header)")
            index = json.loads(header["fxreplace_index"])
            if index.get("format") != FORMAT_NAME or index.get("version") != FORMAT_VERSION:
                raise CaptureError(f"{file}: unsupported format {index.get('format')!r} version {index.get('version')!r}")
            packed = [f.get_tensor(f"packed.{g}") for g in range(len(index["groups"]))]
            token_ids = None
            if index["has_token_ids"]:
                values, offs = f.get_tensor("tokens.values"), f.get_tensor("tokens.offsets")
                token_ids = [values[int(offs[i]) : int(offs[i + 1])].tolist() for i in range(len(offs) - 1)]
            extras = {name: f.get_tensor(f"extra.{name}") for name in index["extras"]}
            lengths = f.get_tensor("prompt.lengths")
            offsets = f.get_tensor("prompt.offsets")
        return cls(
            packed=packed,
            columns={m: ModuleColumns(*c) for m, c in index["modules"].items()},
            prompt_ids=list(index["prompts"]),
            offsets=offsets,
            lengths=lengths,
            prompt_token_ids=token_ids,
            num_steps=index["num_steps"],
            metadata=index["metadata"],
            extras=extras,
        )


# ---------------------------------------------------------------------- helpers


def _flatten_one(prompt: int, module: str, value: Any) -> tuple[torch.Tensor, int]:
    """Rows ``[positions, E]`` of one (prompt, module) and the number of steps."""
    where = f"prompt {prompt}, module {module!r}"
    if isinstance(value, torch.Tensor):
        if value.dim() != 2:
            raise CaptureError(f"{where}: a flat capture must be [positions, E], got shape {tuple(value.shape)}")
        if value.shape[0] == 0:
            raise CaptureError(f"{where}: flat capture has no positions")
        return value, 1
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
    return torch.cat(rows), len(value)


def _pack(flat: dict[str, list[torch.Tensor]], lengths: list[int]) -> tuple[dict[str, ModuleColumns], list[torch.Tensor]]:
    """One ``[rows + 1, sum(E)]`` tensor per dtype; the last row stays zero."""
    total = sum(lengths)
    groups: dict[torch.dtype, list[str]] = {}
    for m, rows in flat.items():
        groups.setdefault(rows[0].dtype, []).append(m)
    columns, packed = {}, []
    for g, (dtype, names) in enumerate(groups.items()):
        width = sum(flat[m][0].shape[1] for m in names)
        out = torch.zeros(total + 1, width, dtype=dtype)
        start = 0
        for m in names:
            stop = start + flat[m][0].shape[1]
            out[:total, start:stop] = torch.cat(flat[m])
            columns[m] = ModuleColumns(g, start, stop)
            start = stop
        packed.append(out)
    return columns, packed


def _offsets(lengths: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.long)
    torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0, out=out[1:])
    return out


def _align_token_ids(token_ids, prompt_ids: list[int]) -> list[list[int]] | None:
    """Token ids per internal prompt, from a list aligned with the prompts or a dict by prompt index."""
    if token_ids is None:
        return None
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist() if token_ids.dim() == 2 else [token_ids.tolist()]
    if isinstance(token_ids, Mapping):
        missing = [p for p in prompt_ids if p not in token_ids]
        if missing:
            raise CaptureError(f"prompt_token_ids lacks prompts {_preview(missing)}")
        seqs = [token_ids[p] for p in prompt_ids]
    else:
        seqs = list(token_ids)
        if len(seqs) != len(prompt_ids):
            raise CaptureError(f"got {len(seqs)} prompt_token_ids for {len(prompt_ids)} prompts in the captures")
    out = []
    for p, ids in zip(prompt_ids, seqs):
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if isinstance(ids, list) and ids and isinstance(ids[0], list):  # [1, L] batch of one
            if len(ids) != 1:
                raise CaptureError(f"prompt {p}: token ids have batch size {len(ids)}, expected 1")
            ids = ids[0]
        if not ids:
            raise CaptureError(f"prompt {p}: token ids are empty")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if bad:
            raise CaptureError(f"prompt {p}: token ids must be non-negative integers, got {bad[:5]}")
        out.append(ids)
    return out


def _preview(items: Sequence, n: int = 8) -> str:
    items = list(items)
    return ", ".join(map(str, items[:n])) + (f", ... ({len(items)} in all)" if len(items) > n else "")


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
