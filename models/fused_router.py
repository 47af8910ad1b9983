"""GPT-OSS with a *fused* router: one custom op computes router linear, top-k and
softmax and returns dense expert affinities [T, E], standing in for a Neuron
fused kernel. The logits never exist as a tensor, so the only injection point is
the router output and replacement logits go through ``topk_softmax_scatter``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from fxreplace.targets import Target

from . import Family, gpt_oss, register_family


@torch.library.custom_op("fxreplace_models::router_topk_softmax", mutates_args=())
def router_topk_softmax(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    values, indices = torch.topk(logits, k, dim=-1)
    return torch.zeros_like(logits).scatter(1, indices, torch.softmax(values, dim=-1))


@router_topk_softmax.register_fake
def _(hidden, weight, bias, k):
    return hidden.new_empty(hidden.shape[0], weight.shape[0])


class FusedTopKRouter(nn.Module):
    """Same parameters (and state_dict keys) as GptOssTopKRouter; returns affinities."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.top_k = router.top_k
        self.weight = router.weight
        self.bias = router.bias

    def forward(self, hidden_states):
        return torch.ops.fxreplace_models.router_topk_softmax(hidden_states, self.weight, self.bias, self.top_k)


class FusedGptOssMLP(nn.Module):
    """GptOssMLP whose experts consume affinities from the fused router."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.router = FusedTopKRouter(mlp.router)
        self.experts = mlp.experts

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_dim)
        affinities = self.router(hidden_states)
        scores, indices = torch.topk(affinities, self.router.top_k, dim=-1)
        hidden_states = self.experts(hidden_states, indices, scores)
        return hidden_states.reshape(batch_size, sequence_length, hidden_dim), scores


def fuse_routers(model: nn.Module) -> nn.Module:
    """Swap every GPT-OSS MoE block for its fused-router twin, in place."""
    for layer in model.model.layers:
        layer.mlp = FusedGptOssMLP(layer.mlp)
    return model


register_family(Family(
    architecture="GptOssForCausalLM+fused_router",
    targets=(Target("model.layers.*.mlp.router", point="output", adapter="topk_softmax_scatter"),),
    fused_adapter="topk_softmax_scatter",
    tiny_config=gpt_oss.tiny_config,
    model_kwargs={"attn_implementation": "eager"},
    transform=fuse_routers,
))
