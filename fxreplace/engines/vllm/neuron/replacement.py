"""Replacement on vllm-neuron: the step's context as an input of each compiled call (built on
the host, one copy per store group to the device)."""

from __future__ import annotations

import logging

from ....config import ConfigError, ReplacementConfig
from ....context import ReplacementContext
from ...protocol import StepHooks
from ...replacement import Replacement

logger = logging.getLogger("fxreplace.vllm")


class StepInputReplacement(Replacement):
    """Replacement as a per-step input of each compiled call (vllm-neuron): the reference stays on
    the host, each step gathers there and copies its rows to the device once (into a context per
    bucket, reused by that bucket's every step), and calls outside a step get an all-off context
    of their token count (made once per count, never written)."""

    def __init__(self, side, config: ReplacementConfig):
        if config.select_captures:
            raise ConfigError(f"fxreplace on {side.model_code}: select_captures is not supported (each step hands the "
                              "compiled call one context for every target); drop select_captures")
        super().__init__(side, config, reference_device="cpu")
        self.on_host = True  # every build counts its replaced rows on the host
        self.contexts: dict[int, ReplacementContext] = {}  # per token count: the step contexts' device buffers
        self.off_contexts: dict[int, ReplacementContext] = {}
        self._log_instrumented("a context per compiled call")

    def hooks(self) -> StepHooks:
        return StepHooks(begin_step=self.update_requests, before_forward=self.prepare, off_forward=self.off)

    def prepare(self, scheduler_output, positions) -> ReplacementContext:
        """The context of this forward: every slot, padding off; the all-off one when no request of the
        batch is in the reference, or when the build fails (logged, counted: the step is served)."""
        num_tokens = int(positions.shape[0])
        try:
            layout = self.side.layout(scheduler_output, positions)
            out = self.contexts.get(num_tokens)
            if out is None:
                out = self.contexts[num_tokens] = self.replacer.warmup_context(num_tokens, device=self.device)
            context = self.replacer.step_into(layout, out)
        except Exception as exc:
            self.errors += 1
            logger.error("fxreplace: step served without replacement: %s: %s", type(exc).__name__, exc)
            return self.off(num_tokens)
        if context is None:
            return self.off(num_tokens)
        self._count(context)
        return context

    def off(self, num_tokens: int | None) -> ReplacementContext:
        """The all-off context of ``num_tokens`` slots (the graph of that bucket, replacement off)."""
        context = self.off_contexts.get(num_tokens)
        if context is None:
            context = self.off_contexts[num_tokens] = self.replacer.warmup_context(num_tokens, device=self.device)
        return context

    def check_points(self) -> None:
        """Nothing to run at load: vllm-neuron's first warm-up runs every target's point (replacement off)."""
