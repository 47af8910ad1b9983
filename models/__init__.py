"""Per-family knowledge, registered by architecture name.

A family module says which modules hold the tensors worth replacing in the HF
implementation and gives a tiny config for tests and demos; an engine whose model code
names and returns them differently (vLLM's) registers the family's sites there itself
(:func:`register_sites`).

The registry lives in :mod:`fxreplace.models.registry` (its built-in modules listed there, registered
when it is first used); a package outside this repository registers through the ``fxreplace.families``
entry-point group (see :mod:`fxreplace.extensions`). ``docs/examples/my_family.py`` is a complete, tested
example (``docs/extending.md``).
"""

from __future__ import annotations

import torch

from .registry import (Family, Sites, architecture, decoder_components, families, get_family, register_family,
                       register_sites, sites)

__all__ = ["Family", "Sites", "architecture", "decoder_components", "families", "get_family", "register_family",
           "register_sites", "sites", "tiny_model"]


def tiny_model(architecture: str, *, seed: int = 0, init_std: float | None = 0.2, **config_overrides):
    """A random-weight float32 model of the family's tiny config, in eval mode.

    ``init_std`` sets the weight init scale: the default 0.02 gives near-uniform
    router logits whose argmax ties flip on rounding noise; 0.2 gives peaked
    logits so routing is decided and comparisons are meaningful.
    """
    family = get_family(architecture)
    config = family.tiny_config()
    for key, value in config_overrides.items():
        setattr(config, key, value)
    if init_std is not None:
        config.initializer_range = init_std
    torch.manual_seed(seed)
    if family.build is not None:
        model = family.build(config)
    else:
        from transformers import AutoModelForCausalLM  # the hf extra: a family with its own build needs none

        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **family.model_kwargs)
    if family.transform is not None:
        model = family.transform(model)
    return model.eval()
