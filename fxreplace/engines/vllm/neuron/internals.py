"""Every vllm-neuron internal fxreplace relies on, named in one place (the native plugin line,
vllm-neuron 0.24.x on vLLM 0.24: ``vllm_neuron/vllm/worker/neuron_model_runner.py`` and
``vllm_neuron/vllm/core/scheduler.py``), read as in :mod:`fxreplace.engines.vllm.internals`:
:func:`check` reports by name what an upgrade moved.

vllm-neuron's ``NeuronModelRunner`` is not a vLLM ``GPUModelRunner``: it builds its model as a
plain ``nn.Module``, wraps it in ``torch.compile`` (``model``, and ``capture_backend_model`` for
graph capture; each keeps the module as ``_orig_mod``), compiles per bucket in
``warmup_prefill``/``warmup_decode``, and calls the compiled module itself with keyword inputs:
in ``_execute_model_forward(input_ids, positions, ...)`` for a scheduled step (``positions`` on
the host, padded), directly for warm-ups, graph capture and ``execute_dummy_batch``.
"""

from __future__ import annotations

import importlib
import inspect
import re

#: (module, class) of the runner, the scheduler (it sets ``num_scheduled_tokens_padded``)
NEURON_MODEL_RUNNER = ("vllm_neuron.vllm.worker.neuron_model_runner", "NeuronModelRunner")
NEURON_SCHEDULER = ("vllm_neuron.vllm.core.scheduler", "NeuronScheduler")
#: the package whose platform class marks a vllm-neuron engine
PLATFORM_PACKAGE = "vllm_neuron"

#: runner methods: ``load_model`` (builds, moves and compiles the model), ``execute_model``
#: (one scheduler step), ``_execute_model_forward`` (private: the compiled call of one step)
LOAD_MODEL = "load_model"
EXECUTE_MODEL = "execute_model"
MODEL_FORWARD = "_execute_model_forward"
#: ``_execute_model_forward(input_ids, positions, ...)``: host positions, padded, by keyword
#: or as the second positional argument
POSITIONS_ARG = "positions"
POSITIONS_INDEX = 1
#: forwards outside a step, which fxreplace feeds an all-off context through the compiled call
OFF_STEP_METHODS = ("warmup_prefill", "warmup_decode", "execute_dummy_batch")
#: the compiled calls' keyword that carries the step's tokens (its length is the bucket's)
INPUT_IDS_ARG = "input_ids"
#: runner attributes: the compiled wrappers (``capture_backend_model`` may be None), the
#: original module inside them, the persistent batch, the sizes, the config
COMPILED_MODELS = ("model", "capture_backend_model")
ORIGINAL_MODULE = "_orig_mod"  # torch.compile's OptimizedModule keeps the module it wraps here
RUNNER_ATTRS = ("vllm_config", "device", "input_batch", "max_num_batched_tokens", "max_num_reqs",
                "speculative_config", "use_async_scheduling") + COMPILED_MODELS
#: vllm-neuron's own replacer: built by ``init_tensor_replacement`` from ``neuron_config.tensor_replacement``
#: (fxreplace keeps that key unset on Neuron, so it stays None)
OWN_REPLACER = "_tensor_replacer"
#: ``SchedulerOutput``: what registration and the layout read; ``num_scheduled_tokens_padded``
#: is set by vllm-neuron's scheduler and edited by the runner when it drops speculative tokens
SCHEDULER_OUTPUT_FIELDS = ("scheduled_new_reqs", "finished_req_ids", "num_scheduled_tokens",
                           "total_num_scheduled_tokens")
PADDED_COUNTS = "num_scheduled_tokens_padded"
#: the key both vllm-neuron and (elsewhere) fxreplace read
SHARED_KEY = ("neuron_config", "tensor_replacement")


def _import(where: tuple[str, str]):
    return getattr(importlib.import_module(where[0]), where[1])


def runner_class() -> type:
    return _import(NEURON_MODEL_RUNNER)


