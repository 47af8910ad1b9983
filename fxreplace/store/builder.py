"""Flattening captures into shards: every prompt is checked against the first one's layout
before anything of it is kept."""

from __future__ import annotations

import math
import mmap
from typing import Any, Mapping

import numpy as np
import torch

from .format import CaptureError, Group, Shard, _offsets, _preview
from .rules import check_extra_against_metadata, extra_layout, token_key

class _ShardBuilder:
    """Accumulates validated prompts; packs them into a :class:`Shard`.

    The first prompt fixes the layout (capture names, dtypes, widths, each extra's dtype and
    trailing shape); every later prompt must match it and the store's ``metadata`` (token ids
    below its ``vocab_size``, logits as wide), and no two prompts may have the same token ids.
    A refused prompt leaves nothing behind. Used by :meth:`ReferenceStore.from_captures` (one shard in memory)
    and :class:`StoreWriter` (one shard per file).
    """

    def __init__(self, allow_nonfinite: bool = False, metadata: Mapping[str, Any] | None = None):
        self.allow_nonfinite = allow_nonfinite
        self.metadata = dict(metadata or {})
        self.extra_layouts: dict[str, tuple] | None = None
        self.token_keys: dict[bytes, int] = {}  # every shard's prompts' token ids -> prompt (shared by successors)
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
        nxt = _ShardBuilder(self.allow_nonfinite, self.metadata)
        nxt.groups, nxt.first_prompt, nxt.has_token_ids, nxt.extra_names, nxt.extra_layouts, nxt.token_keys = (
            self.groups, self.first_prompt, self.has_token_ids, self.extra_names, self.extra_layouts, self.token_keys)
        return nxt

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def add(self, prompt: int, per_name: Any, token_ids: Any, extras: Mapping[str, torch.Tensor]) -> None:
        flat, length, steps, prefill = _flatten(prompt, per_name)
        groups = self.groups or _layout(flat)
        self._check_layout(prompt, flat, groups, self.first_prompt if self.groups else prompt)
        if not self.allow_nonfinite:
            _check_finite(prompt, flat)
        ids, key = self._checked_token_ids(prompt, token_ids, prefill)
        extras, layouts = self._checked_extras(prompt, extras)
        # all checks passed: record the prompt
        if self.groups is None:
            self.groups, self.first_prompt = groups, prompt
        self.has_token_ids, self.extra_names = ids is not None, set(extras)
        if self.extra_layouts is None:
            self.extra_layouts = layouts
        if ids is not None:
            self.token_ids.append(ids)
            self.token_keys[key] = prompt
        for name, t in extras.items():
            self.extras.setdefault(name, []).append(t.detach().cpu())
            self.nbytes += t.numel() * t.element_size()  # extras (e.g. logits) count toward the shard size
        for m, rows in flat.items():
            self.rows.setdefault(m, []).append(rows.detach())
            self.nbytes += rows.numel() * rows.element_size()
        self.prompt_ids.append(prompt)
        self.lengths.append(length)
        self.num_steps.append(steps)
        self.prefill.append(prefill)

    def _checked_token_ids(self, prompt: int, token_ids: Any, prefill) -> tuple[np.ndarray | None, Any]:
        """The prompt's token ids (None when not given) and their key, checked against the vocabulary and the
        prompts before it (given for every prompt or none, no two alike)."""
        if self.has_token_ids is not None and (token_ids is not None) != self.has_token_ids:
            raise CaptureError(f"prompt {prompt}: token ids must be given for every prompt or for none")
        if token_ids is None:
            return None, None
        ids = _check_token_ids(prompt, token_ids, prefill)
        vocab = self.metadata.get("vocab_size")
        if isinstance(vocab, int) and int(ids.max()) >= vocab:
            raise CaptureError(f"prompt {prompt}: token id {int(ids.max())} is not below the store's vocab_size {vocab}")
        key = token_key(ids)
        if key in self.token_keys:
            raise CaptureError(f"prompt {prompt} has the same token ids as prompt {self.token_keys[key]}: a request "
                               f"with these tokens could only ever get one of them; capture each prompt once")
        return ids, key

    def _checked_extras(self, prompt: int, extras: Any) -> tuple[dict, dict]:
        """The prompt's extras and each one's layout, checked against the first prompt's and the metadata."""
        if not isinstance(extras, Mapping):
            raise CaptureError(f"prompt {prompt}: extras must be a dict {{name: tensor}}, got {type(extras).__name__}")
        extras = dict(extras)
        if self.extra_names is not None and set(extras) != self.extra_names:
            raise CaptureError(f"prompt {prompt}: extras {sorted(extras)} differ from the first prompt's {sorted(self.extra_names)}")
        layouts = {}
        for name, t in extras.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise CaptureError(f"prompt {prompt}: extra {name!r} must be a tensor with a leading per-item dim, got {t!r:.60}")
            layouts[name] = extra_layout(t.dtype, t.shape)
            if self.extra_layouts is not None and layouts[name] != self.extra_layouts[name]:
                (dtype, shape), (want_dtype, want_shape) = layouts[name], self.extra_layouts[name]
                raise CaptureError(f"prompt {prompt}: extra {name!r} has {dtype} rows of shape {list(shape)} but prompt "
                                   f"{self.first_prompt} has {want_dtype} {list(want_shape)}")
            check_extra_against_metadata(name, layouts[name], self.metadata, f"prompt {prompt}")
        return extras, layouts

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
        """Pack the prompts (each capture's rows are released as they are packed: a shard is held once)."""
        total = sum(self.lengths)
        # every prompt's extras have one dtype and trailing shape (checked in add), so they concatenate
        extras = {name: (torch.cat(values), _offsets([v.shape[0] for v in values])) for name, values in self.extras.items()}
        packed = []
        for g in self.groups:
            out = _rows_table((total + 1, len(g.capture_names), g.width), g.dtype)
            for i, m in enumerate(g.capture_names):
                torch.cat(self.rows.pop(m), out=out[:total, i])  # pop: hold each capture's rows once
            out[total].zero_()
            packed.append(out)
        return Shard(packed, total, extras)


_HUGE_PAGE = 2 << 20



def _flatten(prompt: int, per_name: Any) -> tuple[dict[str, torch.Tensor], int, Any, Any]:
    """The prompt's captures as ``{name: [T, E] rows}``, their positions ``T`` (the same for every capture) and
    the steps and prefill length they were captured in."""
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
    return flat, prompt_len[1], steps, prefill


def _check_finite(prompt: int, flat: Mapping[str, torch.Tensor]) -> None:
    """Refuse a capture holding NaN or Inf, naming its first such position."""
    for m, rows in flat.items():
        bad = (~torch.isfinite(rows)).any(dim=1).nonzero()
        if bad.numel():
            raise CaptureError(
                f"prompt {prompt}, capture {m!r}, position {int(bad[0])}: capture holds NaN or Inf "
                f"(pass allow_nonfinite=True to accept it)"
            )


def _rows_table(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor for a group's rows, on transparent huge pages where the
    OS grants them on request (Linux THP in ``madvise`` mode, the default of many distributions
    and cloud images). A decode step reads rows at random all over the table: on 4 KiB pages
    nearly every row costs a page-table walk, on 2 MiB pages a few hundred walks cover the
    table (docs/benchmarks.md: the 1024-request gather ~1.1-1.3x faster). Where the OS
    refuses, the memory is ordinary."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP
        pass
    return torch.frombuffer(memory, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


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

