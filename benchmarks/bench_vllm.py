"""Decode step time of an MoE model in vLLM: without the fxreplace plugin, with the
plugin loaded but unconfigured, and with replacement active (every token of every
request replaced); eager and compiled.

    python benchmarks/bench_vllm.py [--quick] [--samples N] [--rounds 3k]

Each configuration is its own engine process (the plugin patches classes for the
life of a process; ``VLLM_PLUGINS`` keeps it from loading for the baseline). The
three engines of a round stay alive side by side and take turns: one sample from
each, in rotating order. On a shared machine the speed drifts by 10-40% over
minutes, which separate runs per configuration cannot tell from an overhead;
samples taken seconds apart see the same machine. Measured on this machine: of
engines started one after another, the first runs ~25% slower than the others
for its whole life, whatever its configuration. So a mode has rounds of fresh
engines (3 by default, a multiple of 3), each configuration started first in a
third of them.

One sample = decode step time = (time for NEW tokens - time for 1 token) /
(NEW - 1) over all prompts, each the fastest of three runs, on two clocks: the
engine thread's CPU time (the engine runs in-process on one thread,
``OMP_NUM_THREADS=1``, so this is its work, whatever else the host runs) and wall
time. Per round, a configuration's ratio is the median over turns of its sample /
the baseline's sample of the same turn; its overhead is the geometric mean over the
rounds (worst mode): every configuration is started at every position equally
often, so a position's slowdown multiplies into its ratios and its speed-up cancels
it. ``overhead_active``/``overhead_inactive`` are on CPU time, the ``_wall`` ones on
wall time.

The plugin's own time (request bookkeeping, fill, clear: the state's
``update_requests``, ``prepare`` and ``clear``, on the thread's CPU clock) is measured
in one more generate per sample (the clocks are off in the runs the step time comes
from; what stays there is one pass-through call per method) and booked to the forward
of its step: ``plugin_us_per_decode_forward`` is the median over the
steps where every request decodes one token (8 decode requests: the steps the step
time above measures), ``plugin_us_per_forward`` the mean over all forwards, prefills
and their registrations included. ``overhead_active_intrinsic`` is 1 + the first
over the baseline's CPU step time: a figure that neither other load nor process
placement moves. The instrumented model's own extra work (arming, the targets'
wrappers) is not in it; ``overhead_active`` holds everything.

Unconfigured, the plugin wraps no per-step method (only engine configuration
and model load), so ``overhead_inactive`` measures the noise floor. Active, each
step gathers the batch's reference rows straight into the model's static buffers
(one copy per packed group and one mask write, padding rows off), so nothing is
cleared after the forward (only before a dummy run); a target reads them through
one ``where`` (the feed's rows are strided columns of its position-major groups, which
are not handed on as the module's output). Compiled mode is vLLM's default (Dynamo +
Inductor).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from engine_child import EngineChild

ARCH = "Qwen3MoeForCausalLM"
MID = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
           num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
           vocab_size=1024, max_position_embeddings=1024)
QUICK = dict(MID, hidden_size=256, moe_intermediate_size=128, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_experts=8, num_experts_per_tok=2, vocab_size=512)
CONFIGS = ("no_plugin", "inactive", "active")
CLOCKS = {"cpu": "step_cpu_s", "wall": "step_s"}  # the engine thread's CPU time, and wall time


def plugins_but_fxreplace() -> str:
    """``VLLM_PLUGINS`` for the baseline: every installed general plugin except ours."""
    from importlib.metadata import entry_points

    return ",".join(e.name for e in entry_points(group="vllm.general_plugins") if e.name != "fxreplace")


def child(args) -> None:
    """One engine; answers each ``sample`` line on stdin with one decode-step sample."""
    import torch
    from vllm import LLM, SamplingParams

    data = torch.load(args.ref, weights_only=True)
    extra = {}
    plugin = {"on": False, "pending": 0.0, "decode": [], "other": []}  # seconds per forward: all-decode steps, the rest
    if args.config == "active":
        from fxreplace.engines.vllm import FxReplaceConfig
        from fxreplace.engines.vllm.replacement import VllmReplacement

        extra["additional_config"] = {"fxreplace": FxReplaceConfig(tensors=data["captures"],
                                                                   prompt_token_ids=data["prompts"])}
        # the runner binds these methods when the engine loads the model: wrapped before it starts
        for name in ("update_requests", "prepare", "clear"):
            setattr(VllmReplacement, name, timed(getattr(VllmReplacement, name), name == "prepare", plugin))
    llm = LLM(model=args.ckpt, dtype="float32", enforce_eager=args.mode == "eager", seed=0, max_model_len=512,
              distributed_executor_backend="uni", enable_prefix_caching=False, max_num_seqs=len(data["prompts"]),
              **extra)
    prompts = [{"prompt_token_ids": p} for p in data["prompts"]]

    def run(n):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0, c0 = time.perf_counter(), time.thread_time()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0, time.thread_time() - c0

    run(4)  # warm
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "sample":
            break
        plugin.update(pending=0.0, decode=[], other=[])
        one, many = [run(1) for _ in range(3)], [run(args.new) for _ in range(3)]
        if args.config == "active":  # the plugin's clocks run in an extra generate, not in the timed ones
            plugin["on"] = True
            run(args.new)
            plugin["on"] = False
        result = {"step_s": (min(w for w, _ in many) - min(w for w, _ in one)) / (args.new - 1),
                  "step_cpu_s": (min(c for _, c in many) - min(c for _, c in one)) / (args.new - 1)}
        if plugin["decode"]:
            result["plugin_s_per_decode_forward"] = statistics.median(plugin["decode"])
            result["plugin_s_per_forward"] = (sum(plugin["decode"]) + sum(plugin["other"])) / (
                len(plugin["decode"]) + len(plugin["other"]))
        print("RESULT " + json.dumps(result), flush=True)


def timed(method, books_forward: bool, plugin: dict):
    """``method`` of the plugin's state, on the thread's CPU clock while ``plugin["on"]``;
    ``books_forward``: the call that prepares a forward books the time gathered since the
    last one (its step's request bookkeeping and clears) to that forward."""

    def call(self, *args):
        if not plugin["on"]:
            return method(self, *args)
        t0 = time.thread_time()
        try:
            return method(self, *args)
        finally:
            plugin["pending"] += time.thread_time() - t0
            if books_forward:
                scheduler_output = args[0]
                decode = scheduler_output.total_num_scheduled_tokens == len(scheduler_output.num_scheduled_tokens)
                plugin["decode" if decode else "other"].append(plugin["pending"])
                plugin["pending"] = 0.0

    return call


def start_engine(config: str, mode: str, ckpt: str, ref: str, new: int, env: dict) -> EngineChild:
    env = dict(env)
    if config == "no_plugin":
        env["VLLM_PLUGINS"] = plugins_but_fxreplace()
    cmd = [sys.executable, __file__, "--child", "--config", config, "--mode", mode, "--ckpt", ckpt,
           "--ref", ref, "--new", str(new)]
    engine = EngineChild(f"{mode}/{config}", cmd, env)
    engine.expect("READY")
    return engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config"), ap.add_argument("--mode"), ap.add_argument("--ckpt"), ap.add_argument("--ref")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--samples", type=int, default=None, help="sample turns per round (default 12, quick 8)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of fresh engines per mode (a multiple of 3)")
    args = ap.parse_args()
    if args.rounds < 3 or args.rounds % 3:
        ap.error("--rounds must be a multiple of 3 (every configuration starts at every position)")
    if args.child:
        return child(args)

    import torch
    from fxreplace.instrument import instrument
    from fxreplace.models import get_family
    from fxreplace.engines.vllm.testing import capture_router_logits, save_tiny_checkpoint

    shape = QUICK if args.quick else MID
    modes = ["eager"] if args.quick else ["eager", "compiled"]
    samples = args.samples or (8 if args.quick else 12)
    new = 16 if args.quick else 32
    num_prompts, prompt_len = 8, 64
    tmp = tempfile.mkdtemp(prefix="fxreplace_bench_vllm_")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # the checkpoint and reference, also when a run fails
    ckpt = str(save_tiny_checkpoint(ARCH, os.path.join(tmp, "ckpt"), **shape))
    from transformers import AutoModelForCausalLM

    hf = instrument(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval(), get_family(ARCH).targets)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, shape["vocab_size"], (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]
    # The reference is the model's own router logits over its own greedy continuation, so the
    # active engine computes exactly what the baseline does (same tokens, same experts) and
    # the difference is the replacement's cost alone (forced routing would also change how
    # the MoE kernel's work spreads over experts, which is not an overhead).
    with torch.no_grad():
        greedy = [hf.generate(torch.tensor([p]), max_new_tokens=new + 8, do_sample=False)[0].tolist() for p in prompts]
    captures = {i: capture_router_logits(hf, hf.targets, seq) for i, seq in enumerate(greedy)}
    ref = os.path.join(tmp, "ref.pt")
    torch.save({"captures": captures, "prompts": prompts}, ref)
    del hf

    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    summary = {"model": shape, "num_prompts": num_prompts, "new_tokens": new, "samples_per_round": samples,
               "step_ms": {}, "step_cpu_ms": {}, "paired_ratio": {}, "paired_ratio_wall": {},
               "plugin_us_per_decode_forward": {}, "plugin_us_per_forward": {}}
    ratios = {"overhead_active": [], "overhead_inactive": [], "overhead_active_wall": [], "overhead_inactive_wall": [],
              "overhead_active_intrinsic": []}  # per mode; the summary reports the worst
    order = list(CONFIGS)
    for mode in modes:
        steps = {clock: {config: [] for config in order} for clock in CLOCKS}
        rounds = {clock: {config: [] for config in order} for clock in CLOCKS}  # per round: median paired ratio
        decode_cost, forward_cost = [], []
        for r in range(args.rounds):
            created = order[r % 3:] + order[:r % 3]  # engines started earlier run slower: each goes first in turn
            engines = {config: start_engine(config, mode, ckpt, ref, new, env) for config in created}  # one at a time
            turns = {clock: {config: [] for config in order} for clock in CLOCKS}
            for i in range(samples):
                for config in created[i % 3:] + created[:i % 3]:  # rotate: no position bias
                    got = engines[config].sample()
                    for clock, key in CLOCKS.items():
                        turns[clock][config].append(got[key])
                    if "plugin_s_per_decode_forward" in got:
                        decode_cost.append(got["plugin_s_per_decode_forward"])
                        forward_cost.append(got["plugin_s_per_forward"])
            for engine in engines.values():
                engine.close(60)
            for clock in CLOCKS:
                for config in order:
                    steps[clock][config] += turns[clock][config]
                    rounds[clock][config].append(statistics.median(
                        x / b for x, b in zip(turns[clock][config], turns[clock]["no_plugin"])))
            print(f"{mode:8s} round {r} (started {', '.join(created)}): " + "  ".join(
                f"{c} {statistics.median(turns['cpu'][c]) * 1e3:6.2f} ms x{rounds['cpu'][c][-1]:.3f}"
                f" (wall x{rounds['wall'][c][-1]:.3f})" for c in order), flush=True)
        paired = {clock: {c: statistics.geometric_mean(v) for c, v in rounds[clock].items()} for clock in CLOCKS}
        summary["step_ms"][mode] = {c: round(statistics.median(v) * 1e3, 3) for c, v in steps["wall"].items()}
        summary["step_cpu_ms"][mode] = {c: round(statistics.median(v) * 1e3, 3) for c, v in steps["cpu"].items()}
        summary["paired_ratio"][mode] = {c: round(v, 4) for c, v in paired["cpu"].items()}
        summary["paired_ratio_wall"][mode] = {c: round(v, 4) for c, v in paired["wall"].items()}
        summary.setdefault("round_ratios", {})[mode] = {c: [round(x, 4) for x in v] for c, v in rounds["cpu"].items()}
        for config in ("active", "inactive"):
            ratios[f"overhead_{config}"].append(paired["cpu"][config])
            ratios[f"overhead_{config}_wall"].append(paired["wall"][config])
        # the plugin's own time: immune to other load and to process placement
        summary["plugin_us_per_decode_forward"][mode] = round(statistics.median(decode_cost) * 1e6, 1)
        summary["plugin_us_per_forward"][mode] = round(statistics.median(forward_cost) * 1e6, 1)
        ratios["overhead_active_intrinsic"].append(1 + statistics.median(decode_cost) / statistics.median(steps["cpu"]["no_plugin"]))
    print(f"{'mode':10s}{'config':12s}{'cpu ms':>10s}{'vs base':>9s}{'wall ms':>10s}{'vs base':>9s}")
    for mode in modes:
        for config in order:
            print(f"{mode:10s}{config:12s}{summary['step_cpu_ms'][mode][config]:10.3f}"
                  f"{summary['paired_ratio'][mode][config]:9.3f}{summary['step_ms'][mode][config]:10.3f}"
                  f"{summary['paired_ratio_wall'][mode][config]:9.3f}")
    summary.update({name: round(max(values), 4) for name, values in ratios.items()})
    print(json.dumps(summary))

if __name__ == "__main__":
    main()
