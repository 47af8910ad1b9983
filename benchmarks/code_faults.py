"""Code faults for the localisation benchmark (``bench_blame_suite.py --code-faults``): our own reenactments of
bug classes that public trackers document, planted as *code* in tiny float32 HF models, the weights untouched.

A fault is a subclass of the class a layer's module runs (one class for every layer it is planted in), whose
method or property does what the documented bug did: a port reads the config wrong, drops a step, uses another
activation. Planted in one layer or in every layer (of the type it concerns: every MoE layer, every sliding
attention layer). Besides: a router bug planted as an instance attribute (``module.forward = MethodType(...)``,
which ``instrument()`` once erased), the decode-only attention faults of ``decode_faults.py`` (a forward
without a cache never runs them), the interaction case (an RMSNorm offset in every layer, where one layer's
replacement alone makes the target worse), and a code fault beside a weight fault of another kind (two router
rows negated in another layer: two independent sources).

Each fault names the module whose output the oracle replaces with the clean model's (forward hooks, no
fxreplace) and the kind blame must name. Sources (the tracker threads each bug class follows; the code here is
ours):

- top-k renormalisation skipped: pytorch/torchtitan#1448 (DeepSeek-V3 router without norm_topk_prob)
- attention scale from hidden_size // num_heads, not head_dim: EleutherAI/gpt-neox#1434, karpathy/ng-video-lecture#6
- q/k norm missing: Cerebras/modelzoo#85 (q_norm/k_norm built, never called), huggingface/transformers#37620
- attention sinks dropped: vllm-project/vllm-metal#212 and PR #550 (``use_sinks = false`` hard-coded)
- sliding window one short: huggingface/transformers#39408, ml-explore/mlx-lm#390, zml/zml#763
- key/value heads tiled instead of interleaved: onnx/onnx#7274 (GQA by Tile), apple/axlearn#842
- wrong activation (GELU for SiLU): huggingface/candle#991, togethercomputer/stripedhyena#9
- routed scaling factor applied twice: sgl-project/sglang#35152 (DeepSeek's factor applied again in every layer)
- expert bias folded into the gating weights: huggingface/transformers#39581 (Ernie-4.5), #41663 (dots1)
- GPT-OSS softmax over every expert instead of the k chosen: pytorch/torchtitan#2258
- RoPE scaling ignored: vllm-project/vllm#1956 (InternLM ignored rope_scaling), Blaizzy/mlx-vlm#1710
- RMSNorm (1 + weight) offset: linkedin/Liger-Kernel#74 (Gemma's offset applied as Llama's, or the reverse)
- decode-only: Blaizzy/mlx-vlm#1983 (decode positions ignore the cache offset), pytorch/executorch#2010
- the residual taken after the norm (a pre-norm layer's own forward): Howuhh/faster-trajectory-transformer#3,
  SHI-Labs/Compact-Transformers#25
- RMSNorm (1 + weight) offset in the norm class itself, so every norm runs it: linkedin/Liger-Kernel#74
"""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

QWEN, MIXTRAL, LLAMA, GPT_OSS, DEEPSEEK = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "LlamaForCausalLM",
                                           "GptOssForCausalLM", "DeepseekV3ForCausalLM")


def ported(model: nn.Module, path: str, layers, **code) -> nn.Module:
    """A copy of ``model`` whose module at ``path`` in each of ``layers`` runs one subclass of its class with
    ``code`` (methods, properties) instead: the port's bug, the weights untouched."""
    model = copy.deepcopy(model)
    modules = [model.model.layers[k].get_submodule(path) for k in layers]
    faulty = type(f"Ported{type(modules[0]).__name__}", (type(modules[0]),), code)
    for module in modules:
        module.__class__ = faulty
    return model


# ---------------------------------------------------------------------------------------------- attention

