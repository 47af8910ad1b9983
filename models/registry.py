"""The family registry: what fxreplace knows per model architecture, found by its name.

The built-in families (the modules of :data:`BUILTIN` in ``fxreplace.models``) register when the
registry is first used; packages outside this repository register through the ``fxreplace.families``
entry-point group (:mod:`fxreplace.extensions`), or by calling :func:`register_family`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping

from fxreplace.extensions import load_extensions
from fxreplace.registries import Registry, describe_failures
from fxreplace.targets import Target

logger = logging.getLogger("fxreplace")

#: the built-in families' modules: the stand-in needs torch alone, the others transformers (the `hf` extra)
BUILTIN = ("neuron_moe",)
BUILTIN_HF = ("deepseek_v3", "fused_router", "gpt_oss", "llama", "mixtral", "qwen3_moe")


@dataclass(frozen=True)
class Family:
    """What fxreplace knows about one model architecture.

    ``targets``: the HF implementation's injection sites (router logits for MoE
    models); the same sites in another engine's model code are that engine's to declare
    (:func:`register_sites`, read through :meth:`targets_for`).
    ``tiny_config``: a small config with random weights for tests and demos;
    ``model_kwargs``: arguments ``from_config`` needs here (e.g. eager attention).
    ``transform``: turns the HF model into the family's variant (e.g. a fused router).
    ``build``: makes the model from its config when it is not a transformers model.
    ``components``: the candidates ``fxreplace blame`` replaces in the HF implementation, by
    kind (``attention``, ``router``, ``routing``, ``experts`` or ``mlp``, ``layer``), in the order
    they run inside a decoder layer; ``*`` in each pattern is the layer index (see
    :func:`decoder_components`).
    """

    architecture: str
    targets: tuple[Target, ...]
    tiny_config: Callable[[], object]
    model_kwargs: dict = field(default_factory=dict)
    transform: Callable | None = None
    build: Callable | None = None
    components: dict[str, Target] = field(default_factory=dict)

    def targets_for(self, model_code: str) -> tuple[Target, ...]:
        """The targets in the model code named ``model_code`` (an engine's, as it registered them with
        :func:`register_sites`; none registered: empty)."""
        return sites(model_code, self.architecture).targets

    def components_for(self, model_code: str) -> dict[str, Target]:
        """The blame components in the model code named ``model_code`` (none registered: empty)."""
        return dict(sites(model_code, self.architecture).components)


@dataclass(frozen=True)
class Sites:
    """A family's sites in one engine's model code: the ``targets`` it replaces by default and the
    ``components`` blame replaces (as :attr:`Family.components`), each capture named as the HF
    reference names it (``Target(name=...)`` where the modules are named differently)."""

    targets: tuple[Target, ...] = ()
    components: Mapping[str, Target] = field(default_factory=dict)


_SITES: Registry[Sites] = Registry("model-code sites")


def register_sites(model_code: str, architecture: str, *, targets=(), components=None, replace: bool = False) -> Sites:
    """Declare the sites of the family ``architecture`` in the model code an engine runs, by the
    name the engine's runner side looks them up with (``RunnerSide.engine``). The engine's own
    package registers them, as it registers the engine: a family names no engine. Registering a
    family's sites for a model code again is an error unless ``replace=True``."""
    return _SITES.register(f"{model_code}/{architecture}", Sites(tuple(targets), dict(components or {})),
                           replace=replace)


def sites(model_code: str, architecture: str) -> Sites:
    """The sites registered for ``architecture`` in ``model_code`` (none: empty :class:`Sites`)."""
    key = f"{model_code}/{architecture}"
    return _SITES[key] if key in _SITES else Sites()


_FAMILIES: Registry[Family] = Registry("family")
_loaded = False  # the built-in modules imported
_HF_AVAILABLE = True  # transformers installed (set when the built-ins load)


def register_family(family: Family, *, replace: bool = False) -> Family:
    """Make ``family`` known by its architecture name. A name already registered (a built-in
    one included) is an error unless ``replace=True``: an extension must not silently take
    over another family's targets."""
    if not isinstance(family, Family):
        raise TypeError(f"register_family needs a Family, got {type(family).__name__}")
    _load_builtins()  # a built-in name is taken before anyone registers
    return _FAMILIES.register(family.architecture, family, replace=replace)



def architecture(config, default: str) -> str:
    """The registry key of a model: the architecture its config (or config.json as a dict) names
    first, else ``default``."""
    names = config.get("architectures") if isinstance(config, Mapping) else getattr(config, "architectures", None)
    return (names or [default])[0]


def get_family(architecture: str) -> Family:
    """The family registered for ``architecture`` (built-in, by an extension, or by register_family)."""
    _load_builtins()
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
    _load_builtins()
    for failure in load_extensions():
        logger.warning("fxreplace: %s", failure)
    return sorted(_FAMILIES)


def decoder_components(*, router: Target | None = None, routing: Target | None = None, attention: str = "self_attn",
                       block: str = "mlp", block_kind: str = "experts", block_point: str = "output",
                       embedding: bool = True, attention_point: str = "output[0]",
                       layer_adapter: str | None = None) -> dict[str, Target]:
    """Components of a ``model.layers.N`` decoder stack, in forward order: the token
    embedding's output (the first layer's input; ``embedding=False``: not declared), the
    attention block's output (at ``attention_point``: HF attention returns ``(output, weights)``),
    the router logits (MoE), the routing the experts are called with (MoE: point ``"routing"``,
    their top-k weights and expert ids), the MLP/MoE block's output, and the residual stream
    after the layer (through ``layer_adapter`` where the layer returns it in another form).
    ``attention`` and ``block`` name the layer's attention and MLP/MoE submodules.
    """
    # the embedding: an error in one of its rows reaches every later position through layer 0's attention,
    # so without it blame names that attention
    out = {"embedding": Target("model.embed_tokens", point="output")} if embedding else {}
    out["attention"] = Target(f"model.layers.*.{attention}", point=attention_point)
    if router is not None:
        out["router"] = router
    if routing is not None:
        out["routing"] = routing
    out[block_kind] = Target(f"model.layers.*.{block}", point=block_point)
    out["layer"] = Target("model.layers.*", point="output", adapter=layer_adapter)
    return out


def _load_builtins() -> None:
    """Import the built-in family modules once (each registers its families); the HF ones when
    transformers is installed."""
    global _loaded, _HF_AVAILABLE
    if _loaded:
        return
    _loaded = True  # first: their register_family calls come back here
    _HF_AVAILABLE = importlib.util.find_spec("transformers") is not None
    for name in BUILTIN + (BUILTIN_HF if _HF_AVAILABLE else ()):
        importlib.import_module(f"{__package__}.{name}")
