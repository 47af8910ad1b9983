"""Every vLLM internal the plugin relies on, named in one place.

vLLM has no public API for "run code before each forward with the scheduler's
batch"; the plugin uses the V1 model runner's private structure. Each name below
is read through this module only, and :func:`check` reports which of them a
vLLM upgrade moved (``tests/test_vllm.py`` fails with its message), so an
upgrade breaks loudly at one place instead of deep inside a worker.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re

#: (module, class) -> the attributes of it that fxreplace reads or wraps.
(ENGINE_ARGS, GPU_MODEL_RUNNER, CPU_MODEL_RUNNER, INPUT_BATCH, SCHEDULER_OUTPUT, INPUT_PROCESSOR,
 ENGINE_CORE_REQUEST, VALIDATION_ERROR, NEW_REQUEST_DATA) = (
    ("vllm.engine.arg_utils", "EngineArgs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch"),
    ("vllm.v1.core.sched.output", "SchedulerOutput"),
    ("vllm.v1.engine.input_processor", "InputProcessor"),
    ("vllm.v1.engine", "EngineCoreRequest"),
    ("vllm.exceptions", "VLLMValidationError"),
    ("vllm.v1.core.sched.output", "NewRequestData"),
)

#: ``EngineArgs.create_engine_config``: the front end builds the engine config
#: here (the plugin validates and wraps the fxreplace section before it).
CREATE_ENGINE_CONFIG = "create_engine_config"
#: ``InputProcessor.process_inputs`` (front end, once per request) returns an
#: ``EngineCoreRequest``; a VLLMValidationError raised there refuses the request
#: (HTTP 400 online) and the engine keeps serving.
PROCESS_INPUTS = "process_inputs"
ENGINE_CORE_REQUEST_FIELDS = ("request_id", "prompt_token_ids", "sampling_params")
#: model runner methods: ``load_model`` (instrument after loading), ``execute_model``
#: (one scheduler step), ``_model_forward`` (private: the model call of one step).
LOAD_MODEL = "load_model"
EXECUTE_MODEL = "execute_model"
MODEL_FORWARD = "_model_forward"
#: ``_model_forward(input_ids, positions, ...)``: positions by keyword, else the
#: second positional argument.
POSITIONS_ARG = "positions"
POSITIONS_INDEX = 1
#: ``_dummy_run(num_tokens)``: a forward without requests (vLLM's own warm-up and
#: profile runs use it); ``do_not_compile``: the attribute of vLLM's
#: ``@support_torch_compile`` modules that makes their ``__call__`` run eagerly.
DUMMY_RUN = "_dummy_run"
DO_NOT_COMPILE = "do_not_compile"
COMPILE_DECORATOR = ("vllm.compilation.decorators", "support_torch_compile")
#: model runner attributes: ``vllm_config.additional_config``, ``model``,
#: ``model_config.hf_config``, ``max_num_tokens`` (the largest batch: buffer rows),
#: ``input_batch`` (the persistent batch, in the order the forward lays tokens out).
RUNNER_ATTRS = ("vllm_config", "model", "model_config", "max_num_tokens", "input_batch")
#: ``InputBatch``: ``_req_ids`` and ``req_id_to_index`` (behind the ``req_ids`` and
#: ``num_reqs`` properties), ``num_computed_tokens_cpu`` (numpy, for positions when they
#: live on a device).
INPUT_BATCH_ATTRS = ("_req_ids", "req_id_to_index", "num_computed_tokens_cpu")
#: ``SchedulerOutput``: new requests, finished ids, tokens scheduled per request.
SCHEDULER_OUTPUT_FIELDS = ("scheduled_new_reqs", "finished_req_ids", "num_scheduled_tokens")
#: ``NewRequestData``: what registration reads.
NEW_REQUEST_FIELDS = ("req_id", "prompt_token_ids", "sampling_params")

#: Capture mode (fxreplace.engines.vllm.capture) reads besides: ``sample_tokens`` (returns
#: the step's ``ModelRunnerOutput``: ``req_ids``, ``sampled_token_ids``),
#: ``execute_model_state`` (set by ``execute_model``: ``logits`` of the sampled rows,
#: ``spec_decode_metadata.logits_indices``), the runner's ``cache_config``,
#: ``use_async_scheduling`` and ``num_spec_tokens``, the scheduler output's
#: ``preempted_req_ids``, a new request's ``num_computed_tokens``, and the
#: scheduler's stop rule ``check_stop(request, max_model_len)``.
SAMPLE_TOKENS = "sample_tokens"
EXECUTE_MODEL_STATE = "execute_model_state"
CAPTURE_RUNNER_ATTRS = ("cache_config", "use_async_scheduling", "num_spec_tokens", EXECUTE_MODEL_STATE)
EXECUTE_MODEL_STATE_CLASS = ("vllm.v1.worker.gpu_model_runner", "ExecuteModelState")
EXECUTE_MODEL_STATE_FIELDS = ("logits", "spec_decode_metadata")
MODEL_RUNNER_OUTPUT = ("vllm.v1.outputs", "ModelRunnerOutput")
MODEL_RUNNER_OUTPUT_FIELDS = ("req_ids", "sampled_token_ids")
CAPTURE_SCHEDULER_OUTPUT_FIELDS = ("preempted_req_ids",)
CAPTURE_NEW_REQUEST_FIELDS = ("num_computed_tokens",)
CHECK_STOP = ("vllm.v1.core.sched.utils", "check_stop")
#: ``ParallelConfig.data_parallel_index``: the engine's data-parallel rank, also for dense
#: models (whose replicas vLLM runs with ``data_parallel_size`` 1 and rank 0).
PARALLEL_CONFIG = ("vllm.config.parallel", "ParallelConfig")
PARALLEL_CONFIG_FIELDS = ("data_parallel_index", "data_parallel_size")
#: ``PPMissingLayer``: what a pipeline stage's model holds in place of the layers of the
#: other stages.
PP_MISSING_LAYER = ("vllm.model_executor.models.utils", "PPMissingLayer")
#: ``AttentionLayerBase``: every attention layer's base. Outside a scheduled step (the start-up
#: dummy forward) it has no attention metadata and returns its output buffer unwritten, so a
#: module holding one computes other bits on every call there.
ATTENTION_LAYER = ("vllm.model_executor.layers.attention_layer_base", "AttentionLayerBase")
#: ``WorkerBase``: the plugin adds the methods below to it, for ``llm.collective_rpc(name)``
#: (a worker wrapper forwards unknown attributes to its worker). A name crosses vLLM's
#: serializer as a string; a function would need pickle (``VLLM_ALLOW_INSECURE_SERIALIZATION``).
WORKER_BASE = ("vllm.v1.worker.worker_base", "WorkerBase")
#: close a capturing worker's store, return its counts (:func:`fxreplace.engines.vllm.capture_worker.finish_capture`)
FINISH_CAPTURE_METHOD = "fxreplace_finish_capture"
#: what a worker's fxreplace state did so far (:func:`fxreplace.engines.vllm.plugin.worker_state`)
WORKER_STATE_METHOD = "fxreplace_worker_state"
#: what replacing each component spans in a worker's model (:func:`fxreplace.engines.vllm.plugin.worker_covers`)
COVERS_METHOD = "fxreplace_covers"


def _import(where: tuple[str, str]):
    return getattr(importlib.import_module(where[0]), where[1])


def engine_args():
    return _import(ENGINE_ARGS)


def worker_base():
    return _import(WORKER_BASE)


def input_processor():
    return _import(INPUT_PROCESSOR)


def refuse(message: str, parameter: str) -> Exception:
    """The error that refuses one request in the front end (400 online)."""
    return _import(VALIDATION_ERROR)(message, parameter=parameter)


def model_runner_classes() -> list[type]:
    """The V1 model runner classes whose ``load_model`` the plugin wraps (the CPU
    runner overrides it; GPU builds have no CPU runner)."""
    classes = [_import(GPU_MODEL_RUNNER)]
    try:
        classes.append(_import(CPU_MODEL_RUNNER))
    except (ImportError, AttributeError):
        pass
    return classes


def forward_positions(args: tuple, kwargs: dict):
    """The positions tensor of one ``_model_forward(*args, **kwargs)`` call."""
    if POSITIONS_ARG in kwargs:
        return kwargs[POSITIONS_ARG]
    return args[POSITIONS_INDEX] if len(args) > POSITIONS_INDEX else None


def wrap_steps(runner, *, begin_step, before_forward=None, after_forward=None, dummy_forward=None,
               end_step=None, after_sample=None) -> None:
    """Per-step wrappers on one runner *instance* (its bound methods; the class and
    unconfigured runners stay untouched), the only place fxreplace hooks a step:

    * ``begin_step(scheduler_output)`` before each ``execute_model``;
    * around each model forward of that step (never a dummy or profile run: those
      happen outside ``execute_model``) ``before_forward(scheduler_output, positions)``
      and, even when the forward raises, ``after_forward(scheduler_output, positions)``;
    * ``dummy_forward()`` before each forward outside a step (vLLM's dummy and profile runs);
    * ``end_step(output)`` after ``execute_model`` returns (``None`` when the step's
      tokens are sampled by a later ``sample_tokens``);
    * ``after_sample(output)`` with what each ``sample_tokens`` returns.
    """
    execute = getattr(runner, EXECUTE_MODEL)
    forward = getattr(runner, MODEL_FORWARD)
    step = [None]  # the scheduler output of the step being executed

    @functools.wraps(execute)
    def execute_model(scheduler_output, *args, **kwargs):
        begin_step(scheduler_output)
        step[0] = scheduler_output
        try:
            output = execute(scheduler_output, *args, **kwargs)
        finally:
            step[0] = None
        if end_step is not None:
            end_step(output)
        return output

    @functools.wraps(forward)
    def model_forward(*args, **kwargs):
        scheduler_output = step[0]
        if scheduler_output is None:  # dummy/profile run
            if dummy_forward is not None:
                dummy_forward()
            return forward(*args, **kwargs)
        positions = kwargs[POSITIONS_ARG] if POSITIONS_ARG in kwargs else forward_positions(args, kwargs)
        if before_forward is not None:
            before_forward(scheduler_output, positions)
        if after_forward is None:
            return forward(*args, **kwargs)
        try:
            return forward(*args, **kwargs)
        finally:
            after_forward(scheduler_output, positions)

    setattr(runner, EXECUTE_MODEL, execute_model)
    setattr(runner, MODEL_FORWARD, model_forward)
    if after_sample is not None:
        sample = getattr(runner, SAMPLE_TOKENS)

        @functools.wraps(sample)
        def sample_tokens(*args, **kwargs):
            output = sample(*args, **kwargs)
            after_sample(output)
            return output

        setattr(runner, SAMPLE_TOKENS, sample_tokens)


#: the model runner attribute that holds fxreplace's state of that runner (set at model load)
STATE_ATTR = "_fxreplace_state"


def get_state(runner):
    """The fxreplace state of a model runner: a
    :class:`~fxreplace.engines.vllm.replacement.VllmReplacement`, a
    :class:`~fxreplace.engines.vllm.capture_worker.VllmCapture`, or None when not configured."""
    return getattr(runner, STATE_ATTR, None)


def batch_requests(runner) -> list[str]:
    """Request ids of the step being run, in the order its tokens are laid out: the
    persistent batch's own list (read it, never keep or change it). Read through the
    attributes behind the ``req_ids``/``num_reqs`` properties (once per forward; each
    property is a Python call). The batch is condensed before every forward, so the list
    holds exactly ``num_reqs`` ids."""
    batch = runner.input_batch
    ids = batch._req_ids
    num_reqs = len(batch.req_id_to_index)
    return ids if len(ids) == num_reqs else ids[:num_reqs]


def data_parallel_rank(runner) -> int:
    """This engine's data-parallel rank (``data_parallel_index``: kept for dense-model
    replicas, whose ``data_parallel_rank`` vLLM resets to 0)."""
    return int(runner.vllm_config.parallel_config.data_parallel_index)


def check_stop():
    """vLLM's own stop rule (EOS, stop token ids, max_tokens, model length)."""
    return _import(CHECK_STOP)


