"""A Neuron-style MoE language model with static shapes, in plain torch (no transformers).

Laid out the way NxD Inference computes MoE, so that what fxreplace does to it is
what it does to a model traced for Neuron: each MoE block (``model.layers.N.mlp``)
has a ``router`` whose ``linear_router`` produces ``[T, E]`` logits and which returns
(logits, softmax affinities over all experts, top-k expert ids); the block keeps the
top-k affinities in a dense ``[T, E]`` matrix (zero elsewhere, optionally
renormalised), and ``expert_mlps`` computes every expert for every token and sums
them weighted by that matrix. No shape depends on the routing, so an XLA trace of a
bucket is one graph whatever the tokens choose.

Targets: ``model.layers.*.mlp.router``, point "auto" = the logits (the router
returns a tuple). The fused variant (``NeuronMoeForCausalLM+fused_router``) stands
in for a router kernel that returns only the dense affinities; replacement logits
reach it through the ``softmax_topk_renorm`` adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fxreplace.targets import Target

from .registry import Family, register_family


@dataclass
class NeuronMoeConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    architectures: list = field(default_factory=lambda: ["NeuronMoeForCausalLM"])


def tiny_config(**overrides) -> NeuronMoeConfig:
    return NeuronMoeConfig(**overrides)


class RouterTopK(nn.Module):
    """Returns (router logits [T, E], softmax affinities [T, E], top-k expert ids [T, k])."""

    def __init__(self, config: NeuronMoeConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob  # read by the softmax_topk_renorm adapter
        self.linear_router = nn.Linear(config.hidden_size, config.num_experts, bias=False)

    def forward(self, hidden_states):
        router_logits = self.linear_router(hidden_states)
        expert_affinities = F.softmax(router_logits.float(), dim=-1).to(hidden_states.dtype)
        expert_index = torch.topk(router_logits, self.top_k, dim=-1).indices
        return router_logits, expert_affinities, expert_index


def topk_affinities(affinities: torch.Tensor, expert_index: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The affinities of the chosen experts in a dense [T, E] matrix, zero elsewhere."""
    dense = torch.zeros_like(affinities).scatter(1, expert_index, affinities.gather(1, expert_index))
    return dense / dense.sum(dim=-1, keepdim=True) if normalize else dense


class ExpertMLPs(nn.Module):
    """All experts (SwiGLU) on all tokens, combined by dense affinities: static shapes."""

    def __init__(self, config: NeuronMoeConfig):
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))

    def forward(self, hidden_states, affinities):
        gate, up = torch.einsum("th,ehi->eti", hidden_states, self.gate_up_proj).chunk(2, dim=-1)
        per_expert = torch.einsum("eti,eih->eth", F.silu(gate) * up, self.down_proj)
        return torch.einsum("te,eth->th", affinities, per_expert)


class NeuronMoE(nn.Module):
    def __init__(self, config: NeuronMoeConfig):
        super().__init__()
        self.router = RouterTopK(config)
        self.expert_mlps = ExpertMLPs(config)

    def forward(self, hidden_states):
        batch, seq, hidden = hidden_states.shape
        tokens = hidden_states.reshape(batch * seq, hidden)
        _, affinities, expert_index = self.router(tokens)
        dense = topk_affinities(affinities, expert_index, self.router.norm_topk_prob)
        return self.expert_mlps(tokens, dense).reshape(batch, seq, hidden)


class Attention(nn.Module):
    """Causal multi-head attention without positional encoding (enough for a test model)."""

    def __init__(self, config: NeuronMoeConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        batch, seq, hidden = hidden_states.shape
        q, k, v = (t.reshape(batch, seq, self.heads, -1).transpose(1, 2)
                   for t in self.qkv_proj(hidden_states).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class DecoderLayer(nn.Module):
    def __init__(self, config: NeuronMoeConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = NeuronMoE(config)

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class NeuronMoeModel(nn.Module):
    def __init__(self, config: NeuronMoeConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


class NeuronMoeForCausalLM(nn.Module):
    """``forward(input_ids [B, S]) -> logits [B, S, vocab]``; no KV cache (each bucket is traced whole)."""

    def __init__(self, config: NeuronMoeConfig):
        super().__init__()
        self.config = config
        self.model = NeuronMoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for name, param in self.named_parameters():
            if "norm" not in name:
                nn.init.normal_(param, std=config.initializer_range)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


@torch.library.custom_op("fxreplace_models::router_softmax_topk_affinities", mutates_args=())
def router_softmax_topk_affinities(hidden: torch.Tensor, weight: torch.Tensor, k: int, normalize: bool) -> torch.Tensor:
    logits = F.linear(hidden, weight)
    affinities = F.softmax(logits.float(), dim=-1).to(hidden.dtype)
    return topk_affinities(affinities, torch.topk(logits, k, dim=-1).indices, normalize)


@router_softmax_topk_affinities.register_fake
def _(hidden, weight, k, normalize):
    return hidden.new_empty(hidden.shape[0], weight.shape[0])


class FusedRouterTopK(nn.Module):
    """One kernel from hidden states to dense top-k affinities [T, E]; same parameters as RouterTopK."""

    def __init__(self, router: RouterTopK):
        super().__init__()
        self.top_k = router.top_k
        self.norm_topk_prob = router.norm_topk_prob
        self.linear_router = router.linear_router

    def forward(self, hidden_states):
        return torch.ops.fxreplace_models.router_softmax_topk_affinities(
            hidden_states, self.linear_router.weight, self.top_k, self.norm_topk_prob)


class FusedNeuronMoE(nn.Module):
    def __init__(self, moe: NeuronMoE):
        super().__init__()
        self.router = FusedRouterTopK(moe.router)
        self.expert_mlps = moe.expert_mlps

    def forward(self, hidden_states):
        batch, seq, hidden = hidden_states.shape
        tokens = hidden_states.reshape(batch * seq, hidden)
        return self.expert_mlps(tokens, self.router(tokens)).reshape(batch, seq, hidden)


def fuse_routers(model: NeuronMoeForCausalLM) -> NeuronMoeForCausalLM:
    """Swap every MoE block for its fused-router twin, in place."""
    for layer in model.model.layers:
        layer.mlp = FusedNeuronMoE(layer.mlp)
    return model


register_family(Family(
    architecture="NeuronMoeForCausalLM",
    targets=(Target("model.layers.*.mlp.router"),),
    tiny_config=tiny_config,
    build=NeuronMoeForCausalLM,
))

register_family(Family(
    architecture="NeuronMoeForCausalLM+fused_router",
    targets=(Target("model.layers.*.mlp.router", point="output", adapter="softmax_topk_renorm"),),
    tiny_config=tiny_config,
    build=NeuronMoeForCausalLM,
    transform=fuse_routers,
))
