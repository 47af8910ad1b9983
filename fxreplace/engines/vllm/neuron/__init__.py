"""The vllm-neuron engine: vLLM's plugin on vllm-neuron's ``NeuronModelRunner`` (one compiled
graph per bucket, the replacement context handed to each compiled call)."""

from .capture import StepInputCapture
from .replacement import StepInputReplacement
from .runner import NeuronRunner

__all__ = ["NeuronRunner", "StepInputCapture", "StepInputReplacement"]
