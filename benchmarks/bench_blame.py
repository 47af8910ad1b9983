"""Blame search cost against depth: passes and wall time for L = 4, 8, 16 layers, one planted fault.

Each depth: a tiny Qwen3-MoE in float32 is the reference (components captured); the
target is the same weights with one attention output projection scaled in layer
``0.6 L`` (the bisection then visits both halves). The search must find it and its
passes must grow with log2(L), not with L: replacing every component one by one
needs 1 + 4L passes.

``--engine vllm``: the target is a checkpoint searched through one eager float32 vLLM
engine (:class:`~fxreplace.vllm.engine.VllmBlameEngine`: every pass's requests select
their captures); ``seconds`` is the search, ``start_seconds`` the engine's start.

Prints a table and a final JSON line {"passes": {L: n}, "one_by_one": {L: n},
"seconds": {L: s}, "found": {L: bool}, "passes_per_log2_layer": ..., "logarithmic": bool}
(vLLM: also "start_seconds").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from fxreplace.blame import blame
from fxreplace.capture import capture_reference
from fxreplace.models import get_family, tiny_model

ARCH = "Qwen3MoeForCausalLM"


def run(layers: int, prompts: list[list[int]], new_tokens: int, engine: str) -> dict:
    family = get_family(ARCH)
    reference_model = tiny_model(ARCH, num_hidden_layers=layers)
    reference = capture_reference(reference_model, prompts, [], new_tokens, components=family.components, progress=False)
    fault = int(0.6 * layers)
    extra = {}
    if engine == "vllm":
        result, extra["start_seconds"] = blame_in_vllm(reference, layers, fault, prompts, new_tokens)
    else:
        target = tiny_model(ARCH, num_hidden_layers=layers)
        with torch.no_grad():
            target.model.layers[fault].self_attn.o_proj.weight.mul_(1.5)
        result = blame(target, reference, progress=False)
    top = result.ranking[0]
    found = result.confident and (top.kind, top.layer) == ("attention", fault)
    return {"layers": layers, "fault_layer": fault, "passes": len(result.passes), "one_by_one": 1 + 4 * layers,
            "seconds": result.seconds, "found": found, "top": f"{top.component} ({top.kind})", **extra}


def blame_in_vllm(reference, layers: int, fault: int, prompts, new_tokens: int):
    """The search through one vLLM engine on the faulty checkpoint; (result, engine start seconds)."""
    from safetensors.torch import load_file, save_file

    from fxreplace.vllm.engine import VllmBlameEngine
    from fxreplace.vllm.testing import save_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_tiny_checkpoint(ARCH, Path(tmp) / "ckpt", num_hidden_layers=layers)
        weights = load_file(str(ckpt / "model.safetensors"))
        weights[f"model.layers.{fault}.self_attn.o_proj.weight"] *= 1.5
        save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
        reference.save(Path(tmp) / "reference")
        t0 = time.perf_counter()
        engine = VllmBlameEngine(str(ckpt), str(Path(tmp) / "reference"), enforce_eager=True, seed=0,
                                 max_model_len=max(len(p) for p in prompts) + new_tokens + 8, max_num_seqs=len(prompts),
                                 distributed_executor_backend="uni")
        start = time.perf_counter() - t0
        try:
            return blame(engine, reference, progress=False), start
        finally:
            engine.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts and tokens")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--engine", choices=["runner", "vllm"], default="runner")
    args = ap.parse_args()
    if args.engine == "vllm":  # in-process engine, small KV cache, vLLM's CPU thread cap (see DESIGN)
        for key, value in (("OMP_NUM_THREADS", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                           ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")):
            os.environ.setdefault(key, value)
    g = torch.Generator().manual_seed(0)
    count, new_tokens = (2, 6) if args.quick else (4, 12)
    prompts = [torch.randint(4, 128, (int(n),), generator=g).tolist() for n in torch.randint(6, 16, (count,), generator=g)]
    rows = [run(n, prompts, new_tokens, args.engine) for n in args.layers]
    print(f"{count} prompts x {new_tokens} tokens, planted fault: attention o_proj x1.5 at layer 0.6 L, "
          f"engine {args.engine}")
    print(f"{'L':>4} {'fault':>6} {'passes':>7} {'1-by-1':>7} {'seconds':>8} {'start s':>8}  found  top")
    for r in rows:
        print(f"{r['layers']:>4} {r['fault_layer']:>6} {r['passes']:>7} {r['one_by_one']:>7} {r['seconds']:>8.1f} "
              f"{r.get('start_seconds', 0.0):>8.1f}  {str(r['found']):<5}  {r['top']}")
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
        **({"start_seconds": {r["layers"]: round(r["start_seconds"], 2) for r in rows}} if args.engine == "vllm" else {}),
    }))


if __name__ == "__main__":
    main()
