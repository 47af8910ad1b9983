"""``fxreplace inspect`` and ``fxreplace repack``: a model's injection points, a store's health."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..instrument import instrument
from ..liveness import check_live
from ..loading import default_targets, load_model
from ..words import one_line
from ..points import locate_injection_point
from ..store import CaptureError, ReferenceStore, describe_store, repack_store
from ..store.publish import DERIVED_DIRS
from ..targets import Target
from .args import EXIT_GATE_FAILED, EXIT_OK, UsageError


def inspect(args) -> int:
    """A model's candidate injection points (or its targets' liveness), or a store's health."""
    if args.verify:
        return _verify_store(args.verify)
    if args.model is None:
        raise UsageError("inspect needs a model (builtin:ARCH or a directory) or --verify REF")
    model = load_model(args.model)
    if args.check_live is not None:
        return _check_live(model, args.check_live, args.tokens)
    shapes: dict[str, tuple] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or "gate" in name.rsplit(".", 1)[-1] or "router" in name.rsplit(".", 1)[-1]:
            def hook(mod, inputs, output, name=name):
                first = output[0] if isinstance(output, tuple) else output
                if isinstance(first, torch.Tensor):
                    shapes[name] = (type(mod).__name__, tuple(first.shape), isinstance(output, tuple))
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=torch.zeros(1, args.tokens, dtype=torch.long))
    for h in hooks:
        h.remove()
    print(f"candidate injection points for {args.model} ({args.tokens} tokens; routers first):")
    routers = [n for n in shapes if n.endswith((".gate", ".router"))]
    for name in routers + [n for n in shapes if n not in routers]:
        cls, shape, is_tuple = shapes[name]
        note = ""
        if is_tuple:  # where 'auto' lands is points.py's rule: ask it
            inside = locate_injection_point(model.get_submodule(name), name).graph_module is not None
            note = "returns a tuple: point 'auto' " + ("injects at its logits" if inside else "is its output")
        print(f"  {name:<40} {cls:<24} {str(shape):<16} {note}")
    return 0


def _check_live(model, specs: list[str], tokens: int) -> int:
    """``inspect --check-live``: one forward per target with a random replacement must move the logits."""
    instrument(model, [Target(*spec.split("@", 1)) for spec in specs] or default_targets(model))
    moved = check_live(model, lambda: model(input_ids=torch.zeros(1, tokens, dtype=torch.long)))
    print(f"every target reaches the logits ({tokens} tokens, one random replacement per target):")
    for name, change in moved.items():
        print(f"  {name:<40} max |logit change| {change:.3g}")
    return 0


def repack(args) -> int:
    """Rewrite a store into shards of another size, every source shard checked against its digests."""
    args.produced.describe = lambda: (f"--out {Path(args.out).resolve()} holds {describe_store(args.out)} (a repack "
                                      f"appears whole or not at all); {args.reference} unchanged")
    try:
        before = len(ReferenceStore.load(args.reference).shards)
        store = ReferenceStore.load(repack_store(args.reference, args.out, shard_bytes=args.shard_mib << 20))
    except (CaptureError, OSError) as e:
        raise UsageError(one_line(e), f"`fxreplace inspect --verify {args.reference}` checks the store") from None
    print(f"{args.out}: {store.num_prompts} prompts in {len(store.shards)} shard(s), repacked from {before} "
          f"shard(s) of {args.reference}; every source shard matched its recorded digests")
    return 0


def _verify_store(path: str) -> int:
    """Read every byte of a reference store: digests recorded at write, then finiteness."""
    parts = [Path(path)] + sorted(p.parent for name in DERIVED_DIRS for p in Path(path).glob(f"{name}/*/index.json"))
    for part in parts:  # the store, then the stores fxreplace added to it (blame's components)
        try:
            summary = ReferenceStore.load(part).verify()
        except (CaptureError, OSError) as e:
            print(f"error: {one_line(e)}", file=sys.stderr)
            return EXIT_GATE_FAILED
        finite = "every row finite" if summary["finite"] else "rows not checked for NaN/Inf (written with allow_nonfinite)"
        print(f"{part}: OK: {summary['prompts']} prompts in {summary['shards']} shard(s), "
              f"{summary['bytes'] / 2**20:.1f} MiB match the SHA-256 digests recorded at write; {finite}")
    return EXIT_OK
