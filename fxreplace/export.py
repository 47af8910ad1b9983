"""``export()``: ahead-of-time export of a model that takes replacements as inputs.

The only code of fxreplace that reaches into torch internals: it rewrites the
exported graph's calling convention (``_codegen.pytree_info``), drops the
exported module's input-checking pre-hooks and its ``_guards_fn`` call, then
exports again so torch derives fresh guards for the new inputs.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Mapping
from typing import Iterable, Sequence

import torch
from torch import nn

from ._compat import size_hint
from .context import ReplacementContext
from .injection import Injection
from .passes import InjectionSpec, insert_replacements
from .points import check_adapter_fits, find_injection_node, is_linear
from .sharding import ShapeError
from .targets import TargetLike, resolve_targets


# the program's inputs beside the model's and the targets' rows (export() makes them, export_inputs() fills them)
MASK_INPUT = "fxreplace_mask"
RANK_INPUT = "fxreplace_rank"


def export_input_name(capture_name: str) -> str:
    """The exported program's input name for one target's replacement."""
    return "fxreplace_" + re.sub(r"\W", "_", capture_name)


def export_inputs(program: torch.export.ExportedProgram, context: ReplacementContext,
                  rank: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The replacement inputs of a program made by :func:`export`, taken from a context:
    each target's rows (floating-point values cast to the dtype the program takes, as the
    eager model casts them) and ``fxreplace_mask``, plus ``fxreplace_rank`` when the program
    takes one. Checked here against the program's signature, naming the input: a program
    called with a wrong dtype or width fails deep inside its graph, naming nothing."""
    placeholders = {n.name: n.meta["val"] for n in program.graph.nodes if n.op == "placeholder"}
    wanted = [s.arg.name for s in program.graph_signature.input_specs
              if s.kind.name == "USER_INPUT" and s.arg.name.startswith("fxreplace_")]
    by_input = {export_input_name(name): name for name in context}
    inputs: dict[str, torch.Tensor] = {}
    for input_name in wanted:
        expected = placeholders[input_name]
        if input_name == MASK_INPUT:
            inputs[input_name] = context.mask
        elif input_name == RANK_INPUT:
            if rank is None:
                raise ValueError("the program takes fxreplace_rank (a sharded target's rank as a tensor): pass rank=")
            inputs[input_name] = rank
        elif input_name not in by_input:
            raise KeyError(f"the program takes {input_name}, but the context holds no capture name that maps to it "
                           f"(it holds {sorted(context)[:5]}{' ...' if len(context) > 5 else ''})")
        else:
            name, value = by_input[input_name], context[by_input[input_name]]
            if not value.dtype.is_floating_point:
                raise TypeError(f"replacement for {name!r} ({input_name}) is {value.dtype}; the program takes "
                                f"{expected.dtype} values (the captured tensor), not a cast of them")
            if value.dim() != expected.dim() or value.shape[-1] != expected.shape[-1]:
                raise ShapeError(f"replacement for {name!r} ({input_name}) has shape {tuple(value.shape)}; the program "
                                 f"takes [tokens, {expected.shape[-1]}]")
            # contiguous: a built context's tensors are columns of its position-major group storage, and an
            # AOTInductor program reads its inputs with the strides it was compiled for, unchecked
            inputs[input_name] = value.to(expected.dtype).contiguous()
    return inputs


def _example_inputs(resolved, specs, located, tensor_rank: bool) -> dict[str, torch.Tensor]:
    """Example values for the program's new inputs, shaped like what each target computes (a sequence
    shard's rows and an expert shard's columns whole), then the mask and the rank."""
    examples = {}
    for target, spec, value in zip(resolved, specs, located):
        shard = target.shard
        shape = [size_hint(size) for size in value.shape]  # the example's sizes when shapes are dynamic
        rows = math.prod(shape) // shape[-1]
        columns = shape[-1]
        if shard is not None and shard.mode == "sequence":
            rows *= shard.world_size
        if shard is not None and shard.mode == "expert":
            columns *= shard.world_size
        examples[spec.input_name] = torch.zeros(rows, columns, dtype=value.dtype, device=value.device)
    tokens = {v.shape[0] for v in examples.values()}
    if len(tokens) != 1:
        raise ShapeError(f"targets see different token counts {tokens}; export them separately")
    examples[MASK_INPUT] = torch.zeros(tokens.pop(), dtype=torch.bool, device=next(iter(examples.values())).device)
    if tensor_rank:
        examples[RANK_INPUT] = next(t.shard.rank for t in resolved if t.shard and isinstance(t.shard.rank, torch.Tensor))
    return examples


