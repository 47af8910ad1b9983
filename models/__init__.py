"""Per-family knowledge, registered by architecture name.

A family module says which modules hold the tensors worth replacing in the HF
implementation (and in vLLM's, which names and returns them differently) and
gives a tiny config for tests and demos.

Registering a family: a module in ``models/`` imported at the end of this file, or, for a
package outside this repository, a module declared in the ``fxreplace.families`` entry-point
group (see :mod:`fxreplace.extensions`). ``docs/examples/my_family.py`` is a complete, tested
example (``docs/extending.md``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from fxreplace.extensions import describe_failures, load_extensions
from fxreplace.targets import Target

logger = logging.getLogger("fxreplace")


@dataclass(frozen=True)
class Family:
    """What fxreplace knows about one model architecture.

    ``targets``: the HF implementation's injection sites (router logits for MoE
    models). ``vllm_targets``: the same sites in vLLM's implementation;
    ``vllm_neuron_targets``: in the model code vllm-neuron serves (for the families with
    NxD's MoE layout, :func:`fxreplace.models.nxd.nxd_router_targets`).
    ``tiny_config``: a small config with random weights for tests and demos;
    ``model_kwargs``: arguments ``from_config`` needs here (e.g. eager attention).
    ``transform``: turns the HF model into the family's variant (e.g. a fused router).
    ``build``: makes the model from its config when it is not a transformers model.
    ``components`` / ``vllm_components``: the candidates ``fxreplace blame`` replaces, by
    kind (``attention``, ``router``, ``experts`` or ``mlp``, ``layer``), in the order
    they run inside a decoder layer; ``*`` in each pattern is the layer index (see
    :func:`decoder_components`). vLLM's captures are named as in the HF reference.
    """

    architecture: str
    targets: tuple[Target, ...]
    tiny_config: Callable[[], object]
    vllm_targets: tuple[Target, ...] = ()
    vllm_neuron_targets: tuple[Target, ...] = ()
    model_kwargs: dict = field(default_factory=dict)
    transform: Callable | None = None
    build: Callable | None = None
    components: dict[str, Target] = field(default_factory=dict)
    vllm_components: dict[str, Target] = field(default_factory=dict)


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family, *, replace: bool = False) -> Family:
    """Make ``family`` known by its architecture name. A name already registered (a built-in
    one included) is an error unless ``replace=True``: an extension must not silently take
    over another family's targets."""
    if not isinstance(family, Family):
        raise TypeError(f"register_family needs a Family, got {type(family).__name__}")
    if not isinstance(family.architecture, str) or not family.architecture:
        raise TypeError(f"Family.architecture must be a non-empty string, got {family.architecture!r}")
    if family.architecture in _FAMILIES and not replace:
        raise ValueError(f"a family for {family.architecture!r} is already registered; pass replace=True to replace it")
    _FAMILIES[family.architecture] = family
    return family



def architecture(config, default: str) -> str:
    """The registry key of a model: the architecture its config (or config.json as a dict) names
    first, else ``default``."""
    names = config.get("architectures") if isinstance(config, Mapping) else getattr(config, "architectures", None)
    return (names or [default])[0]

def get_family(architecture: str) -> Family:
    failures = []
    if architecture not in _FAMILIES:
        failures = load_extensions()  # an installed package may register it (entry-point group fxreplace.families)
    try:
        return _FAMILIES[architecture]
    except KeyError:
        missing = "" if _HF_AVAILABLE else " (the HF families need transformers: pip install 'fxreplace[hf]')"
        raise KeyError(f"no fxreplace family for {architecture!r}; registered: {sorted(_FAMILIES)}{missing}"
                       f"{describe_failures(failures)}") from None


def families() -> list[str]:
    """Every registered family; an entry point that failed to load is logged, by name, at every call."""
    for failure in load_extensions():
        logger.warning("fxreplace: %s", failure)
    return sorted(_FAMILIES)


def decoder_components(*, router: Target | None = None, attention: str = "self_attn", block: str = "mlp",
                       block_kind: str = "experts", block_point: str = "output", vllm: bool = False) -> dict[str, Target]:
    """Components of a ``model.layers.N`` decoder stack, in forward order: the token
    embedding's output (HF; the first layer's input), the attention block's output, the
    router logits (MoE), the MLP/MoE block's output, and the residual stream after the
    layer. ``attention`` and ``block`` name the layer's attention and MLP/MoE submodules.

    HF attention returns ``(output, weights)``; vLLM's returns the output. vLLM's
    decoder layer returns ``(block output, residual)`` and leaves the add to the next
    layer's fused norm, so the stream after the layer is their sum: its replacement
    goes through the ``residual_stream_pair`` adapter, which hands the layer's
    consumers ``(0, stream)``.
    """
    # the embedding: an error in one of its rows reaches every later position through layer 0's attention,
    # so without it blame names that attention; vLLM's engine does not declare it (not exercised there yet)
    out = {} if vllm else {"embedding": Target("model.embed_tokens", point="output")}
    out["attention"] = Target(f"model.layers.*.{attention}", point="output" if vllm else "output[0]")
    if router is not None:
        out["router"] = router
    out[block_kind] = Target(f"model.layers.*.{block}", point=block_point)
    out["layer"] = Target("model.layers.*", point="output", adapter="residual_stream_pair" if vllm else None)
    return out


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
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **family.model_kwargs)
    if family.transform is not None:
        model = family.transform(model)
    return model.eval()


# Registration. The HF families need transformers (the `hf` extra); the core and the
# HF-independent families work without it.
from . import neuron_moe  # noqa: E402,F401

try:
    import transformers  # noqa: F401
except ModuleNotFoundError:
    _HF_AVAILABLE = False
else:
    _HF_AVAILABLE = True
    from . import deepseek_v3, fused_router, gpt_oss, llama, mixtral, qwen3_moe  # noqa: E402,F401
