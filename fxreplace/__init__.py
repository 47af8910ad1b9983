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
    **dict.fromkeys(["get_adapter", "register_adapter"], "fxreplace.adapters"),
    **dict.fromkeys(["blame"], "fxreplace.blame"),
    **dict.fromkeys(["BlameResult"], "fxreplace.blame.result"),
    **dict.fromkeys(["capture_reference", "tokenize_prompts"], "fxreplace.capture"),
    **dict.fromkeys(["ReplacementConfig", "TensorReplacementConfig"], "fxreplace.config"),
    **dict.fromkeys(["ReplacementContext"], "fxreplace.context"),
    **dict.fromkeys(["Runner", "RunnerConfig"], "fxreplace.engines.embedded"),
    **dict.fromkeys(["BlameError", "CaptureError", "ConfigError", "InstrumentationChangedError", "SetupError",
                     "ShapeError", "StoreError", "TargetError", "TargetNotHitError", "TargetNotLiveError"],
                    "fxreplace.errors"),
    **dict.fromkeys(["export", "export_input_name", "export_inputs"], "fxreplace.export"),
    **dict.fromkeys(["guard_filter"], "fxreplace.guards"),
    **dict.fromkeys(["instrument", "observe", "uninstrument"], "fxreplace.instrument"),
    **dict.fromkeys(["check_live"], "fxreplace.liveness"),
    **dict.fromkeys(["Tolerances", "Verdict", "verdict"], "fxreplace.metrics"),
    **dict.fromkeys(["Reference", "load_reference"], "fxreplace.reference"),
    **dict.fromkeys(["TensorReplacer"], "fxreplace.replacer"),
    **dict.fromkeys(["ShardSpec"], "fxreplace.sharding"),
    **dict.fromkeys(["ReferenceStore", "StoreWriter"], "fxreplace.store"),
    **dict.fromkeys(["Target"], "fxreplace.targets"),
    **dict.fromkeys(["check_unchanged", "prove_unchanged"], "fxreplace.unchanged"),
    **dict.fromkeys(["Gate", "ValidationResult", "logit_validation"], "fxreplace.validation"),
}

if TYPE_CHECKING:
    from .adapters import get_adapter, register_adapter
    from .blame import blame
    from .blame.result import BlameResult
    from .capture import capture_reference, tokenize_prompts
    from .config import ReplacementConfig, TensorReplacementConfig
    from .context import ReplacementContext
    from .engines.embedded import Runner, RunnerConfig
    from .errors import (BlameError, CaptureError, ConfigError, InstrumentationChangedError, SetupError, ShapeError,
                         StoreError, TargetError, TargetNotHitError, TargetNotLiveError)
    from .export import export, export_input_name, export_inputs
    from .guards import guard_filter
    from .instrument import instrument, observe, uninstrument
    from .liveness import check_live
    from .metrics import Tolerances, Verdict, verdict
    from .reference import Reference, load_reference
    from .replacer import TensorReplacer
    from .sharding import ShardSpec
    from .store import ReferenceStore, StoreWriter
    from .targets import Target
    from .unchanged import check_unchanged, prove_unchanged
    from .validation import Gate, ValidationResult, logit_validation


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


# exactly what docs/api.md documents at the top (tests/test_docs.py holds the two equal)
__all__ = sorted(_LAZY)
