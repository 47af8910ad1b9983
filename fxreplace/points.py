"""Injection points: where inside a target module the replacement goes.

Every rule about points lives here, and :func:`~fxreplace.instrument`, reference
capture, :func:`~fxreplace.export.export` and the vLLM plugin all use it:

- ``"output"`` / ``"output[i]"``: the module's output (or its i-th element);
- ``"auto"``: the output when the module returns one tensor, else the *logits*:
  the first linear-family op computed inside the module (HF MoE routers return a
  tuple whose logits their MoE block ignores, so only the inner node matters).
  A module that cannot be traced alone falls back to ``"output"``, which is then
  checked to be a tensor when the module first runs;
- ``"routing"``: the routing a module is *called with*: the arguments of its call that its parent
  computes from a top-k (the experts' top-k weights and expert ids, or their dense ``[T, E]``
  matrix), found by tracing the parent with the module kept whole (see :func:`locate_routing`);
- a callable ``fn(nodes) -> Node`` picking the node among the module's FX nodes.

Nodes are attributed to modules either because the graph was traced from the
module alone (``module_name == ""``) or through ``meta["nn_module_stack"]`` of a
whole-model graph (torch.export, Dynamo).
"""

from __future__ import annotations

import copy
import functools
import inspect
import operator
import re
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import fx, nn

from .adapters import routing_adapter_name
from .errors import TargetNotLiveError
from .targets import Point, TargetError, closest_names
from .words import one_line

_aten = torch.ops.aten
LINEAR_FUNCTIONS = {
    F.linear, torch._C._nn.linear, torch.matmul, torch.mm, torch.addmm, operator.matmul,
    _aten.linear.default, _aten.mm.default, _aten.addmm.default, _aten.matmul.default,
}
LINEAR_METHODS = {"matmul", "mm", "addmm", "__matmul__"}
#: the point of the routing a module is called with (see :func:`locate_routing`)
ROUTING = "routing"
_CALL_OPS = ("call_function", "call_method", "call_module")


def check_point(point) -> None:
    """Reject a point that is neither a known string nor a callable (before any model is seen)."""
    if callable(point) or point in ("auto", ROUTING) or parse_output_point(point)[0]:
        return
    raise TargetError(f"unknown point {point!r}; use 'auto', 'output', 'output[i]', 'routing' or a callable")


def parse_output_point(point) -> tuple[bool, int | None]:
    """``"output"`` -> (True, None), ``"output[2]"`` -> (True, 2), else (False, None)."""
    if not isinstance(point, str):
        return False, None
    m = re.fullmatch(r"output(?:\[(\d+)\])?", point)
    if not m:
        return False, None
    return True, int(m.group(1)) if m.group(1) is not None else None


def _normalise_module_path(path: str) -> str:
    """Dynamo spells ``L['self'].model.layers[0]`` or ``L['self']._modules['model']``;
    export spells ``model.layers.0``. Map both to the qualified name."""
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"^L\['self'\]\.?", "", path)
    return path.lstrip(".")


