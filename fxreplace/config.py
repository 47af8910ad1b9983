"""``ReplacementConfig``: where the reference comes from and what to replace, in one place.

The vLLM plugin's ``additional_config`` section, the CLI and the embedded runner
all build this one dataclass, so a field has one name, one default and one
meaning everywhere, and a bad value fails when the config is made (for vLLM: in
the front end, before any engine process starts), naming the field.

The Neuron tool's ``TensorReplacementConfig(tensors_path=..., prompt_token_ids_path=...)``
is the same class under its old name.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from .adapters import get_adapter
from .errors import ConfigError
from .points import check_point
from .sharding import ShardSpec
from .store import INDEX_FILE, TENSORS_FILE
from .targets import Target, TargetError

OnUnknown = Literal["error", "passthrough"]
ON_UNKNOWN = ("error", "passthrough")
TARGET_FIELDS = ("pattern", "point", "adapter", "name", "shard")


def check_on_unknown(value) -> None:
    """What a request the reference does not hold gets: ``"error"`` or ``"passthrough"``."""
    if value not in ON_UNKNOWN:
        raise ConfigError(f"on_unknown must be 'error' or 'passthrough', got {value!r}")


@dataclass
class ReplacementConfig:
    """Where the reference comes from and how requests are served.

    Source (exactly one of each pair; a reference directory or ``.safetensors``
    store carries its own token ids, so the second pair is optional then):

    - ``tensors``: captures (step-wise list or flat dict) or a ReferenceStore;
      ``tensors_path``: a reference directory, a ``.safetensors`` store or the
      Neuron tool's ``torch.save`` file (read with ``weights_only=True``);
    - ``prompt_token_ids`` / ``prompt_token_ids_path`` (JSON or legacy file).

    ``targets``: what to replace, as glob strings, :class:`~fxreplace.Target`
    objects or dicts of Target fields (``{"pattern", "point", "adapter", "name"}``;
    ``name`` is the reference's capture name when it differs, ``{}`` taking the
    wildcard match). None: the model family's default targets.

    ``on_unknown``: a request whose prompt is not in the reference is
    ``"error"`` (the default): refused with an error naming the request
    (:class:`~fxreplace.TensorReplacer` raises KeyError; vLLM rejects it when it
    is submitted and keeps serving); ``"passthrough"``: served without replacement.

    ``capture``: ``{"out": DIR, "targets": [...]}`` makes a vLLM engine capture a
    reference instead of replacing (:mod:`fxreplace.engines.vllm.capture`); no source then.

    ``select_captures`` (vLLM): each request may choose which captures replace it
    (``SamplingParams(extra_args={"fxreplace": {"captures": [capture names]}})``), so
    one engine serves every set of replaced components (``fxreplace blame``). Each
    target then reads a mask of its own, filled every step; off (the default),
    every target reads one shared mask.
    """

    tensors: Any = None
    prompt_token_ids: Any = None
    tensors_path: str | os.PathLike | None = None
    prompt_token_ids_path: str | os.PathLike | None = None
    targets: Any = None
    on_unknown: OnUnknown = "error"
    capture: Any = None
    select_captures: bool = False

    def __post_init__(self):
        check_on_unknown(self.on_unknown)
        if not isinstance(self.select_captures, bool):
            raise ConfigError(f"select_captures must be true or false, got {self.select_captures!r}")
        if self.capture is not None:
            self.capture = _capture_section(self.capture, self)
            return
        _exactly_one("tensors", self.tensors, "tensors_path", self.tensors_path, required=True)
        _exactly_one("prompt_token_ids", self.prompt_token_ids, "prompt_token_ids_path", self.prompt_token_ids_path,
                     required=False)
        for key in ("tensors", "prompt_token_ids"):
            value = getattr(self, key)
            if isinstance(value, (str, bytes, os.PathLike)):
                raise ConfigError(f"{key} holds the data itself, got the path {value!r}; give a path as {key}_path")
        for key in ("tensors_path", "prompt_token_ids_path"):
            path = getattr(self, key)
            if path is not None:
                setattr(self, key, _existing_path(key, path))
        if self.targets is not None:
            self.targets = parse_targets(self.targets)

    # ------------------------------------------------------------ dict form

    @classmethod
    def from_dict(cls, data: Mapping) -> "ReplacementConfig":
        """From a dict such as vLLM's ``additional_config["fxreplace"]`` (JSON-compatible);
        an unknown key is an error that suggests the closest field."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"the fxreplace config must be a dict of fields, got {type(data).__name__}")
        known = [f.name for f in fields(cls)]
        for key in data:
            if key == "name_map":
                raise ConfigError(_name_map_moved(data[key]))
            if key not in known:
                raise ConfigError(f"unknown fxreplace config field {key!r}{_did_you_mean(key, known)}; "
                                  f"fields: {known}")
        return cls(**{k: v for k, v in data.items() if v is not None})

    def to_dict(self) -> dict:
        """The fields that are set (targets as dicts of their set fields); ``from_dict`` inverts it."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in ("on_unknown", "select_captures") and value == f.default:
                continue
            if f.name == "targets":
                value = [_target_dict(t) for t in value]
            if f.name == "capture" and "targets" in value:
                value = {**value, "targets": [_target_dict(t) for t in value["targets"]]}
            out[f.name] = value
        return out


#: The Neuron tool's name for the same configuration.
TensorReplacementConfig = ReplacementConfig


def parse_targets(targets: Any) -> tuple[Target, ...]:
    """Glob strings, Targets or dicts of Target fields -> Targets; errors name the entry."""
    if isinstance(targets, (str, bytes, Mapping)) or not hasattr(targets, "__iter__"):
        raise ConfigError(f"targets must be a list of patterns, Targets or dicts of Target fields, got "
                          f"{type(targets).__name__} {targets!r}"
                          + ("; wrap a single pattern in a list" if isinstance(targets, str) else ""))
    parsed = []
    for i, t in enumerate(targets):
        try:
            parsed.append(_parse_target(t))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"targets[{i}]: {exc}") from None
    if not parsed:
        raise ConfigError("targets is empty; leave it out for the model family's default targets")
    return tuple(parsed)


def _parse_target(t: Any) -> Target:
    if isinstance(t, Target):
        target = t
    elif isinstance(t, str):
        target = Target(t)
    elif isinstance(t, Mapping):
        for key in t:
            if key not in TARGET_FIELDS:
                raise ConfigError(f"unknown target field {key!r}{_did_you_mean(key, TARGET_FIELDS)}; "
                                  f"fields: {list(TARGET_FIELDS)}")
        if "pattern" not in t:
            raise ConfigError(f"a target dict needs 'pattern', got {dict(t)!r}")
        fields_ = dict(t)
        if isinstance(fields_.get("shard"), Mapping):  # JSON: {"mode", "world_size", "rank"}
            fields_["shard"] = ShardSpec(**fields_["shard"])
        target = Target(**fields_)
    else:
        raise ConfigError(f"a target is a pattern string, a Target or a dict of Target fields; got {t!r}")
    if not isinstance(target.pattern, str) or not target.pattern:
        raise ConfigError(f"pattern must be a non-empty string, got {target.pattern!r}")
    if target.name is not None and not isinstance(target.name, str):
        raise ConfigError(f"name must be a string, got {target.name!r}")

    try:
        check_point(target.point)
    except TargetError as exc:
        raise ConfigError(str(exc)) from None
    if isinstance(target.adapter, str):
        try:
            get_adapter(target.adapter)
        except KeyError as exc:
            raise ConfigError(exc.args[0]) from None
    return target


def _target_dict(target: Target) -> dict:
    out = {"pattern": target.pattern}
    for key, default in (("point", "auto"), ("adapter", None), ("shard", None), ("name", None)):
        value = getattr(target, key)
        if value != default:
            out[key] = value
    return out


def _did_you_mean(key: str, known) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _name_map_moved(name_map: Any) -> str:
    example = ""
    if isinstance(name_map, Mapping) and name_map:
        capture, module = next(iter(name_map.items()))
        if isinstance(capture, str) and isinstance(module, str):
            template = capture.replace("**", "{}").replace("*", "{}")
            example = f': {{"targets": [{{"pattern": "{module}", "name": "{template}"}}]}}'
    return ("'name_map' is replaced by per-target capture names (one syntax for capture names): give the target "
            f"its reference capture name, with {{}} for the wildcard match{example}")


CAPTURE_FIELDS = ("out", "targets")


def _capture_section(capture: Any, config: ReplacementConfig) -> dict:
    """``capture`` as ``{"out": str, "targets": tuple[Target] (optional)}``; capture and
    replacement are separate engines, so no reference source may be given with it."""
    given = [f for f in ("tensors", "tensors_path", "prompt_token_ids", "prompt_token_ids_path", "targets")
             if getattr(config, f) is not None]
    if given:
        raise ConfigError(f"'capture' comes alone (capture and replacement run in separate engines; capture "
                          f"targets go inside it), but {given} are set too")
    if not isinstance(capture, Mapping):
        raise ConfigError(f"capture must be a dict with 'out', got {type(capture).__name__} {capture!r}")
    for key in capture:
        if key not in CAPTURE_FIELDS:
            raise ConfigError(f"unknown capture field {key!r}{_did_you_mean(key, CAPTURE_FIELDS)}; "
                              f"fields: {list(CAPTURE_FIELDS)}")
    out = capture.get("out")
    if not isinstance(out, (str, os.PathLike)) or not os.fspath(out):
        raise ConfigError(f"capture needs 'out': the directory the reference is written to, got {out!r}")
    out = os.fspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"capture 'out': {out!r} is a file; the reference is written into a new or empty directory")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ConfigError(f"capture 'out': {out!r} cannot be created ({parent!r} is not a writable directory)")
    section = {"out": out}
    if capture.get("targets") is not None:
        section["targets"] = parse_targets(capture["targets"])
    return section


def _existing_path(key: str, path: Any) -> str:
    """``path`` as a string after checking it names a store directory or a readable file."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(f"{key} must be a path, got {type(path).__name__} {path!r}")
    path = os.fspath(path)
    shown = f"{path!r}" + (f" (a link to {os.path.realpath(path)!r})" if os.path.islink(path) else "")
    if not os.path.exists(path):
        raise ConfigError(f"{key}: {shown} does not exist")
    if os.path.isdir(path):
        if key == "tensors_path" and not any(os.path.exists(os.path.join(path, f)) for f in (INDEX_FILE, TENSORS_FILE)):
            raise ConfigError(f"{key}: the directory {shown} holds no reference store (no index.json or reference.safetensors)")
    elif not os.path.isfile(path):
        raise ConfigError(f"{key}: {shown} is not a regular file or a store directory")
    elif not os.access(path, os.R_OK):
        raise ConfigError(f"{key}: {shown} is not readable")
    return path


def _exactly_one(name_a: str, a: Any, name_b: str, b: Any, required: bool) -> None:
    if a is not None and b is not None:
        raise ConfigError(f"give either {name_a} or {name_b}, not both")
    if required and a is None and b is None:
        raise ConfigError(f"give {name_a} or {name_b}")
