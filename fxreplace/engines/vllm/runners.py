"""vLLM's own V1 model runner (``GPUModelRunner`` and the CPU runner that subclasses it) as a
:class:`~fxreplace.engines.protocol.RunnerSide`: the model vLLM loaded, static buffers bound before
vLLM compiles it, and each forward's layout from the scheduler output and the persistent batch.
Every vLLM name it reads is in :mod:`fxreplace.engines.vllm.internals`."""

from __future__ import annotations

import numpy as np
import torch

from . import internals
from .replacement import SelectingReplacement, VllmReplacement
from .requests import step_requests
from .sites import MODEL_CODE
from ..protocol import StepHooks, StepLayout, StepRequests


class VllmRunner:
    """One vLLM GPU/CPU model runner, seen through the runner protocol."""

    model_code = MODEL_CODE  # the family sites it reads (registered by importing .sites)

    def __init__(self, runner):
        self.runner = runner
        self.model = runner.model
        self.hf_config = runner.model_config.hf_config
        self.device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        self.max_tokens = int(runner.max_num_tokens)

    def replacement_class(self, select_captures: bool) -> type:
        """Bound buffers: vLLM compiles (and CUDA-graph captures) the model once; with ``select_captures``,
        a mask per capture that each request's selection sets."""
        return SelectingReplacement if select_captures else VllmReplacement

    def capture_class(self) -> type:
        from .capture_worker import VllmCapture  # the capture's module in a capturing engine only

        return VllmCapture

    def split_by_stage(self, targets: list) -> tuple[list, list]:
        return internals.split_by_stage(self.model, targets)

    def requests(self, scheduler_output) -> StepRequests:
        return step_requests(scheduler_output)

    def layout(self, scheduler_output, positions) -> StepLayout:
        """Request ``i`` of the persistent batch computes its scheduled tokens in the next slots;
        vLLM pads only after the last request. Device positions are recomputed on the host."""
        req_ids = internals.batch_requests(self.runner)
        if scheduler_output.total_num_scheduled_tokens == len(req_ids):  # one token each: a decode step
            counts = [1] * len(req_ids)
        else:
            counts = list(map(scheduler_output.num_scheduled_tokens.__getitem__, req_ids))
        if positions is None or not positions.is_cpu:
            positions = self._host_positions(counts, sum(counts) if positions is None else positions.shape[0])
        return StepLayout(req_ids, counts, positions)

    def _host_positions(self, counts: list[int], num_tokens: int) -> torch.Tensor:
        """Each scheduled token's position from the batch's computed-token counts, then
        zeros for the padding up to ``num_tokens``."""
        num_reqs, total = len(counts), sum(counts)
        counts = np.asarray(counts, dtype=np.int64)
        owner = np.repeat(np.arange(num_reqs), counts)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        computed = internals.computed_tokens(self.runner)[:num_reqs].astype(np.int64)
        positions = np.zeros(num_tokens, dtype=np.int64)
        positions[:total] = computed[owner] + np.arange(total) - starts[owner]
        return torch.from_numpy(positions)

    def install(self, hooks: StepHooks) -> None:
        off = hooks.off_forward
        internals.wrap_steps(self.runner, begin_step=hooks.begin_step, before_forward=hooks.before_forward,
                             after_forward=hooks.after_forward, dummy_forward=None if off is None else lambda: off(None),
                             end_step=hooks.end_step, after_sample=hooks.after_sample)

    def off_forward(self, num_tokens: int) -> None:
        internals.eager_forward(self.runner, num_tokens)