def module_paths(node: fx.Node) -> set[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return {_normalise_module_path(path) for path, _ in stack.values()}


def nodes_in_module(gm: fx.GraphModule, module_name: str) -> list[fx.Node]:
    """The operations computed inside ``module_name``, in graph order."""
    calls = [n for n in gm.graph.nodes if n.op in _CALL_OPS]
    if not module_name:
        return calls
    return [n for n in calls if module_name in module_paths(n)]


def is_linear(node: fx.Node, gm: fx.GraphModule | None = None) -> bool:
    if node.op == "call_function":
        return node.target in LINEAR_FUNCTIONS
    if node.op == "call_method":
        return node.target in LINEAR_METHODS
    if node.op == "call_module" and gm is not None:
        return isinstance(gm.get_submodule(node.target), nn.Linear)
    return False


def _module_outputs(gm: fx.GraphModule, module_name: str, nodes: list[fx.Node]) -> list:
    """The values a module hands back: the graph output for a single-module
    graph, else its nodes that are used outside the module."""
    if not module_name:
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        return list(out) if isinstance(out, (tuple, list)) else [out]
    inside = set(nodes)
    return [n for n in nodes if any(u not in inside for u in n.users)]


def find_injection_node(gm: fx.GraphModule, module_name: str, point: Point) -> fx.Node:
    """The node whose value the replacement stands for (see the module docstring)."""
    where = f"module {module_name!r}" if module_name else "the traced module"
    nodes = nodes_in_module(gm, module_name)
    if not nodes:
        raise TargetError(f"no graph node belongs to {where}; it is not called in this graph")
    if callable(point):
        node = point(nodes)
        if node not in nodes:
            raise TargetError(f"point callable for {where} returned {node!r}, which is not one of its nodes")
        return node
    check_point(point)
    if point == ROUTING:
        raise TargetError(f"{where}: point 'routing' is the routing the module is called with, which instrument() "
                          "replaces at the call; a graph pass cannot (target the router's logits here instead)")
    _, index = parse_output_point(point)
    outputs = _module_outputs(gm, module_name, nodes)
    if point == "auto":  # the output when it is one tensor (or nothing is linear), else the logits
        linear = [n for n in nodes if is_linear(n, gm)]
        if linear and not (len(outputs) == 1 and isinstance(outputs[0], fx.Node)):
            return linear[0]
    if index is None and len(outputs) == 1 or index is not None and module_name == "" and index < len(outputs):
        node = outputs[index or 0]
        if isinstance(node, fx.Node):
            return node
    raise TargetError(
        f"{where} has no single node for point {point!r}: its outputs are {outputs}; "
        "pass point='output[i]' or a callable that picks the node"
    )


@dataclass
class InjectionPoint:
    """Where one module's replacement goes.

    ``graph_module`` is set when the point is a node inside the module: the
    module traced alone, and ``point`` selects the node in it. ``routing_inputs`` is set
    for point ``"routing"``: where the module's call passes its routing (argument positions,
    keyword names), and ``num_experts`` the width of the dense matrix a (weights, ids) pair
    stands for. Otherwise the point is the module output (``output_index`` picks
    ``output[i]``), checked to be a tensor at run time (an untraceable module with
    ``"auto"`` lands here, keeping ``point="auto"`` so errors can say why).
    """

    module_name: str
    point: Point
    graph_module: fx.GraphModule | None = None
    output_index: int | None = None
    routing_inputs: tuple[int | str, ...] | None = None
    num_experts: int | None = None


#: where accelerate's hooks (``from_pretrained(device_map=...)``, ``add_hook_to_module``) keep the forward
#: the module had at dispatch: their wrapper, set as the instance's ``forward``, calls it
WRAPPED_FORWARD = "_old_forward"


def function_copy(function: types.FunctionType) -> types.FunctionType:
    """``function`` on a code object of its own (its globals, defaults, cells and names kept): called,
    it is the function; to Dynamo, which keeps compiled graphs and counts recompiles per code object,
    another function."""
    copied = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                                function.__defaults__, function.__closure__)
    copied.__kwdefaults__, copied.__qualname__ = function.__kwdefaults__, function.__qualname__
    copied.__module__ = function.__module__
    return copied


def forward_attribute(module: nn.Module) -> str:
    """Where a module's own forward is called from: inside accelerate's wrapper when it has one."""
    return WRAPPED_FORWARD if WRAPPED_FORWARD in module.__dict__ else "forward"


#: where :func:`~fxreplace.instrument` keeps a target's forward attribute as it was given (None: its class's)
GIVEN_FORWARD = "_fxreplace_given_forward"

#: set on the class :func:`~fxreplace.instrument` gives a target (a subclass of the class it had)
TARGET_CLASS = "_fxreplace_target_class"


def given_class(module: nn.Module) -> type:
    """The class ``module`` had before it was instrumented (its class, when it was not)."""
    cls = type(module)
    return cls.__bases__[0] if cls.__dict__.get(TARGET_CLASS) else cls


def instance_forward(module: nn.Module) -> Callable | None:
    """The forward a call of ``module`` runs as given when the instance defines it (a bound method, a
    ``functools.partial`` or a plain function set on it, or the one accelerate's wrapper calls);
    None when its class's ``forward`` runs (a subclass's included). For an instrumented target, the
    forward it had before."""
    if GIVEN_FORWARD in module.__dict__:
        own = module.__dict__[GIVEN_FORWARD]
    else:
        own = module.__dict__.get(forward_attribute(module))
    if own is None:
        return None
    cls = given_class(module)
    if (isinstance(own, types.MethodType) and own.__self__ is module
            and own.__func__ is getattr(cls.forward, "__func__", cls.forward)):
        return None  # the class's forward bound to the instance (what accelerate keeps for an unchanged module)
    return own


