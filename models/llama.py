"""Dense Llama: no router; useful targets are block outputs. ``mlp`` returns a
tensor; HF's ``self_attn`` returns (output, weights), so its point is ``output[0]``
(vLLM's returns the tensor: point ``output``); the decoder layer's output is the
residual stream after that layer (vLLM's returns (hidden, residual) unsummed)."""

from transformers import LlamaConfig

from fxreplace.targets import Target

from .registry import Family, decoder_components, register_family

MLP_OUTPUT = Target("model.layers.*.mlp", point="output")
ATTENTION_OUTPUT = Target("model.layers.*.self_attn", point="output[0]")
RESIDUAL_STREAM = Target("model.layers.*", point="output")


def tiny_config(**overrides):
    config = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
    )
    return LlamaConfig(**{**config, **overrides})


register_family(Family(
    architecture="LlamaForCausalLM",
    targets=(MLP_OUTPUT,),
    tiny_config=tiny_config,
    components=decoder_components(block_kind="mlp"),
))
