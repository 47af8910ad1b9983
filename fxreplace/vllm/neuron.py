"""vllm-neuron's ``NeuronModelRunner`` as a :class:`~fxreplace.vllm.protocol.RunnerSide`, and the
replacement state that hands each of its compiled calls the step's context.

vllm-neuron compiles one graph per bucket (prefill: one request's tokens padded to a token
bucket by repeating its last position; decode: 1 or 1 + k tokens per request, padded at the
end with position 0 to a batch bucket, plus data-parallel padding) and calls the compiled
module itself. So the context is a per-step *input*: right before each compiled call,
``replacements=`` receives the step's context (built on the host, one copy per store group
to the device), or an all-off context of the same token count for warm-ups, graph capture
and dummy batches; the graph is the same for both, so no bucket compiles twice.

Every vllm-neuron name read here is in :mod:`fxreplace.vllm.neuron_internals`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError, ReplacementConfig
from ..dtypes import dtype_name
from ..context import ReplacementContext
from ..gather import host_bits
from ..instrument import instrument, observe
from ..store import StoreWriter
from ..targets import TargetError, resolve_targets
from . import neuron_internals as internals
from .capture import _Recorder, _RequestRows
from .protocol import RecordedRows, StepHooks, StepLayout
from .replacement import Replacement

logger = logging.getLogger("fxreplace.vllm")

ASYNC_SPECULATION_HINT = (
    "vllm-neuron corrects the positions of rejected speculative drafts only on the device under async "
    "scheduling, so the host positions fxreplace maps rows from would be wrong; serve with "
    "--no-async-scheduling (async_scheduling=False), or without speculative_config")
SHARED_KEY_HINT = (
    f"on vllm-neuron, additional_config['{internals.SHARED_KEY[0]}']['{internals.SHARED_KEY[1]}'] configures "
    "vllm-neuron's own tensor replacer, so both would replace: configure fxreplace under "
    "additional_config['fxreplace'] instead (the same fields)")


class NeuronRunner:
    """One vllm-neuron ``NeuronModelRunner``, seen through the runner protocol."""

    bound = False  # one graph per bucket, called by the runner: the context is each call's input
    engine = "vllm-neuron"
    family_targets = "vllm_neuron_targets"  # a family's targets in vllm-neuron's model code

    def __init__(self, runner):
        if getattr(runner, internals.OWN_REPLACER, None) is not None:
            raise ConfigError(f"fxreplace: vllm-neuron's own tensor replacer is configured: {SHARED_KEY_HINT}")
        speculation = runner.speculative_config
        if runner.use_async_scheduling and speculation is not None:
            raise ConfigError(f"fxreplace with async scheduling and speculative decoding: {ASYNC_SPECULATION_HINT}")
        self.runner = runner
        self.compiled = internals.compiled_models(runner)
        self.model = internals.original_module(runner.model)
        self.hf_config = runner.vllm_config.model_config.hf_config
        self.device = torch.device(runner.device)
        drafts = int(getattr(speculation, "num_speculative_tokens", 0) or 0)
        self.max_tokens = max(int(runner.max_num_batched_tokens), int(runner.max_num_reqs) * (1 + drafts))
        self.step = None  # the scheduler output of the step being executed
        self.armed: ReplacementContext | None = None  # the context the next compiled call of the step receives

    def split_by_stage(self, targets: list) -> tuple[list, list]:
        """vllm-neuron shards each model over tensor parallelism inside its graphs: every target is this runner's."""
        return list(targets), []

    def batch_requests(self) -> list[str]:
        return internals.batch_requests(self.runner)

    def layout(self, scheduler_output, positions, req_ids: list[str] | None = None) -> StepLayout:
        """Request ``i`` computes ``num_scheduled_tokens`` tokens followed by the padding up to its
        ``num_scheduled_tokens_padded`` (a prefill's bucket); every slot after the last request's
        is padding (decode batch buckets, data-parallel padding). The counts are read at the
        forward, after the runner dropped any speculative tokens from the scheduler output."""
        if req_ids is None:
            req_ids = self.batch_requests()
        counts = [int(scheduler_output.num_scheduled_tokens[r]) for r in req_ids]
        padded = internals.padded_counts(scheduler_output, req_ids)
        padding = None if padded is None else [p - c for p, c in zip(padded, counts)]
        if padding is not None and min(padding, default=0) < 0:
            raise ValueError(f"requests {req_ids[:4]} schedule more tokens {counts[:4]} than their padded counts "
                             f"{padded[:4]}")
        if not positions.is_cpu:  # vllm-neuron hands the forward host positions; a device copy costs a sync
            positions = positions.cpu()
        layout = StepLayout(req_ids, counts, positions, padding if padding and any(padding) else None)
        layout.check()
        return layout

    def install(self, hooks: StepHooks) -> None:
        """Wrap this runner instance's ``execute_model`` (step bookkeeping) and
        ``_execute_model_forward`` (the step's context, armed for its compiled call), and give
        each compiled wrapper a forward pre-hook that passes the armed context, or the all-off
        one of the call's token count, as ``replacements=``."""
        runner = self.runner
        execute = getattr(runner, internals.EXECUTE_MODEL)
        forward = getattr(runner, internals.MODEL_FORWARD)

        @functools.wraps(execute)
        def execute_model(scheduler_output, *args, **kwargs):
            if hooks.begin_step is not None:
                hooks.begin_step(scheduler_output)
            self.step = scheduler_output
            try:
                output = execute(scheduler_output, *args, **kwargs)
            finally:
                self.step = None
            if hooks.end_step is not None:
                hooks.end_step(output)
            return output

        @functools.wraps(forward)
        def execute_model_forward(*args, **kwargs):
            step = self.step
            positions = internals.forward_positions(args, kwargs)
            if step is not None and hooks.before_forward is not None:
                self.armed = hooks.before_forward(step, positions)
            try:
                return forward(*args, **kwargs)
            finally:
                self.armed = None
                if step is not None and hooks.after_forward is not None:
                    hooks.after_forward(step, positions)

        def feed_call(module, args, kwargs):  # runs outside the graph, before each compiled call
            context = self.armed
            if context is None:  # warm-up, graph capture, dummy batch, or a step without a context
                context = hooks.off_forward(_num_tokens(args, kwargs))
            return args, {**kwargs, "replacements": context}

        setattr(runner, internals.EXECUTE_MODEL, execute_model)
        setattr(runner, internals.MODEL_FORWARD, execute_model_forward)
        if hooks.off_forward is not None:  # replacement (capture feeds nothing)
            for compiled in self.compiled:
                compiled.register_forward_pre_hook(feed_call, with_kwargs=True)


