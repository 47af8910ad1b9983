"""The vLLM plugin: instruments vLLM's own model at load time and feeds each
forward the replacement built from the scheduler's actual batch.

``register()`` (entry point ``vllm.general_plugins``) runs in every vLLM process
(front end, engine core, workers). It sends fxreplace's log records to vLLM's
logger handler and only patches classes, idempotently (every vLLM name it relies
on is in :mod:`fxreplace.engines.vllm.internals`):

* ``EngineArgs.create_engine_config`` (front end): validates the fxreplace section
  of ``additional_config`` (a :class:`~fxreplace.ReplacementConfig`; errors name
  the field, before any engine process starts) and wraps it in an
  :class:`~fxreplace.engines.vllm.config.FxReplaceConfig` so vLLM can hash and pickle it;
* ``InputProcessor.process_inputs`` (front end, per request): with
  ``on_unknown="error"`` refuses a prompt that is not in the reference;
* the model runners' ``load_model``: after loading, when configured, builds a
  :class:`~fxreplace.engines.vllm.replacement.VllmReplacement` (instrument + static buffers) before warmup compiles,
  and runs one eager dummy forward so every injection point is checked at start-up;
* when configured, that runner *instance* (not the class) gets two wrappers:
  ``execute_model`` registers new requests and releases finished ones;
  ``_model_forward`` builds the context for the batch and fills the buffers in
  place: every row the forward reads, padding rows off, so nothing needs clearing
  after it; a dummy or profile run (no scheduled batch) clears the mask first.

Unconfigured, nothing runs per step: the class-level wrappers only act at engine
configuration, request submission and model load, and step methods are never wrapped.
The per-runner state, and what a request may ask of it, live in
:mod:`fxreplace.engines.vllm.replacement`.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os

from ...covers import components_from_data, covers_to_data
from ...matching import PromptIndex
from ...replacer.sources import reference_capture_names, reference_token_ids
from ...targets import TargetError
from . import internals
from .neuron import internals as neuron_internals
from .config import NEURON_KEYS, ConfigError, name_graph_key, parse_config, refuse_unsupported, wrap_in_place
from .runners import VllmRunner
from .startup import report_start_error
from ..replacement import NoTargetOnThisStage, Replacement
from .requests import selection_of, switched_off

logger = logging.getLogger("fxreplace.vllm")

_MARK = "_fxreplace_wrapped"
_PROMPTS_ATTR = "_fxreplace_prompts"
_CAPTURES_ATTR = "_fxreplace_capture_names"
_UNSET = object()
_registered = False


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
            _wrap(cls, internals.LOAD_MODEL, _load_model(VllmRunner))
    try:  # vllm-neuron's runner, where that platform plugin is installed
        neuron_runner = neuron_internals.runner_class()
    except (ImportError, AttributeError):
        neuron_runner = None
    if neuron_runner is not None:
        from .neuron import NeuronRunner  # where vllm-neuron is installed only

        _wrap(neuron_runner, neuron_internals.LOAD_MODEL, _load_model(NeuronRunner))
    worker = internals.worker_base()
    setattr(worker, internals.FINISH_CAPTURE_METHOD, _finish_capture)
    setattr(worker, internals.WORKER_STATE_METHOD, worker_state)
    setattr(worker, internals.COVERS_METHOD, worker_covers)
    _registered = True


def _finish_capture(worker) -> dict | None:
    from .capture_worker import finish_capture  # capture's state: in a capturing worker only

    return finish_capture(worker)


def worker_state(worker) -> dict | None:
    """``llm.collective_rpc("fxreplace_worker_state")``: this worker's process, ranks and what
    its fxreplace state did so far (None: the worker holds none)."""
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank  # asked in a vLLM worker only

    state = internals.get_state(worker.model_runner)
    if state is None:
        return None
    return {"pid": os.getpid(), "host_ip": os.environ.get("VLLM_HOST_IP"), "pp_rank": get_pp_group().rank_in_group,
            "tp_rank": get_tensor_model_parallel_rank(), **state.summary()}


def worker_covers(worker, components: list) -> dict | None:
    """``llm.collective_rpc("fxreplace_covers", args=(components,))``: what replacing each component
    (:func:`~fxreplace.covers.components_to_data`) spans in this worker's model, as plain data (None: the worker
    holds no replacement state: a capturing one, or none)."""
    state = internals.get_state(worker.model_runner)
    if not isinstance(state, Replacement):
        return None
    return covers_to_data(state.covers(components_from_data(components)))


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
        _refuse_shared_key_on_neuron(getattr(self, "additional_config", None))
        wrap_in_place(getattr(self, "additional_config", None))
        config = parse_config(getattr(self, "additional_config", None))
        if config is not None:
            refuse_unsupported(self)
        if config is not None and config.config.capture is not None:
            from .capture import prepare_engine_args  # capture's checks: a capture configured only

            prepare_engine_args(self, config.config.capture)
        return original(self, *args, **kwargs)

    return create_engine_config


def _refuse_shared_key_on_neuron(additional_config) -> None:
    """On vllm-neuron, ``neuron_config.tensor_replacement`` configures vllm-neuron's own replacer:
    fxreplace reading it too would replace twice, so there fxreplace is configured under
    ``fxreplace`` only."""
    neuron = additional_config.get(NEURON_KEYS[0]) if isinstance(additional_config, dict) else None
    if isinstance(neuron, dict) and neuron.get(NEURON_KEYS[1]) is not None and neuron_internals.on_neuron():
        from .neuron.runner import SHARED_KEY_HINT  # on vllm-neuron only

        raise ConfigError(f"fxreplace: {SHARED_KEY_HINT}; to use vllm-neuron's own replacer instead, leave fxreplace's "
                          "plugin out of VLLM_PLUGINS")


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
        if prompts is None or tokens is None or switched_off(request.sampling_params):
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
    token_ids = reference_token_ids(config.config)
    if token_ids is None:  # nothing to match against: the workers report each request
        return None
    return PromptIndex(list(token_ids.values()) if isinstance(token_ids, dict) else token_ids)


def _check_selection(processor, request) -> None:
    """Front end: a selection ``{"captures": [names]}`` must be a list of capture names the
    reference holds, sent to an engine configured with ``select_captures``."""
    selection = selection_of(request.sampling_params)
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
            names = set(reference_capture_names(config.config))
            setattr(processor, _CAPTURES_ATTR, names)
        unknown = [c for c in captures if c not in names]
        if not unknown:
            return
        close = {c: difflib.get_close_matches(c, names, n=2) for c in unknown[:4]}
        problem = f"selects capture(s) {unknown} that the reference does not hold (closest: {close})"
    raise internals.refuse(f"fxreplace: request {request.request_id} {problem}", parameter="extra_args")


def _load_model(side_kind):
    """A runner class's ``load_model`` wrapper: after loading, the runner seen as ``side_kind``
    (a runner protocol implementation) gets fxreplace's state when configured."""
    def wrap(original):
        def load_model(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            if internals.get_state(self) is None:
                config = parse_config(self.vllm_config.additional_config)
                if config is not None:
                    attach_state(side_kind(self), config)
            return out

        return load_model

    return wrap


def attach_state(side, config) -> None:
    """After a runner loaded its model: when fxreplace is configured, build its capture or
    replacement state through the runner protocol (instrumenting the model before the runner
    compiles it), install the state's per-step hooks on that runner instance and keep the
    state on it. Unconfigured, nothing is installed: no per-step code runs. An fxreplace error
    here fails the engine's start and is reported to the command that started it."""
    try:
        _attach_state(side, config)
    except (TargetError, ConfigError) as error:
        report_start_error(error)
        raise


def _attach_state(side, config) -> None:
    if config.config.capture is not None:
        _keep(side, side.capture_class()(side, config.config.capture))
    else:
        try:
            state = side.replacement_class(config.config.select_captures)(side, config.config)
        except NoTargetOnThisStage as exc:
            logger.info("fxreplace: %s", exc)
            return
        _keep(side, state)
        state.check_points()


def _keep(side, state) -> None:
    """``state`` kept on its runner, its hooks installed, and its model's key named in the config
    that vLLM files the model's compiled graphs under (see :func:`~.config.name_graph_key`)."""
    runner = side.runner
    setattr(runner, internals.STATE_ATTR, state)
    name_graph_key(runner.vllm_config.additional_config, state.model._fxreplace.key)
    side.install(state.hooks())
