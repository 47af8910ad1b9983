"""Recording a component's calls in the reference run as an engine makes them (prefill, then decode steps
with the KV cache it read), for :mod:`fxreplace.repro` to export and replay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import repro_run
from .devices import input_device
from .repro_run import ReproError


@dataclass
class Call:
    """One call of the component in the reference run: its arguments (a cache it read as the
    :class:`CacheState` it held before the call), what it returned, and when it ran: in the
    prompt's prefill or a decode step, after ``cached`` positions, computing ``tokens`` of them."""

    prompt: int
    kind: str  # repro_run.PREFILL or repro_run.DECODE
    cached: int
    tokens: int
    args: tuple
    kwargs: dict
    output: object


@dataclass
class CacheState:
    """The layers of a KV cache that a call read, as they were before it: ``{layer index: (keys,
    values)}`` (empty in a prefill). ``unrecorded``: why the state cannot be recorded (a cache
    layer holding something other than keys and values), in which case the call cannot be replayed."""

    layers: dict
    unrecorded: str = ""

    def tensors(self) -> list[torch.Tensor]:
        return [t for kv in self.layers.values() for t in kv]


@torch.no_grad()
def capture_calls(model: nn.Module, module_name: str, runs: Sequence[tuple[int, Sequence[int], Sequence[int]]]
                  ) -> Iterator[Call]:
    """The module's calls (arguments and output) as an engine makes them: per ``(prompt number, prompt
    ids, forced ids)`` the prompt's prefill, then one decode step per forced token with the model's KV cache
    (teacher-forced on the reference's tokens). A full forward without a cache would hide every
    fault that arises only in decode (positions with a cache, RoPE on cached keys, the window).
    Yielded after each forward: a decode call holds a copy of the cache it read, so a caller keeps
    only the calls it needs (a module called outside the model's forwards, meanwhile, is not recorded)."""
    from transformers import Cache, DynamicCache  # the hf extra: a repro is written from HF models

    module = model.get_submodule(module_name)
    layers_read = sorted({m.layer_idx for m in module.modules() if isinstance(getattr(m, "layer_idx", None), int)})
    calls: list[Call] = []
    pending: list[tuple] = []
    step = {"recording": False}  # the forward running now: its kind, the positions cached before it, its tokens

    def before(_, args, kwargs):
        def state(x):
            return (_cache_state(x, layers_read, module_name, step["kind"] == repro_run.DECODE)
                    if isinstance(x, Cache) else x)

        if step["recording"]:
            pending.append(pytree.tree_map(state, (args, kwargs), is_leaf=lambda x: isinstance(x, Cache)))

    def after(_, args, kwargs, output):
        if step["recording"]:
            a, k = pending.pop()
            calls.append(Call(prompt, step["kind"], step["cached"], step["tokens"], a, k,
                              pytree.tree_map(_detach, output)))

    hooks = [module.register_forward_pre_hook(before, with_kwargs=True),
             module.register_forward_hook(after, with_kwargs=True)]
    device = input_device(model)
    try:
        for prompt, ids, forced in runs:
            cache = DynamicCache(config=model.config)
            forwards = [(repro_run.PREFILL, 0, list(ids))]
            forwards += [(repro_run.DECODE, len(ids) + n, [token]) for n, token in enumerate(forced)]
            for kind, cached, tokens in forwards:
                step.update(kind=kind, cached=cached, tokens=len(tokens), recording=True)
                model(input_ids=torch.tensor([tokens], device=device), past_key_values=cache, use_cache=True)
                step["recording"] = False
                for call in calls:
                    _check_plain(call, module_name)
                    yield call
                calls.clear()
    finally:
        for h in hooks:
            h.remove()


def _check_plain(call: Call, module_name: str) -> None:
    bad = [type(x).__name__ for x in pytree.tree_leaves((call.args, call.kwargs))
           if not isinstance(x, (torch.Tensor, CacheState, bool, int, float, str, type(None)))]
    if bad:
        raise ReproError(f"{module_name} is called with {bad[0]} arguments; a repro takes tensors and plain "
                         "values only: name a module whose forward takes tensors")


def _cache_state(cache, layers_read: list[int], module_name: str, decoding: bool) -> CacheState:
    """What the module reads of ``cache``, copied before its call changes it: the keys and values of
    the cache layers its attention modules index (``layer_idx``); nothing in a prefill."""
    if not decoding:
        return CacheState({})
    if not layers_read:
        return CacheState({}, f"{module_name} reads a KV cache but holds no attention module naming the cache layer "
                              "it reads (layer_idx)")
    layers = {}
    for i in layers_read:
        layer = cache.layers[i] if i < len(cache.layers) else None
        if layer is None or not isinstance(getattr(layer, "keys", None), torch.Tensor):
            return CacheState({}, f"its cache layer {i} is a {type(layer).__name__}, not keys and values (the "
                                  "only state a repro rebuilds)")
        layers[i] = (layer.keys.detach().clone(), layer.values.detach().clone())  # where the call's other inputs are
    return CacheState(layers)


def _detach(x):
    return x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x  # a repro folder is device-neutral


def call_tensors(call: Call, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The call's input tensors in order (a cache's keys and values where it was), floating ones in ``dtype``."""
    flat = []
    for x in pytree.tree_leaves((call.args, call.kwargs)):
        flat += x.tensors() if isinstance(x, CacheState) else [x] if isinstance(x, torch.Tensor) else []
    return [x.to(dtype) if dtype is not None and x.is_floating_point() else x for x in flat]


def unreplayable(call: Call) -> str:
    """Why the call cannot be replayed ("" when it can)."""
    return next((x.unrecorded for x in pytree.tree_leaves((call.args, call.kwargs))
                 if isinstance(x, CacheState) and x.unrecorded), "")
