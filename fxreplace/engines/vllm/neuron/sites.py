"""The built-in families' sites in the model code vllm-neuron serves, registered under the name
its runner side looks them up with (:attr:`~fxreplace.engines.vllm.neuron.NeuronRunner.model_code`):
Qwen3-MoE in NxD's MoE layout (``layers.N.mlp.router.linear_router``), read under the HF capture
names (:func:`fxreplace.models.nxd.nxd_router_targets`)."""

from __future__ import annotations

from ....models import register_sites
from ....models.nxd import nxd_router_targets
from ....targets import Target

MODEL_CODE = "vllm-neuron"

register_sites(MODEL_CODE, "Qwen3MoeForCausalLM", targets=nxd_router_targets(Target("model.layers.*.mlp.gate")))
