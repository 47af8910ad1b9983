"""``fxreplace repro``: the guilty component as a standalone ticket for the compiler team.

From a blame verdict (or a component named by the user), the reference model and the
target: the component's calls are recorded in the reference run as an engine makes them
(per prompt its prefill, then one decode step per generated token with the KV cache,
teacher-forced on the reference's tokens; a decode call's cache recorded as the keys and
values it read), and a folder is written holding

- ``prefill.pt2`` / ``decode.pt2``: the *target's* component as a ``torch.export`` program
  per kind of call, with its weights (stored as raw bytes; no sample inputs, so nothing in
  it is a pickle); the decode program rebuilds the cache from its keys and values inputs,
- ``inputs.safetensors`` / ``reference_outputs.safetensors``: a handful of calls of each
  kind (those where the target's component departs most from the reference's) and the
  reference component's outputs on them,
- ``repro.json`` (what it came from, the tolerance, a kind of call that could not be
  recorded and why), ``README.md`` (the command that wrote it and how to run it) and
  ``run.py`` (:mod:`fxreplace.repro_run`, which needs only torch and safetensors).

``fxreplace repro run DIR --backend inductor`` (or ``python DIR/run.py``) then says whether
the port or the compiler is wrong, and in which kind of call, without the model, the
reference store or vLLM: a fault that arises only in decode shows in the decode calls alone.
"""

from __future__ import annotations

import copy
import itertools
import json
import shutil
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch
from safetensors.torch import save_file
from torch import nn
from torch.export import Dim
from torch.utils import _pytree as pytree

from . import repro_run
from .repro_calls import CacheState, Call, call_tensors, capture_calls, unreplayable
from .repro_run import ReproError
from .components import Component, ComponentError, family_components, layer_of, resolve_components
from .dtypes import dtype_name
from .points import ROUTING
from .reference import load_reference
from .targets import Target, TargetLike, resolve_targets

#: Relative error a component may show against the reference, by the target's dtype: rounding
#: to bf16 alone leaves ~1e-2 in an attention block; a planted or compiler fault leaves far more.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 5e-2, torch.float16: 1e-2}
README = "README.md"
#: Op namespaces torch itself provides (no library to import before loading the program).
BUILTIN_NAMESPACES = {"aten", "prims", "_operator", "higher_order", "quantized", "_c10d_functional"}


def find_component(model: nn.Module, name: str, components: Mapping[str, TargetLike] | None = None) -> Component:
    """The component ``name`` (a blame capture name, e.g. ``model.layers.3.mlp.gate``): one the
    family declares (or ``components``), else the module of that name, whole output compared."""
    if components is None:
        try:
            components = family_components(model)
        except ComponentError:
            components = {}
    for c in resolve_components(model, components):
        if c.capture_name == name:
            return c
    resolved = resolve_targets(model, [Target(name, point="output")])  # a TargetError names the closest modules
    if len(resolved) != 1:
        raise ReproError(f"component {name!r} matches {len(resolved)} modules ({resolved[0].module_name}, ...): "
                         "name one module")
    r = resolved[0]
    return Component("module", layer_of(r.module_name), r.module_name, r.capture_name,
                     Target(r.module_name, point="output"))


def _with_its_module(component: Component) -> Component:
    """The module a repro exports for ``component``: its own, but for a component at the routing a module
    is *called with* (point ``"routing"``: the experts' arguments), whose code lives in the caller: the
    parent block that computes it (router, routing, experts) with its output compared. The experts alone,
    given the reference's routing, would agree and point away from the fault."""
    if component.target.point != ROUTING:
        return component
    block = component.module_name.rpartition(".")[0]
    return Component(component.kind, component.layer, block, component.capture_name, Target(block, point="output"))


