"""Decode step time of an MoE model in vLLM: without the fxreplace plugin, with the
plugin loaded but unconfigured, and with replacement active (every token of every
request replaced); eager and compiled; rounds interleaved.

    python benchmarks/bench_vllm.py [--quick]

Each measurement runs in its own process (the plugin patches classes for the
life of a process; ``VLLM_PLUGINS`` keeps it from loading for the baseline).
Decode step time = (time for NEW tokens - time for 1 token) / (NEW - 1), median
of repeats. Final line: JSON with ``overhead_inactive`` and ``overhead_active``
(ratios to the baseline, worst over modes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ARCH = "Qwen3MoeForCausalLM"
MID = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
           vocab_size=1024, max_position_embeddings=1024)
QUICK = dict(MID, hidden_size=256, moe_intermediate_size=128, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_experts=8, num_experts_per_tok=2, vocab_size=512)


def child(args) -> None:
    import torch
    from vllm import LLM, SamplingParams

    data = torch.load(args.ref)
    extra = {}
    if args.config == "active":
        extra["additional_config"] = {"fxreplace": {"tensors": data["captures"], "prompt_token_ids": data["token_ids"]}}
    llm = LLM(model=args.ckpt, dtype="float32", enforce_eager=args.mode == "eager", seed=0, max_model_len=512,
              distributed_executor_backend="uni", enable_prefix_caching=False, max_num_seqs=len(data["prompts"]),
              **extra)
    prompts = [{"prompt_token_ids": p} for p in data["prompts"]]

    def run(n):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    run(4)  # warm
    steps = []
    for _ in range(args.repeats):
        t1, tn = run(1), run(args.new)
        steps.append((tn - t1) / (args.new - 1))
    print("RESULT " + json.dumps({"step_s": statistics.median(steps)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config"), ap.add_argument("--mode"), ap.add_argument("--ckpt"), ap.add_argument("--ref")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.child:
        return child(args)

    import torch
    from fxreplace.instrument import instrument
    from fxreplace.models import get_family
    from fxreplace.vllm.testing import capture_router_logits, force_routing, save_tiny_checkpoint

    shape = QUICK if args.quick else MID
    modes = ["eager"] if args.quick else ["eager", "compiled"]
    rounds = 3
    new = 16 if args.quick else 32
    repeats = 3 if args.quick else 5
    num_prompts, prompt_len = 8, 64
    tmp = tempfile.mkdtemp(prefix="fxreplace_bench_vllm_")
    ckpt = str(save_tiny_checkpoint(ARCH, os.path.join(tmp, "ckpt"), **shape))
    from transformers import AutoModelForCausalLM

    hf = instrument(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval(), get_family(ARCH).targets)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, shape["vocab_size"], (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]
    captures = {i: force_routing(capture_router_logits(hf, hf.targets, p + [5] * (new + 8))) for i, p in enumerate(prompts)}
    ref = os.path.join(tmp, "ref.pt")
    torch.save({"captures": captures, "token_ids": prompts, "prompts": prompts}, ref)
    del hf

    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    configs = {"no_plugin": "lora_filesystem_resolver", "inactive": None, "active": None}
    results: dict = {m: {c: [] for c in configs} for m in modes}
    for r in range(rounds):
        for mode in modes:
            for config, plugins in configs.items():  # interleaved
                e = dict(env)
                if plugins is not None:
                    e["VLLM_PLUGINS"] = plugins  # every general plugin but fxreplace
                cmd = [sys.executable, __file__, "--child", "--config", config, "--mode", mode, "--ckpt", ckpt,
                       "--ref", ref, "--new", str(new), "--repeats", str(repeats)]
                proc = subprocess.run(cmd, env=e, capture_output=True, text=True)
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode or not line:
                    sys.exit(f"{mode}/{config} failed:\n{proc.stderr[-3000:]}")
                step = json.loads(line[-1][7:])["step_s"]
                results[mode][config].append(step)
                print(f"round {r} {mode:8s} {config:10s} decode step {step * 1e3:8.2f} ms", flush=True)
    summary = {"model": shape, "num_prompts": num_prompts, "new_tokens": new, "step_ms": {}}
    inactive, active = [], []
    for mode in modes:
        med = {c: statistics.median(v) for c, v in results[mode].items()}
        summary["step_ms"][mode] = {c: round(v * 1e3, 3) for c, v in med.items()}
        inactive.append(med["inactive"] / med["no_plugin"])
        active.append(med["active"] / med["no_plugin"])
    summary["overhead_inactive"] = round(max(inactive), 4)
    summary["overhead_active"] = round(max(active), 4)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
