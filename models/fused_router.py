"""GPT-OSS with a *fused* router: one custom op computes router linear, top-k and
softmax, standing in for a Neuron fused kernel. The logits never exist as a
tensor, so the only injection point is the router output and replacement logits
go through an adapter. Two variants, for the two forms such kernels return:

* ``GptOssForCausalLM+fused_router``: dense expert affinities ``[T, E]``
  (adapter ``topk_softmax_scatter``);
* ``GptOssForCausalLM+fused_topk``: top-k pairs ``(weights [T, k], expert ids
  [T, k])`` handed straight to the experts (adapter ``topk_softmax_pairs``).
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from fxreplace.targets import Target

from . import gpt_oss
from .registry import Family, decoder_components, register_family


@torch.library.custom_op("fxreplace_models::router_topk_softmax", mutates_args=())
def router_topk_softmax(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    values, indices = torch.topk(logits, k, dim=-1)
    return torch.zeros_like(logits).scatter(1, indices, torch.softmax(values, dim=-1))


@router_topk_softmax.register_fake
def _(hidden, weight, bias, k):
    return hidden.new_empty(hidden.shape[0], weight.shape[0])


@torch.library.custom_op("fxreplace_models::router_topk_pairs", mutates_args=())
def router_topk_pairs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = torch.topk(F.linear(hidden, weight, bias), k, dim=-1)
    return torch.softmax(values, dim=-1), indices


@router_topk_pairs.register_fake
def _(hidden, weight, bias, k):
    return hidden.new_empty(hidden.shape[0], k), hidden.new_empty(hidden.shape[0], k, dtype=torch.long)


class FusedTopKRouter(nn.Module):
    """Same parameters (and state_dict keys) as GptOssTopKRouter; returns affinities."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.top_k = router.top_k
        self.weight = router.weight
        self.bias = router.bias

    def forward(self, hidden_states):
        return torch.ops.fxreplace_models.router_topk_softmax(hidden_states, self.weight, self.bias, self.top_k)


class FusedTopKPairRouter(FusedTopKRouter):
    """Returns ``(weights [T, k], expert ids [T, k])``."""

    def forward(self, hidden_states):
        return torch.ops.fxreplace_models.router_topk_pairs(hidden_states, self.weight, self.bias, self.top_k)


class FusedGptOssMLP(nn.Module):
    """GptOssMLP whose experts consume what the fused router returns."""

    def __init__(self, mlp: nn.Module, router: type[FusedTopKRouter]):
        super().__init__()
        self.router = router(mlp.router)
        self.experts = mlp.experts

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_dim)
        routed = self.router(hidden_states)
        if isinstance(routed, torch.Tensor):  # dense affinities
            scores, indices = torch.topk(routed, self.router.top_k, dim=-1)
        else:
            scores, indices = routed
        hidden_states = self.experts(hidden_states, indices, scores)
        return hidden_states.reshape(batch_size, sequence_length, hidden_dim), scores


def fuse_routers(model: nn.Module, router: type[FusedTopKRouter] = FusedTopKRouter) -> nn.Module:
    """Swap every GPT-OSS MoE block for its fused-router twin, in place."""
    for layer in model.model.layers:
        layer.mlp = FusedGptOssMLP(layer.mlp, router)
    return model


for architecture, router, adapter in (
    ("GptOssForCausalLM+fused_router", FusedTopKRouter, "topk_softmax_scatter"),
    ("GptOssForCausalLM+fused_topk", FusedTopKPairRouter, "topk_softmax_pairs"),
):
    register_family(Family(
        architecture=architecture,
        targets=(Target("model.layers.*.mlp.router", point="output", adapter=adapter),),
        tiny_config=gpt_oss.tiny_config,
        model_kwargs={"attn_implementation": "eager"},
        transform=functools.partial(fuse_routers, router=router),
        components=decoder_components(router=Target("model.layers.*.mlp.router", point="output", adapter=adapter),
                                      block_point="output[0]"),
    ))
