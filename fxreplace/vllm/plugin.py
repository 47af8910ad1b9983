"""The vLLM plugin: instruments vLLM's own model at load time and feeds each
forward the replacement built from the scheduler's actual batch.

``register()`` (entry point ``vllm.general_plugins``) runs in every vLLM process
(front end, engine core, workers). It sends fxreplace's log records to vLLM's
logger handler and only patches classes, idempotently (every vLLM name it relies
on is in :mod:`fxreplace.vllm.internals`):

* ``EngineArgs.create_engine_config`` (front end): validates the fxreplace section
  of ``additional_config`` (a :class:`~fxreplace.ReplacementConfig`; errors name
  the field, before any engine process starts) and wraps it in an
  :class:`~fxreplace.vllm.config.FxReplaceConfig` so vLLM can hash and pickle it;
* ``InputProcessor.process_inputs`` (front end, per request): with
  ``on_unknown="error"`` refuses a prompt that is not in the reference;
* the model runners' ``load_model``: after loading, when configured, builds a
  :class:`VllmReplacement` (instrument + static buffers) before warmup compiles,
  and runs one eager dummy forward so every injection point is checked at start-up;
* when configured, that runner *instance* (not the class) gets two wrappers:
  ``execute_model`` registers new requests and releases finished ones;
  ``_model_forward`` builds the context for the batch and fills the buffers in
  place: every row the forward reads, padding rows off, so nothing needs clearing
  after it; a dummy or profile run (no scheduled batch) clears the mask first.

Unconfigured, nothing runs per step: the class-level wrappers only act at engine
configuration, request submission and model load, and step methods are never wrapped.

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

import difflib
import functools
import json
import logging
import os
from typing import Any

import numpy as np
import torch

from ..config import ReplacementConfig
from ..context import ReplacementContext
from ..instrument import instrument
from ..matching import PromptIndex
from ..replacer import TensorReplacer
from ..targets import Target, TargetError, resolve_targets
from . import internals
from .config import parse_config, refuse_unsupported, wrap_in_place

logger = logging.getLogger("fxreplace.vllm")

_STATE_ATTR = "_fxreplace_state"
DEBUG_STATE_ENV = "FXREPLACE_DEBUG_STATE"
OFF_VALUES = ("off", "false", "0", False, 0)
_MARK = "_fxreplace_wrapped"
_PROMPTS_ATTR = "_fxreplace_prompts"
_CAPTURES_ATTR = "_fxreplace_capture_names"
_UNSET = object()
_registered = False


# --------------------------------------------------------------------------- patches


def register() -> None:
    """``vllm.general_plugins`` entry point. Idempotent; only patches classes."""
    global _registered
    if _registered:
        return
    _log_through_vllm()
    try:
        engine_args = internals.engine_args()
        runners = internals.model_runner_classes()
    except Exception as exc:  # pragma: no cover - incompatible vLLM
        logger.warning("fxreplace: vLLM V1 model runner not importable (%s); plugin disabled", exc)
        _registered = True
        return
    _wrap(engine_args, internals.CREATE_ENGINE_CONFIG, _create_engine_config)
    _wrap(internals.input_processor(), internals.PROCESS_INPUTS, _process_inputs)
    for cls in runners:  # CPUModelRunner overrides load_model: wrap each class's own
        if internals.LOAD_MODEL in cls.__dict__:
            _wrap(cls, internals.LOAD_MODEL, _load_model)
    _registered = True


class _ToVllmLogger(logging.Handler):
    """Hands fxreplace's records to vLLM's logger, whose handler vLLM configures
    (format, level, stream) in every process, whenever it does so."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _log_through_vllm() -> None:
    """vLLM configures only its own logger: without this, fxreplace's INFO lines
    ("instrumented N targets", unknown prompts) would never appear under vLLM.
    Left alone when the user gave the ``fxreplace`` logger handlers of their own."""
    root = logging.getLogger("fxreplace")
    if root.handlers:
        return
    root.addHandler(_ToVllmLogger())
    root.propagate = False  # no second copy through a root handler
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)


