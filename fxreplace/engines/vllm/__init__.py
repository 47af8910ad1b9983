"""vLLM integration: a ``vllm.general_plugins`` plugin that instruments vLLM's own
model implementation and feeds each forward the replacement tensors of the
requests in vLLM's batch.

Offline::

    from vllm import LLM
    llm = LLM(model=path, additional_config={"fxreplace": {
        "tensors": captures, "prompt_token_ids": prompt_ids}})        # or tensors_path=...

Online::

    python -m vllm.entrypoints.openai.api_server --model DIR \\
        --additional-config '{"fxreplace": {"tensors_path": "REF_DIR"}}'

Users of the Neuron tool can keep ``additional_config={"neuron_config":
{"tensor_replacement": TensorReplacementConfig(...)}}`` (not on vllm-neuron, where that key is
vllm-neuron's own replacer's: :mod:`fxreplace.engines.vllm.neuron`). The plugin is inert
when neither key is present. :class:`VllmEngine` runs teacher-forced validation
through vLLM (``fxreplace validate --engine vllm``).
"""

from .config import CONFIG_KEY, ConfigError, FxReplaceConfig, parse_config
from .engine import VllmEngine
from .internals import get_state
from .plugin import register
from .replacement import VllmReplacement

__all__ = ["CONFIG_KEY", "ConfigError", "FxReplaceConfig", "VllmEngine", "VllmReplacement", "get_state",
           "parse_config", "register"]