def scale_from_hidden_size(model, layers):
    """Attention scores scaled by (hidden_size // num_heads) ** -0.5 instead of head_dim ** -0.5."""
    return ported(model, "self_attn", layers,
                  scaling=property(lambda self: (self.config.hidden_size // self.config.num_attention_heads) ** -0.5))


def no_qk_norm(model, layers):
    """Qwen3's per-head q/k RMSNorms built but not applied."""
    return ported(model, "self_attn", layers, q_norm=property(lambda self: nn.Identity()),
                  k_norm=property(lambda self: nn.Identity()))


def sinks_dropped(model, layers):
    """GPT-OSS attention without its sinks: the softmax runs over the scores alone (a sink logit of -inf)."""
    return ported(model, "self_attn", layers,
                  sinks=property(lambda self: torch.full_like(self._parameters["sinks"], float("-inf"))))


def window_one_short(model, layers):
    """A sliding window that keeps one key fewer than the config's: the oldest key of the window is masked."""
    base = type(model.model.layers[layers[0]].self_attn).forward

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        if self.sliding_window and attention_mask is not None:
            # each query row whose window is full (sliding_window keys visible) loses its oldest key: the first
            # visible one (caches keep keys in position order)
            visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            full = visible.sum(-1, keepdim=True) == self.sliding_window
            oldest = F.one_hot(visible.int().argmax(-1), visible.shape[-1]).bool()
            edge = full & oldest
            attention_mask = (attention_mask & ~edge if attention_mask.dtype == torch.bool
                              else attention_mask.masked_fill(edge, torch.finfo(attention_mask.dtype).min))
        return base(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)

    return ported(model, "self_attn", layers, forward=forward)


def kv_heads_tiled(model, layers):
    """Grouped-query attention whose key/value heads are tiled ([k0, k1, k0, k1]) where query head h must read key
    head h // groups ([k0, k0, k1, k1]): the attention written out, with Tensor.repeat where repeat_interleave
    belongs."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k = self.q_proj(hidden_states).view(shape), self.k_proj(hidden_states).view(shape)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        k, v = k.repeat(1, self.num_key_value_groups, 1, 1), v.repeat(1, self.num_key_value_groups, 1, 1)  # the bug
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if attention_mask is None:
            t, s = scores.shape[-2:]
            attention_mask = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril(s - t)
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
        return self.o_proj(out), weights

    return ported(model, "self_attn", layers, forward=forward)


def rope_scaling_ignored(model, layers):
    """Linear RoPE scaling in the config, ignored by the attention: its rotation is recomputed from the plain
    positions (``position_ids``), not the positions divided by the factor."""
    base = type(model.model.layers[layers[0]].self_attn).forward

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        positions = kwargs.get("position_ids")
        theta = self.config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        angles = positions.float()[..., None] * inv_freq  # no division by rope_parameters["factor"]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = position_embeddings
        position_embeddings = angles.cos().to(cos.dtype), angles.sin().to(sin.dtype)
        return base(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)

    return ported(model, "self_attn", layers, forward=forward)


def norm_weight_offset_forward(self, x):
    """An RMSNorm scaling by (1 + weight), Gemma's convention, on weights stored for ``weight``."""
    return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def norm_weight_offset(model, layers):
    """The input RMSNorm scales by (1 + weight)."""
    return ported(model, "input_layernorm", layers, forward=norm_weight_offset_forward)


def norm_class_offset(model, layers):
    """The port's RMSNorm *class* scales by (1 + weight): every norm running it does, in every layer (input and
    post-attention norms, Qwen3's q/k norms) and the final norm after them (``layers`` is not read)."""
    model = copy.deepcopy(model)
    norm = type(model.model.norm)
    faulty = type(f"Ported{norm.__name__}", (norm,), {"forward": norm_weight_offset_forward})
    for module in model.modules():
        if type(module) is norm:
            module.__class__ = faulty
    return model


# ---------------------------------------------------------------------------------------------- the layer itself

def residual_after_norm(model, layers):
    """The decoder layer takes the MLP's residual after the post-attention norm, not before it (a pre-norm layer
    written as a post-norm one): the layer class's own forward, outside every submodule."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
            position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
            position_embeddings=position_embeddings, **kwargs)
        hidden_states = self.post_attention_layernorm(residual + hidden_states)
        return hidden_states + self.mlp(hidden_states)  # the bug: the residual is the normed stream

    return ported(model, "", layers, forward=forward)


# ---------------------------------------------------------------------------------------------- mlp / experts

def gelu_activation(path):
    """The MLP's or the experts' activation is GELU where the config says SiLU."""
    def plant(model, layers):
        return ported(model, path, layers, act_fn=property(lambda self: F.gelu))
    return plant


# ---------------------------------------------------------------------------------------------- routing

def skip_renorm(self, hidden_states):
    """A softmax -> top-k router (Qwen3-MoE, Mixtral) that does not renormalise the k weights it keeps."""
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    weights, ids = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
    return logits, weights.to(logits.dtype), ids


def renorm_skipped(model, layers):
    return ported(model, "mlp.gate", layers, forward=skip_renorm)


def renorm_skipped_instance(model, layers):
    """The same router bug set on each gate *instance* (``gate.forward = MethodType(...)``)."""
    model = copy.deepcopy(model)
    for k in layers:
        gate = model.model.layers[k].mlp.gate
        gate.forward = types.MethodType(skip_renorm, gate)
    return model


def scaled_twice(model, layers):
    """DeepSeek-V3's MoE block multiplying by the routed scaling factor the router already applied."""

    def forward(self, hidden_states):
        residuals, shape = hidden_states, hidden_states.shape
        _, weights, ids = self.gate(hidden_states)
        weights = weights * self.gate.routed_scaling_factor  # the second time
        out = self.experts(hidden_states.view(-1, shape[-1]), ids, weights).view(*shape)
        return out + self.shared_experts(residuals)

    return ported(model, "mlp", layers, forward=forward)


def bias_in_weights(model, layers):
    """DeepSeek-V3's router gathering the expert weights from the bias-corrected scores (the correction bias is
    meant for choosing the experts only)."""
    base = type(model.model.layers[layers[0]].mlp.gate).forward

    def forward(self, hidden_states):
        logits, _, ids = base(self, hidden_states)
        weights = (logits.sigmoid() + self.e_score_correction_bias).gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, ids

    return ported(model, "mlp.gate", layers, forward=forward)


def softmax_over_all(model, layers):
    """GPT-OSS's router taking the softmax over every expert's logit, then the k chosen, instead of the softmax
    over the k chosen logits."""

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight, self.bias)
        _, ids = torch.topk(logits, self.top_k, dim=-1)
        return logits, torch.softmax(logits, dim=-1).gather(1, ids), ids

    return ported(model, "mlp.router", layers, forward=forward)


# ---------------------------------------------------------------------------------------------- decode-only

def decode_fault(name):
    """decode_faults.py's fault ``name`` (arising only with a cache of earlier positions) in one layer: the module
    beside this one (tests/test_repro_decode.py loads it from here too)."""
    def plant(model, layers):
        here = str(Path(__file__).resolve().parent)
        if here not in sys.path:
            sys.path.insert(0, here)
        import decode_faults

        (layer,) = layers
        return decode_faults.plant(copy.deepcopy(model), name, layer)
    return plant


# ---------------------------------------------------------------------------------------------- weight fault

def router_rows(model: nn.Module, layer: int) -> tuple[str, str]:
    """A weight fault beside a code fault: two of layer ``layer``'s router rows negated and scaled 1.5x, in place;
    the module the oracle replaces and the kind blame must name."""
    mlp = model.model.layers[layer].mlp
    path = "router" if hasattr(mlp, "router") else "gate"
    with torch.no_grad():
        weight = getattr(mlp, path).weight
        weight[[1, 5]] = -1.5 * weight[[1, 5]]
    return f"model.layers.{layer}.mlp.{path}", "router"


# ---------------------------------------------------------------------------------------------- the cases

GPT_OSS_TYPES = {"layer_types": "alternating"}  # sliding, full, sliding, ... over the model's layers (config_for)


@dataclass(frozen=True)
class CodeFault:
    name: str
    family: str
    plant: Callable  # (clean model, layers) -> a faulty copy
    module: str  # the module in a faulty layer whose output the oracle replaces
    kind: str  # what blame must name
    source: str  # the tracker thread the bug class follows
    config: dict = field(default_factory=dict)  # overrides of the family's tiny config (besides the layers)
    where: str = "every layer"  # the layers "every layer" means: "every layer", "every MoE layer", "every sliding..."
    single: bool = True  # also planted in one layer
    every: bool = True  # also planted in every such layer
    decode: bool = False  # arises only in decode: validated, reproduced
    interaction: bool = False  # every layer's fault interacts: one layer replaced alone makes the target worse
    layers: tuple = ()  # planted in these layers only (with ``beside``)
    beside: tuple = ()  # (weight fault, its layer): planted beside the code fault, an independent source
    in_class: bool = False  # planted in the class every instance runs (the final norm too): ``kind`` joins the kinds


FAULTS = [
    CodeFault("renorm skipped", QWEN, renorm_skipped, "mlp.gate", "routing", "pytorch/torchtitan#1448"),
    CodeFault("renorm skipped", MIXTRAL, renorm_skipped, "mlp.gate", "routing", "pytorch/torchtitan#1448"),
    CodeFault("renorm skipped, instance attribute", QWEN, renorm_skipped_instance, "mlp.gate", "routing",
              "pytorch/torchtitan#1448", every=False),
    CodeFault("attention scale", QWEN, scale_from_hidden_size, "self_attn", "attention", "EleutherAI/gpt-neox#1434",
              {"num_attention_heads": 4}),
    CodeFault("attention scale", LLAMA, scale_from_hidden_size, "self_attn", "attention", "EleutherAI/gpt-neox#1434",
              {"num_attention_heads": 4}),
    CodeFault("q/k norm missing", QWEN, no_qk_norm, "self_attn", "attention", "Cerebras/modelzoo#85"),
    CodeFault("attention sinks dropped", GPT_OSS, sinks_dropped, "self_attn", "attention",
              "vllm-project/vllm-metal#212", GPT_OSS_TYPES),
    CodeFault("sliding window one short", GPT_OSS, window_one_short, "self_attn", "attention",
              "huggingface/transformers#39408", {**GPT_OSS_TYPES, "sliding_window": 4},
              where="every sliding attention layer"),
    CodeFault("kv heads tiled", LLAMA, kv_heads_tiled, "self_attn", "attention", "onnx/onnx#7274",
              {"num_attention_heads": 4, "num_key_value_heads": 2}),
    CodeFault("kv heads tiled", QWEN, kv_heads_tiled, "self_attn", "attention", "onnx/onnx#7274",
              {"num_attention_heads": 4, "num_key_value_heads": 2}),
    CodeFault("activation", LLAMA, gelu_activation("mlp"), "mlp", "mlp", "huggingface/candle#991"),
    CodeFault("activation", MIXTRAL, gelu_activation("mlp.experts"), "mlp.experts", "experts",
              "huggingface/candle#991"),
    CodeFault("scaling twice", DEEPSEEK, scaled_twice, "mlp.experts", "routing", "sgl-project/sglang#35152",
              where="every MoE layer"),
    CodeFault("bias in weights", DEEPSEEK, bias_in_weights, "mlp.gate", "routing", "huggingface/transformers#39581",
              where="every MoE layer"),
    CodeFault("softmax over all experts", GPT_OSS, softmax_over_all, "mlp.router", "routing",
              "pytorch/torchtitan#2258", GPT_OSS_TYPES),
    CodeFault("rope scaling ignored", LLAMA, rope_scaling_ignored, "self_attn", "attention", "vllm-project/vllm#1956",
              {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
    CodeFault("rope scaling ignored", MIXTRAL, rope_scaling_ignored, "self_attn", "attention",
              "vllm-project/vllm#1956",
              {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}),
    CodeFault("rmsnorm offset", LLAMA, norm_weight_offset, "input_layernorm", "attention",
              "linkedin/Liger-Kernel#74", single=False),
    CodeFault("rmsnorm offset (interaction)", QWEN, norm_weight_offset, "input_layernorm", "attention",
              "linkedin/Liger-Kernel#74", single=False, interaction=True),
    # the norm class itself: every norm of the model runs it, so origins of two kinds in every layer and a part after
    # the layers: one fault, named by its class
    CodeFault("rmsnorm offset in its class", LLAMA, norm_class_offset, "", "attention and mlp",
              "linkedin/Liger-Kernel#74", single=False, in_class=True),
    CodeFault("rmsnorm offset in its class", QWEN, norm_class_offset, "", "attention and experts",
              "linkedin/Liger-Kernel#74", single=False, in_class=True),
    CodeFault("rmsnorm offset in its class", MIXTRAL, norm_class_offset, "", "attention and experts",
              "linkedin/Liger-Kernel#74", single=False, in_class=True),
    CodeFault("rmsnorm offset in its class", DEEPSEEK, norm_class_offset, "", "attention and experts",
              "linkedin/Liger-Kernel#74", single=False, in_class=True),
    CodeFault("rmsnorm offset in its class", GPT_OSS, norm_class_offset, "", "attention and experts",
              "linkedin/Liger-Kernel#74", GPT_OSS_TYPES, single=False, in_class=True),
    # the layer class's own forward: no kind explains it, so each layer is named by itself; in every layer, one fault
    CodeFault("residual after the norm", LLAMA, residual_after_norm, "", "layer",
              "Howuhh/faster-trajectory-transformer#3"),
    CodeFault("residual after the norm", QWEN, residual_after_norm, "", "layer",
              "Howuhh/faster-trajectory-transformer#3"),
    # a code fault beside a weight fault of another kind: two independent sources, the systematic one not
    # swallowing the other (a routing replacement also undoes a router-weight fault: it is downstream)
    CodeFault("attention scale + router rows", QWEN, scale_from_hidden_size, "self_attn", "attention",
              "EleutherAI/gpt-neox#1434", {"num_attention_heads": 4}, single=False, every=False,
              beside=(router_rows, 2)),
    CodeFault("renorm skipped + router rows", MIXTRAL, renorm_skipped, "mlp.gate", "routing", "pytorch/torchtitan#1448",
              single=False, every=False, layers=(0, 2), beside=(router_rows, 3)),
    CodeFault("scaling twice + router rows", DEEPSEEK, scaled_twice, "mlp.experts", "routing",
              "sgl-project/sglang#35152", single=False, every=False, layers=(1, 2), beside=(router_rows, 3)),
    CodeFault("decode: rope again", LLAMA, decode_fault("rope_again"), "self_attn", "attention",
              "pytorch/executorch#2010", every=False, decode=True),
    CodeFault("decode: position off by one", QWEN, decode_fault("position_off_by_one"), "self_attn", "attention",
              "Blaizzy/mlx-vlm#1983", every=False, decode=True),
]


def config_for(fault: CodeFault, layers: int) -> dict:
    """The fault's config overrides for a model of ``layers`` decoder layers."""
    config = dict(fault.config)
    if config.get("layer_types") == "alternating":
        config["layer_types"] = [("sliding_attention", "full_attention")[k % 2] for k in range(layers)]
    return config


def prepare(clean: nn.Module, fault: CodeFault) -> nn.Module:
    """The clean model as a fault needs it: DeepSeek-V3's correction bias as a trained model holds one (init: 0)."""
    if fault.family == DEEPSEEK:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in clean.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(
                        layer.mlp.gate.e_score_correction_bias.shape, generator=gen) * 0.5)
    return clean


def faulty_layers(model: nn.Module, fault: CodeFault) -> list[int]:
    """The layers "every layer" means for ``fault``: every layer, every MoE layer, every sliding attention layer."""
    layers = range(model.config.num_hidden_layers)
    if fault.where == "every MoE layer":
        return [k for k in layers if hasattr(model.model.layers[k].mlp, "gate")]
    if fault.where == "every sliding attention layer":
        return [k for k in layers if model.config.layer_types[k] == "sliding_attention"]
    return list(layers)