def _num_tokens(args, kwargs) -> int:
    tokens = kwargs.get(internals.INPUT_IDS_ARG, args[0] if args else None)
    if tokens is None:
        raise TypeError(f"fxreplace: a compiled vllm-neuron call without {internals.INPUT_IDS_ARG!r}: cannot size its "
                        "replacement context")
    return int(tokens.shape[0])


class StepInputReplacement(Replacement):
    """Replacement as a per-step input of each compiled call (vllm-neuron): the reference stays on
    the host, each step gathers there and copies its rows to the device once (into a context per
    bucket, reused by that bucket's every step), and calls outside a step get an all-off context
    of their token count (made once per count, never written)."""

    def __init__(self, side, config: ReplacementConfig):
        if config.select_captures:
            raise ConfigError(f"fxreplace on {side.engine}: select_captures is not supported (each step hands the "
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
            req_ids = self.side.batch_requests()
            if not self.replacer.any_matched(req_ids):
                return self.off(num_tokens)
            layout = self.side.layout(scheduler_output, positions, req_ids)
            out = self.contexts.get(num_tokens)
            if out is None:
                out = self.contexts[num_tokens] = self.replacer.warmup_context(num_tokens, device=self.device)
            context = layout.build(self.replacer, out)
        except Exception as exc:
            self.errors += 1
            logger.error("fxreplace: step served without replacement: %s: %s", type(exc).__name__, exc)
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
        from fxreplace.models import architecture, get_family

        self.side = side
        self.model = side.model
        arch = architecture(side.hf_config, type(self.model).__name__)
        targets = capture.get("targets") or list(getattr(get_family(arch), side.family_targets, ()))
        if not targets:
            raise TargetError(f"fxreplace capture: the {arch} family has no {side.family_targets}; give capture 'targets'")
        resolved = resolve_targets(self.model, list(targets))
        self.max_tokens = int(side.max_tokens)
        instrument(self.model, [r.observed() for r in resolved],
                   max_tokens=self.max_tokens)
        self.names = [r.capture_name for r in resolved]
        widths = [_linear_width(self.model.get_submodule(r.module_name), r.module_name, r.point) for r in resolved]
        edges = np.cumsum([0, *widths]).tolist()
        self.columns = {name: slice(a, b) for name, a, b in zip(self.names, edges, edges[1:])}
        self.dtype = next(self.model.parameters()).dtype
        self.buffer = torch.zeros(self.max_tokens, edges[-1], dtype=self.dtype, device=side.device)
        self.bits = host_bits(torch.zeros(1, dtype=self.dtype)).dtype  # rows held as numpy (bf16 too)
        self._observing = contextlib.ExitStack()  # open for the engine's life
        self._observing.enter_context(observe(self.model, _Recorder(self.buffer, self.columns)))
        self.active: dict[str, _RequestRows] = {}
        self.completed = self.dropped = 0
        self.writes = True
        self.out = Path(capture["out"])
        self.writer = StoreWriter(self.out, metadata={"architecture": arch, "engine": side.engine,
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
            self.active[new.req_id] = _RequestRows(prompt, new.sampling_params, self.buffer.shape[1],
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

    def _write(self, record: _RequestRows) -> None:
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
