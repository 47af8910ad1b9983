"""Adapters turn replacement router *logits* into the value an injection point
computes.

Needed when the only place to inject is downstream of the logits, e.g. a fused
router kernel that never materialises them and returns expert affinities. An
adapter is ``fn(logits [T, E], module) -> Tensor``; ``module`` is the targeted
module, so routing constants (``top_k``, a correction bias) come from the model
itself. The built-in routing adapters come in two forms, for the two things fused
routers hand to their experts: dense ``[T, E]`` affinities (the routing weight at
each chosen expert, zero elsewhere; ``topk_softmax_scatter``, ...) and top-k pairs
``(weights [T, k], expert ids [T, k])`` in the order the routing's top-k picks
them (``pairs=True``; registered as ``topk_softmax_pairs``, ...). A pair adapter
replaces a point that computes such a pair (``Target(point="output")`` on a router
returning ``(weights, ids)``).
"""

from __future__ import annotations

from typing import Callable, Union

import torch
from torch import nn

from .extensions import load_extensions
from .registries import Registry, describe_failures

Adapter = Callable[[torch.Tensor, nn.Module], Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]

_REGISTRY: Registry[Adapter] = Registry("adapter")
_ROUTING: set[str] = set()


def register_adapter(name: str, fn: Adapter, *, routing: bool = False, replace: bool = False) -> Adapter:
    """Make ``fn(logits, module)`` available to ``Target(adapter=name)``.
    ``routing=True``: it turns logits into routing weights, so it must never be
    applied at a point that computes the logits themselves (checked at instrument).
    A name already registered is an error unless ``replace=True`` (two packages must
    not silently take each other's adapter)."""
    if not callable(fn):
        raise TypeError(f"adapter {name!r} must be callable")
    _REGISTRY.register(name, fn, replace=replace)
    _ROUTING.discard(name)
    if routing:
        _ROUTING.add(name)
    return fn


def routing_adapter_name(adapter: Union[str, Adapter, None]) -> str | None:
    """The registered name of a routing adapter (given by name or as its function), else None."""
    for name in _ROUTING:
        if adapter == name or adapter is _REGISTRY[name]:
            return name
    return None


def get_adapter(adapter: Union[str, Adapter, None]) -> Adapter:
    """Resolve a :class:`~fxreplace.Target` adapter field to a function."""
    if adapter is None:
        return identity
    if callable(adapter):
        return adapter
    failures = []
    if adapter not in _REGISTRY:
        failures = load_extensions()  # an installed package may register it
    try:
        return _REGISTRY[adapter]
    except KeyError:
        raise KeyError(f"unknown adapter {adapter!r}; registered: {sorted(_REGISTRY)}{describe_failures(failures)}") from None


def identity(logits: torch.Tensor, module: nn.Module) -> torch.Tensor:
    return logits


def _module_attr(module: nn.Module, value, attr: str, adapter: str):
    if value is not None:
        return value
    if not hasattr(module, attr):
        raise ValueError(f"adapter {adapter} needs {attr!r}: pass it explicitly or give the module that attribute")
    return getattr(module, attr)


def routing_matrix(weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Top-k routing ``(weights [T, k], expert ids [T, k])`` as the dense ``[T, E]`` matrix the experts
    apply: each token's weight at its chosen experts, zero elsewhere (what the dense routing adapters
    return, and the form a routing capture holds)."""
    dense = torch.zeros(weights.shape[0], num_experts, dtype=weights.dtype, device=weights.device)
    return dense.scatter(1, ids, weights)


def routing_pair(dense: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`routing_matrix`: each row's ``k`` non-zero entries (largest magnitude first)
    as ``(weights [T, k], expert ids [T, k])``. A chosen expert of weight exactly zero comes back as
    some expert of weight zero, which the experts' weighted sum cannot tell apart."""
    ids = torch.topk(dense.abs(), k, dim=-1).indices
    return dense.gather(-1, ids), ids


def _routed(route: Callable, pairs: bool) -> Adapter:
    """``route(logits, module) -> (weights, ids)`` as a dense or a pair adapter."""

    def adapter(logits, module):
        weights, indices = route(logits, module)
        return (weights, indices) if pairs else routing_matrix(weights, indices, logits.shape[-1])

    return adapter


def topk_softmax_scatter(k: int | None = None, pairs: bool = False) -> Adapter:
    """GPT-OSS routing: top-k of the raw logits, softmax over those k values."""

    def route(logits, module):
        top_k = _module_attr(module, k, "top_k", "topk_softmax_scatter")
        values, indices = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(values, dim=-1), indices

    return _routed(route, pairs)


def softmax_topk_renorm(k: int | None = None, renormalize: bool | None = None, pairs: bool = False) -> Adapter:
    """Qwen3-MoE / Mixtral routing: softmax over all experts, top-k, optional
    renormalisation of the k weights to sum to one."""

    def route(logits, module):
        top_k = _module_attr(module, k, "top_k", "softmax_topk_renorm")
        renorm = renormalize if renormalize is not None else getattr(module, "norm_topk_prob", True)
        values, indices = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
        if renorm:
            values = values / values.sum(dim=-1, keepdim=True)
        return values, indices

    return _routed(route, pairs)


def sigmoid_bias_grouped_topk(
    k: int | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float | None = None,
    norm_topk_prob: bool | None = None,
    pairs: bool = False,
) -> Adapter:
    """DeepSeek-V3 routing: sigmoid scores; experts chosen by score plus the
    module's ``e_score_correction_bias`` within the best ``topk_group`` groups;
    weights are the unbiased scores, optionally renormalised, then scaled."""

    def route(logits, module):
        name = "sigmoid_bias_grouped_topk"
        top_k = _module_attr(module, k, "top_k", name)
        groups = _module_attr(module, n_group, "num_group", name)
        keep_groups = _module_attr(module, topk_group, "topk_group", name)
        scale = _module_attr(module, routed_scaling_factor, "routed_scaling_factor", name)
        renorm = _module_attr(module, norm_topk_prob, "norm_topk_prob", name)
        num_tokens, num_experts = logits.shape
        scores = logits.float().sigmoid()
        choice = scores + module.e_score_correction_bias.float()
        group_scores = choice.view(num_tokens, groups, num_experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=keep_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(num_tokens, groups, num_experts // groups)
        choice = choice.masked_fill(expert_mask.reshape(num_tokens, num_experts) == 0, float("-inf"))
        indices = torch.topk(choice, k=top_k, dim=-1)[1]
        weights = scores.gather(1, indices)
        if renorm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * scale, indices

    return _routed(route, pairs)


def residual_stream_pair(stream: torch.Tensor, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after a decoder layer, ``[T, H]``, for a layer that returns
    ``(block output, residual)`` and leaves their add to the next fused norm (vLLM):
    ``(0, stream)``, whose sum is the stream."""
    return torch.zeros_like(stream), stream


register_adapter("identity", identity)
register_adapter("residual_stream_pair", residual_stream_pair)
register_adapter("topk_softmax_scatter", topk_softmax_scatter(), routing=True)
register_adapter("softmax_topk_renorm", softmax_topk_renorm(), routing=True)
register_adapter("sigmoid_bias_grouped_topk", sigmoid_bias_grouped_topk(), routing=True)
register_adapter("topk_softmax_pairs", topk_softmax_scatter(pairs=True), routing=True)
register_adapter("softmax_topk_renorm_pairs", softmax_topk_renorm(pairs=True), routing=True)
register_adapter("sigmoid_bias_grouped_topk_pairs", sigmoid_bias_grouped_topk(pairs=True), routing=True)