def describe_forward(module: nn.Module) -> str:
    """What defines ``module``'s forward, in words an error message can show."""
    own = instance_forward(module)
    if own is None:
        return f"its class {type(module).__name__}'s forward"
    if isinstance(own, types.MethodType):
        bound = "it" if own.__self__ is module else f"another {type(own.__self__).__name__}"
        what = f"method {own.__func__.__qualname__} bound to {bound}"
    elif isinstance(own, functools.partial):
        what = f"functools.partial of {getattr(own.func, '__qualname__', type(own.func).__name__)}"
    else:
        what = f"{'function' if isinstance(own, types.FunctionType) else type(own).__name__} " \
               f"{getattr(own, '__qualname__', '')}".rstrip()
    wrapped = " (the forward accelerate's hook wraps)" if forward_attribute(module) == WRAPPED_FORWARD else ""
    return f"its forward is an instance attribute ({what}){wrapped}"


def _as_method(forward: Callable, module: nn.Module) -> Callable:
    """``forward`` (a callable ``module`` holds) as a function of ``(self, <its parameters>)`` calling
    it, for torch.fx, which traces a module's forward from its class and makes one graph input per
    named parameter (so they are spelled out, their defaults kept)."""
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        return forward.__func__  # self is the traced twin, which holds what the module holds
    kind = inspect.Parameter
    params = [p.replace(annotation=kind.empty) for p in inspect.signature(forward).parameters.values()]
    passed = ["*" + p.name if p.kind is kind.VAR_POSITIONAL else "**" + p.name if p.kind is kind.VAR_KEYWORD
              else f"{p.name}={p.name}" if p.kind is kind.KEYWORD_ONLY else p.name for p in params]
    bare = inspect.Signature([kind("self", kind.POSITIONAL_ONLY)] + [p.replace(default=kind.empty) for p in params])
    namespace = {"_forward": forward}
    exec(f"def forward{bare}:\n    return _forward({', '.join(passed)})\n", namespace)  # noqa: S102 - our own source
    function = namespace["forward"]
    positional = [p.default for p in params if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)]
    function.__defaults__ = tuple(d for d in positional if d is not kind.empty) or None
    function.__kwdefaults__ = {p.name: p.default for p in params
                               if p.kind is kind.KEYWORD_ONLY and p.default is not kind.empty} or None
    return function


def _traced_root(module: nn.Module) -> nn.Module:
    """What torch.fx traces for the forward a call of ``module`` runs: the module when its class's forward
    runs; else (fx traces a module's forward from its class) a shallow twin (the same parameters, buffers
    and children) of a class whose forward is the instance's."""
    own, cls = instance_forward(module), given_class(module)
    if own is None and cls is type(module):
        return module
    twin = copy.copy(module)
    for name in ("forward", WRAPPED_FORWARD, GIVEN_FORWARD):
        twin.__dict__.pop(name, None)
    if own is None:  # an instrumented target: its class's own forward
        twin.__class__ = cls
        return twin
    twin.__class__ = type(cls.__name__, (cls,), {"forward": _as_method(own, module), "__module__": cls.__module__})
    return twin


def trace_alone(module: nn.Module) -> fx.GraphModule:
    """``torch.fx`` trace of the forward a call of ``module`` runs (its class's, or the one the instance
    holds); parameters are shared, not copied."""
    root = _traced_root(module)
    return fx.GraphModule(root, fx.Tracer().trace(root), type(module).__name__)


def check_adapter_fits(module_name: str, point: Point, adapter, computes_logits: Callable[[], bool]) -> None:
    """A routing adapter at a point that computes the logits themselves would put routing
    weights where the model expects logits, with the same [T, E] shape: refuse it.
    ``computes_logits`` is only called for a routing adapter."""
    name = routing_adapter_name(adapter)
    if name is not None and computes_logits():
        raise TargetError(
            f"{module_name!r}: adapter {name!r} turns router logits into routing weights, but point "
            f"{point!r} is computed by a linear layer, i.e. it is the logits: the model would get routing "
            "weights in their place. Replace the logits without an adapter (e.g. point='auto' on the router), or "
            "keep the adapter and target what consumes routing weights (e.g. a fused router's output, point='output')"
        )


