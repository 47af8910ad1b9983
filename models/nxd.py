"""NxD Inference (NxDI): how fxreplace targets the models NxDI builds, and a stand-in that keeps their contracts.

NxDI's MoE models (e.g. ``NeuronQwen3MoeForCausalLM``) hold an inner model, the module
NxDI traces once per bucket, laid out as ``layers.N.mlp`` = NxD's ``MoE`` with a
``router`` (``RouterTopK``) and ``expert_mlps``. ``RouterTopK`` returns
``(router_logits, expert_affinities, expert_index)`` but computes the affinities and
expert ids from its own internal logits, so the tensor worth replacing is its
``linear_router``'s output: point ``"auto"``. Replacing the returned ``output[0]`` would
change nothing downstream. :func:`nxd_targets` gives that target with the capture
names of the HF reference's router (NxDI converts HF's ``model.layers.N.mlp.gate``
into ``layers.N.mlp.router.linear_router``), so nobody writes the mapping by hand.

The rest of this module is a stand-in for tests and the docs, written from NxD's and
NxDI's documented contracts (no NxD code): :class:`NxDQwen3MoeModel` (the inner model,
HF Qwen3-MoE's arithmetic with NxD's module layout and static-shape experts), the
module-boundary markers that break Dynamo graphs inside each decoder layer, the fused
token-generation MoE kernel (``moe_fused_nki_kernel_enabled``: one opaque op from the
hidden states to the MoE output that never calls the router), and
:class:`BucketedApplication`, which owns the forward the way NxDI's wrappers do
(context encoding padded to a bucket, token generation one row per sequence, or
``1 + k`` with ``k`` speculated tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fxreplace.bypass import register_bypass_hint
from fxreplace.targets import Target

from .registry import get_family

#: NxDI's module that holds the router: ``layers.N.mlp.router`` in every NxDI MoE model.
NXD_ROUTER = "layers.*.mlp.router"


def nxd_router_targets(hf_router: Target) -> tuple[Target, ...]:
    """The router target of NxD's MoE layout (an NxDI inner model, or vllm-neuron's model code
    laid out the same way), named as the HF reference captures ``hf_router`` (one module per
    layer): e.g. ``layers.N.mlp.router`` (point "auto", its ``linear_router``) <- ``model.layers.N.mlp.gate``."""
    if hf_router.pattern.count("*") != 1:
        raise ValueError(f"the HF router target {hf_router.pattern!r} does not name one module per layer")
    return (Target(NXD_ROUTER, name=hf_router.pattern.replace("*", "{}")),)


def nxd_targets(hf_architecture: str = "Qwen3MoeForCausalLM") -> tuple[Target, ...]:
    """The targets of an NxDI MoE model's inner model, named as the HF reference
    (``hf_architecture``'s registered family) captures them (see :func:`nxd_router_targets`)."""
    family = get_family(hf_architecture)
    return nxd_router_targets(family.components.get("router") or family.targets[0])


@register_bypass_hint
def fused_kernel_hint(model: nn.Module, module_name: str) -> str | None:
    """NxD's MoE with its fused token-generation kernel (``moe_fused_tkg``, built when the model's
    ``moe_fused_nki_kernel_enabled`` is set) computes the router inside one kernel at token
    generation, so the router module never runs there."""
    parent_name = module_name.rpartition(".")[0]
    try:
        parent = model.get_submodule(parent_name)
    except AttributeError:
        return None
    if getattr(parent, "moe_fused_tkg", None) is None:
        return None
    return (f"{parent_name}.moe_fused_tkg, NxD's fused token-generation MoE kernel, computes the router inside one "
            f"kernel and skips {module_name}: build the model with moe_fused_nki_kernel_enabled=False "
            "(MoENeuronConfig) for a replacement run")


# ----------------------------------------------------------------------------- the stand-in


@dataclass
class NeuronConfig:
    """The knobs of NxDI's ``MoENeuronConfig`` the stand-in honours."""

    batch_size: int = 2  # sequences per step (NxDI's max_batch_size)
    buckets: tuple[int, ...] = (8, 16)  # context-encoding lengths; the last is the KV cache length
    speculation_length: int = 0  # drafted tokens verified per token-generation step
    moe_fused_nki_kernel_enabled: bool = False
    module_markers: bool = True  # NxDI's decoder layers call boundary markers that break Dynamo graphs

    @property
    def seq_len(self) -> int:
        return self.buckets[-1]


class RouterTopK(nn.Module):
    """NxD's contract: ``(router_logits, expert_affinities, expert_index)``, the last two computed
    from the internal logits of ``linear_router``, so the first is only a copy handed out."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.linear_router = nn.Linear(hidden_size, num_experts, bias=False)

    def forward(self, hidden_states):
        router_logits = self.linear_router(hidden_states)
        expert_affinities = F.softmax(router_logits, dim=-1, dtype=torch.float32).to(hidden_states.dtype)
        expert_index = torch.topk(router_logits, self.top_k).indices
        return router_logits, expert_affinities, expert_index


def _expert_outputs(tokens, gate_up_proj, down_proj, affinities, expert_index, normalize):
    """Every expert on every token (static shapes), weighted by the chosen experts' affinities."""
    chosen = affinities.gather(1, expert_index)
    if normalize:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    dense = torch.zeros_like(affinities).scatter(1, expert_index, chosen)
    gate, up = torch.einsum("th,ehi->eti", tokens, gate_up_proj).chunk(2, dim=-1)
    per_expert = torch.einsum("eti,eih->eth", F.silu(gate) * up, down_proj)
    return torch.einsum("te,eth->th", dense, per_expert)


class ExpertMLPs(nn.Module):
    """SwiGLU experts in NxD's layout: ``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, normalize_top_k_affinities: bool):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.normalize_top_k_affinities = normalize_top_k_affinities

    def forward(self, hidden_states, expert_affinities, expert_index):
        return _expert_outputs(hidden_states, self.gate_up_proj, self.down_proj, expert_affinities, expert_index,
                               self.normalize_top_k_affinities)


@torch.library.custom_op("fxreplace_models::nxd_moe_fused_tkg", mutates_args=())
def moe_fused_tkg_kernel(hidden: torch.Tensor, gamma: torch.Tensor, router_weight: torch.Tensor,
                         gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_k: int, eps: float,
                         normalize: bool) -> torch.Tensor:
    """RMSNorm + router + top-k + experts in one kernel, as NxD's fused token-generation MoE kernel."""
    normed = F.rms_norm(hidden, (hidden.shape[-1],), gamma, eps)
    logits = F.linear(normed, router_weight)
    affinities = F.softmax(logits, dim=-1, dtype=torch.float32).to(hidden.dtype)
    return _expert_outputs(normed, gate_up_proj, down_proj, affinities, torch.topk(logits, top_k).indices, normalize)


@moe_fused_tkg_kernel.register_fake
def _(hidden, gamma, router_weight, gate_up_proj, down_proj, top_k, eps, normalize):
    return torch.empty_like(hidden)


class MoEFusedTKG(nn.Module):
    """Token generation's fused MoE: reads the router's weight, never calls the router."""

    def __init__(self, moe: "MoE"):
        super().__init__()
        self.moe = [moe]  # a plain list: no second registration of the MoE's parameters

    def forward(self, hidden_states):
        moe = self.moe[0]
        return torch.ops.fxreplace_models.nxd_moe_fused_tkg(
            hidden_states, moe.rmsnorm.weight, moe.router.linear_router.weight, moe.expert_mlps.gate_up_proj,
            moe.expert_mlps.down_proj, moe.router.top_k, moe.rmsnorm.eps, moe.expert_mlps.normalize_top_k_affinities)


class MoE(nn.Module):
    """NxD's MoE block: ``forward(hidden_states [B, S, H], padding_mask) -> (output,)``. With the fused
    kernel enabled it owns the post-attention RMSNorm and token generation (S == 1 + speculation)
    runs :class:`MoEFusedTKG` instead of the router and experts."""

    def __init__(self, config, neuron_config: NeuronConfig, rmsnorm: nn.Module | None = None):
        super().__init__()
        self.router = RouterTopK(config.num_experts, config.num_experts_per_tok, config.hidden_size)
        self.expert_mlps = ExpertMLPs(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                      config.norm_topk_prob)
        self.rmsnorm = rmsnorm
        self.token_generation_length = 1 + neuron_config.speculation_length
        self.moe_fused_tkg = MoEFusedTKG(self) if neuron_config.moe_fused_nki_kernel_enabled else None

    def forward(self, hidden_states, padding_mask=None):
        batch, seq, hidden = hidden_states.shape
        if self.moe_fused_tkg is not None and seq == self.token_generation_length:
            tokens = hidden_states.reshape(batch * seq, hidden)
            return (self.moe_fused_tkg(tokens).reshape(batch, seq, hidden),)
        if self.rmsnorm is not None:
            hidden_states = self.rmsnorm(hidden_states)
        tokens = hidden_states.reshape(batch * seq, hidden)
        _, expert_affinities, expert_index = self.router(tokens)
        return (self.expert_mlps(tokens, expert_affinities, expert_index).reshape(batch, seq, hidden),)


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    """Qwen3 attention (per-head q/k RMSNorm, RoPE, grouped KV heads) over a static KV cache."""

    def __init__(self, config, neuron_config: NeuronConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_layernorm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_layernorm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim),
                             persistent=False)
        cache = (neuron_config.batch_size, self.kv_heads, neuron_config.seq_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache), persistent=False)

    def forward(self, hidden_states, position_ids):
        batch, seq, _ = hidden_states.shape
        q = self.q_layernorm(self.q_proj(hidden_states).view(batch, seq, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_layernorm(self.k_proj(hidden_states).view(batch, seq, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        angles = position_ids[:, None, :, None].float() * self.inv_freq
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        where = position_ids[:, None, :, None].expand(batch, self.kv_heads, seq, self.head_dim)
        self.k_cache.copy_(self.k_cache.scatter(2, where, k))
        self.v_cache.copy_(self.v_cache.scatter(2, where, v))
        keys = self.k_cache.repeat_interleave(self.heads // self.kv_heads, dim=1)
        values = self.v_cache.repeat_interleave(self.heads // self.kv_heads, dim=1)
        visible = torch.arange(self.k_cache.shape[2], device=position_ids.device) <= position_ids[:, None, :, None]
        scores = (q @ keys.transpose(-1, -2)) * self.head_dim ** -0.5
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj((probs @ values).transpose(1, 2).reshape(batch, seq, -1))


def module_marker(hidden_states):
    """NxDI's module-boundary marker: identity on the value, an opaque call that breaks a Dynamo graph."""
    torch._dynamo.graph_break()
    return hidden_states


class DecoderLayer(nn.Module):
    def __init__(self, config, neuron_config: NeuronConfig):
        super().__init__()
        self.markers = neuron_config.module_markers
        self.fused = neuron_config.moe_fused_nki_kernel_enabled
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Attention(config, neuron_config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MoE(config, neuron_config, rmsnorm=self.post_attention_layernorm if self.fused else None)

    def forward(self, hidden_states, position_ids, padding_mask=None):
        if self.markers:
            hidden_states = module_marker(hidden_states)
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_ids)
        moe_input = hidden_states if self.fused else self.post_attention_layernorm(hidden_states)
        hidden_states = hidden_states + self.mlp(moe_input, padding_mask)[0]
        if self.markers:
            hidden_states = module_marker(hidden_states)
        return hidden_states


class NxDQwen3MoeModel(nn.Module):
    """The inner model NxDI traces per bucket: ``forward(input_ids, position_ids) -> logits``
    (``lm_head`` inside, as in NxDI). Built from an HF ``Qwen3MoeConfig``."""

    def __init__(self, config, neuron_config: NeuronConfig | None = None):
        super().__init__()
        self.config = config
        self.neuron_config = neuron_config = neuron_config or NeuronConfig()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, neuron_config) for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, position_ids):
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_ids)
        return self.lm_head(self.norm(hidden_states))

    @classmethod
    def from_hf(cls, hf_model, neuron_config: NeuronConfig | None = None) -> "NxDQwen3MoeModel":
        """NxDI's conversion of an HF Qwen3-MoE checkpoint: the router weight moves from
        ``mlp.gate`` to ``mlp.router.linear_router``, the experts are stacked (transformers 4.x
        keeps one module per expert, 5.x a fused [E, 2I, H] tensor)."""
        hf = hf_model.state_dict()
        model = cls(hf_model.config, neuron_config)
        own = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"],
               "lm_head.weight": hf["lm_head.weight"]}
        for n in range(hf_model.config.num_hidden_layers):
            src, dst = f"model.layers.{n}.", f"layers.{n}."
            for name in ("input_layernorm", "post_attention_layernorm"):
                own[f"{dst}{name}.weight"] = hf[f"{src}{name}.weight"]
            if model.neuron_config.moe_fused_nki_kernel_enabled:  # the same norm, owned by the MoE too
                own[f"{dst}mlp.rmsnorm.weight"] = hf[f"{src}post_attention_layernorm.weight"]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                own[f"{dst}self_attn.{name}.weight"] = hf[f"{src}self_attn.{name}.weight"]
            own[f"{dst}self_attn.q_layernorm.weight"] = hf[f"{src}self_attn.q_norm.weight"]
            own[f"{dst}self_attn.k_layernorm.weight"] = hf[f"{src}self_attn.k_norm.weight"]
            own[f"{dst}mlp.router.linear_router.weight"] = hf[f"{src}mlp.gate.weight"]
            experts = f"{src}mlp.experts."
            if f"{experts}gate_up_proj" in hf:  # transformers 5: [E, 2I, H] and [E, H, I]
                gate_up, down = hf[f"{experts}gate_up_proj"], hf[f"{experts}down_proj"]
            else:  # transformers 4: per expert gate_proj/up_proj [I, H], down_proj [H, I]
                count = hf_model.config.num_experts
                gate_up = torch.stack([torch.cat((hf[f"{experts}{e}.gate_proj.weight"], hf[f"{experts}{e}.up_proj.weight"]))
                                       for e in range(count)])
                down = torch.stack([hf[f"{experts}{e}.down_proj.weight"] for e in range(count)])
            own[f"{dst}mlp.expert_mlps.gate_up_proj"] = gate_up.transpose(1, 2)
            own[f"{dst}mlp.expert_mlps.down_proj"] = down.transpose(1, 2)
        model.load_state_dict(own)
        return model.to(next(hf_model.parameters()).dtype).eval()


class BucketedApplication:
    """Owns the forward as NxDI's application does. ``forward(input_ids [B, S], position_ids [B, S])``
    runs token generation when S is ``1 + speculation_length`` (rows as given), else context
    encoding padded to the smallest bucket that holds S (pad token 0, the padded positions
    continue the sequence); it returns the logits of the given positions, [B, S, vocab]."""

    def __init__(self, model: NxDQwen3MoeModel):
        self.model = model
        self.neuron_config = model.neuron_config
        self.token_generation_length = 1 + self.neuron_config.speculation_length

    def bucket(self, length: int) -> int:
        """The context-encoding bucket a prompt of ``length`` tokens is padded to."""
        for bucket in self.neuron_config.buckets:
            if length <= bucket:
                return bucket
        raise ValueError(f"a context of {length} tokens exceeds the largest bucket {self.neuron_config.buckets[-1]}")

    @property
    def max_tokens(self) -> int:
        """Rows the largest step hands each router: batch x the largest bucket."""
        return self.neuron_config.batch_size * self.neuron_config.buckets[-1]

    def rows(self, length: int) -> int:
        """Tokens (router rows) of a step of ``length`` tokens per sequence: batch x bucket for
        context encoding, batch x (1 + speculation) for token generation."""
        per_sequence = length if length == self.token_generation_length else self.bucket(length)
        return self.neuron_config.batch_size * per_sequence

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        batch, length = input_ids.shape
        if batch != self.neuron_config.batch_size:
            raise ValueError(f"a step holds batch_size={self.neuron_config.batch_size} sequences, got {batch}")
        device = next(self.model.parameters()).device
        if length == self.token_generation_length:
            return self.model(input_ids.to(device), position_ids.to(device))
        pad = self.bucket(length) - length
        padded_ids = F.pad(input_ids, (0, pad))
        padded_positions = torch.cat([position_ids, position_ids[:, -1:] + torch.arange(1, pad + 1)], dim=1)
        return self.model(padded_ids.to(device), padded_positions.to(device))[:, :length]
