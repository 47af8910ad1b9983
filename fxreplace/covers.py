"""What each component's replacement covers: the modules that run between the point before it and its own.

Replacing a component makes its value the reference's whatever computed it since the last point the search
can replace before it: ``model.layers.N.mlp``'s output also undoes a fault in the norm that feeds it. A verdict
naming the kind alone sends the fix to the wrong class; the cover names every module (and class) it spans,
and the classes the covers of several kinds share are where one bug in every layer can sit (an RMSNorm class
that every layer's attention and MLP run). Found by running the model once on two tokens with hooks on its
modules, in the order they finish: no model is read by its source or its registration order. An engine runs that
forward where its model lives (a vLLM worker: :meth:`~fxreplace.engines.protocol.Engine.covers`) and hands the
covers back as plain data (:func:`covers_to_data`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.utils._pytree as pytree
from torch import nn

from .components import LAYER, Component
from .points import ROUTING
from .targets import Target


@dataclass(frozen=True)
class Cover:
    """The modules a component's replacement spans, as (qualified name, class name) in the order they
    finish: ``spanned`` every one, nested ones included; ``top`` those not inside another (what to read first)."""

    spanned: tuple[tuple[str, str], ...]
    top: tuple[tuple[str, str], ...]
    framework: frozenset[str] = frozenset()  # the class names torch defines (Linear): named after the model's own

    @property
    def classes(self) -> frozenset[str]:
        return frozenset(cls for _, cls in self.spanned)

    def words(self) -> str:
        """``input_layernorm (LlamaRMSNorm), self_attn (LlamaAttention)``, the layer's prefix dropped."""
        return ", ".join(f"{in_layer(name)} ({cls})" for name, cls in self.top)

    def qualified(self, cls: str) -> str | None:
        """The first spanned module of class ``cls`` by its qualified name (a repro's ``--component``)."""
        return next((name for name, c in self.spanned if c == cls), None)

    def holding(self, cls: str) -> list[str]:
        """The spanned modules of class ``cls``, the layer's prefix dropped."""
        return [in_layer(name) for name, c in self.spanned if c == cls]


#: where the layers end: the modules that finish after the last layer (a final norm, the LM head)
AFTER_LAYERS = "after the last layer"


def component_covers(model: nn.Module, components: list[Component],
                     run: Callable[[], object] | None = None) -> dict[str, Cover]:
    """Each component's :class:`Cover` by capture name, and the modules after the last layer under
    :data:`AFTER_LAYERS`; empty when the model cannot run so. ``run``: one forward of ``model`` on a few
    tokens (default: an HF causal LM's on two; an engine's dummy step, whose values need not be right: only
    the order modules run in and which tensors they hand on are read).

    A module outside the layers whose output a component is called with (the rotary embedding's cos/sin,
    computed once and handed to every layer's attention) is in that component's cover too: no component's
    output holds it, yet the component's replacement undoes its fault."""
    order: list[tuple[str, str]] = []  # ("enter" | "exit", module name), as the forward runs them
    names = {module: name for name, module in model.named_modules() if name}
    # each numbered layer's module, from its components' names (declared ``layer`` streams or not)
    layer_of_component = {c.capture_name: split[0] for c in components
                          if c.layer is not None and (split := _at_layer(c.module_name))}
    layer_names = tuple(name + "." for name in set(layer_of_component.values()))
    called = {c.module_name for c in components if c.kind != LAYER}
    # the outputs of modules outside the layers and the tensors each component's module is called with, kept
    # until the end (a freed tensor's id may be another's: they are compared by id once all are alive)
    outside: dict[str, list[torch.Tensor]] = {}
    inputs: dict[str, list[torch.Tensor]] = {}

    def enter(module, args, kwargs, name):
        order.append(("enter", name))
        if name in called:
            inputs.setdefault(name, []).extend(_tensors((args, kwargs)))

    def leave(module, args, output, name):
        order.append(("exit", name))
        if not (name + ".").startswith(layer_names):
            outside.setdefault(name, []).extend(_tensors(output))

    hooks = []
    for module, name in names.items():
        hooks.append(module.register_forward_pre_hook(functools.partial(enter, name=name), with_kwargs=True))
        hooks.append(module.register_forward_hook(functools.partial(leave, name=name)))
    try:
        with torch.no_grad():
            if run is None:
                model(input_ids=torch.tensor([[1, 2]], device=next(model.parameters()).device))
            else:
                run()
    except Exception:  # noqa: BLE001 - the covers are words only: a model that cannot run so gets the kind's
        return {}
    finally:
        for hook in hooks:
            hook.remove()
    classes = {name: type(module).__name__ for module, name in names.items()}
    framework = frozenset(type(module).__name__ for module in names if type(module).__module__.startswith("torch."))
    exits = {name: i for i, (event, name) in enumerate(order) if event == "exit"}  # (the last: a module called twice)
    enters = {}
    for i, (event, name) in enumerate(order):
        if event == "enter":
            enters.setdefault(name, i)
    layers = [name for name in set(layer_of_component.values()) if name in exits]
    holders = {name.rsplit(".", k)[0] for name in layers for k in range(name.count(".") + 1)}
    covers = {}
    for c in components:
        if c.kind == LAYER or c.module_name not in exits:
            continue
        point = enters[c.module_name] if c.target.point == ROUTING else exits[c.module_name]
        layer = layer_of_component.get(c.capture_name)
        if layer is None or layer not in exits:  # before the layers (the embedding): what finished up to it
            start = -1
            within = ""
        else:
            start = max([enters[layer]] + [exits[x.module_name] for x in components
                                           if x.layer == c.layer and x.kind != LAYER and x.module_name in exits
                                           and exits[x.module_name] < point and not _same_unit(x, c, layer)])
            within = layer + "."
        given = {id(t) for t in inputs.get(c.module_name, ())}
        handed = [n for n, outputs in outside.items() if n not in called and n not in holders
                  and any(id(t) in given for t in outputs)]
        spanned = handed + [n for n, i in exits.items() if start < i <= point and n.startswith(within)]
        # the block calling the module hands it the routing: its code is spanned
        caller = c.module_name.rpartition(".")[0] if c.target.point == ROUTING else None
        covers[c.capture_name] = _cover(spanned, classes, framework, caller)
    spanned_anywhere = {n for cover in covers.values() for n, _ in cover.spanned}
    for layer in layers:  # the layer's own forward (its residual adds), and what in it no component spans
        covers[own_code(layer)] = _cover([layer] + [n for n in exits if n.startswith(layer + ".")
                                                    and n not in spanned_anywhere], classes, framework)
    if layers:
        last = max(exits[name] for name in layers)
        covers[AFTER_LAYERS] = _cover([n for n, i in exits.items() if i > last and n not in holders], classes, framework)
    return covers


