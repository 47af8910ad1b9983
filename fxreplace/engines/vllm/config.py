"""The plugin's configuration: where it lives in ``additional_config``, and a
carrier object that survives vLLM's config hashing and pickling.

The fields are :class:`~fxreplace.ReplacementConfig`'s (validated when the
carrier is made: in the front end, before any engine process starts).
vLLM hashes ``additional_config`` with ``json.dumps`` (compile cache key) and
pickles it to start engine processes. Tensors fail the first; a plain object
fails both unless it implements vLLM's hash protocol. :class:`FxReplaceConfig`
is a ``str`` whose value is a digest of the configuration (what ``json.dumps``
and ``compute_hash`` see) and which carries the :class:`ReplacementConfig`,
tensors included, as an attribute that pickles with it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from ...config import ConfigError, ReplacementConfig

CONFIG_KEY = "fxreplace"
NEURON_KEYS = ("neuron_config", "tensor_replacement")
CLUSTER_DOCS = "docs/cluster.md"


def refuse_unsupported(engine_args) -> None:
    """Front end, when fxreplace is configured: refuse an engine layout fxreplace (or
    vLLM on this platform) cannot run, naming the setting, before any worker starts;
    otherwise the failure surfaces deep in a worker as an engine-start error.

    * the Ray executor on a platform without a Ray device key (vLLM's CPU build: it
      would fail placing its workers, after starting Ray);
    * prefill context parallelism: each rank computes a slice of a prompt's tokens,
      while fxreplace maps every rank's rows from the whole scheduled batch.
    """
    backend = engine_args.distributed_executor_backend
    if backend == "ray" or getattr(backend, "uses_ray", False):
        from vllm.platforms import current_platform  # vLLM's platform: read under Ray only

        if not current_platform.ray_device_key:
            raise ConfigError(
                f"distributed_executor_backend={backend!r}: vLLM's {current_platform.device_name} platform has no Ray "
                "device key (ray_device_key is empty), so vLLM cannot place its workers on a Ray cluster; use "
                f"distributed_executor_backend='mp' on one machine, or a platform plugin that names the Ray resource "
                f"of each node's devices (see {CLUSTER_DOCS})")
    pcp = getattr(engine_args, "prefill_context_parallel_size", 1)
    if pcp > 1:
        raise ConfigError(f"prefill_context_parallel_size={pcp}: fxreplace feeds and observes each rank's rows from "
                          "the whole scheduled batch, and under prefill context parallelism a rank computes only a "
                          "slice of it; use tensor, pipeline or data parallelism")


def as_config(spec: Any) -> ReplacementConfig:
    """A dict (or its JSON string), a ReplacementConfig or an FxReplaceConfig -> ReplacementConfig."""
    if isinstance(spec, FxReplaceConfig):
        return spec.config
    if isinstance(spec, ReplacementConfig):
        return spec
    if isinstance(spec, str):  # a JSON string, e.g. from a CLI that did not parse it
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            raise ConfigError(f"fxreplace config is a string that is not JSON: {spec[:80]!r}") from None
    if not isinstance(spec, Mapping):
        raise ConfigError(f"fxreplace config must be a dict or ReplacementConfig, got {type(spec).__name__}")
    try:
        return ReplacementConfig.from_dict(spec)
    except ConfigError as exc:
        raise ConfigError(f"fxreplace config: {exc}") from None


def _digest_value(h, value: Any) -> None:
    """Feed ``value`` into hash ``h``: tensors by dtype, shape and content."""
    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous().cpu()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        h.update(b"{")
        for k in sorted(value, key=repr):
            h.update(repr(k).encode())
            _digest_value(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            _digest_value(h, v)
        h.update(b"]")
    elif hasattr(value, "packed") and hasattr(value, "columns"):  # a ReferenceStore
        _digest_value(h, list(value.packed))
        _digest_value(h, {k: repr(v) for k, v in value.columns.items()})
        _digest_value(h, value.offsets)
        tokens = value.prompt_token_ids  # a TokenTable: its flat ids and offsets
        _digest_value(h, None if tokens is None else [torch.from_numpy(tokens.values), torch.from_numpy(tokens.offsets)])
    else:
        h.update(repr(value).encode())


def _digest(config: ReplacementConfig) -> str:
    fields = config.to_dict()
    h = hashlib.sha256()
    _digest_value(h, fields)
    for key in ("tensors_path", "prompt_token_ids_path"):  # a rewritten file must not reuse a stale cache
        path = fields.get(key)
        if path is not None and os.path.exists(path):
            st = os.stat(path)
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


class FxReplaceConfig(str):
    """fxreplace's configuration as it travels inside ``additional_config``.

    ``FxReplaceConfig(tensors=..., prompt_token_ids=...)`` (ReplacementConfig's
    fields) or ``FxReplaceConfig({...})`` / ``FxReplaceConfig(ReplacementConfig(...))``.
    Its string value is ``"fxreplace:<digest>"``; ``.config`` is the
    :class:`ReplacementConfig`. The plugin wraps plain dicts and ReplacementConfig
    objects found under the config keys automatically, so passing this class is optional.
    """

    config: ReplacementConfig

    def __new__(cls, spec: Any = None, **fields):
        if spec is not None and fields:
            raise ConfigError("give a config object or keyword fields, not both")
        config = as_config(spec if spec is not None else fields)
        obj = super().__new__(cls, f"fxreplace:{_digest(config)}")
        obj.config = config
        return obj

    def __reduce__(self):
        return (_restore, (self.config, str(self)))

    def compute_hash(self) -> str:  # vLLM's SupportsHash protocol
        return str(self)

    def __repr__(self) -> str:
        shown = {k: (f"<{type(v).__name__}>" if k == "tensors" or k == "prompt_token_ids" else v)
                 for k, v in self.config.to_dict().items()}
        return f"FxReplaceConfig({shown})"


def _restore(config: ReplacementConfig, value: str) -> FxReplaceConfig:
    obj = str.__new__(FxReplaceConfig, value)
    obj.config = config
    return obj


def find_config(additional_config: Any) -> Any:
    """The raw fxreplace section of ``additional_config`` (None when absent)."""
    if additional_config is None:
        return None
    if isinstance(additional_config, FxReplaceConfig):
        return additional_config
    getter = getattr(additional_config, "get", None)
    if getter is None:
        return None
    found = getter(CONFIG_KEY)
    neuron = getter(NEURON_KEYS[0])
    nested = neuron.get(NEURON_KEYS[1]) if isinstance(neuron, Mapping) else None
    if found is not None and nested is not None:
        raise ConfigError(f"fxreplace is configured twice: under {CONFIG_KEY!r} and under "
                          f"{NEURON_KEYS[0]!r}/{NEURON_KEYS[1]!r}; keep one")
    return found if found is not None else nested


def parse_config(additional_config: Any) -> FxReplaceConfig | None:
    """The validated config, or None when fxreplace is not configured."""
    raw = find_config(additional_config)
    if raw is None:
        return None
    return raw if isinstance(raw, FxReplaceConfig) else FxReplaceConfig(raw)


def name_graph_key(additional_config: Any, graph_key: str) -> None:
    """In an engine, once its model is instrumented: the fxreplace section of ``additional_config`` (a
    dict) now also names ``graph_key``, the key by which the model's compiled graph reads its entries
    (see :data:`fxreplace.slots.ARMED`). vLLM files the graphs it compiles under a hash of the config:
    a graph saved for another model (another engine of this process, whose model has another key)
    would read that model's entries, so it must never be loaded for this one. (An ``additional_config``
    that is not a dict is hashed by its own ``compute_hash``, which fxreplace's section cannot extend.)"""
    if not isinstance(additional_config, dict):
        return
    carrier = parse_config(additional_config)
    _put_section(additional_config, _restore(carrier.config, f"{str(carrier).split('@')[0]}@{graph_key}"))


def _put_section(additional_config: dict, carrier: FxReplaceConfig) -> None:
    """``carrier`` where the fxreplace section of ``additional_config`` is (its own key or neuron_config's)."""
    if CONFIG_KEY in additional_config:
        additional_config[CONFIG_KEY] = carrier
    else:
        neuron = dict(additional_config[NEURON_KEYS[0]])
        neuron[NEURON_KEYS[1]] = carrier
        additional_config[NEURON_KEYS[0]] = neuron


def wrap_in_place(additional_config: Any) -> None:
    """Replace the fxreplace section of a dict ``additional_config`` by an
    :class:`FxReplaceConfig`, so vLLM can hash and pickle it. No-op when absent."""
    if not isinstance(additional_config, dict):
        return
    if find_config(additional_config) is None:
        return
    _put_section(additional_config, parse_config(additional_config))
