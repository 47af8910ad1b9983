"""The replacement state every serving runner shares (vLLM's own runner, vllm-neuron's): the
replacer, the instrumented model and the per-step request bookkeeping, all read through the
runner side (:class:`~fxreplace.engines.protocol.RunnerSide`), whose ``requests(step)`` says what
each scheduler step ends and starts.

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
from ..covers import component_covers
from ..instrument import instrument
from ..models import architecture
from ..unchanged import prove_unchanged
from ..replacer import TensorReplacer
from ..targets import Target, TargetError, resolve_targets
from .protocol import StepRequests
from .recording import runner_targets

logger = logging.getLogger(__name__)

DEBUG_STATE_ENV = "FXREPLACE_DEBUG_STATE"


class NoTargetOnThisStage(Exception):
    """Every target lies in layers that other pipeline stages hold: this stage's runner
    stays as vLLM made it (a single-layer target under pipeline parallelism)."""


class Replacement:
    """fxreplace's replacement state of one model runner, whatever the runner: the replacer,
    the instrumented model and the per-step request bookkeeping. A runner side
    (:class:`~fxreplace.engines.protocol.RunnerSide`) says what to instrument and how each
    forward lays out its slots; :class:`VllmReplacement` fills buffers bound to the model,
    :class:`~fxreplace.engines.vllm.neuron.StepInputReplacement` hands each compiled call its context."""

    def __init__(self, side, config: ReplacementConfig, *, reference_device=None):
        self.side = side
        self.runner = side.runner
        self.model = side.model
        arch = architecture(side.hf_config, type(side.model).__name__)
        self.device = side.device
        # by default the reference lives where the model runs: each step gathers into the model's buffers
        self.replacer = self._build_replacer(config, self.device if reference_device is None else reference_device)
        self.targets, self.other_stages_captures = self._targets(config)
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

    def _targets(self, config: ReplacementConfig) -> tuple[list[Target], set[str]]:
        """This stage's targets, resolved and checked against the reference, and the capture
        names of the targets other pipeline stages hold."""
        explicit = config.targets
        _, targets = runner_targets(self.side, explicit, who="fxreplace", give="'targets' in the fxreplace config")
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
        instead of the first request; on that forward each target's given forward runs
        again on the same arguments, proving that instrumenting changed nothing the engine
        computes (:func:`~fxreplace.unchanged.prove_unchanged`), else the start-up fails
        naming the module."""
        num_tokens = min(8, self.max_tokens)
        unprovable = self.unprovable_at_start()
        prove_unchanged(self.model, lambda: self.side.off_forward(num_tokens), skip=unprovable)
        if unprovable:
            logger.info("fxreplace: %d target(s) not proven unchanged at start-up, their forward computing other bits "
                        "on every dummy call (%s%s)", len(unprovable), ", ".join(unprovable[:3]),
                        " ..." if len(unprovable) > 3 else "")

    def covers(self, components: list) -> dict:
        """What replacing each of ``components`` spans in this runner's model
        (:func:`~fxreplace.covers.component_covers`), read on one eager dummy forward with replacement off
        (as :meth:`check_points` runs): blame's verdict through this engine names those modules."""
        return component_covers(self.model, components, run=lambda: self.side.off_forward(2))

    def unprovable_at_start(self) -> list[str]:
        """The targets whose own forward the start-up dummy forward cannot reproduce (none by default)."""
        return []

    # ------------------------------------------------------------ per step

    def update_requests(self, step) -> None:
        """Register the requests the scheduler's ``step`` starts and release those it ends."""
        requests = self.side.requests(step)
        if requests.finished or requests.new:  # most steps have neither
            self._update(requests)
        if self.debug_state_path is not None:
            self.write_debug_state()

    def _update(self, requests: StepRequests) -> None:
        for req_id in requests.finished:
            self.released += self.replacer.release_request(req_id)
        for new in requests.new:
            tokens = new.prompt
            if tokens is None:  # prompt embeddings: nothing to match
                continue
            if new.replace is False:  # unregistered: served untouched
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