def blamed_component(blame_result) -> str:
    """The component a blame result names first (a :class:`~fxreplace.blame.BlameResult`, its
    ``to_dict()`` or the path of its ``blame.json``)."""
    if isinstance(blame_result, (str, Path)):
        blame_result = json.loads(Path(blame_result).read_text())
    if not isinstance(blame_result, dict):
        blame_result = blame_result.to_dict()
    named = [o["component"] for o in blame_result.get("origins", []) if o.get("component")]
    if not named:
        raise ReproError(f"the blame verdict names no component ({blame_result.get('verdict', '')[:160]}); "
                         "name one with --component (a module, e.g. model.layers.2.input_layernorm)")
    return named[0]


class _Positional(nn.Module):
    """The component with its inputs' tensors as positional arguments (the other arguments, such as
    ``use_cache=True`` or a None mask, fixed as captured) and its output's tensors as a tuple: the
    exported program then takes and returns plain tensors, which is all the runner knows. A KV cache
    the call read comes in as its layers' keys and values, rebuilt into a fresh ``DynamicCache``
    of the model's ``config`` inside the forward (an exported program cannot take a Cache object)."""

    def __init__(self, component: nn.Module, call: Call, config):
        super().__init__()
        self.component, self.config = component, config
        leaves, self.spec = pytree.tree_flatten((call.args, call.kwargs))
        self.fixed = [None if isinstance(x, (torch.Tensor, CacheState)) else x for x in leaves]
        # per leaf: None (fixed), "tensor", or the cache layers it rebuilds from two tensors each
        self.slots = ["tensor" if isinstance(x, torch.Tensor) else list(x.layers) if isinstance(x, CacheState) else None
                      for x in leaves]

    def forward(self, *tensors):
        given = iter(tensors)
        leaves = [fixed if slot is None else next(given) if slot == "tensor" else self._cache(slot, given)
                  for slot, fixed in zip(self.slots, self.fixed)]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return tuple(x for x in pytree.tree_leaves(self.component(*args, **kwargs)) if isinstance(x, torch.Tensor))

    def _cache(self, layers: list[int], given):
        from transformers import DynamicCache  # the hf extra: only a call that read a cache rebuilds one

        cache = DynamicCache(config=self.config)
        for i in layers:
            cache.update(next(given), next(given), i)
        return cache


def _outputs(output) -> list[tuple[str, torch.Tensor]]:
    """The output's tensors with their names as a point spells them (``output[0]``)."""
    named = []
    for path, x in pytree.tree_flatten_with_path(output)[0]:
        if isinstance(x, torch.Tensor):
            named.append(("output" + "".join(f"[{getattr(k, 'idx', getattr(k, 'key', k))}]" for k in path), x))
    return named


def _compared(names: list[str], point: str, is_tuple: bool) -> list[bool]:
    """Which outputs the component's point reads: ``output[k]``'s, else the whole output, or the
    first of a tuple for a point inside the module (``auto``: a router's logits)."""
    if point.startswith("output["):
        prefix = point
    elif point == "output" or not is_tuple:
        prefix = "output"
    else:
        prefix = "output[0]"
    return [n == prefix or n.startswith(prefix + "[") or prefix == "output" for n in names]


def _op_libraries(program) -> list[str]:
    """Python modules that register the custom ops the program calls (imported before loading it)."""
    from torch._library.custom_ops import OPDEFS  # torch's custom-op registry: no public listing exists

    found = []
    for node in program.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
                target.namespace not in BUILTIN_NAMESPACES:
            opdef = OPDEFS.get(target._schema.name)
            module = getattr(getattr(opdef, "_init_fn", None), "__module__", None) or target.namespace
            if module not in found:
                found.append(module)
    return found


