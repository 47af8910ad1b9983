"""Blame search cost against depth: L = 4, 8, 16, 32 layers, one planted fault and two.

Each depth: a tiny Qwen3-MoE in float32 is the clean model; its reference holds the
router logits only (the README's capture), so every component the search replaces is
captured from the clean model on demand (``blame(..., clean=...)``). Targets: the same
weights with one attention output projection scaled in layer ``0.6 L``, and with two
faults (attention in layer ``L/4``, router in layer ``3L/4``). Per run: validation passes,
rounds (batched validations: the passes of one round run side by side as copies of the
prompts), components captured on demand (of 5L: the family's kinds per layer), wall time of the search with and without
completing the reference (the captures), and that time divided by one validation pass of the target with nothing
replaced (measured on an equal runner in the same run, median of 3, before and after the
search: their mean divides, and the two give the spread).

The noise floor's cost: the clean model in bf16 teacher-forced against the reference, on the
same prompts (``fxreplace.floor.measure_floor``), timed beside the pass; it is one extra pass
of other weights, so it cannot share a batch with the target's "off" pass, and ``capture
--noise-floor`` pays it once per reference. ``same`` is two faults in one layer (attention
and router in layer ``L/2``), found by trying the layer's kinds together.

Goals: a single-fault search in <= 3 validation passes of wall time at L = 16 and L = 32, two
faults in <= 5 at L = 16 (completing the reference excluded: its cost is paid once), and
passes and captures growing as log L, not as L (one by one: 1 + 5L passes, 5L captures).

Prints a table and a final JSON line {"passes": {fault: {L: n}}, "rounds": ..., "captured": ...,
"seconds": ..., "per_pass": {fault: {L: search seconds / one pass}}, "found": ..., "goal_met": bool,
"logarithmic": bool}.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import statistics
import time

import torch

from fxreplace.blame import PROBES, blame, blame_runner, resolve_components
from fxreplace.capture import capture_reference
from fxreplace.floor import measure_floor
from fxreplace.instrument import instrument
from fxreplace.models import get_family, tiny_model
from fxreplace.validation import logit_validation

ARCH = "Qwen3MoeForCausalLM"
#: the components the family declares in every layer (attention, router, routing, experts, the stream)
PER_LAYER = sum("*" in t.pattern for t in get_family(ARCH).components.values())


FAULTS = ("one", "two", "same")


def faults(layers: int, which: str) -> list[tuple[str, int]]:
    if which == "one":
        return [("attention", int(0.6 * layers))]
    if which == "same":
        return [("attention", layers // 2), ("router", layers // 2)]
    return [("attention", layers // 4), ("router", 3 * layers // 4)]


def plant(model, planted):
    model = copy.deepcopy(model)
    with torch.no_grad():
        for kind, layer in planted:
            if kind == "attention":
                model.model.layers[layer].self_attn.o_proj.weight.mul_(1.5)
            else:
                model.model.layers[layer].mlp.gate.weight.mul_(-1.0)
    return model


def one_pass_seconds(target, reference, comps, repeats: int = 3) -> float:
    """One teacher-forced validation with nothing replaced, on the runner blame builds."""
    model = instrument(copy.deepcopy(target), [c.target for c in comps])
    runner = blame_runner(model, target.config, reference.store, reference, range(reference.num_prompts), comps,
                          probes=PROBES)
    times = []
    for _ in range(repeats):
        gc.collect()  # the heap the earlier depths left is theirs to collect, not this pass's
        t0 = time.perf_counter()
        logit_validation(runner, reference, modes=("on",), replace=(), progress=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(layers: int, which: str, prompts, new_tokens: int, tmp) -> dict:
    clean = tiny_model(ARCH, num_hidden_layers=layers)
    directory = tmp / f"ref-{layers}-{which}"
    capture_reference(clean, prompts, get_family(ARCH).targets, new_tokens, progress=False).save(directory)
    planted = faults(layers, which)
    target = plant(clean, planted)
    comps = resolve_components(clean, get_family(ARCH).components)
    from fxreplace.reference import load_reference

    # one pass measured before and after the search: a load swing between them shows in the spread
    before = one_pass_seconds(target, load_reference(directory), comps)
    gc.collect()  # likewise for the search: a CLI run starts from a fresh process
    result = blame(target, directory, clean=clean, progress=False)
    after = one_pass_seconds(target, load_reference(directory), comps)
    one = (before + after) / 2
    gc.collect()
    floor = measure_floor(clean, load_reference(directory), torch.bfloat16)
    named = sorted((o.kind, o.layer) for o in result.origins)
    search_seconds = result.seconds - result.capture_seconds
    return {"layers": layers, "fault": which, "planted": planted, "passes": len(result.passes), "rounds": result.rounds,
            "captured": len(result.captured), "seconds": result.seconds, "search_seconds": search_seconds,
            "one_pass": one, "per_pass": search_seconds / one, "floor_seconds": floor.seconds,
            "floor_per_pass": floor.seconds / one, "per_pass_spread": (search_seconds / max(before, after),
                                                                                    search_seconds / min(before, after)),
            "found": result.confident and named == sorted(planted),
            "verdict": result.verdict}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS), help="the cases to run (default: all)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    count, new_tokens = (2, 6) if args.quick else (4, 12)
    prompts = [torch.randint(4, 128, (int(n),), generator=g).tolist() for n in torch.randint(6, 16, (count,), generator=g)]
    import tempfile
    from pathlib import Path

    print(f"{count} prompts x {new_tokens} tokens; faults: one = attention x1.5 at layer 0.6 L, two = attention at L/4 "
          "and router at 3L/4; reference: router logits only, components captured on demand")
    print(f"{'fault':>5} {'L':>4} {'passes':>7} {'1-by-1':>7} {'rounds':>7} {'captured':>9} {'of':>5} {'total s':>8} "
          f"{'search s':>9} {'1 pass s':>9} {'÷ pass':>7} {'floor ÷':>8}  found", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for which in args.faults:
            for n in args.layers:
                r = run(n, which, prompts, new_tokens, Path(tmp))
                rows.append(r)
                print(f"{r['fault']:>5} {r['layers']:>4} {r['passes']:>7} {1 + PER_LAYER * r['layers']:>7} {r['rounds']:>7} "
                      f"{r['captured']:>9} {PER_LAYER * r['layers']:>5} {r['seconds']:>8.1f} {r['search_seconds']:>9.1f} "
                      f"{r['one_pass']:>9.2f} {r['per_pass']:>7.2f} {r['floor_per_pass']:>8.2f}  {r['found']}", flush=True)
    for r in rows:
        if not r["found"]:
            print(f"  {r['fault']} L={r['layers']}: {r['verdict']}")

    def by(key):
        return {w: {r["layers"]: (round(r[key], 2) if isinstance(r[key], float) else r[key]) for r in rows
                    if r["fault"] == w} for w in FAULTS}

    # localisation: PROBES streams per round, ceil(log_(PROBES + 1) L) rounds per origin, then its 3 kinds
    bound = {r["layers"]: 1 + len(r["planted"]) * (PROBES * math.ceil(math.log(r["layers"], PROBES + 1)) + 3 + 1)
             for r in rows}
    def ratio(which, layers):
        return next((r["per_pass"] for r in rows if r["fault"] == which and r["layers"] == layers), None)
    print(json.dumps({
        "passes": by("passes"), "rounds": by("rounds"), "captured": by("captured"), "seconds": by("seconds"),
        "search_seconds": by("search_seconds"), "one_pass_seconds": by("one_pass"), "per_pass": by("per_pass"),
        "per_pass_spread": {w: {r["layers"]: [round(x, 2) for x in r["per_pass_spread"]] for r in rows if r["fault"] == w}
                            for w in FAULTS},
        "found": by("found"),
        "floor_per_pass": by("floor_per_pass"),
        "goals": {"one_L16": ratio("one", 16), "one_L32": ratio("one", 32), "two_L16": ratio("two", 16)},
        "goal_met": all(v is not None for v in (ratio("one", 16), ratio("one", 32), ratio("two", 16)))
        and ratio("one", 16) <= 3.0 and ratio("one", 32) <= 3.0 and ratio("two", 16) <= 5.0,
        "logarithmic": all(r["passes"] <= bound[r["layers"]] for r in rows if r["fault"] == "one"),
    }))


if __name__ == "__main__":
    main()