def covers_to_data(covers: Mapping[str, Cover]) -> dict[str, list]:
    """``covers`` as lists of strings: what crosses an engine's boundary (vLLM's serializer takes no class of ours)."""
    return {key: [[list(p) for p in c.spanned], [list(p) for p in c.top], sorted(c.framework)] for key, c in covers.items()}


def covers_from_data(data: Mapping[str, list]) -> dict[str, Cover]:
    """What :func:`covers_to_data` wrote, as covers again."""
    return {key: Cover(tuple(map(tuple, spanned)), tuple(map(tuple, top)), frozenset(framework))
            for key, (spanned, top, framework) in data.items()}


def components_to_data(components: list[Component]) -> list[list]:
    """What :func:`component_covers` reads of each component, as plain values (sent to an engine's worker): of its
    point, whether it is the routing the module is called with (a callable point does not cross)."""
    return [[c.kind, c.layer, c.module_name, c.capture_name, ROUTING if c.target.point == ROUTING else "output"]
            for c in components]


def components_from_data(data: list[list]) -> list[Component]:
    return [Component(kind, layer, module, capture, Target(module, point=point)) for kind, layer, module, capture, point
            in data]


def own_code(layer: str) -> str:
    """The key of what layer module ``layer`` runs outside every component's cover (:func:`component_covers`)."""
    return f"{layer} itself"


def _tensors(value) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def _at_layer(name: str) -> tuple[str, str] | None:
    """``model.layers.3.mlp.gate`` -> (``model.layers.3``, ``mlp.gate``): split after its layer index (the first
    numeric part, as :func:`~fxreplace.components.layer_of` reads it); None when it has none."""
    parts = name.split(".")
    k = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return None if k is None else (".".join(parts[:k + 1]), ".".join(parts[k + 1:]))


def _same_unit(x: Component, c: Component, layer: str) -> bool:
    """Whether ``x`` and ``c`` sit in the same child of their layer (a router and its MoE block's output):
    the point before ``c`` is then the last one in another child."""
    def unit(name: str) -> str:
        return name[len(layer) + 1:].split(".", 1)[0]
    return unit(x.module_name) == unit(c.module_name)


def _cover(spanned: list[str], classes: dict[str, str], framework: frozenset[str], caller: str | None = None) -> Cover:
    names = [n for n in dict.fromkeys(spanned) if n in classes]
    top = [n for n in names if not any(n.startswith(other + ".") for other in names)]
    if caller in classes:
        names.append(caller)
        top.append(caller)
    return Cover(tuple((n, classes[n]) for n in names), tuple((n, classes[n]) for n in top), framework)


def in_layer(name: str) -> str:
    """``model.layers.3.mlp.gate`` -> ``mlp.gate``; a layer itself, or a name outside the layers, as it is."""
    split = _at_layer(name)
    return split[1] if split and split[1] else name
