"""fxreplace: inject reference tensors into compiled LLM graphs to find which component drifts.

What a user calls is here: instrument a model, build replacement contexts from a reference
store, capture a reference, validate and blame, run the bucketed runner (each name loads its
module when first used). Plumbing (the graph pass, the runtime op, prompt matching, file
formats) lives in the submodules.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

# Every name loads its module when first used: the command line (`fxreplace --help`, a mistake
# refused before any model loads) answers without importing torch.
_LAZY = {
    "get_adapter": "fxreplace.adapters", "register_adapter": "fxreplace.adapters",
    "blame": "fxreplace.blame",
    "ConfigError": "fxreplace.config", "ReplacementConfig": "fxreplace.config",
    "TensorReplacementConfig": "fxreplace.config",
    "ReplacementContext": "fxreplace.context",
    "export": "fxreplace.export", "export_input_name": "fxreplace.export", "export_inputs": "fxreplace.export",
    "TargetNotHitError": "fxreplace.instrument", "instrument": "fxreplace.instrument",
    "observe": "fxreplace.instrument", "uninstrument": "fxreplace.instrument",
    "InstrumentationChangedError": "fxreplace.unchanged", "check_unchanged": "fxreplace.unchanged",
    "prove_unchanged": "fxreplace.unchanged",
    "check_live": "fxreplace.liveness",
    "TargetNotLiveError": "fxreplace.points",
    "TensorReplacer": "fxreplace.replacer",
    "ShapeError": "fxreplace.sharding", "ShardSpec": "fxreplace.sharding",
    "CaptureError": "fxreplace.store", "ReferenceStore": "fxreplace.store", "StoreError": "fxreplace.store",
    "StoreWriter": "fxreplace.store", "merge_stores": "fxreplace.store", "repack_store": "fxreplace.store",
    "Target": "fxreplace.targets", "TargetError": "fxreplace.targets",
    "logit_validation": "fxreplace.validation",
    "capture_reference": "fxreplace.capture",
    "Runner": "fxreplace.engines.embedded",
    "RunnerConfig": "fxreplace.engines.embedded",
}

if TYPE_CHECKING:
    from .adapters import get_adapter, register_adapter
    from .blame import blame
    from .capture import capture_reference
    from .config import ConfigError, ReplacementConfig, TensorReplacementConfig
    from .context import ReplacementContext
    from .export import export, export_input_name, export_inputs
    from .instrument import TargetNotHitError, instrument, observe, uninstrument
    from .liveness import check_live
    from .unchanged import InstrumentationChangedError, check_unchanged, prove_unchanged
    from .points import TargetNotLiveError
    from .replacer import TensorReplacer
    from .engines.embedded import Runner, RunnerConfig
    from .sharding import ShapeError, ShardSpec
    from .store import CaptureError, ReferenceStore, StoreError, StoreWriter, merge_stores, repack_store
    from .targets import Target, TargetError
    from .validation import logit_validation


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fxreplace' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """Importing a submodule binds it as an attribute of its package: for the submodules named
    like the public function they define (``fxreplace.blame``, ``.export``, ``.instrument``) the
    function is bound instead, as an eager ``from .blame import blame`` did."""

    def __setattr__(self, name, value):
        if name in ("blame", "export", "instrument") and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "CaptureError",
    "ConfigError",
    "InstrumentationChangedError",
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
    "check_unchanged",
    "export",
    "export_input_name",
    "export_inputs",
    "get_adapter",
    "instrument",
    "logit_validation",
    "merge_stores",
    "observe",
    "prove_unchanged",
    "register_adapter",
    "repack_store",
    "uninstrument",
]