def eager_forward(runner, num_tokens: int) -> None:
    """Run the model once on ``num_tokens`` dummy tokens, eagerly even in compiled
    mode (before vLLM compiles it, and without triggering a compile); vLLM's CPU
    runner runs no warm-up forward in eager mode, nor with ``VLLM_CPU_CI_ENV``."""
    compiled = [m for m in runner.model.modules() if hasattr(m, DO_NOT_COMPILE)]
    saved = [getattr(m, DO_NOT_COMPILE) for m in compiled]
    try:
        for m in compiled:
            setattr(m, DO_NOT_COMPILE, True)
        getattr(runner, DUMMY_RUN)(num_tokens)
    finally:
        for m, value in zip(compiled, saved):
            setattr(m, DO_NOT_COMPILE, value)


def split_by_stage(model, targets: list) -> tuple[list, list]:
    """``targets`` as (this pipeline stage's, other stages'). A target is another stage's
    when its pattern names a layer that stage holds (here a placeholder), or a module
    inside one, e.g. ``model.layers.3.mlp.gate`` on a stage without layer 3; a pattern
    with a wildcard before the layer number (``model.layers.*.mlp.gate``) is every
    stage's, matching the layers each holds. Without pipeline parallelism all are this
    stage's."""
    placeholder = _import(PP_MISSING_LAYER)
    elsewhere = [name for name, module in model.named_modules() if isinstance(module, placeholder)]
    here, there = [], []
    for target in targets:
        pattern = target if isinstance(target, str) else target.pattern
        fixed = re.split(r"[*?\[]", pattern, maxsplit=1)[0]  # the start no wildcard can change
        other = any(fixed.startswith(f"{layer}.") or pattern == layer for layer in elsewhere)
        (there if other else here).append(target)
    return here, there


