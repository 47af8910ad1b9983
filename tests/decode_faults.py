"""Faults that arise only in incremental decoding, planted as code in the attention classes of
Llama and Qwen3-MoE: a full forward (prefill, or one without a cache) never sees them.

The fault a model carries is named by its config (``planted_decode_fault``, saved in its
config.json with the checkpoint), so a checkpoint directory keeps it: any process that imports
this module (:func:`install`) and loads that directory runs the faulty attention; the clean
model, without the attribute, runs HF's own code. A fault is active only in the layer
``planted_decode_layer`` and only when the cache already holds earlier positions of it.
"""

from __future__ import annotations

import functools

import torch
from transformers.models.llama import modeling_llama
from transformers.models.qwen3_moe import modeling_qwen3_moe

#: position_off_by_one: the new token's query and key rotated as the next position's;
#: rope_again: every key read from the cache rotated once more, by the new token's angle.
FAULTS = ("position_off_by_one", "rope_again")
ATTENTIONS = (modeling_llama.LlamaAttention, modeling_qwen3_moe.Qwen3MoeAttention)


def plant(model, fault: str, layer: int):
    """``model`` with ``fault`` in layer ``layer``'s attention (in its config, which a checkpoint saves)."""
    if fault not in FAULTS:
        raise ValueError(f"unknown decode fault {fault!r}; one of {FAULTS}")
    install()
    model.config.planted_decode_fault, model.config.planted_decode_layer = fault, layer
    return model


def install() -> None:
    """Patch the attention classes' forward once (a model without a planted fault runs HF's code)."""
    for cls in ATTENTIONS:
        if not getattr(cls.forward, "planted", False):
            cls.forward = _faulty(cls.forward)


def _faulty(forward):
    @functools.wraps(forward)
    def patched(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        fault = getattr(self.config, "planted_decode_fault", None)
        if fault and self.layer_idx == self.config.planted_decode_layer and _holds_earlier(past_key_values, self.layer_idx):
            if fault == "position_off_by_one":
                position_embeddings = _one_position_later(self.config, self.head_dim, *position_embeddings)
            else:
                past_key_values = _RotatingCache(past_key_values, *position_embeddings)
        return forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)

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
