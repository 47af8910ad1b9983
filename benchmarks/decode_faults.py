"""Faults that arise in one phase only, planted as code in the attention classes of Llama and
Qwen3-MoE. The decode faults arise only in incremental decoding: a full forward (a prefill, or
one without a cache) never sees them. The prefill fault is the reverse: it scales the attention's
output in a prefill only, so the cached keys and values stay right and decode steps stay exact.

The fault a model carries is named by its config (``planted_phase_fault``, saved in its
config.json with the checkpoint), so a checkpoint directory keeps it: any process that imports
this module (:func:`install`) and loads that directory runs the faulty attention; the clean
model, without the attribute, runs HF's own code. A fault is active only in the layer
``planted_phase_fault_layer``: a decode fault when the cache already holds earlier positions of it, the
prefill fault when it holds none.
"""

from __future__ import annotations

import functools

import torch
from transformers.models.llama import modeling_llama
from transformers.models.qwen3_moe import modeling_qwen3_moe

#: position_off_by_one: the new token's query and key rotated as the next position's;
#: rope_again: every key read from the cache rotated once more, by the new token's angle.
DECODE_FAULTS = ("position_off_by_one", "rope_again")
#: prefill_output_scaled: the attention's output 1.5x in a prefill (what it caches is right).
PREFILL_FAULT = "prefill_output_scaled"
FAULTS = (*DECODE_FAULTS, PREFILL_FAULT)
ATTENTIONS = (modeling_llama.LlamaAttention, modeling_qwen3_moe.Qwen3MoeAttention)


def plant(model, fault: str, layer: int):
    """``model`` with ``fault`` in layer ``layer``'s attention (in its config, which a checkpoint saves)."""
    if fault not in FAULTS:
        raise ValueError(f"unknown planted fault {fault!r}; one of {FAULTS}")
    install()
    model.config.planted_phase_fault, model.config.planted_phase_fault_layer = fault, layer
    return model


def install() -> None:
    """Patch the attention classes' forward once (a model without a planted fault runs HF's code)."""
    for cls in ATTENTIONS:
        if not getattr(cls.forward, "planted", False):
            cls.forward = _faulty(cls.forward)


def _faulty(forward):
    @functools.wraps(forward)
    def patched(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        fault = getattr(self.config, "planted_phase_fault", None)
        if not fault or self.layer_idx != self.config.planted_phase_fault_layer:
            return forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        decoding = _holds_earlier(past_key_values, self.layer_idx)
        if fault == "position_off_by_one" and decoding:
            position_embeddings = _one_position_later(self.config, self.head_dim, *position_embeddings)
        elif fault == "rope_again" and decoding:
            past_key_values = _RotatingCache(past_key_values, *position_embeddings)
        output, weights = forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        return (output * 1.5 if fault == PREFILL_FAULT and not decoding else output), weights

    patched.planted = True
    return patched


def _holds_earlier(cache, layer_idx: int) -> bool:
    """Whether the cache holds earlier positions of this layer: a decode step, not a prefill."""
    return cache is not None and bool(cache.get_seq_length(layer_idx) > 0)


def _one_position_later(config, head_dim: int, cos: torch.Tensor, sin: torch.Tensor):
    """cos/sin of each position plus one (the angles add: default RoPE, whole head rotated)."""
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    step = torch.cat([inv_freq, inv_freq]).to(cos.device)
    c, s = step.cos().to(cos.dtype), step.sin().to(sin.dtype)
    return cos * c - sin * s, sin * c + cos * s


class _RotatingCache:
    """The cache, whose keys come back rotated once more by the newest position's angle."""

    def __init__(self, cache, cos: torch.Tensor, sin: torch.Tensor):
        self.cache, self.cos, self.sin = cache, cos[:, None, -1:], sin[:, None, -1:]

    def update(self, keys, values, layer_idx, *args, **kwargs):
        keys, values = self.cache.update(keys, values, layer_idx, *args, **kwargs)
        return keys * self.cos + modeling_llama.rotate_half(keys) * self.sin, values

    def __getattr__(self, name):
        return getattr(self.cache, name)