def on_neuron() -> bool:
    """Whether vLLM's current platform is vllm-neuron's (the front end's view)."""
    try:
        from vllm.platforms import current_platform  # vLLM loads in its own processes, not with fxreplace
    except ImportError:
        return False
    return type(current_platform).__module__.startswith(PLATFORM_PACKAGE)


def original_module(compiled):
    """The module a ``torch.compile`` wrapper runs (the module itself when not wrapped)."""
    return getattr(compiled, ORIGINAL_MODULE, compiled)


def compiled_models(runner) -> list:
    """The runner's compiled wrappers that exist (graph capture may be off)."""
    return [m for m in (getattr(runner, name, None) for name in COMPILED_MODELS) if m is not None]


def forward_positions(args: tuple, kwargs: dict):
    """The positions tensor of one ``_execute_model_forward(*args, **kwargs)`` call."""
    if POSITIONS_ARG in kwargs:
        return kwargs[POSITIONS_ARG]
    return args[POSITIONS_INDEX] if len(args) > POSITIONS_INDEX else None


def batch_requests(runner) -> list[str]:
    """The step's request ids in slot order (the persistent batch, condensed before the forward)."""
    batch = runner.input_batch
    return list(batch.req_ids[:batch.num_reqs])


def padded_counts(scheduler_output, req_ids: list[str]) -> list[int] | None:
    """Slots per request, padding included (None: the scheduler set none)."""
    padded = getattr(scheduler_output, PADDED_COUNTS, None)
    return None if padded is None else [int(padded.get(r, 0)) for r in req_ids]


def check() -> list[str]:
    """What this vllm-neuron no longer provides of the above, one line each (empty: all present)."""
    problems = []
    try:
        cls = runner_class()
    except (ImportError, AttributeError) as exc:
        return [f"{NEURON_MODEL_RUNNER[0]}.{NEURON_MODEL_RUNNER[1]} is gone ({exc})"]
    for name in (LOAD_MODEL, EXECUTE_MODEL, MODEL_FORWARD, *OFF_STEP_METHODS):
        if not hasattr(cls, name):
            problems.append(f"{NEURON_MODEL_RUNNER[1]} has no {name!r}")
    source = inspect.getsource(cls)
    for attr in RUNNER_ATTRS + (OWN_REPLACER,):
        if not re.search(rf"self\.{attr}\s*[:=]", source):
            problems.append(f"{NEURON_MODEL_RUNNER[1]} no longer sets {attr!r}")
    if hasattr(cls, MODEL_FORWARD):
        params = list(inspect.signature(getattr(cls, MODEL_FORWARD)).parameters)
        if params[POSITIONS_INDEX + 1: POSITIONS_INDEX + 2] != [POSITIONS_ARG]:  # +1: self
            problems.append(f"{NEURON_MODEL_RUNNER[1]}.{MODEL_FORWARD} no longer takes {POSITIONS_ARG!r} as argument "
                            f"{POSITIONS_INDEX}: its parameters are {params}")
    if not re.search(rf"\b{INPUT_IDS_ARG}\b", source):
        problems.append(f"{NEURON_MODEL_RUNNER[1]} no longer calls its model with {INPUT_IDS_ARG!r}")
    try:
        scheduler = inspect.getsource(inspect.getmodule(_import(NEURON_SCHEDULER)))
        if PADDED_COUNTS not in scheduler:
            problems.append(f"{NEURON_SCHEDULER[0]} no longer sets {PADDED_COUNTS!r}")
    except (ImportError, AttributeError) as exc:
        problems.append(f"{NEURON_SCHEDULER[0]}.{NEURON_SCHEDULER[1]} is gone ({exc})")
    from vllm.v1.core.sched.output import SchedulerOutput  # vLLM loads in its own processes, not with fxreplace

    for name in SCHEDULER_OUTPUT_FIELDS:
        if name not in getattr(SchedulerOutput, "__dataclass_fields__", {}):
            problems.append(f"vllm.v1.core.sched.output.SchedulerOutput has no {name!r}")
    return problems
