"""fxreplace: inject reference tensors into compiled LLM graphs to find which component drifts."""

from .adapters import get_adapter, register_adapter
from .blame import blame
from .config import ConfigError, ReplacementConfig, TensorReplacementConfig
from .context import ReplacementContext, get_active_context, get_replacement_tensor, set_active_context
from .export import export, export_input_name
from .instrument import TargetNotHitError, instrument, observe, uninstrument
from .matching import PromptIndex
from .passes import Injection, InjectionSpec, PassResult, insert_replacements
from .points import locate_injection_point
from .replacer import TensorReplacer
from .sharding import ShapeError, ShardSpec
from .store import CaptureError, ReferenceStore, StoreError, StoreWriter, load_captures, load_legacy, load_token_ids, merge_stores, repack_store
from .targets import Target, TargetError, resolve_targets

__all__ = [
    "blame",
    "CaptureError",
    "ConfigError",
    "Injection",
    "InjectionSpec",
    "PassResult",
    "PromptIndex",
    "ReferenceStore",
    "ReplacementConfig",
    "ReplacementContext",
    "ShapeError",
    "ShardSpec",
    "StoreError",
    "StoreWriter",
    "Target",
    "TargetError",
    "TargetNotHitError",
    "TensorReplacementConfig",
    "TensorReplacer",
    "export",
    "export_input_name",
    "get_active_context",
    "get_adapter",
    "get_replacement_tensor",
    "insert_replacements",
    "instrument",
    "load_captures",
    "load_legacy",
    "load_token_ids",
    "locate_injection_point",
    "merge_stores",
    "repack_store",
    "observe",
    "register_adapter",
    "resolve_targets",
    "set_active_context",
    "uninstrument",
]
