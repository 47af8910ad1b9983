"""Where a model or module runs: the one place fxreplace decides where tensors it makes go."""

from __future__ import annotations

import itertools

import torch
from torch import nn


def input_device(model: torch.nn.Module) -> torch.device:
    """Where a forward's inputs go: the device of the model's first module. A model loaded with
    ``from_pretrained(device_map=...)`` names it first in ``hf_device_map`` (where transformers'
    pipelines put inputs too); its parameters may be on the meta device, offloaded. A module
    offloaded to the CPU or disk takes them on the CPU: accelerate's hooks move them to where it runs."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        first = next(iter(device_map.values()))
        return torch.device("cpu" if first in ("cpu", "disk") else first)
    return next(model.parameters()).device


def computes_on(module: nn.Module) -> torch.device | None:
    """The device of a module's first parameter or buffer (None when it has none, or when its
    weights are offloaded and only accelerate's hook knows where it runs)."""
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    if first is None:
        return None
    if first.device.type != "meta":
        return first.device
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    return None if device is None else torch.device(device)
