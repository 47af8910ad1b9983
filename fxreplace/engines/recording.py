"""What capture keeps while requests run, for every runner under vLLM's scheduler (vLLM's own,
vllm-neuron's): each request's rows by position, and the observer that writes what targets
compute into one static buffer; the setup both capture states share (the targets a runner side
instruments, the observation buffer)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ..injection import recording
from ..instrument import instrument, observe
from ..models import architecture, get_family
from ..targets import ResolvedTarget, TargetError, resolve_targets


def runner_targets(side, given: Sequence | None, *, who: str, give: str) -> tuple[str, list]:
    """The model's architecture and the targets a runner side instruments: ``given``, else its family's in the
    side's model code (``side.model_code``). A family fxreplace does not know, or one declaring none there, is an
    error starting with ``who`` that says to give them (``give``: where)."""
    arch = architecture(side.hf_config, type(side.model).__name__)
    if given is not None:
        return arch, list(given)
    try:
        targets = list(get_family(arch).targets_for(side.model_code))
    except KeyError as exc:
        raise TargetError(f"{who}: {exc.args[0]}; give {give}") from None
    if not targets:
        raise TargetError(f"{who}: the {arch} family declares no targets in {side.model_code}'s model code; give {give}")
    return arch, targets


def observe_targets(model: torch.nn.Module, targets: list, max_tokens: int) -> list[ResolvedTarget]:
    """``targets`` resolved on ``model`` and instrumented to be observed (nothing replaced)."""
    resolved = resolve_targets(model, targets)
    instrument(model, [r.observed() for r in resolved], max_tokens=max_tokens)
    return resolved


class ObservationBuffer:
    """One ``[max_tokens, sum of widths]`` buffer where the model runs, observed for the engine's life: each
    target fills its columns in place (inside a compiled graph), and a step's rows are read from it once."""

    def __init__(self, model: torch.nn.Module, names: list[str], widths: list[int], max_tokens: int,
                 dtype: torch.dtype, device):
        edges = np.cumsum([0, *widths]).tolist()
        self.columns = {name: slice(a, b) for name, a, b in zip(names, edges, edges[1:])}
        self.width = edges[-1]
        self.buffer = torch.zeros(max_tokens, self.width, dtype=dtype, device=device)
        self._observing = contextlib.ExitStack()  # open for the engine's life
        self._observing.enter_context(observe(model, Recorder(self.buffer, self.columns)))


@dataclass
class StopView:
    """The fields of a vLLM ``Request`` that ``check_stop`` reads."""

    sampling_params: Any
    prompt_len: int
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    pooling_params: Any = None
    status: Any = None
    stop_reason: Any = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)


class RequestRows:
    """One request's captures, stored by position: ``rows[p]`` is every target's
    row at position ``p``; ``logits[j]`` predicts generated token ``j`` (one row per
    step: the first ``generated`` rows are held). Held as numpy arrays: a small slice
    copy costs a fifteenth of torch's, and this runs every step."""

    def __init__(self, prompt: list[int], sampling_params, width: int, capacity: int, bits, arrival: int,
                 logit_rows: int):
        self.prompt = prompt
        self.arrival = arrival  # the request's number in the scheduler's order (the same on every stage)
        self.stop = StopView(sampling_params, len(prompt), int(sampling_params.max_tokens))
        self.rows = np.zeros((capacity, width), dtype=bits)
        self.computed = 0  # positions computed so far (a pipeline stage before the last writes these)
        self.logit_rows = logit_rows  # the logits' first allocation, made with the first sampled row
        self.logits: np.ndarray | None = None
        self.generated = 0

    def put_rows(self, start: int, rows: np.ndarray) -> None:
        end = start + len(rows)
        if end > len(self.rows):
            self.rows = np.concatenate([self.rows, np.zeros((end - len(self.rows), self.rows.shape[1]),
                                                            dtype=self.rows.dtype)])
        self.rows[start:end] = rows
        if end > self.computed:
            self.computed = end

    def put_logits(self, position: int, row: np.ndarray) -> None:
        j = position - (self.stop.prompt_len - 1)
        if j < 0:  # a prefill chunk's end: its sample is discarded
            return
        if self.logits is None or j >= len(self.logits):
            self._grow_logits(j + 1, row)
        self.logits[j] = row
        if j >= self.generated:
            self.generated = j + 1

    def put_token(self, position: int, row: np.ndarray, sampled: np.ndarray) -> None:
        """A decode step's one row at ``position`` and the logits sampled from it."""
        self.put_rows(position, row[None])
        self.put_logits(position, sampled)

    def _grow_logits(self, need: int, row: np.ndarray) -> None:
        """Room for ``need`` logits rows: the first allocation holds ``logit_rows`` (the request's
        max_tokens, up to a bound), later ones double, so the rows held are copied a few times
        per request, not every step (``np.empty``: pages no token is generated into stay untouched)."""
        held = 0 if self.logits is None else len(self.logits)
        grown = np.empty((max(need, self.logit_rows, 2 * held), row.shape[-1]), dtype=np.float32)
        if held:
            grown[:self.generated] = self.logits[:self.generated]
        self.logits = grown

    def generated_logits(self, count: int) -> np.ndarray:
        """The logits of the first ``count`` generated tokens, for the store, which holds what it
        is given until its shard is written: a copy when they fill only part of the allocation."""
        logits = self.logits[:count]
        return logits if count == len(self.logits) else logits.copy()


class Recorder:
    """Observer: copies each target's computed ``[T, E]`` into its columns of the
    shared buffer (in place, so a compiled graph writes the same storage).

    Traced into a graph, the copy is an ``index_put_`` of the T rows: a copy into a slice
    of the buffer becomes a ``slice_scatter`` there, which inductor computes as a pass over
    the whole ``[max_tokens, width]`` buffer every forward. Eagerly, the slice copy is the
    fast one (``index_put_`` takes ~20x as long for a 512-token prefill)."""

    def __init__(self, buffer: torch.Tensor, columns: dict[str, slice]):
        self.buffer = buffer
        self.columns = columns
        # each target's columns as a view made once: an eager forward, every step, then only
        # selects its rows
        self.column_views = {name: buffer[:, c] for name, c in columns.items()}

    def __call__(self, name: str, computed) -> None:
        if not isinstance(computed, torch.Tensor):
            raise TargetError(f"{name}: its point computes a {type(computed).__name__}, not one tensor")
        flat = computed if computed.dim() == 2 else computed.reshape(-1, computed.shape[-1])
        if recording():
            columns = self.columns[name]
            rows = torch.arange(flat.shape[0], device=flat.device).unsqueeze(1)
            self.buffer.index_put_((rows, torch.arange(columns.start, columns.stop, device=flat.device)), flat)
        else:
            self.column_views[name][:flat.shape[0]].copy_(flat)
