"""The plugin's configuration: where it lives in ``additional_config``, its
fields, and a carrier object that survives vLLM's config hashing and pickling.

vLLM hashes ``additional_config`` with ``json.dumps`` (compile cache key) and
pickles it to start engine processes. Tensors fail the first; a plain object
fails both unless it implements vLLM's hash protocol. :class:`FxReplaceConfig`
is a ``str`` whose value is a digest of the configuration (what ``json.dumps``
and ``compute_hash`` see) and which carries the fields, tensors included, as
an attribute that pickles with it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import fields as dataclass_fields, is_dataclass
from typing import Any

import torch

from ..replacer import TensorReplacementConfig

CONFIG_KEY = "fxreplace"
NEURON_KEYS = ("neuron_config", "tensor_replacement")

FIELDS = (
    "tensors", "tensors_path", "prompt_token_ids", "prompt_token_ids_path",
    "targets", "name_map", "on_unknown", "capture",
)


class ConfigError(ValueError):
    """The fxreplace section of ``additional_config`` is malformed."""


def _fields_of(spec: Any) -> dict:
    """Normalise a dict, a TensorReplacementConfig or an FxReplaceConfig to a field dict."""
    if isinstance(spec, FxReplaceConfig):
        return dict(spec.fields)
    if is_dataclass(spec) and not isinstance(spec, type):
        spec = {f.name: getattr(spec, f.name) for f in dataclass_fields(spec)}
    if isinstance(spec, str):  # a JSON string, e.g. from a CLI that did not parse it
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            raise ConfigError(f"fxreplace config is a string that is not JSON: {spec[:80]!r}") from None
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"fxreplace config must be a dict or TensorReplacementConfig, got {type(spec).__name__}"
        )
    unknown = sorted(set(spec) - set(FIELDS))
    if unknown:
        raise ConfigError(f"unknown fxreplace config field(s) {unknown}; known fields: {list(FIELDS)}")
    out = {k: v for k, v in spec.items() if v is not None}
    if "capture" in out:  # capture mode (fxreplace.vllm.capture): observes, replaces nothing
        from .capture import check_capture_config

        both = sorted(set(out) & {"tensors", "tensors_path", "prompt_token_ids", "prompt_token_ids_path"})
        if both:
            raise ConfigError(f"fxreplace config has 'capture' and a reference ({both}): capture and replacement "
                              "run in separate engines")
        out["capture"] = check_capture_config(out["capture"])
        return out
    try:  # the reference source: TensorReplacementConfig's own checks
        TensorReplacementConfig(**{f.name: out.get(f.name) for f in dataclass_fields(TensorReplacementConfig)})
    except ValueError as exc:
        raise ConfigError(f"fxreplace config: {exc} (got fields {sorted(out)})") from None
    on_unknown = out.get("on_unknown", "passthrough")
    if on_unknown not in ("passthrough", "error"):
        raise ConfigError(f"on_unknown must be 'passthrough' or 'error', got {on_unknown!r}")
    for key in ("tensors_path", "prompt_token_ids_path"):
        if key in out:
            out[key] = os.fspath(out[key])
    if "name_map" in out and not isinstance(out["name_map"], Mapping):
        raise ConfigError(f"name_map must map capture names to vLLM module names, got {type(out['name_map']).__name__}")
    return out


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
        _digest_value(h, value.prompt_token_ids)
    else:
        h.update(repr(value).encode())


def _digest(fields: Mapping) -> str:
    h = hashlib.sha256()
    _digest_value(h, dict(fields))
    for key in ("tensors_path", "prompt_token_ids_path"):  # a rewritten file must not reuse a stale cache
        path = fields.get(key)
        if path is not None and os.path.exists(path):
            st = os.stat(path)
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


class FxReplaceConfig(str):
    """fxreplace's configuration as it travels inside ``additional_config``.

    ``FxReplaceConfig(tensors=..., prompt_token_ids=...)`` or
    ``FxReplaceConfig({...})`` / ``FxReplaceConfig(TensorReplacementConfig(...))``.
    Its string value is ``"fxreplace:<digest>"``; ``.fields`` holds the fields.
    The plugin wraps plain dicts and TensorReplacementConfig objects found under
    the config keys automatically, so passing this class is optional.
    """

    fields: dict

    def __new__(cls, spec: Any = None, **fields):
        if spec is not None and fields:
            raise ConfigError("give a config object or keyword fields, not both")
        normalised = _fields_of(spec if spec is not None else fields)
        obj = super().__new__(cls, f"fxreplace:{_digest(normalised)}")
        obj.fields = normalised
        return obj

    def __reduce__(self):
        return (_restore, (dict(self.fields), str(self)))

    def compute_hash(self) -> str:  # vLLM's SupportsHash protocol
        return str(self)

    def __repr__(self) -> str:
        shown = {k: (f"<{type(v).__name__}>" if k == "tensors" or k == "prompt_token_ids" else v)
                 for k, v in self.fields.items()}
        return f"FxReplaceConfig({shown})"


def _restore(fields: dict, value: str) -> FxReplaceConfig:
    obj = str.__new__(FxReplaceConfig, value)
    obj.fields = fields
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


def wrap_in_place(additional_config: Any) -> None:
    """Replace the fxreplace section of a dict ``additional_config`` by an
    :class:`FxReplaceConfig`, so vLLM can hash and pickle it. No-op when absent."""
    if not isinstance(additional_config, dict):
        return
    if find_config(additional_config) is None:
        return
    if CONFIG_KEY in additional_config:
        additional_config[CONFIG_KEY] = parse_config(additional_config)
    else:
        neuron = dict(additional_config[NEURON_KEYS[0]])
        neuron[NEURON_KEYS[1]] = parse_config(additional_config)
        additional_config[NEURON_KEYS[0]] = neuron
