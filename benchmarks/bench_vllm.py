"""Decode step time of an MoE model in vLLM: without the fxreplace plugin, with the
plugin loaded but unconfigured, and with replacement active (every token of every
request replaced); eager and compiled; rounds interleaved.

    python benchmarks/bench_vllm.py [--quick]

Each measurement runs in its own process (the plugin patches classes for the
life of a process; ``VLLM_PLUGINS`` keeps it from loading for the baseline).
Decode step time = (time for NEW tokens - time for 1 token) / (NEW - 1); per
process the minimum over repeats (other load on a shared machine only adds
time), per configuration the median over rounds; the order of the three
configurations rotates every round. Compiled mode is vLLM's default (Dynamo +
Inductor; compiled graphs are cached by vLLM after the first round). Final
line: JSON with ``overhead_inactive`` and ``overhead_active`` (ratios to the
baseline, worst over modes), the per-mode step times, and
``overhead_active_intrinsic``: 1 + the plugin's own measured time per forward
(request bookkeeping, gather, clear) over the baseline step, a figure that other
load on the machine barely moves.

Unconfigured, the plugin wraps no per-step method (only engine configuration
and model load), so ``overhead_inactive`` measures noise. Active, each step
gathers the batch's reference rows straight into the model's static buffers
(one ``index_select`` per packed group and one mask copy) and clears the mask
after the forward.
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

    data = torch.load(args.ref, weights_only=True)
    extra = {}
    if args.config == "active":
        extra["additional_config"] = {"fxreplace": {"tensors": data["captures"], "prompt_token_ids": data["token_ids"]}}
    llm = LLM(model=args.ckpt, dtype="float32", enforce_eager=args.mode == "eager", seed=0, max_model_len=512,
              distributed_executor_backend="uni", enable_prefix_caching=False, max_num_seqs=len(data["prompts"]),
              **extra)
    prompts = [{"prompt_token_ids": p} for p in data["prompts"]]
    plugin = {"s": 0.0, "forwards": 0}
    if args.config == "active":  # time the plugin's own per-step work (in-process engine)
        from fxreplace.vllm import get_state

        state = get_state(llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner)
        for name in ("update_requests", "prepare", "clear"):
            def timed(*a, _orig=getattr(state, name), _name=name, **k):
                t0 = time.perf_counter()
                try:
                    return _orig(*a, **k)
                finally:
                    plugin["s"] += time.perf_counter() - t0
                    plugin["forwards"] += _name == "prepare"
            setattr(state, name, timed)

    def run(n):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    run(4)  # warm
    plugin.update(s=0.0, forwards=0)
    steps = []
    for _ in range(args.repeats):
        t1, tn = run(1), run(args.new)
        steps.append((tn - t1) / (args.new - 1))
    result = {"step_s": min(steps), "median_s": statistics.median(steps)}
    if plugin["forwards"]:
        result["plugin_s_per_forward"] = plugin["s"] / plugin["forwards"]
    print("RESULT " + json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config"), ap.add_argument("--mode"), ap.add_argument("--ckpt"), ap.add_argument("--ref")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each starts every configuration)")
    args = ap.parse_args()
    if args.child:
        return child(args)

    import torch
    from fxreplace.instrument import instrument
    from fxreplace.models import get_family
    from fxreplace.vllm.testing import capture_router_logits, force_routing, save_tiny_checkpoint

    shape = QUICK if args.quick else MID
    modes = ["eager"] if args.quick else ["eager", "compiled"]
    rounds = args.rounds
    new = 16 if args.quick else 32
    repeats = 3
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
    order = list(configs)
    plugin_cost: dict = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes:
            for config in order[r % 3:] + order[:r % 3]:  # interleaved, rotating order
                plugins = configs[config]
                e = dict(env)
                if plugins is not None:
                    e["VLLM_PLUGINS"] = plugins  # every general plugin but fxreplace
                cmd = [sys.executable, __file__, "--child", "--config", config, "--mode", mode, "--ckpt", ckpt,
                       "--ref", ref, "--new", str(new), "--repeats", str(repeats)]
                proc = subprocess.run(cmd, env=e, capture_output=True, text=True)
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode or not line:
                    sys.exit(f"{mode}/{config} failed:\n{proc.stderr[-3000:]}")
                got = json.loads(line[-1][7:])
                step = got["step_s"]
                results[mode][config].append(step)
                if "plugin_s_per_forward" in got:
                    plugin_cost[mode].append(got["plugin_s_per_forward"])
                print(f"round {r} {mode:8s} {config:10s} decode step {step * 1e3:8.2f} ms", flush=True)
    summary = {"model": shape, "num_prompts": num_prompts, "new_tokens": new, "step_ms": {}}
    inactive, active, intrinsic = [], [], []
    for mode in modes:
        med = {c: statistics.median(v) for c, v in results[mode].items()}
        summary["step_ms"][mode] = {c: round(v * 1e3, 3) for c, v in med.items()}
        inactive.append(med["inactive"] / med["no_plugin"])
        active.append(med["active"] / med["no_plugin"])
        if plugin_cost[mode]:  # the plugin's own time per forward: immune to other load's noise
            cost = statistics.median(plugin_cost[mode])
            summary.setdefault("plugin_ms_per_forward", {})[mode] = round(cost * 1e3, 4)
            intrinsic.append(1 + cost / med["no_plugin"])
    summary["overhead_inactive"] = round(max(inactive), 4)
    summary["overhead_active"] = round(max(active), 4)
    if intrinsic:
        summary["overhead_active_intrinsic"] = round(max(intrinsic), 4)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
