"""fxreplace: inject reference tensors into compiled LLM graphs to find which component drifts."""

from .adapters import get_adapter, register_adapter
from .context import ReplacementContext, get_active_context, get_replacement_tensor, set_active_context
from .instrument import TargetNotHitError, export, export_input_name, instrument, locate_injection_point
from .matching import PromptIndex
from .passes import Injection, InjectionSpec, PassResult, insert_replacements
from .replacer import TensorReplacementConfig, TensorReplacer
from .sharding import ShapeError, ShardSpec
from .store import CaptureError, ReferenceStore, StoreError, StoreWriter, load_captures, load_legacy, load_token_ids, merge_stores
from .targets import Target, TargetError, resolve_targets

__all__ = [
    "CaptureError",
    "Injection",
    "InjectionSpec",
    "PassResult",
    "ShapeError",
    "ShardSpec",
    "StoreError",
    "StoreWriter",
    "Target",
    "TargetError",
    "TargetNotHitError",
    "export",
    "export_input_name",
    "get_adapter",
    "insert_replacements",
    "instrument",
    "locate_injection_point",
    "register_adapter",
    "resolve_targets",
    "PromptIndex",
    "ReferenceStore",
    "ReplacementContext",
    "TensorReplacementConfig",
    "TensorReplacer",
    "get_active_context",
    "get_replacement_tensor",
    "load_captures",
    "load_legacy",
    "load_token_ids",
    "merge_stores",
    "set_active_context",
]
