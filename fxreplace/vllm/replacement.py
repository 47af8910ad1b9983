"""The vLLM plugin's per-runner replacement state: the instrumented model, its bound
buffers and the replacer that fills them from the scheduler's batch before every forward
(:mod:`fxreplace.vllm.plugin` attaches it to a configured model runner).

Per request, ``SamplingParams(extra_args={"fxreplace": "off"})`` (online:
``"vllm_xargs": {"fxreplace": "off"}``) serves a request without replacement even
when its prompt is in the reference. With ``select_captures=True`` in the config,
``extra_args={"fxreplace": {"captures": [capture names]}}`` replaces only those
captures for that request (:class:`SelectingReplacement`); the front end refuses a
selection naming a capture the reference does not hold.

Debugging: with ``FXREPLACE_DEBUG_STATE=/path/state.json`` in the worker's
environment, the worker rewrites that file after every step's request
bookkeeping: ``{"pid", "steps", "errors", "tokens_replaced", "registered",
"released", "requests": {req_id: prompt index or null}}``. The server tests use it
to see the request map drain; unset, no file I/O happens.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from ..config import ReplacementConfig
from ..context import ReplacementContext
from ..instrument import instrument
from ..replacer import TensorReplacer
from ..targets import Target, TargetError, resolve_targets
from .protocol import StepHooks

logger = logging.getLogger("fxreplace.vllm")

DEBUG_STATE_ENV = "FXREPLACE_DEBUG_STATE"
OFF_VALUES = ("off", "false", "0", False, 0)


class NoTargetOnThisStage(Exception):
    """Every target lies in layers that other pipeline stages hold: this stage's runner
    stays as vLLM made it (a single-layer target under pipeline parallelism)."""


def switched_off(sampling_params) -> bool:
    extra = getattr(sampling_params, "extra_args", None)
    return bool(extra) and extra.get("fxreplace") in OFF_VALUES


def selection_of(sampling_params):
    """A request's ``extra_args["fxreplace"]`` when it is a selection (a dict), else None."""
    extra = getattr(sampling_params, "extra_args", None)
    value = extra.get("fxreplace") if extra else None
    return value if isinstance(value, dict) else None


