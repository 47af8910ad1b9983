"""Components: a model's candidate values by kind and layer (attention, router, experts, the
layer's residual stream), resolved with the same Target logic as ``instrument()``.

Capture records them and blame searches over them; both import this module, which
imports neither.
"""

from __future__ import annotations

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
    resolved on ``model``, in layer order then the declared kind order."""
    found = []
    for order, (kind, target) in enumerate(components.items()):
        for r in resolve_targets(model, [target]):
            exact = r.as_target()
            found.append((layer_of(r.capture_name), order, Component(kind, layer_of(r.capture_name), r.module_name,
                                                                     r.capture_name, exact)))
    return [c for _, _, c in sorted(found, key=lambda t: (-1 if t[0] is None else t[0], t[1]))]