def write_repro(target: nn.Module, clean: nn.Module, reference, component, out: str | Path, *,
                dtype: torch.dtype | None = None, prompts: Sequence[int] | None = None, inputs: int = 4,
                components: Mapping[str, TargetLike] | None = None, command: str | None = None,
                source: Mapping[str, str] | None = None) -> Path:
    """Write the repro folder of ``component`` to ``out`` (replaced if it holds a repro).

    ``target``: the HF model under test (its component is exported, in ``dtype`` if given);
    ``clean``: the reference model; ``reference``: the reference (or its directory) whose
    prompts and generated tokens the inputs come from (``prompts``: which; default all);
    ``component``: a capture name, a :class:`Component`, or a blame result naming it;
    ``inputs``: how many calls of each kind (prefill, decode) to keep (those whose target output
    departs most from the reference's); ``source``: ``{"model": ..., "target": ...}`` as the
    README names them. A kind of call that cannot be recorded or exported is named in the folder
    (``repro.json``'s ``unrecorded``) and the runner says so instead of "agrees".
    """
    if isinstance(reference, (str, Path)):
        reference = load_reference(reference)
    component = _the_component(component, clean, components)
    indices = list(range(reference.num_prompts)) if prompts is None else list(prompts)
    if inputs < 1 or not indices:
        raise ReproError(f"a repro needs at least one input (inputs={inputs}, prompts={indices})")
    check_out_dir(out)
    runs = [(p, reference.prompt_tokens(p), reference.tokens(p)[:-1]) for p in indices]
    module, dtype = _module_in(target, component.module_name, dtype)
    recorded = capture_calls(clean, component.module_name, runs)
    first = next(recorded, None)  # the first prompt's prefill: the outputs every call returns
    if first is None:
        raise ReproError(f"{component.module_name} is never called in the reference model's forward: name a module "
                         "on its path")
    names = [n for n, _ in _outputs(first.output)]
    compared = _compared(names, component.target.point, isinstance(first.output, (tuple, list)))
    best, calls, unrecorded = _most_departing(
        itertools.chain([first], recorded), inputs, lambda call: _departure(module, call, compared, dtype, target.config))
    chosen, programs = _export_kinds(module, best, unrecorded, dtype, component.module_name, target.config)
    out = _fresh_dir(Path(out))  # a previous repro there goes only now, once this one can be written
    _save_programs(out, programs, chosen, dtype)
    source = dict(source or {})
    tokens = {p: list(ids) + list(forced) for p, ids, forced in runs}
    meta = {
        "format": repro_run.FORMAT,
        "component": component.capture_name, "kind": component.kind, "layer": component.layer,
        "module_name": component.module_name, "module": type(module).__name__, "point": component.target.point,
        "model": source.get("model") or reference.metadata.get("source_model") or type(clean).__name__,
        "target": source.get("target") or type(target).__name__,
        "dtype": dtype_name(dtype), "tolerance": TOLERANCE.get(dtype, 1e-3),
        "outputs": [{"name": n, "compared": c} for n, c in zip(names, compared)],
        "programs": {kind: repro_run.PROGRAMS[kind] for kind in programs},
        "calls": calls,
        "unrecorded": unrecorded,
        "inputs": [{"prompt": c.prompt, "call": c.kind, "cached": c.cached, "tokens": c.tokens,
                    "tensors": len(call_tensors(c)), "shapes": [list(t.shape) for t in call_tensors(c)],
                    "error_at_write": d} for c, d in chosen],
        "prompt_tokens": {str(p): tokens[p] for p in dict.fromkeys(c.prompt for c, _ in chosen)},
        "op_libraries": list(dict.fromkeys(lib for program in programs.values() for lib in _op_libraries(program))),
        "command": command, "torch": torch.__version__,
    }
    (out / repro_run.META).write_text(json.dumps(meta, indent=1))
    shutil.copyfile(repro_run.__file__, out / "run.py")
    (out / README).write_text(_readme(meta))  # last: a folder holding it is complete
    return out


def _the_component(component, clean: nn.Module, components) -> Component:
    """``component`` (a capture name, a :class:`Component` or a blame result naming it) as a component whose
    target names its module."""
    if not isinstance(component, (str, Component)):
        component = blamed_component(component)
    if isinstance(component, str):
        component = find_component(clean, component, components)
    return _with_its_module(component)


