"""vllm-neuron's ``NeuronModelRunner`` as a :class:`~fxreplace.engines.protocol.RunnerSide`.

vllm-neuron compiles one graph per bucket (prefill: one request's tokens padded to a token
bucket by repeating its last position; decode: 1 or 1 + k tokens per request, padded at the
end with position 0 to a batch bucket, plus data-parallel padding) and calls the compiled
module itself. So the context is a per-step *input* (see :mod:`.replacement`): right before
each compiled call, ``replacements=`` receives the step's context, or an all-off context of
the same token count for warm-ups, graph capture and dummy batches; the graph is the same
for both, so no bucket compiles twice.

Every vllm-neuron name read here is in :mod:`fxreplace.engines.vllm.neuron.internals`.
"""

from __future__ import annotations

import functools

import torch

from ....config import ConfigError
from ....context import ReplacementContext
from ...protocol import StepHooks, StepLayout, StepRequests
from ..requests import step_requests
from . import internals
from .capture import StepInputCapture
from .replacement import StepInputReplacement
from .sites import MODEL_CODE

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

    model_code = MODEL_CODE  # the family sites it reads (registered by importing .sites)

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

    def replacement_class(self, select_captures: bool) -> type:
        """A context handed to each compiled call: one graph per bucket, called by the runner (the state
        refuses ``select_captures`` itself)."""
        return StepInputReplacement

    def capture_class(self) -> type:
        return StepInputCapture

    def split_by_stage(self, targets: list) -> tuple[list, list]:
        """vllm-neuron shards each model over tensor parallelism inside its graphs: every target is this runner's."""
        return list(targets), []

    def requests(self, scheduler_output) -> StepRequests:
        return step_requests(scheduler_output)

    def layout(self, scheduler_output, positions) -> StepLayout:
        """Request ``i`` computes ``num_scheduled_tokens`` tokens followed by the padding up to its
        ``num_scheduled_tokens_padded`` (a prefill's bucket); every slot after the last request's
        is padding (decode batch buckets, data-parallel padding). The counts are read at the
        forward, after the runner dropped any speculative tokens from the scheduler output."""
        req_ids = internals.batch_requests(self.runner)
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