def _wrap(cls: type, name: str, make) -> None:
    original = cls.__dict__[name]
    if getattr(original, _MARK, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(cls, name, wrapper)


def _create_engine_config(original):
    def create_engine_config(self, *args, **kwargs):
        wrap_in_place(getattr(self, "additional_config", None))
        config = parse_config(getattr(self, "additional_config", None))
        if config is not None:
            refuse_unsupported(self)
        if config is not None and config.config.capture is not None:
            from .capture import prepare_engine_args

            prepare_engine_args(self, config.config.capture)
        return original(self, *args, **kwargs)

    return create_engine_config


def _process_inputs(original):
    """Front end, once per request: with ``on_unknown="error"`` a prompt that is not
    in the reference is refused here (an error naming the request; HTTP 400
    online) instead of being served without replacement."""

    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        _check_selection(self, request)
        prompts = self.__dict__.get(_PROMPTS_ATTR, _UNSET)
        if prompts is _UNSET:
            prompts = _reference_prompts(self.vllm_config.additional_config)
            setattr(self, _PROMPTS_ATTR, prompts)
        tokens = request.prompt_token_ids
        if prompts is None or tokens is None or _switched_off(request.sampling_params):
            return request
        if prompts.longest_prefix(tokens) is None:
            raise internals.refuse(
                f"fxreplace: request {request.request_id} ({len(tokens)} prompt tokens, first {list(tokens[:8])}) "
                "starts with no reference prompt; fxreplace is configured with on_unknown='error' (the default). "
                "Send it with extra_args {'fxreplace': 'off'} or configure on_unknown='passthrough'",
                parameter="prompt_token_ids")
        return request

    return process_inputs


def _reference_prompts(additional_config):
    """The reference prompts' index when unknown prompts are refused (None: they are not)."""
    config = parse_config(additional_config)
    if config is None or config.config.on_unknown != "error":
        return None
    token_ids = config.config.reference_token_ids()
    if token_ids is None:  # nothing to match against: the workers report each request
        return None
    return PromptIndex(list(token_ids.values()) if isinstance(token_ids, dict) else token_ids)


def _switched_off(sampling_params) -> bool:
    extra = getattr(sampling_params, "extra_args", None)
    return bool(extra) and extra.get("fxreplace") in OFF_VALUES


def _selection(sampling_params):
    """A request's ``extra_args["fxreplace"]`` when it is a selection (a dict), else None."""
    extra = getattr(sampling_params, "extra_args", None)
    value = extra.get("fxreplace") if extra else None
    return value if isinstance(value, dict) else None


def _check_selection(processor, request) -> None:
    """Front end: a selection ``{"captures": [names]}`` must be a list of capture names the
    reference holds, sent to an engine configured with ``select_captures``."""
    selection = _selection(request.sampling_params)
    if selection is None:
        return
    config = parse_config(processor.vllm_config.additional_config)
    captures = selection.get("captures")
    if set(selection) != {"captures"} or not isinstance(captures, list) or not all(isinstance(c, str) for c in captures):
        problem = f"extra_args['fxreplace'] must be 'off' or {{'captures': [capture names]}}, got {selection!r}"
    elif config is None or config.config.capture is not None or not config.config.select_captures:
        problem = "selects captures, but the engine's fxreplace config does not set select_captures=True"
    else:
        names = processor.__dict__.get(_CAPTURES_ATTR)
        if names is None:
            names = set(config.config.build_replacer(on_unknown="passthrough").capture_names)
            setattr(processor, _CAPTURES_ATTR, names)
        unknown = [c for c in captures if c not in names]
        if not unknown:
            return
        close = {c: difflib.get_close_matches(c, names, n=2) for c in unknown[:4]}
        problem = f"selects capture(s) {unknown} that the reference does not hold (closest: {close})"
    raise internals.refuse(f"fxreplace: request {request.request_id} {problem}", parameter="extra_args")


def _load_model(original):
    def load_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if getattr(self, _STATE_ATTR, None) is None:
            config = parse_config(self.vllm_config.additional_config)
            if config is not None and config.config.capture is not None:
                from .capture import VllmCapture, attach

                state = VllmCapture(self, config.config.capture)
                setattr(self, _STATE_ATTR, state)
                attach(self, state)
            elif config is not None:
                kind = SelectingReplacement if config.config.select_captures else VllmReplacement
                state = kind(self, config.config)
                setattr(self, _STATE_ATTR, state)
                _wrap_steps(self, state)
                state.check_points(self)
        return out

    return load_model


def _wrap_steps(runner, state: "VllmReplacement") -> None:
    """Per-step wrappers on one configured runner instance: requests are registered
    and released per step and the buffers filled before each forward; every row the
    forward reads is rewritten (padding rows off), so nothing is cleared after it.
    Dummy/profile runs see replacement off."""
    internals.wrap_steps(runner, begin_step=state.update_requests, before_forward=state.prepare,
                         dummy_forward=state.clear)


# --------------------------------------------------------------------------- per worker


class VllmReplacement:
    """fxreplace state of one model runner: the replacer and the instrumented model."""

    whole_mask = True  # every target reads the one mask the replacer writes

    def __init__(self, runner, config: ReplacementConfig):
        from fxreplace.models import architecture  # configured engines only: unconfigured start-up stays light

        self.runner = runner
        self.model = runner.model
        arch = architecture(runner.model_config.hf_config, type(runner.model).__name__)
        self.device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        # the reference lives where the model runs: each step gathers into the model's buffers
        self.replacer = self._build_replacer(config, self.device)
        self.targets = self._targets(arch, config)
        self.max_tokens = int(runner.max_num_tokens)
        instrument(self.model, self.targets, max_tokens=self.max_tokens)
        # Bind before warmup compiles: the graph reads these buffers from its first trace.
        # Each step gathers straight into their first rows (no second copy).
        self.feed = self.replacer.warmup_context(self.max_tokens)
        self.model.feed(self._bound_context(), bind=True)
        self._views: dict[int, ReplacementContext] = {}  # first-T-rows views of self.feed, per T
        self._decode_views = self._views if self.whole_mask else {}  # the views decode_into may fill
        self.steps = 0  # forwards that held at least one request matched to the reference
        self.host_tokens_replaced = 0
        self.device_tokens_replaced = torch.zeros((), dtype=torch.int64, device=self.device)
        self.errors = 0
        self.registered = 0  # requests registered (matched or not) and released, over the engine's life
        self.released = 0
        self.armed = False  # whether the mask may hold True rows (clear() is a no-op otherwise)
        self.on_host = self.feed.mask.device.type == "cpu"
        self.debug_state_path = os.environ.get(DEBUG_STATE_ENV) or None
        logger.info("fxreplace: instrumented %d target(s) of %s (%s ...), %d reference prompt(s), buffers of %d tokens",
                    len(self.targets), arch, self.targets[0].pattern, self.replacer.store.num_prompts, self.max_tokens)

    # ------------------------------------------------------------ setup

    @staticmethod
    def _build_replacer(config: ReplacementConfig, device) -> TensorReplacer:
        try:
            # Unknown prompts reaching a worker pass through: with on_unknown="error" the
            # front end refused them already (a worker cannot fail one request).
            return config.build_replacer(on_unknown="passthrough", device=device)
        except Exception as exc:
            where = config.tensors_path or "the in-memory tensors"
            raise type(exc)(f"fxreplace: cannot load the reference from {where}: {exc}") from exc

    def _targets(self, arch: str, config: ReplacementConfig) -> list[Target]:
        explicit = config.targets
        if explicit is not None:
            targets = list(explicit)
        else:
            from fxreplace.models import get_family

            try:
                targets = list(get_family(arch).vllm_targets)
            except KeyError as exc:
                raise TargetError(f"fxreplace: {exc.args[0]}; give 'targets' in the fxreplace config") from None
            if not targets:
                raise TargetError(f"fxreplace: the {arch} family has no vllm_targets; give 'targets' in the config")
        resolved = resolve_targets(self.model, targets)
        stored = set(self.replacer.capture_names)
        out, missing = [], []
        for r in resolved:
            capture = r.capture_name
            if capture not in stored:
                missing.append(f"{r.module_name} (capture name {capture!r})")
                continue
            out.append(Target(r.module_name, point=r.point, adapter=r.adapter, shard=r.shard, name=capture))
        if missing and (explicit is not None or not out):
            raise TargetError(
                f"fxreplace: the reference holds no tensors for {len(missing)} target(s): {missing[:4]}; "
                f"stored names: {sorted(stored)[:6]}{' ...' if len(stored) > 6 else ''}. "
                "Give each target its capture name ('targets': [{\"pattern\": ..., \"name\": ...}])"
            )
        if missing:
            logger.warning("fxreplace: %d default target(s) have no reference tensors and stay unreplaced: %s",
                           len(missing), missing[:4])
        return out

    def _bound_context(self) -> ReplacementContext:
        """What the model's buffers become: the feed itself, so every target reads its one mask."""
        return self.feed

    def check_points(self, runner) -> None:
        """Run every target's injection point once (an eager dummy forward, replacement
        off) before the engine serves, so a wrong point (e.g. a tuple output) or a
        reference whose feature width differs from the module fails the start-up
        instead of the first request."""
        internals.eager_forward(runner, min(8, self.max_tokens))

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
            if _switched_off(new.sampling_params):  # unregistered: served untouched
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

    def prepare(self, scheduler_output, positions) -> None:
        """Fill the buffers for this forward from the batch vLLM actually runs: every
        row it reads, the padding after the scheduled tokens included (mask off there).

        The hot path: a steady decode step (the same requests as the last step, one
        token each) is one :meth:`TensorReplacer.decode_into` into the bound buffers'
        leading rows; nothing is allocated but the rows' index list."""
        try:
            req_ids = internals.batch_requests(self.runner)
            n = len(req_ids)
            # as many positions as requests is one token each, no padding (vLLM drops unscheduled
            # requests from the batch and schedules at least one token per request): decode_into
            # checks that, and every request's row
            out = self._decode_views.get(n)
            if out is not None and self.replacer.decode_into(req_ids, positions, out):
                self.armed = True
                self.steps += 1
                self.host_tokens_replaced += n
                return
            self._fill(req_ids, scheduler_output, positions)
        except Exception as exc:
            self.errors += 1
            self.clear()
            logger.error("fxreplace: step served without replacement: %s: %s", type(exc).__name__, exc)

    def _fill(self, req_ids: list[str], scheduler_output, positions) -> tuple[list[int], int] | None:
        """:meth:`prepare`'s general path; returns the batch's scheduled token counts and
        the rows written (padding included), or None when nothing is replaced."""
        if not self.replacer.any_matched(req_ids):  # nothing to replace: buffers off
            self.clear()
            return None
        if scheduler_output.total_num_scheduled_tokens == len(req_ids):
            counts = [1] * len(req_ids)
        else:
            counts = list(map(scheduler_output.num_scheduled_tokens.__getitem__, req_ids))
        if positions is None or not positions.is_cpu:  # device positions: recompute on the host
            positions = _host_positions(self.runner, counts, sum(counts) if positions is None else positions.shape[0])
        rows = positions.shape[0]
        self.armed = True
        out = self._views.get(rows)
        if out is None:
            out = self._new_view(rows)
        ctx = self.replacer.build_context_for_batch(req_ids, counts, positions, out=out)
        self.steps += 1
        if self.on_host:
            self.host_tokens_replaced += ctx.num_replaced
        else:  # summed on the device: reading it each step would wait for the forward
            self.device_tokens_replaced += ctx.mask.sum()
        return counts, rows

    def _new_view(self, n: int) -> ReplacementContext:
        """The bound buffers' first ``n`` rows as an ``out=`` context, kept for the next forward of ``n`` rows."""
        view = self._views[n] = self.feed.leading(n)
        return view

    def clear(self) -> None:
        if self.armed:
            self.feed.mask.fill_(False)  # every target's mask buffer is this one tensor
            self.armed = False

    @property
    def requests(self) -> dict:
        return self.replacer.requests

    @property
    def tokens_replaced(self) -> int:
        """Tokens whose rows were replaced, over the engine's life (reads the device count: a sync)."""
        return self.host_tokens_replaced + (0 if self.on_host else int(self.device_tokens_replaced))


class SelectingReplacement(VllmReplacement):
    """``select_captures=True``: each request picks the captures that replace it
    (``extra_args={"fxreplace": {"captures": [...]}}``; without a selection, all).

    Every target reads a mask of its own (the feed bound as a
    :class:`~fxreplace.context.SelectedContext`); each step sets every row the forward
    reads to the batch's mask where the token's request selected that target's capture
    (padding rows off). The graph's inputs are the same whatever the selection, so one
    compiled graph serves them all.
    """

    whole_mask = False  # every step writes per-target masks: no decode_into shortcut

    def _bound_context(self) -> ReplacementContext:
        self.capture_names = list(dict.fromkeys(t.name for t in self.targets))
        bound = self.feed.select(self.capture_names)
        self.masks = [bound.mask_for(name) for name in self.capture_names]
        self.all_selected = torch.ones(len(self.capture_names), dtype=torch.bool)
        self.none_selected = torch.zeros(len(self.capture_names), dtype=torch.bool)
        self.selections: dict[str, torch.Tensor] = {}  # request id -> [captures] bool, when it selected
        return bound

    def update_requests(self, scheduler_output) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.selections.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            selection = _selection(new.sampling_params)
            if selection is None:
                continue
            wanted = set(selection["captures"])  # validated in the front end
            ignored = sorted(wanted - set(self.capture_names))
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


def _host_positions(runner, counts: list[int], num_tokens: int) -> torch.Tensor:
    """Each scheduled token's position from the batch's computed-token counts, then
    zeros for the padding up to ``num_tokens``."""
    num_reqs, total = len(counts), sum(counts)
    counts = np.asarray(counts, dtype=np.int64)
    owner = np.repeat(np.arange(num_reqs), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    computed = internals.computed_tokens(runner)[:num_reqs].astype(np.int64)
    positions = np.zeros(num_tokens, dtype=np.int64)
    positions[:total] = computed[owner] + np.arange(total) - starts[owner]
    return torch.from_numpy(positions)


def get_state(runner):
    """The fxreplace state of a model runner: a VllmReplacement, a
    :class:`~fxreplace.vllm.capture.VllmCapture`, or None when not configured."""
    return getattr(runner, _STATE_ATTR, None)