def _module_in(target: nn.Module, name: str, dtype: torch.dtype | None) -> tuple[nn.Module, torch.dtype]:
    """The target's module ``name`` (a copy in ``dtype`` when given) and the dtype it computes in."""
    module = target.get_submodule(name)
    if dtype is not None:
        module = copy.deepcopy(module).to(dtype)
    return module, next(module.parameters(), torch.empty(0)).dtype


def _export_kinds(module: nn.Module, best: dict, unrecorded: dict, dtype, name: str, config) -> tuple[list, dict]:
    """Each kind of call's program and the calls it keeps; a kind that cannot be exported goes to ``unrecorded``
    with why. Refused when no kind can."""
    chosen, programs = [], {}
    for kind, kept in best.items():
        try:
            programs[kind] = _export(module, [c for c, _ in kept], dtype, name, config)
            chosen += kept
        except ReproError as e:
            unrecorded[kind] = str(e)
    if not programs:
        raise ReproError(f"{name}: no call can be replayed: " + "; ".join(unrecorded.values()))
    return chosen, programs


def _save_programs(out: Path, programs: dict, chosen: list, dtype) -> None:
    """The programs (checked free of pickles) and the chosen calls' inputs and reference outputs, into ``out``."""
    for kind, program in programs.items():
        program.example_inputs = None  # torch.export would store them as a pickle
        torch.export.save(program, out / repro_run.PROGRAMS[kind])
        repro_run.check_no_pickle(out / repro_run.PROGRAMS[kind])
    save_file({f"{i}.{j}": t.contiguous() for i, (c, _) in enumerate(chosen) for j, t in enumerate(call_tensors(c, dtype))},
              out / repro_run.INPUTS)
    save_file({f"{i}.{k}": x.contiguous() for i, (c, _) in enumerate(chosen)
               for k, (_, x) in enumerate(_outputs(c.output))}, out / repro_run.OUTPUTS)


def _most_departing(calls: Iterator[Call], count: int, departure) -> tuple[dict, dict, dict]:
    """Per kind of call, the ``count`` calls where ``departure(call)`` is largest (ties: in run order)
    with it, in run order (only those are held, with the cache each read); how many calls of each kind
    ran; and per kind whose calls cannot be replayed, why."""
    ran = dict.fromkeys(repro_run.KINDS, 0)
    best: dict[str, list] = {kind: [] for kind in repro_run.KINDS}  # (departure, order, call), largest first
    unrecorded: dict[str, str] = {}
    for order, call in enumerate(calls):
        ran[call.kind] += 1
        why = unreplayable(call)
        if why or call.kind in unrecorded:  # one call of a kind that cannot be replayed: its kind cannot be
            unrecorded.setdefault(call.kind, why)
            best[call.kind] = []
            continue
        best[call.kind].append((departure(call), order, call))
        best[call.kind].sort(key=lambda b: (-b[0], b[1]))
        del best[call.kind][count:]
    kept = {kind: [(call, d) for d, _, call in sorted(held, key=lambda b: b[1])] for kind, held in best.items() if held}
    return kept, ran, unrecorded


def _departure(module: nn.Module, call: Call, compared: list[bool], dtype, config) -> float:
    """How far the target's module departs from the reference's outputs on ``call`` (compared outputs)."""
    with torch.no_grad():
        got = _Positional(module, call, config)(*call_tensors(call, dtype))
    return max(repro_run.error(g, want) for g, (_, want), use in zip(got, _outputs(call.output), compared) if use)


