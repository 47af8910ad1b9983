"""GPT-OSS: top-k of the raw logits, softmax over the k values. HF router
``mlp.router`` (logits, weights, indices); vLLM names it ``mlp.router`` too, a
linear layer returning the logits. Attention must be eager here. HF's MLP block
returns (output, router scores); vLLM's returns the output, and vLLM names the
attention block ``attn`` (HF: ``self_attn``)."""

from transformers import GptOssConfig

from fxreplace.targets import Target

from .registry import Family, decoder_components, register_family


def tiny_config(**overrides):
    config = dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"], sliding_window=16,
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
    )
    return GptOssConfig(**{**config, **overrides})


register_family(Family(
    architecture="GptOssForCausalLM",
    targets=(Target("model.layers.*.mlp.router"),),
    tiny_config=tiny_config,
    model_kwargs={"attn_implementation": "eager"},
    components=decoder_components(router=Target("model.layers.*.mlp.router"),
                                  routing=Target("model.layers.*.mlp.experts", point="routing"),
                                  block_point="output[0]"),
))