class Replacement:
    """fxreplace's replacement state of one model runner, whatever the runner: the replacer,
    the instrumented model and the per-step request bookkeeping. A runner side
    (:class:`~fxreplace.vllm.protocol.RunnerSide`) says what to instrument and how each
    forward lays out its slots; :class:`VllmReplacement` fills buffers bound to the model,
    :class:`~fxreplace.vllm.neuron.StepInputReplacement` hands each compiled call its context."""

    def __init__(self, side, config: ReplacementConfig, *, reference_device=None):
        from fxreplace.models import architecture  # configured engines only: unconfigured start-up stays light

        self.side = side
        self.runner = side.runner
        self.model = side.model
        arch = architecture(side.hf_config, type(side.model).__name__)
        self.device = side.device
        # by default the reference lives where the model runs: each step gathers into the model's buffers
        self.replacer = self._build_replacer(config, self.device if reference_device is None else reference_device)
        self.targets, self.other_stages_captures = self._targets(arch, config)
        self.max_tokens = int(side.max_tokens)
        instrument(self.model, self.targets, max_tokens=self.max_tokens)
        self.steps = 0  # forwards that held at least one request matched to the reference
        self.host_tokens_replaced = 0
        self.device_tokens_replaced = torch.zeros((), dtype=torch.int64, device=self.device)
        self.errors = 0
        self.registered = 0  # requests registered (matched or not) and released, over the engine's life
        self.released = 0
        self.debug_state_path = os.environ.get(DEBUG_STATE_ENV) or None
        self.arch = arch

    def _log_instrumented(self, how: str) -> None:
        logger.info("fxreplace: instrumented %d target(s) of %s (%s ...), %d reference prompt(s), %s",
                    len(self.targets), self.arch, self.targets[0].pattern, self.replacer.store.num_prompts, how)

    # ------------------------------------------------------------ setup

    @staticmethod
    def _build_replacer(config: ReplacementConfig, device) -> TensorReplacer:
        try:
            # Unknown prompts reaching a worker pass through: with on_unknown="error" the
            # front end refused them already (a worker cannot fail one request).
            return TensorReplacer.from_config(config, on_unknown="passthrough", device=device)
        except Exception as exc:
            where = config.tensors_path or "the in-memory tensors"
            raise type(exc)(f"fxreplace: cannot load the reference from {where}: {exc}") from exc

    def _targets(self, arch: str, config: ReplacementConfig) -> tuple[list[Target], set[str]]:
        """This stage's targets, resolved and checked against the reference, and the capture
        names of the targets other pipeline stages hold."""
        explicit = config.targets
        if explicit is not None:
            targets = list(explicit)
        else:
            from fxreplace.models import get_family

            which = self.side.family_targets  # the family's targets for this runner's model code
            try:
                targets = list(getattr(get_family(arch), which, ()))
            except KeyError as exc:
                raise TargetError(f"fxreplace: {exc.args[0]}; give 'targets' in the fxreplace config") from None
            if not targets:
                raise TargetError(f"fxreplace: the {arch} family has no {which}; give 'targets' in the config")
        targets, elsewhere = self.side.split_by_stage(targets)
        shown = f"{[t if isinstance(t, str) else t.pattern for t in elsewhere][:4]}{' ...' if len(elsewhere) > 4 else ''}"
        if not targets:
            raise NoTargetOnThisStage(f"this pipeline stage holds none of the {len(elsewhere)} target(s) ({shown}): "
                                      "it replaces nothing")
        if elsewhere:
            logger.info("fxreplace: %d target(s) lie in layers other pipeline stages hold (%s): they replace there",
                        len(elsewhere), shown)
        resolved = resolve_targets(self.model, targets)
        stored = set(self.replacer.capture_names)
        out, missing = [], []
        for r in resolved:
            capture = r.capture_name
            if capture not in stored:
                missing.append(f"{r.module_name} (capture name {capture!r})")
                continue
            out.append(r.as_target())
        if missing and (explicit is not None or not out):
            raise TargetError(
                f"fxreplace: the reference holds no tensors for {len(missing)} target(s): {missing[:4]}; "
                f"stored names: {sorted(stored)[:6]}{' ...' if len(stored) > 6 else ''}. "
                "Give each target its capture name ('targets': [{\"pattern\": ..., \"name\": ...}])"
            )
        if missing:
            logger.warning("fxreplace: %d default target(s) have no reference tensors and stay unreplaced: %s",
                           len(missing), missing[:4])
        return out, {t if isinstance(t, str) else t.name or t.pattern for t in elsewhere}

    def check_points(self) -> None:
        """Run every target's injection point once (an eager dummy forward, replacement
        off) before the engine serves, so a wrong point (e.g. a tuple output) or a
        reference whose feature width differs from the module fails the start-up
        instead of the first request."""
        self.side.off_forward(min(8, self.max_tokens))

    # ------------------------------------------------------------ per step

    def update_requests(self, scheduler_output) -> None:
        finished, new_requests = scheduler_output.finished_req_ids, scheduler_output.scheduled_new_reqs
        if finished or new_requests:  # most steps have neither
            self._update(finished, new_requests)
        if self.debug_state_path is not None:
            self.write_debug_state()

    def _update(self, finished, new_requests) -> None:
        for req_id in finished:
            self.released += self.replacer.release_request(req_id)
        for new in new_requests:
            tokens = new.prompt_token_ids
            if tokens is None:  # prompt embeddings: nothing to match
                continue
            if switched_off(new.sampling_params):  # unregistered: served untouched
                continue
            try:
                matched = self.replacer.register_request(new.req_id, list(tokens))
                self.registered += 1
            except Exception as exc:  # one bad request must not stop the engine
                logger.error("fxreplace: request %s is served without replacement: %s", new.req_id, exc)
                continue
            if matched is None:  # on_unknown="passthrough" (the front end refuses them otherwise)
                logger.info("fxreplace: request %s (%d prompt tokens, first %s) matches no reference prompt; "
                            "served without replacement", new.req_id, len(tokens), list(tokens[:8]))

    def write_debug_state(self) -> None:
        """Atomically rewrite the ``FXREPLACE_DEBUG_STATE`` file (debugging only)."""
        path = self.debug_state_path
        state = {"pid": os.getpid(), "steps": self.steps, "errors": self.errors,
                 "tokens_replaced": self.tokens_replaced, "registered": self.registered,
                 "released": self.released, "requests": self.requests}
        try:
            with open(f"{path}.tmp{os.getpid()}", "w") as f:
                json.dump(state, f)
            os.replace(f"{path}.tmp{os.getpid()}", path)
        except OSError as exc:
            logger.warning("fxreplace: cannot write %s=%s: %s", DEBUG_STATE_ENV, path, exc)
            self.debug_state_path = None

    def _count(self, ctx: ReplacementContext) -> None:
        """A forward whose buffers ``ctx`` filled (its mask may hold True rows)."""
        self.armed = True
        self.steps += 1
        if self.on_host:
            self.host_tokens_replaced += ctx.num_replaced
        else:  # summed on the device: reading it each step would wait for the forward
            self.device_tokens_replaced += ctx.mask.sum()

    @property
    def requests(self) -> dict:
        return self.replacer.requests

    def summary(self) -> dict:
        """What this runner replaced so far (``fxreplace_worker_state``; JSON-able)."""
        return {"errors": self.errors, "tokens_replaced": self.tokens_replaced, "steps": self.steps,
                "requests": dict(self.requests), "targets": [t.pattern for t in self.targets]}

    @property
    def tokens_replaced(self) -> int:
        """Tokens whose rows were replaced, over the engine's life (reads the device count: a sync)."""
        return self.host_tokens_replaced + (0 if self.on_host else int(self.device_tokens_replaced))


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

    def hooks(self) -> StepHooks:
        """Requests are registered and released per step and the buffers filled before each
        forward; every row the forward reads is rewritten (padding rows off), so nothing is
        cleared after it. Forwards outside a step see replacement off."""
        return StepHooks(begin_step=self.update_requests, before_forward=self.prepare,
                         off_forward=lambda num_tokens: self.clear())

    def prepare(self, scheduler_output, positions) -> None:
        """Fill the buffers for this forward from the batch vLLM actually runs: every
        row it reads, the padding after the scheduled tokens included (mask off there).

        One build per step: a steady decode step (the same requests as the last step, one
        token each) is the replacer's :meth:`~fxreplace.TensorReplacer.decode_into` into the
        bound buffers' leading rows, anything else its general build."""
        try:
            self._fill(self.side.batch_requests(), scheduler_output, positions)
        except Exception as exc:
            self.errors += 1
            self.clear()
            logger.error("fxreplace: step served without replacement: %s: %s", type(exc).__name__, exc)

    def _fill(self, req_ids: list[str], scheduler_output, positions) -> tuple[list[int], int] | None:
        """Fill the buffers for ``req_ids``; returns the batch's scheduled token counts and
        the rows written (padding included), or None when nothing is replaced."""
        out = self._views.get(len(req_ids))
        if out is not None and self.replacer.decode_into(req_ids, positions, out):  # a steady decode step
            self._count(out)
            return [1] * len(req_ids), len(req_ids)
        if not self.replacer.any_matched(req_ids):  # nothing to replace: buffers off
            self.clear()
            return None
        layout = self.side.layout(scheduler_output, positions, req_ids)
        rows = layout.num_slots
        out = self._views.get(rows)
        if out is None:
            out = self._new_view(rows)
        self._count(layout.build(self.replacer, out))
        return layout.counts, rows

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

    def update_requests(self, scheduler_output) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.selections.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            selection = selection_of(new.sampling_params)
            if selection is None:
                continue
            wanted = set(selection["captures"])  # validated in the front end
            ignored = sorted(wanted - set(self.capture_names) - self.other_stages_captures)
            if ignored:
                logger.error("fxreplace: request %s selects capture(s) %s that no instrumented target reads; "
                             "they are not replaced", new.req_id, ignored)
            self.selections[new.req_id] = torch.tensor([name in wanted for name in self.capture_names])
        super().update_requests(scheduler_output)

    def _fill(self, req_ids: list[str], scheduler_output, positions) -> tuple[list[int], int] | None:
        filled = super()._fill(req_ids, scheduler_output, positions)
        if filled is None:
            return None
        counts, rows = filled
        total = sum(counts)
        # per token, whether its request selected each capture (padding rows: none)
        chosen = torch.stack([self.selections.get(r, self.all_selected) for r in req_ids] + [self.none_selected], 1)
        per_token = chosen.repeat_interleave(torch.tensor(counts + [rows - total]), dim=1).to(self.device)
        batch_mask = self.feed.mask[:rows]
        for mask, selected in zip(self.masks, per_token):
            torch.logical_and(batch_mask, selected, out=mask[:rows])
        return filled

    def clear(self) -> None:
        if self.armed:
            for mask in self.masks:
                mask.fill_(False)
        super().clear()