def computes_linear_output(module: nn.Module, located: InjectionPoint) -> bool:
    """Whether the point's value comes straight out of a linear layer: for a router,
    the logits. Linear-family modules (``nn.Linear``, vLLM's ``*Linear`` layers, whose
    ``output[0]`` is the result) are recognised by type; other output points by
    tracing the module alone, when it can be traced."""
    if located.graph_module is not None:
        gm = located.graph_module
        return is_linear(find_injection_node(gm, "", located.point), gm)
    if located.output_index in (None, 0) and type(module).__name__.endswith("Linear"):
        return True
    try:
        gm = trace_alone(module)
    except Exception:
        return False
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    index = located.output_index
    if index is not None:
        output = output[index] if isinstance(output, (tuple, list)) and index < len(output) else None
    return isinstance(output, fx.Node) and is_linear(output, gm)


class _KeepLeaf(fx.Tracer):
    """Traces a module with one child kept as a call (its output stays one node). A child dispatched by
    accelerate is traced through the forward its hook wraps: the hook only moves tensors between devices
    and loads offloaded weights, in Python fx cannot trace."""

    def __init__(self, leaf: nn.Module):
        super().__init__()
        self.leaf = leaf

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return module is self.leaf or super().is_leaf_module(module, qualified_name)

    def call_module(self, m, forward, args, kwargs):
        return super().call_module(m, m.__dict__.get(WRAPPED_FORWARD, forward), args, kwargs)


def check_output_point_read(model: nn.Module, module_name: str, point: Point) -> bool:
    """Refuse ``output[i]`` of a module whose caller never reads element ``i`` (e.g. NxD's
    ``RouterTopK``, whose MoE block reads only the affinities and ids it computes from its
    internal logits). Decided from the parent module traced alone with the target kept whole.
    Returns False when nothing was decided (a parent that cannot be traced, or that does not
    call the target): the first forward that reaches the target then watches whether element
    ``i`` is read (see :mod:`fxreplace.instrument`)."""
    is_output, index = parse_output_point(point)
    parent_name, _, child = module_name.rpartition(".")
    if not is_output or index is None or not child:
        return True
    parent, module = model.get_submodule(parent_name), model.get_submodule(module_name)
    try:
        graph = _KeepLeaf(module).trace(parent)
    except Exception:
        return False
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target == child]
    if not calls:
        return False
    for call in calls:
        for user in call.users:
            is_element = user.op == "call_function" and user.target is operator.getitem and len(user.args) == 2
            if not is_element or user.args[1] == index and user.users:
                return True  # the whole output is passed on, or element i is read
    raise TargetNotLiveError(
        f"target {module_name!r}, point {point!r}: its caller {parent_name!r} never reads {point} (it reads "
        f"{_read_elements(calls) or 'none of its outputs'}), so a replacement there changes nothing downstream; "
        f"{working_point(module, point)}")


def _read_elements(calls: list[fx.Node]) -> str:
    read = sorted({u.args[1] for call in calls for u in call.users if u.users})
    return ", ".join(f"output[{i}]" for i in read)


def working_point(module: nn.Module, point: Point) -> str:
    """What to target instead of a dead ``point``: the linear inside the module that its outputs
    come from, when the module has one and ``point`` is not already it."""
    try:
        gm = trace_alone(module)
        node = find_injection_node(gm, "", "auto")
    except Exception:
        node = None
    if point != "auto" and node is not None and is_linear(node, gm):
        inner = f" ({node.target})" if node.op == "call_module" else ""
        return f"use point='auto': the logits{inner} the module computes its other outputs from"
    return "target a value the model reads on the way to its output (another point, or the module that consumes it)"


def _class_point_inside(module: nn.Module) -> bool:
    """Whether the module's class computes its ``"auto"`` point inside (router logits), not as its output."""
    try:
        gm = fx.symbolic_trace(module)
        node = find_injection_node(gm, "", "auto")
    except Exception:
        return False
    return node is not next(n for n in gm.graph.nodes if n.op == "output").args[0]


