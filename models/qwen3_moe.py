"""Qwen3-MoE: softmax -> top-k -> renormalised routing.

HF: ``mlp.gate`` (Qwen3MoeTopKRouter) returns (logits, weights, indices) and the
MoE block ignores the logits, so the injection point is the router's first
linear ("auto"). vLLM: ``mlp.gate`` is a ReplicatedLinear returning (logits, bias).
vllm-neuron: NxD's MoE layout (``layers.N.mlp.router.linear_router``, see
:mod:`fxreplace.models.nxd`), read under the HF capture names.
"""

from transformers import Qwen3MoeConfig

from fxreplace.targets import Target

from .registry import Family, decoder_components, register_family

ROUTER = Target("model.layers.*.mlp.gate")
#: the routing the experts are called with (top-k weights and expert ids), which the block's gate computes
ROUTING = Target("model.layers.*.mlp.experts", point="routing")


def tiny_config(**overrides):
    config = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
    )
    return Qwen3MoeConfig(**{**config, **overrides})


register_family(Family(
    architecture="Qwen3MoeForCausalLM",
    targets=(ROUTER,),
    tiny_config=tiny_config,
    components=decoder_components(router=ROUTER, routing=ROUTING),
))