def holds_attention(module) -> bool:
    """Whether ``module`` is or holds one of vLLM's attention layers."""
    layer = _import(ATTENTION_LAYER)
    return any(isinstance(m, layer) for m in module.modules())


def computed_tokens(runner):
    """Tokens each request of the batch has computed before this step (numpy, host)."""
    return runner.input_batch.num_computed_tokens_cpu


def check() -> list[str]:
    """What this vLLM no longer provides of the above, one line each (empty: all present)."""
    problems = []

    def need(where, attrs, how):
        try:
            cls = _import(where)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{where[0]}.{where[1]} is gone ({exc})")
            return
        for attr in attrs:
            if not how(cls, attr):
                problems.append(f"{where[0]}.{where[1]} has no {attr!r}")
        return cls

    def has_attr(cls, attr):
        return hasattr(cls, attr)

    def has_field(cls, attr):  # dataclasses (vLLM's scheduler output types are)
        return attr in getattr(cls, "__dataclass_fields__", {})

    def set_on_instances(cls, attr):
        return hasattr(cls, attr) or re.search(rf"self\.{attr}\s*[:=]", inspect.getsource(cls)) is not None

    need(ENGINE_ARGS, (CREATE_ENGINE_CONFIG,), has_attr)
    need(ATTENTION_LAYER, (), has_attr)
    runner = need(GPU_MODEL_RUNNER, (LOAD_MODEL, EXECUTE_MODEL, MODEL_FORWARD, DUMMY_RUN), has_attr)
    decorators = need(COMPILE_DECORATOR, (), has_attr)
    if decorators is not None and not re.search(rf"self\.{DO_NOT_COMPILE}\s*=", inspect.getsource(
            inspect.getmodule(decorators))):
        problems.append(f"{COMPILE_DECORATOR[0]} no longer sets {DO_NOT_COMPILE!r} on compiled modules")
    if runner is not None:
        need(GPU_MODEL_RUNNER, RUNNER_ATTRS, set_on_instances)
    if runner is not None and hasattr(runner, MODEL_FORWARD):
        params = list(inspect.signature(getattr(runner, MODEL_FORWARD)).parameters)
        if params[POSITIONS_INDEX + 1: POSITIONS_INDEX + 2] != [POSITIONS_ARG]:  # +1: self
            problems.append(f"{GPU_MODEL_RUNNER[1]}.{MODEL_FORWARD} no longer takes {POSITIONS_ARG!r} as "
                            f"argument {POSITIONS_INDEX}: its parameters are {params}")
    need(INPUT_BATCH, INPUT_BATCH_ATTRS, set_on_instances)
    need(SCHEDULER_OUTPUT, SCHEDULER_OUTPUT_FIELDS, has_field)
    need(NEW_REQUEST_DATA, NEW_REQUEST_FIELDS + CAPTURE_NEW_REQUEST_FIELDS, has_field)
    # capture mode
    if runner is not None:
        need(GPU_MODEL_RUNNER, (SAMPLE_TOKENS,), has_attr)
        need(GPU_MODEL_RUNNER, CAPTURE_RUNNER_ATTRS, set_on_instances)
    need(EXECUTE_MODEL_STATE_CLASS, EXECUTE_MODEL_STATE_FIELDS, lambda cls, attr: attr in getattr(cls, "_fields", ()))
    need(MODEL_RUNNER_OUTPUT, MODEL_RUNNER_OUTPUT_FIELDS, has_field)
    need(PARALLEL_CONFIG, PARALLEL_CONFIG_FIELDS, has_field)
    need(PP_MISSING_LAYER, (), has_attr)
    need(WORKER_BASE, (), has_attr)
    need(SCHEDULER_OUTPUT, CAPTURE_SCHEDULER_OUTPUT_FIELDS, has_field)
    try:
        check_stop()
    except (ImportError, AttributeError) as exc:
        problems.append(f"{CHECK_STOP[0]}.{CHECK_STOP[1]} is gone ({exc})")
    need(INPUT_PROCESSOR, (PROCESS_INPUTS,), has_attr)
    need(ENGINE_CORE_REQUEST, ENGINE_CORE_REQUEST_FIELDS, lambda cls, attr: attr in cls.__struct_fields__)
    need(VALIDATION_ERROR, (), has_attr)
    return problems
