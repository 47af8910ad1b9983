"""Reference capture on vllm-neuron: rows recorded inside the compiled graphs, stored by
(request, position) through each step's layout."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ....dtypes import dtype_name
from ....gather import host_bits
from ....store import StoreWriter
from ....targets import TargetError
from ...protocol import RecordedRows, StepHooks
from ...recording import ObservationBuffer, RequestRows, observe_targets, runner_targets

logger = logging.getLogger("fxreplace.vllm")


class StepInputCapture:
    """Reference capture on vllm-neuron: every target writes what it computed into one static
    observation buffer (inside the compiled graph), and after each forward of a step its rows are
    stored by (request, position) through the step's layout (padding skipped); a request's rows go
    to the store when the scheduler reports it finished, every other one when :meth:`close` runs
    (``llm.collective_rpc("fxreplace_finish_capture")``).
    The store holds prompts and rows (no generated logits). Target widths are read from the
    modules (the Neuron device runs no eager forward to observe them): targets computed by a
    linear layer (a router at point "auto" holding one, as NxD's layout does)."""

    def __init__(self, side, capture: dict):
        self.side = side
        self.model = side.model
        arch, targets = runner_targets(side, capture.get("targets") or None, who="fxreplace capture",
                                       give="capture 'targets'")
        self.max_tokens = int(side.max_tokens)
        resolved = observe_targets(self.model, targets, self.max_tokens)
        self.names = [r.capture_name for r in resolved]
        widths = [_linear_width(self.model.get_submodule(r.module_name), r.module_name, r.point) for r in resolved]
        self.dtype = next(self.model.parameters()).dtype
        self.observation = ObservationBuffer(self.model, self.names, widths, self.max_tokens, self.dtype, side.device)
        self.columns, self.buffer = self.observation.columns, self.observation.buffer
        self.bits = host_bits(torch.zeros(1, dtype=self.dtype)).dtype  # rows held as numpy (bf16 too)
        self.active: dict[str, RequestRows] = {}
        self.completed = self.dropped = 0
        self.writes = True
        self.out = Path(capture["out"])
        self.writer = StoreWriter(self.out, metadata={"architecture": arch, "engine": side.model_code,
                                                      "dtype": dtype_name(self.dtype),
                                                      "targets": self.names})
        logger.info("fxreplace: capturing %d target(s) of %s (%s ...) into %s", len(self.names), arch, self.names[0],
                    self.out)

    def hooks(self) -> StepHooks:
        return StepHooks(begin_step=self.begin_step, after_forward=self.after_forward)

    def begin_step(self, scheduler_output) -> None:
        for req_id in scheduler_output.finished_req_ids:
            record = self.active.pop(req_id, None)
            if record is not None:
                self._write(record)
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self.active or new.prompt_token_ids is None:
                continue
            prompt = list(new.prompt_token_ids)
            self.active[new.req_id] = RequestRows(prompt, new.sampling_params, self.buffer.shape[1],
                                                   len(prompt) + int(new.sampling_params.max_tokens),
                                                   self.bits, len(self.active), 1)

    def after_forward(self, scheduler_output, positions) -> None:
        """Store this forward's rows by request and position (through the step's layout)."""
        layout = self.side.layout(scheduler_output, positions)
        recorded = RecordedRows.of(layout)
        rows = host_bits(self.buffer[:layout.num_slots].cpu())
        for req_id, (start, count, first) in zip(recorded.req_ids, recorded.spans):
            record = self.active.get(req_id)
            if record is not None and count:
                record.put_rows(first, rows[start:start + count])

    def _write(self, record: RequestRows) -> None:
        rows = torch.from_numpy(record.rows[:record.computed]).view(self.dtype)
        self.writer.add(record.prompt, {name: rows[:, columns] for name, columns in self.columns.items()})
        self.completed += 1

    def close(self) -> None:
        """Write every request still held (the engine is idle: their rows are complete), then the index."""
        for record in self.active.values():
            self._write(record)
        self.active.clear()
        if self.completed:
            self.writer.close()

    def counts(self) -> dict:
        return {"completed": self.completed, "dropped": self.dropped, "in_flight": len(self.active)}

    def summary(self) -> dict:
        """What this runner captured so far (``fxreplace_worker_state``; JSON-able)."""
        return {"names": self.names, "out": str(self.out), "writes": self.writes, **self.counts()}


def _linear_width(module, name: str, point) -> int:
    """The width of what a target computes, read from its linear layer: the module itself, or,
    at point "auto" (the logits a router computes), its one linear submodule."""
    if not isinstance(getattr(module, "out_features", None), int) and point == "auto":
        linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
        module = linears[0] if len(linears) == 1 else module
    width = getattr(module, "out_features", None)
    if not isinstance(width, int):
        raise TargetError(f"fxreplace capture on vllm-neuron: {name!r} ({type(module).__name__}) is not a linear layer "
                          "nor a module holding one, so its width cannot be read without an eager forward; target "
                          "the router's linear layer")
    return width
