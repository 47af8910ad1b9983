"""Blame search cost against depth: passes and wall time for L = 4, 8, 16 layers, one planted fault.

Each depth: a tiny Qwen3-MoE in float32 is the reference (components captured); the
target is the same weights with one attention output projection scaled in layer
``0.6 L`` (the bisection then visits both halves). The search must find it and its
passes must grow with log2(L), not with L: replacing every component one by one
needs 1 + 4L passes.

Prints a table and a final JSON line {"passes": {L: n}, "one_by_one": {L: n},
"seconds": {L: s}, "found": {L: bool}, "passes_per_log2_layer": ..., "logarithmic": bool}.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from fxreplace.blame import blame
from fxreplace.capture import capture_reference
from fxreplace.models import get_family, tiny_model

ARCH = "Qwen3MoeForCausalLM"


def run(layers: int, prompts: list[list[int]], new_tokens: int) -> dict:
    family = get_family(ARCH)
    reference_model = tiny_model(ARCH, num_hidden_layers=layers)
    reference = capture_reference(reference_model, prompts, [], new_tokens, components=family.components, progress=False)
    fault = int(0.6 * layers)
    target = tiny_model(ARCH, num_hidden_layers=layers)
    with torch.no_grad():
        target.model.layers[fault].self_attn.o_proj.weight.mul_(1.5)
    result = blame(target, reference, progress=False)
    top = result.ranking[0]
    found = result.confident and (top.kind, top.layer) == ("attention", fault)
    return {"layers": layers, "fault_layer": fault, "passes": len(result.passes), "one_by_one": 1 + 4 * layers,
            "seconds": result.seconds, "found": found, "top": f"{top.component} ({top.kind})"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    count, new_tokens = (2, 6) if args.quick else (4, 12)
    prompts = [torch.randint(4, 128, (int(n),), generator=g).tolist() for n in torch.randint(6, 16, (count,), generator=g)]
    rows = [run(n, prompts, new_tokens) for n in args.layers]
    print(f"{count} prompts x {new_tokens} tokens, planted fault: attention o_proj x1.5 at layer 0.6 L")
    print(f"{'L':>4} {'fault':>6} {'passes':>7} {'1-by-1':>7} {'seconds':>8}  found  top")
    for r in rows:
        print(f"{r['layers']:>4} {r['fault_layer']:>6} {r['passes']:>7} {r['one_by_one']:>7} {r['seconds']:>8.1f}  "
              f"{str(r['found']):<5}  {r['top']}")
    per_log = [r["passes"] / math.log2(r["layers"]) for r in rows]
    # off + bisection (ceil log2 L, at most one more for the last layer) + the other kinds of the origin layer
    bound_ok = all(r["passes"] <= 1 + math.ceil(math.log2(r["layers"])) + 1 + 3 for r in rows)
    print(json.dumps({
        "passes": {r["layers"]: r["passes"] for r in rows},
        "one_by_one": {r["layers"]: r["one_by_one"] for r in rows},
        "seconds": {r["layers"]: round(r["seconds"], 2) for r in rows},
        "found": {r["layers"]: r["found"] for r in rows},
        "passes_per_log2_layer": [round(v, 2) for v in per_log],
        "logarithmic": bound_ok,
    }))


if __name__ == "__main__":
    main()
