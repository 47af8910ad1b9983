"""The graph pass: at each target's injection node insert
``replacement -> shard slice -> adapter -> where(mask, ., computed)`` and rewire
the node's users to the result.

:func:`insert_replacements` is a pure function over a ``GraphModule``: it works on
a graph traced from one module (every node belongs to the target) and on a
whole-model graph from ``torch.export`` or Dynamo (nodes are attributed to
modules through ``meta["nn_module_stack"]``). The replacement, mask and rank
arrive as new graph inputs, so one compiled graph serves replacement on, off
(mask all False) and new values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from torch import fx

from .injection import Injection
from .points import find_injection_node
from .targets import Point, TargetError


@dataclass(frozen=True)
class InjectionSpec:
    """One rewrite: ``module_name`` (``""`` for a graph traced from the target
    alone), where in it (``point``), and the :class:`Injection` to insert; the
    replacement arrives as graph input ``input_name``."""

    module_name: str
    point: Point
    injection: Injection
    input_name: str


@dataclass
class ReplacementsInserted:
    """What :func:`insert_replacements` changed: per module the node whose users
    now read the injected value, and the graph inputs it added, in order."""

    rewired: dict[str, str] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)


def _add_inputs(graph: fx.Graph, names: list[str], optional: bool) -> dict[str, fx.Node]:
    """Append placeholders after the existing ones but before ``*args``/``**kwargs``,
    so the generated signature stays valid."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    varargs = [n for n in placeholders if n.target.startswith("*")]
    anchor = placeholders[-1] if placeholders else None
    added = {}
    for name in names:
        if varargs:
            where = graph.inserting_before(varargs[0])
        elif anchor is not None:
            where = graph.inserting_after(anchor)
        else:
            where = graph.inserting_before(next(iter(graph.nodes)))
        with where:
            anchor = added[name] = graph.placeholder(name, default_value=None) if optional else graph.placeholder(name)
    return added


def insert_replacements(
    gm: fx.GraphModule,
    specs: Sequence[InjectionSpec],
    *,
    mask_input: str = "fxreplace_mask",
    rank_input: str | None = None,
    leading_rows_input: str | None = None,
    optional_inputs: bool = True,
) -> ReplacementsInserted:
    """Rewrite ``gm`` in place so each spec's injection node is replaced by
    ``spec.injection(node, <input_name>, <mask_input>, rank=<rank_input>, leading_rows=<leading_rows_input>)``.

    With ``optional_inputs`` new inputs default to None (replacement off), so
    existing callers keep working. Raises :class:`TargetError` if a point cannot be found or a node
    was not rewired exactly once.
    """
    graph = gm.graph
    located = [(spec, find_injection_node(gm, spec.module_name, spec.point)) for spec in specs]
    seen = [node for _, node in located]
    if len(set(seen)) != len(seen):
        raise TargetError("two targets resolve to the same injection node")

    result = ReplacementsInserted()
    new_inputs = [spec.input_name for spec in specs] + [mask_input]
    new_inputs += [n for n in (rank_input, leading_rows_input) if n is not None]
    placeholders = _add_inputs(graph, new_inputs, optional_inputs)
    result.inputs.extend(new_inputs)

    for spec, node in located:
        with graph.inserting_after(node):
            injected = graph.call_function(
                spec.injection,
                (node, placeholders[spec.input_name], placeholders[mask_input]),
                {
                    "rank": placeholders.get(rank_input),
                    "leading_rows": placeholders.get(leading_rows_input, False),
                },
            )
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in node.meta:
                injected.meta[key] = node.meta[key]
        node.replace_all_uses_with(injected, delete_user_cb=lambda user: user is not injected)
        result.rewired[spec.module_name] = node.name

    graph.lint()
    gm.recompile()
    for spec, node in located:
        injected = [u for u in node.users if u.op == "call_function" and isinstance(u.target, Injection)]
        if len(injected) != 1 or len(node.users) != 1:
            raise TargetError(f"{spec.module_name or 'target'}: node {node.name} was not rewired exactly once")
    return result
