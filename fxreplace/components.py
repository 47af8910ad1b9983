"""Components: a model's candidate values by kind and layer (attention, router, experts, the
layer's residual stream), resolved with the same Target logic as ``instrument()``, and which
ones a run uses: those capture recorded, else the model's family's.

Capture records them, the engines place them in their model code and blame searches over
them; all import this module, which imports none of them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

from torch import nn

from .errors import ComponentError
from .models import architecture, get_family
from .targets import Target, TargetLike, resolve_targets


#: the kind of a layer's residual stream (the layer's whole output), beside the kinds inside it
LAYER = "layer"


@dataclass(frozen=True)
class Component:
    """One candidate: a module's value (``capture_name`` in the reference) of a kind, in a layer."""

    kind: str
    layer: int | None
    module_name: str
    capture_name: str
    target: Target  # the exact module, for instrument()


def layer_of(name: str) -> int | None:
    """The layer index of a qualified name: its first numeric component (``model.layers.3.mlp`` -> 3)."""
    m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(m.group(1)) if m else None


def resolve_components(model: nn.Module, components: Mapping[str, TargetLike]) -> list[Component]:
    """``{kind: Target}`` (the family's ``components`` or your own, same Target syntax)
    resolved on ``model``, in layer order then the declared kind order; a component outside the
    numbered layers comes before them (the embedding) or after them (a final norm) as its module
    does in the model (blame's search tells the two apart by this order)."""
    found = []
    for order, (kind, target) in enumerate(components.items()):
        for r in resolve_targets(model, [target]):
            exact = r.as_target()
            found.append((layer_of(r.capture_name), order, Component(kind, layer_of(r.capture_name), r.module_name,
                                                                     r.capture_name, exact)))
    position = {name: i for i, (name, _) in enumerate(model.named_modules())}
    first = min((position[c.module_name] for layer, _, c in found if layer is not None), default=math.inf)

    def where(layer, c) -> float:
        return layer if layer is not None else -1 if position[c.module_name] < first else math.inf

    return [c for _, _, c in sorted(found, key=lambda t: (where(t[0], t[2]), t[1]))]


def family_components(model: nn.Module) -> dict[str, Target]:
    """The components the model's family declares (``fxreplace.models``)."""

    arch = architecture(model.config, type(model).__name__)
    try:
        declared = get_family(arch).components
    except KeyError as exc:
        raise ComponentError(f"{exc.args[0]}; pass components={{kind: Target}} (CLI: --component KIND=PATTERN[@POINT])") from None
    if not declared:
        raise ComponentError(f"the {arch} family declares no components; pass components={{kind: Target}} (CLI: "
                             "--component KIND=PATTERN[@POINT])")
    return dict(declared)


def recorded_targets(reference) -> dict[str, Target]:
    """The ``{kind: Target}`` given to ``fxreplace capture --component`` (empty: none recorded)."""
    return {kind: Target(t["pattern"], point=t.get("point", "auto"))
            for kind, t in (reference.metadata.get("component_targets") or {}).items()}


def recorded_components(reference) -> dict[str, dict]:
    """``{capture name: {"kind", "layer"}}`` as capture_reference recorded them (empty: none)."""
    return dict(reference.metadata.get("components") or {})


def default_components(reference, model: nn.Module) -> dict[str, Target]:
    """The components a run on ``model`` uses when given none: those capture recorded for a family
    fxreplace does not register (``capture --component``), else the family's."""
    return recorded_targets(reference) or family_components(model)


def components_in(reference, reference_dir, declared: Mapping[str, Target], engine: str) -> list[Component]:
    """The components ``reference`` recorded, placed in the model code of ``engine`` (its name in
    messages): ``declared`` gives each kind's module pattern there (``*`` = the layer) and injection point."""
    found = []
    recorded = recorded_components(reference)
    if not recorded:
        raise ComponentError(f"the reference {reference_dir} records no components: capture them with `fxreplace capture "
                             f"{reference.metadata.get('source_model') or 'CLEAN_MODEL'} --prompts PROMPTS.json "
                             "--components --out NEW_REFERENCE` ({engine} replays only what the reference holds)")
    for name, info in recorded.items():
        kind = declared.get(info["kind"])
        if kind is None or info["layer"] is None:
            continue
        module = kind.pattern.replace("*", str(info["layer"]), 1)
        target = Target(module, point=kind.point, adapter=kind.adapter, name=name)
        found.append(Component(info["kind"], info["layer"], module, name, target))
    if not found:
        raise ComponentError(f"no component of the reference {reference_dir} maps to {engine}'s modules (it records kinds "
                             f"{sorted({i['kind'] for i in recorded.values()})}; {engine}'s code declares "
                             f"{sorted(declared)})")
    return found
