"""fxreplace: inject reference tensors into compiled LLM graphs to find which component drifts.

What a user calls is here: instrument a model, build replacement contexts from a reference
store, capture a reference, validate and blame, run the bucketed runner (capture and the
runner load when first used: they import transformers). Plumbing (the graph pass, the runtime op, prompt matching, file formats) lives in
the submodules.
"""

from __future__ import annotations

import importlib

from .adapters import get_adapter, register_adapter
from .blame import blame
from .config import ConfigError, ReplacementConfig, TensorReplacementConfig
from .context import ReplacementContext
from .export import export, export_input_name, export_inputs
from .instrument import TargetNotHitError, instrument, observe, uninstrument
from .liveness import check_live
from .points import TargetNotLiveError
from .replacer import TensorReplacer
from .sharding import ShapeError, ShardSpec
from .store import CaptureError, ReferenceStore, StoreError, StoreWriter, merge_stores, repack_store
from .targets import Target, TargetError
from .validation import logit_validation

_LAZY = {
    "capture_reference": "fxreplace.capture",
    "Runner": "fxreplace.runner",
    "RunnerConfig": "fxreplace.runner",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fxreplace' has no attribute {name!r}")


__all__ = [
    "CaptureError",
    "ConfigError",
    "ReferenceStore",
    "ReplacementConfig",
    "ReplacementContext",
    "Runner",
    "RunnerConfig",
    "ShapeError",
    "ShardSpec",
    "StoreError",
    "StoreWriter",
    "Target",
    "TargetError",
    "TargetNotHitError",
    "TargetNotLiveError",
    "TensorReplacementConfig",
    "TensorReplacer",
    "blame",
    "capture_reference",
    "check_live",
    "export",
    "export_input_name",
    "export_inputs",
    "get_adapter",
    "instrument",
    "logit_validation",
    "merge_stores",
    "observe",
    "register_adapter",
    "repack_store",
    "uninstrument",
]