def check_out_dir(out: str | Path) -> None:
    """``out`` may take a repro: absent, empty, or holding a previous repro (which it replaces)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / repro_run.META).is_file())):
        raise ReproError(f"{out} is not empty and holds no repro: choose another folder")


def _fresh_dir(out: Path) -> Path:
    """``out``, empty: created, or cleared when it holds a previous repro (never another folder)."""
    check_out_dir(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _export(module: nn.Module, calls: list[Call], dtype, name: str, config):
    """The component as an exported program over the shapes of one kind's calls (dimensions that
    vary between them dynamic: the prompt's length in prefill, the cached positions in decode),
    checked against the module on each call."""
    first = call_tensors(calls[0], dtype)
    wrapper = _Positional(module, calls[0], config).eval()
    sizes = [[t.shape for t in call_tensors(c)] for c in calls]
    varying = [{d: Dim.AUTO for d in range(t.dim()) if len({s[j][d] for s in sizes}) > 1} or None
               for j, t in enumerate(first)]
    shapes = (tuple(varying),)
    try:
        program = torch.export.export(wrapper, tuple(first), dynamic_shapes=shapes, strict=False)
    except Exception as e:  # export's errors are many kinds; the message says which
        raise ReproError(f"torch.export cannot export {name} ({type(module).__name__}) for its {calls[0].kind} calls: "
                         f"{str(e).strip().splitlines()[0]}") from e
    exported = program.module()
    with torch.no_grad():
        for call in calls:
            args = call_tensors(call, dtype)
            for got, want in zip(exported(*args), wrapper(*args)):
                if repro_run.error(got, want) > 1e-6:
                    raise ReproError(f"the exported {name} does not reproduce the module on prompt {call.prompt}'s "
                                     f"{call.kind} call (shapes {[list(t.shape) for t in args]}): torch.export "
                                     "specialised it")
    return program


def _readme(meta: dict) -> str:
    prompts = ", ".join(f"{p} ({len(ids)} tokens)" for p, ids in meta["prompt_tokens"].items())
    libraries = (f"\nThe programs call custom ops of {', '.join(meta['op_libraries'])}: the runner imports "
                 "it before loading them.\n") if meta["op_libraries"] else ""
    kept = {kind: sum(i["call"] == kind for i in meta["inputs"]) for kind in meta["programs"]}
    calls = "; ".join([f"{n} of its {meta['calls'][kind]} {kind} calls" for kind, n in kept.items()]
                      + repro_run.unrecorded(meta))
    return f"""# Repro: {meta['component']}

The target's `{meta['module_name']}` ({meta['module']}, {meta['kind']}, layer {meta['layer']}) in
{meta['dtype']}, alone: the component a compiled model's divergence from its reference was
traced to, with the inputs it received in the reference run and the reference's outputs.

- reference model: `{meta['model']}`; target: `{meta['target']}`
- inputs: {calls}; from the reference's prompts {prompts}, run as an engine runs them: the prompt's
  prefill, then one decode step per generated token with the KV cache (teacher-forced on the reference's
  tokens: ids in `repro.json`). A decode call's inputs hold the cached keys and values it read; its
  program rebuilds the cache from them.
- compared: {', '.join(o['name'] for o in meta['outputs'] if o['compared'])} (relative error, tolerance
  {meta['tolerance']:g} for {meta['dtype']})
- written by: `{meta['command'] or 'fxreplace.repro.write_repro'}` (torch {meta['torch']})
{libraries}
## Run it

```bash
python run.py --backend eager        # the port: does the target's component match the reference?
python run.py --backend inductor     # the compiler: does a backend change it? (aot_eager, xla, MODULE:FUNCTION)
python run.py --backend inductor --bisect   # the first inductor stage or pass that breaks it
```

`run.py` needs torch and safetensors only (`fxreplace repro run DIR` is the same). It prints each
input's error against the reference and a verdict per kind of call: disagreeing already in eager is the
port (weights, conversion, code), and disagreeing in decode calls only is a fault that arises with the
cache; only the compiled backend disagreeing is the compiler. Exit status 0: agrees, 1: a disagreement,
2: the folder cannot be run, 3: the calls it holds agree but a kind of call could not be recorded.

Files: {', '.join(f"`{f}` (the {kind} calls' program)" for kind, f in meta['programs'].items())}
(`torch.export.save`: graph as JSON, weights as raw bytes, no pickle: `run.py` checks before loading),
`inputs.safetensors` (input `i`'s tensors as `i.0`, `i.1`, ...), `reference_outputs.safetensors`
(`i.k`: output `k` of the reference's component on input `i`), `repro.json` (what it came from).
"""
