"""Mixtral: softmax -> top-k -> renormalised routing. HF's router is ``mlp.gate``
(returns (logits, weights, indices)); vLLM names it ``block_sparse_moe.gate`` (a
linear returning (logits, bias)) and reads the HF capture of the same layer.
transformers 4.x names the HF block ``block_sparse_moe`` too; its gate's capture keeps
the 5.x name, so references from either major read the same. vLLM's MoE block
(``block_sparse_moe``) returns the hidden-size output, its attention the tensor."""

from transformers import MixtralConfig

from fxreplace.targets import Target

from .registry import Family, decoder_components, register_family


def tiny_config(**overrides):
    config = dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    )
    return MixtralConfig(**{**config, **overrides})


register_family(Family(
    architecture="MixtralForCausalLM",
    targets=(Target("model.layers.*.*.gate", name="model.layers.{0}.mlp.gate"),),  # 4.x: block_sparse_moe
    tiny_config=tiny_config,
    components=decoder_components(router=Target("model.layers.*.mlp.gate"),
                                  routing=Target("model.layers.*.mlp.experts", point="routing")),
))