def _mask_as_bool(gm: torch.fx.GraphModule) -> None:
    """The program reads ``fxreplace_mask`` as ``mask != 0``: a 0/1 integer mask (a common hand-made input)
    works as the bool one does instead of failing inside a ``where`` that names no input (an exported
    program checks its inputs' shapes, not their dtypes)."""
    graph = gm.graph
    mask = next(n for n in graph.nodes if n.op == "placeholder" and n.target == MASK_INPUT)
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_input):
        read = graph.call_function(torch.ops.aten.ne.Scalar, (mask, 0))
    mask.replace_all_uses_with(read, delete_user_cb=lambda user: user is not read)
    graph.lint()
    gm.recompile()


def export(
    model: nn.Module,
    example_inputs: Mapping | Sequence,
    targets: Iterable[TargetLike],
    *,
    dynamic_shapes=None,
    strict: bool = False,
) -> torch.export.ExportedProgram:
    """``torch.export`` the plain model, apply :func:`~fxreplace.passes.insert_replacements`
    to the whole-model graph (nodes found through ``nn_module_stack``), and
    export the result again so it is ATen IR ready for AOTInductor.

    The program takes the model's inputs (``example_inputs``: a dict of keyword
    arguments or a tuple of positional ones, flattened to keywords named as in
    the model's signature), then one ``[T, E]`` replacement per target named
    :func:`export_input_name` (capture name), then ``fxreplace_mask`` (bool
    ``[T]``; 0/1 integers read as bool) and, when a target's shard rank is a tensor, ``fxreplace_rank``.
    Mask all False turns replacement off in the same program. :func:`export_inputs` makes
    these inputs from a :class:`~fxreplace.ReplacementContext`, checked.

    ``dynamic_shapes`` is :func:`torch.export.export`'s, for the model's inputs
    (a dict by argument name, or a tuple matching positional ``example_inputs``);
    the token dimension of the replacement and mask inputs then follows them
    (``Dim.AUTO``: export derives ``T`` from the model's shapes and checks it at
    run time).
    """
    kwargs = dict(example_inputs) if isinstance(example_inputs, Mapping) else {}
    args = () if isinstance(example_inputs, Mapping) else tuple(example_inputs)
    resolved = resolve_targets(model, targets)
    program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict)
    gm = program.module()
    specs = [
        InjectionSpec(
            t.module_name, t.point,
            Injection(t.module_name, model.get_submodule(t.module_name), t.adapter, t.shard),
            export_input_name(t.capture_name),
        )
        for t in resolved
    ]
    tensor_rank = any(t.shard is not None and isinstance(t.shard.rank, torch.Tensor) for t in resolved)
    nodes = [find_injection_node(gm, s.module_name, s.point) for s in specs]
    for t, node in zip(resolved, nodes):
        check_adapter_fits(t.module_name, t.point, t.adapter, lambda node=node: is_linear(node, gm))
    located = [node.meta["val"] for node in nodes]
    # The graph must take the old and new inputs as flat keywords.
    old_inputs = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    new_inputs = [s.input_name for s in specs] + [MASK_INPUT] + ([RANK_INPUT] if tensor_rank else [])
    _take_flat_keywords(gm, old_inputs + new_inputs)
    insert_replacements(gm, specs, mask_input=MASK_INPUT, rank_input=RANK_INPUT if tensor_rank else None,
                        optional_inputs=False)
    _mask_as_bool(gm)

    examples = _example_inputs(resolved, specs, located, tensor_rank)
    return _reexport(gm, model, args, kwargs, old_inputs, examples, dynamic_shapes)


def _take_flat_keywords(gm: torch.fx.GraphModule, names: list[str]) -> None:
    """Make the exported module take ``names`` as flat keywords (the model's inputs, then the new ones)."""
    info = gm.graph._codegen.pytree_info
    gm.graph._codegen.pytree_info = info._replace(
        orig_args=names, in_spec=torch.utils._pytree.tree_structure(((), {n: 0 for n in names}))
    )
    gm._forward_pre_hooks.clear()  # they check inputs against the old signature
    for node in [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        gm.graph.erase_node(node)  # re-export derives its own guards


def _reexport(gm, model: nn.Module, args, kwargs, old_inputs: list[str], examples: dict,
              dynamic_shapes) -> torch.export.ExportedProgram:
    """Export the rewritten module again on the model's example inputs and the new ones (``examples``), the
    replacement and mask inputs' token dimension following the model's dynamic shapes."""
    signature = inspect.signature(model.forward)
    given = signature.bind_partial(*args, **kwargs).arguments
    inputs = {name: given[name] for name in old_inputs} | examples
    if dynamic_shapes is None:
        return torch.export.export(gm, (), inputs, strict=False)
    if not isinstance(dynamic_shapes, Mapping):
        dynamic_shapes = signature.bind_partial(*dynamic_shapes).arguments
    follows = {name: ({0: torch.export.Dim.AUTO} if name != RANK_INPUT else None) for name in examples}
    shapes = {name: dynamic_shapes.get(name) for name in old_inputs} | follows
    return torch.export.export(gm, (), inputs, dynamic_shapes=shapes, strict=False)