def locate_injection_point(module: nn.Module, module_name: str, point: Point = "auto", *,
                            parent: nn.Module | None = None) -> InjectionPoint:
    """Resolve ``point`` for ``module`` without changing anything; point ``"routing"`` needs the module's
    ``parent``."""
    check_point(point)
    if point == ROUTING:
        return locate_routing(module, module_name, parent)
    is_output, index = parse_output_point(point)
    if is_output:
        return InjectionPoint(module_name, point, output_index=index)
    try:
        gm = trace_alone(module)
    except Exception as exc:
        own = instance_forward(module) is not None
        if point == "auto" and not (own and _class_point_inside(module)):  # the output, checked when the module runs
            return InjectionPoint(module_name, "auto")
        inside = " ('auto': the logits its class computes inside)" if point == "auto" else ""
        raise TargetError(f"{module_name!r}: {describe_forward(module)}, which torch.fx cannot trace alone to find "
                          f"point {point!r}{inside}: {one_line(exc)}; make that forward traceable, or target a point "
                          "of its output ('output' / 'output[i]')") from exc
    try:
        node = find_injection_node(gm, "", point)
    except TargetError as exc:
        children = [f"{module_name}.{name}" for name, _ in module.named_modules() if name]
        raise TargetError(f"{module_name!r}: {exc}; closest qualified names: "
                          f"{closest_names(module_name, children) or children[:5]}") from None
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if node is output:
        return InjectionPoint(module_name, "output")
    return InjectionPoint(module_name, point, graph_module=gm)


def _is_topk(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in (torch.topk, _aten.topk.default)
            or node.op == "call_method" and node.target == "topk")


class _Reached(Exception):
    """Ends a trace at the call it looked for (see :class:`_UntilCall`)."""

    def __init__(self, node: fx.Node):
        super().__init__(node.name)
        self.node = node


class _UntilCall(_KeepLeaf):
    """Traces a module up to its first call of one child, kept whole: that call's node is raised in a
    :class:`_Reached`, so what the forward does after it (which fx may not trace) is never read."""

    def call_module(self, m, forward, args, kwargs):
        proxy = super().call_module(m, forward, args, kwargs)
        if m is self.leaf:
            raise _Reached(proxy.node)
        return proxy


def locate_routing(module: nn.Module, module_name: str, parent: nn.Module | None) -> InjectionPoint:
    """Point ``"routing"`` of ``module`` (the experts of an MoE block): the arguments of its call that
    its parent computes from a top-k, whatever computes that top-k (a router module, or the block's own
    forward), found by tracing the forward the parent runs up to that call, with ``module`` kept whole.
    One such argument is a dense ``[T, E]`` routing matrix; two are a (top-k weights, expert ids) pair,
    which stands for the dense matrix of ``module.num_experts`` columns. Nothing is changed."""
    parent_name = module_name.rpartition(".")[0]
    if parent is None:
        raise TargetError(f"{module_name!r}: point 'routing' is the routing its parent passes it, but it has no parent")
    try:
        _UntilCall(module).trace(_traced_root(parent))
    except _Reached as reached:
        call = reached.node
    except Exception as exc:
        raise TargetError(f"{module_name!r}: point 'routing' is found by tracing its parent {parent_name!r} "
                          f"({describe_forward(parent)}) up to its call, which torch.fx cannot: {one_line(exc)}; "
                          "make that forward traceable, or target the router's logits") from exc
    else:
        raise TargetError(f"{module_name!r}: point 'routing' is the routing its parent {parent_name!r} passes it, but "
                          "the parent's forward does not call it")
    routed: set[fx.Node] = set()
    for node in call.graph.nodes:
        if _is_topk(node) or any(n in routed for n in node.all_input_nodes):
            routed.add(node)
    inputs = tuple([i for i, a in enumerate(call.args) if a in routed] +
                   [k for k, a in call.kwargs.items() if a in routed])
    if not inputs:
        raise TargetError(f"{module_name!r}: point 'routing': no argument of its call in {parent_name!r} is "
                          "computed from a top-k, so the routing step is not exposed there (e.g. one kernel computes it "
                          "with the logits); target the router instead")
    if len(inputs) > 2:
        raise TargetError(f"{module_name!r}: point 'routing': {len(inputs)} arguments of its call in {parent_name!r} "
                          f"come from a top-k ({inputs}); a routing point takes dense [T, E] weights or one (weights, "
                          "expert ids) pair")
    experts = getattr(module, "num_experts", None) if len(inputs) == 2 else None
    if len(inputs) == 2 and not isinstance(experts, int):
        raise TargetError(f"{module_name!r}: point 'routing' receives (weights, expert ids), which it replaces as the "
                          "dense [T, E] matrix they stand for, but the module has no int num_experts (E)")
    return InjectionPoint(module_name, ROUTING, routing_inputs=inputs, num_experts=experts)
