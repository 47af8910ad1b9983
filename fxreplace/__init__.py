"""fxreplace: inject reference tensors into compiled LLM graphs to find which component drifts."""

from .context import ReplacementContext, get_active_context, get_replacement_tensor, set_active_context
from .matching import PromptIndex
from .replacer import TensorReplacementConfig, TensorReplacer
from .store import CaptureError, ReferenceStore, load_captures, load_legacy, load_token_ids

__all__ = [
    "CaptureError",
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
    "set_active_context",
]
