"""The vLLM plugin's per-runner replacement state on vLLM's own runner: the instrumented
model, its bound buffers and the replacer that fills them from the scheduler's batch before
every forward (:mod:`fxreplace.engines.vllm.plugin` attaches it to a configured model runner).

With ``select_captures=True`` in the config, ``extra_args={"fxreplace": {"captures": [capture
names]}}`` replaces only those captures for that request (:class:`SelectingReplacement`); the
front end refuses a selection naming a capture the reference does not hold.
"""

from __future__ import annotations

import logging

import torch

from ...config import ReplacementConfig
from ...context import ReplacementContext
from ..protocol import StepHooks, StepLayout, StepRequests
from ..replacement import Replacement
from . import internals

logger = logging.getLogger("fxreplace.vllm")


class VllmReplacement(Replacement):
    """Replacement through static buffers bound to the model before it compiles (vLLM's
    GPU/CPU runner): every target reads its rows and one mask from them, and each step
    fills their leading rows in place."""

    def __init__(self, side, config: ReplacementConfig):
        super().__init__(side, config)
        # Bind before warmup compiles: the graph reads these buffers from its first trace.
        # Each step gathers straight into their first rows (no second copy).
        self.feed = self.replacer.warmup_context(self.max_tokens)
        self.model.feed(self.feed, bind=True)
        self._views: dict[int, ReplacementContext] = {}  # first-T-rows views of self.feed, per T
        self.armed = False  # whether the mask may hold True rows (clear() is a no-op otherwise)
        self.on_host = self.feed.mask.device.type == "cpu"
        self._log_instrumented(f"buffers of {self.max_tokens} tokens")

    def unprovable_at_start(self) -> list[str]:
        """The targets holding an attention layer: vLLM's dummy forward gives it no metadata, so it
        returns an unwritten buffer, other bits on each call (the routers, experts and embeddings
        are proven)."""
        return [t.module_name for t in self.model._fxreplace.targets
                if internals.holds_attention(self.model.get_submodule(t.module_name))]

    def hooks(self) -> StepHooks:
        """Requests are registered and released per step and the buffers filled before each
        forward; every row the forward reads is rewritten (padding rows off), so nothing is
        cleared after it. Forwards outside a step see replacement off."""
        return StepHooks(begin_step=self.update_requests, before_forward=self.prepare,
                         off_forward=lambda num_tokens: self.clear())

    def prepare(self, scheduler_output, positions) -> None:
        """Fill the buffers for this forward from the batch vLLM actually runs: every
        row it reads, the padding after the scheduled tokens included (mask off there).

        One call into the replacer per step, with the step's layout: its
        :meth:`~fxreplace.TensorReplacer.step_into` writes a steady decode step (the same
        requests as the last step, one token each) by its shortcut into the bound
        buffers' leading rows, anything else with its general build."""
        try:
            self._fill(scheduler_output, positions)
        except Exception as exc:
            self.errors += 1
            self.clear()
            logger.error("fxreplace: step served without replacement: %s: %s", type(exc).__name__, exc)

    def _fill(self, scheduler_output, positions) -> StepLayout | None:
        """Fill the buffers for this forward; returns its layout, or None when nothing is
        replaced (no request of the batch matched: buffers off)."""
        layout = self.side.layout(scheduler_output, positions)
        rows = layout.num_slots
        out = self._views.get(rows)
        if out is None:
            out = self._new_view(rows)
        filled = self.replacer.step_into(layout, out)
        if filled is None:
            self.clear()
            return None
        self._count(filled)
        return layout

    def _new_view(self, n: int) -> ReplacementContext:
        """The bound buffers' first ``n`` rows as an ``out=`` context, kept for the next forward of ``n`` rows."""
        view = self._views[n] = self.feed.leading(n)
        return view

    def clear(self) -> None:
        if self.armed:
            self.feed.mask.fill_(False)  # every target's mask buffer is this one tensor
            self.armed = False


class SelectingReplacement(VllmReplacement):
    """``select_captures=True``: each request picks the captures that replace it
    (``extra_args={"fxreplace": {"captures": [...]}}``; without a selection, all).

    Every target reads a mask of its own (the feed bound as a
    :class:`~fxreplace.context.SelectedContext`); each step sets every row the forward
    reads to the batch's mask where the token's request selected that target's capture
    (padding rows off). The graph's inputs are the same whatever the selection, so one
    compiled graph serves them all.
    """

    def __init__(self, side, config: ReplacementConfig):
        super().__init__(side, config)
        self.capture_names = list(dict.fromkeys(t.name for t in self.targets))
        bound = self.feed.select(self.capture_names)
        self.masks = [bound.mask_for(name) for name in self.capture_names]
        self.all_selected = torch.ones(len(self.capture_names), dtype=torch.bool)
        self.none_selected = torch.zeros(len(self.capture_names), dtype=torch.bool)
        self.selections: dict[str, torch.Tensor] = {}  # request id -> [captures] bool, when it selected
        # bound again before warmup compiles, now each target to a mask of its own; the feed's
        # mask stays the batch's, which each step narrows into these
        self.model.feed(bound, bind=True)

    def _update(self, requests: StepRequests) -> None:
        for req_id in requests.finished:
            self.selections.pop(req_id, None)
        for new in requests.new:
            if isinstance(new.replace, bool):  # every capture, or none (unregistered)
                continue
            wanted = set(new.replace)  # validated in the front end
            ignored = sorted(wanted - set(self.capture_names) - self.other_stages_captures)
            if ignored:
                logger.error("fxreplace: request %s selects capture(s) %s that no instrumented target reads; "
                             "they are not replaced", new.req_id, ignored)
            self.selections[new.req_id] = torch.tensor([name in wanted for name in self.capture_names])
        super()._update(requests)

    def _fill(self, scheduler_output, positions) -> StepLayout | None:
        layout = super()._fill(scheduler_output, positions)
        if layout is None:
            return None
        counts, rows = layout.counts, layout.num_slots
        total = sum(counts)
        # per token, whether its request selected each capture (padding rows: none)
        chosen = torch.stack([self.selections.get(r, self.all_selected) for r in layout.req_ids] + [self.none_selected], 1)
        per_token = chosen.repeat_interleave(torch.tensor(counts + [rows - total]), dim=1).to(self.device)
        batch_mask = self.feed.mask[:rows]
        for mask, selected in zip(self.masks, per_token):
            torch.logical_and(batch_mask, selected, out=mask[:rows])
        return layout

    def clear(self) -> None:
        if self.armed:
            for mask in self.masks:
                mask.fill_(False)
        super().clear()

