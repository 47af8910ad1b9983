"""Components: a model's candidate values by kind and layer (attention, router, experts, the
layer's residual stream), resolved with the same Target logic as ``instrument()``.

Capture records them and blame searches over them; both import this module, which
imports neither.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

from torch import nn

from .targets import Target, TargetLike, resolve_targets


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
