"""The built-in families' sites in vLLM's model code, registered under the name vLLM's runner side
looks them up with (:attr:`~fxreplace.engines.vllm.runners.VllmRunner.model_code`, "vllm"). Each
capture is named as the HF reference names it, so vLLM replays an HF capture; a family of your
own adds its sites with :func:`fxreplace.models.register_sites` ("Registering a family")."""

from __future__ import annotations

from ...models import decoder_components, register_sites
from ...targets import Target

MODEL_CODE = "vllm"


def vllm_decoder_components(**kwargs) -> dict[str, Target]:
    """:func:`~fxreplace.models.decoder_components` in vLLM's model code. Its attention returns the
    output itself; its decoder layer returns ``(block output, residual)`` and leaves the add to the
    next layer's fused norm, so the stream after the layer is their sum: its replacement goes through
    the ``residual_stream_pair`` adapter, which hands the layer's consumers ``(0, stream)``. The
    embedding is not declared (not exercised in vLLM yet)."""
    return decoder_components(embedding=False, attention_point="output", layer_adapter="residual_stream_pair", **kwargs)


#: vLLM's MoE gate: a ReplicatedLinear returning (logits, bias)
GATE = Target("model.layers.*.mlp.gate", point="output[0]")
#: vLLM names Mixtral's block ``block_sparse_moe`` (HF 5.x: ``mlp``); its gate reads the HF capture of the same layer
MIXTRAL_GATE = Target("model.layers.*.block_sparse_moe.gate", point="output[0]")
#: GPT-OSS's router in vLLM: a linear returning the logits
GPT_OSS_ROUTER = Target("model.layers.*.mlp.router", point="output")

register_sites(MODEL_CODE, "Qwen3MoeForCausalLM", targets=(GATE,), components=vllm_decoder_components(router=GATE))
register_sites(MODEL_CODE, "DeepseekV3ForCausalLM", targets=(GATE,), components=vllm_decoder_components(router=GATE))
register_sites(MODEL_CODE, "MixtralForCausalLM",
               targets=(Target(MIXTRAL_GATE.pattern, point="output[0]", name="model.layers.{}.mlp.gate"),),
               components=vllm_decoder_components(router=MIXTRAL_GATE, block="block_sparse_moe"))
# vLLM names GPT-OSS's attention block ``attn`` (HF: ``self_attn``); its MLP block returns the output alone
register_sites(MODEL_CODE, "GptOssForCausalLM", targets=(GPT_OSS_ROUTER,),
               components=vllm_decoder_components(router=GPT_OSS_ROUTER, attention="attn"))
register_sites(MODEL_CODE, "LlamaForCausalLM", targets=(Target("model.layers.*.mlp", point="output"),),
               components=vllm_decoder_components(block_kind="mlp"))
