"""fxreplace on a GPU, every figure issue 47 asks for, side by side in one run.

1. Per step, 64 decode tokens of a ~0.5B-parameter Qwen3-MoE (8 layers, 32 experts, bf16):
   plain vs instrumented with an all-off context, a replaced one, and a context built each step,
   under CUDA graphs (``torch.compile(mode="reduce-overhead")``) and eagerly; the host time of a
   call (until it returns, before the device finishes) beside the plain model's. Variants share
   the same weight tensors and are timed interleaved (medians of rounds; a plain twin gives the
   noise floor of the comparison).
2. The builder with the store on the device: a 64-row decode build, and a 1024-token prefill
   of 48 capture names x 128 against a device copy of the same bytes.
3. One graph for alternating hand-made, warm-up and built contexts (inductor with CUDA graphs).
4. The demo's validation and one blame of a planted fault on the device, with wall times.
5. A 7B-shape MoE with random weights (fp32 reference, bf16 target, both on the card) captured,
   validated and blamed end to end, with the peak device memory.

Prints a table and a final JSON line of ratios.

    python benchmarks/bench_gpu.py [--device cuda] [--quick]   (--quick: small shapes, a smoke run)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import fxreplace
from fxreplace.floor import measure_floor
from fxreplace.models import get_family, tiny_model

TARGETS = ["model.layers.*.mlp.gate"]


def qwen3_moe(device, dtype, *, hidden, layers, experts, moe_intermediate, vocab=32000, heads=16, seed=0):
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                            moe_intermediate_size=moe_intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=max(1, heads // 4), head_dim=hidden // heads, num_experts=experts,
                            num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096, initializer_range=0.05)
    torch.manual_seed(seed)
    with torch.device(device):  # weights initialised where they run: a 7B model built on the host takes minutes
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def sharing_weights(model):
    """A new module tree over the same parameter and buffer tensors (same allocation, fair baseline)."""
    twin = copy.copy(model)
    twin._modules = {name: sharing_weights(child) for name, child in model._modules.items()}
    twin._parameters, twin._buffers = dict(model._parameters), dict(model._buffers)
    twin.__dict__ = dict(twin.__dict__)
    return twin


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, call, rounds, repeats):
    """Per-call (device, host) seconds: medians over rounds of ``repeats`` calls."""
    device_times, host_times = [], []
    for _ in range(rounds):
        sync(device)
        start = time.perf_counter()
        hosts = []
        for _ in range(repeats):
            before = time.perf_counter()
            call()
            hosts.append(time.perf_counter() - before)
        sync(device)
        device_times.append((time.perf_counter() - start) / repeats)
        host_times.append(statistics.median(hosts))
    return device_times, host_times


def interleaved(device, variants, rounds, repeats):
    """Each variant's per-round times, the variants alternating round by round."""
    times = {name: ([], []) for name in variants}
    for _ in range(rounds):
        for name, call in variants.items():
            d, h = timed(device, call, 1, repeats)
            times[name][0].extend(d)
            times[name][1].extend(h)
    return times


def step_costs(device, args, rows):
    """Item 1: plain vs instrumented, CUDA graphs and eager."""
    shape = dict(hidden=256, layers=2, experts=8, moe_intermediate=128, vocab=1024, heads=4) if args.quick else dict(
        hidden=1024, layers=8, experts=32, moe_intermediate=512, vocab=32000, heads=16)
    plain = qwen3_moe(device, torch.bfloat16, **shape)
    params = sum(p.numel() for p in plain.parameters())
    twin = sharing_weights(plain)
    target = fxreplace.instrument(sharing_weights(plain), TARGETS)
    names = [t.capture_name for t in target._fxreplace.targets]
    tokens = 64
    ids = torch.randint(0, shape["vocab"], (tokens, 1), device=device)
    positions = torch.randint(0, 512, (tokens, 1), device=device)
    own = {}
    with torch.no_grad(), fxreplace.observe(target, lambda name, value: own.__setitem__(name, value.detach().clone())):
        target(input_ids=ids, position_ids=positions, use_cache=False)
    flat = {0: {name: torch.cat([own[name]] * 8).float().cpu() for name in names}}  # prompt 0: 512 rows
    replacer = fxreplace.TensorReplacer(flat, device=device, on_unknown="passthrough")
    replacer.register_request("r", None, prompt_idx=0)
    off = replacer.warmup_context(tokens, device=device)
    out = replacer.warmup_context(tokens, device=device)
    replaced = replacer.build_context_for_batch(["r"], [tokens], positions.flatten().tolist(), out=out)
    step_positions = [positions.flatten().tolist(), ((positions.flatten() + 1) % 512).tolist()]

    def call(model, ctx=None):
        with torch.no_grad():
            if ctx is None:
                return model(input_ids=ids, position_ids=positions, use_cache=False).logits
            return model(input_ids=ids, position_ids=positions, use_cache=False, replacements=ctx).logits

    counter = [0]

    def build_and_run(model):
        counter[0] += 1
        replacer.build_context_for_batch(["r"], [tokens], step_positions[counter[0] % 2], out=out)
        return call(model, out)

    results = {}
    for mode, compile_mode in (("cuda graphs", "reduce-overhead"), ("eager", None)):
        if compile_mode:
            torch._dynamo.reset()
            models = {name: torch.compile(m, mode=compile_mode) for name, m in
                      (("plain", plain), ("plain_twin", twin), ("instrumented", target))}
        else:
            models = {"plain": plain, "plain_twin": twin, "instrumented": target}
        variants = {
            "plain": lambda: call(models["plain"]),
            "plain_twin": lambda: call(models["plain_twin"]),
            "off": lambda: call(models["instrumented"], off),
            "on": lambda: call(models["instrumented"], replaced),
            "build+run": lambda: build_and_run(models["instrumented"]),
        }
        if not compile_mode:
            variants["no context"] = lambda: call(models["instrumented"])
        for fn in variants.values():  # warm-up (compiles, records graphs)
            for _ in range(3):
                fn()
        times = interleaved(device, variants, args.rounds, args.repeats)
        base, base_host = statistics.median(times["plain"][0]), statistics.median(times["plain"][1])
        for name, (device_times, host_times) in times.items():
            ratios = [t / base for t in device_times]
            results[(mode, name)] = statistics.median(device_times) / base
            rows.append((f"step, {mode}", name, f"{statistics.median(device_times) * 1e3:.3f} ms",
                         f"{results[(mode, name)]:.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f})",
                         f"host {statistics.median(host_times) * 1e6:.0f} us "
                         f"({(statistics.median(host_times) - base_host) * 1e6:+.0f} vs plain)"))
            results[(mode, name, "host_us")] = (statistics.median(host_times) - base_host) * 1e6
        del models
    return params, results


def builder_costs(device, args, rows):
    """Item 2: the builder with the store on the device."""
    names, width, rows_per_prompt, prompts = (8, 16, 256, 8) if args.quick else (48, 128, 2048, 16)
    flat = {p: {f"layer.{i}": torch.randn(rows_per_prompt, width, dtype=torch.bfloat16) for i in range(names)}
            for p in range(prompts)}
    replacer = fxreplace.TensorReplacer(flat, device=device, on_unknown="passthrough")
    for p in range(prompts):
        replacer.register_request(f"r{p}", None, prompt_idx=p)
    decode_ids = [f"r{i % prompts}" for i in range(64)]
    decode_out = replacer.warmup_context(64, device=device)
    positions = [[(i * 7 + s) % rows_per_prompt for i in range(64)] for s in range(2)]
    step = [0]

    def decode():
        step[0] += 1
        replacer.build_context_for_batch(decode_ids, [1] * 64, positions[step[0] % 2], out=decode_out)

    prefill_tokens = min(1024, rows_per_prompt)
    prefill_out = replacer.warmup_context(prefill_tokens, device=device)

    def prefill():
        replacer.build_context(["r0"], list(range(prefill_tokens)), is_prefill=True, out=prefill_out)

    source = torch.empty(prefill_out.storage[0].numel(), dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    times = interleaved(device, {"decode": decode, "prefill": prefill, "copy": lambda: target.copy_(source)},
                        args.rounds, args.repeats)
    decode_us = statistics.median(times["decode"][0]) * 1e6
    prefill_of_copy = statistics.median(times["copy"][0]) / statistics.median(times["prefill"][0])
    megabytes = source.numel() * 2 / 1e6
    rows.append(("builder on the device", "decode build, 64 rows", f"{decode_us:.1f} us", "", ""))
    rows.append(("builder on the device", f"prefill {prefill_tokens} x {names} x {width} ({megabytes:.1f} MB)",
                 f"{statistics.median(times['prefill'][0]) * 1e6:.1f} us",
                 f"{prefill_of_copy:.2f} of a device copy ({statistics.median(times['copy'][0]) * 1e6:.1f} us)", ""))
    return decode_us, prefill_of_copy


def one_graph(device, rows):
    """Item 3: alternating hand-made, warm-up and built contexts compile one graph."""
    model = fxreplace.instrument(tiny_model("Qwen3MoeForCausalLM").to(device), TARGETS)
    names = [t.capture_name for t in model._fxreplace.targets]
    flat = {0: {n: torch.randn(16, model.config.num_experts) for n in names}}
    replacer = fxreplace.TensorReplacer(flat, device=device, on_unknown="passthrough")
    replacer.register_request("a", None, prompt_idx=0)
    built = replacer.build_context(["a"], list(range(8)), is_prefill=True)
    contexts = [replacer.warmup_context(8, device=device), built,
                fxreplace.ReplacementContext({n: built[n].clone() for n in reversed(names)}, built.mask.clone()),
                replacer.build_context(["a"], list(range(2, 10)), is_prefill=True, out=replacer.warmup_context(8, device=device))]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter)
    ids = torch.randint(0, 128, (1, 8), device=device)
    with torch.no_grad():
        for ctx in contexts * 2:
            compiled(input_ids=ids, use_cache=False, replacements=ctx)
    rows.append(("one graph", "hand-made, warm-up, built, out= (x2)", f"{counter.frame_count} graph(s)", "", ""))
    return counter.frame_count


def validate_and_blame(device, rows, label, model, prompts, new_tokens, bucket):
    """Capture, validate (with the floor) and blame a planted router fault, each timed."""
    family_targets = list(get_family("Qwen3MoeForCausalLM").targets)
    started = time.perf_counter()
    reference = fxreplace.capture_reference(model, prompts, family_targets, max_new_tokens=new_tokens, progress=False)
    capture_s = time.perf_counter() - started
    target = fxreplace.instrument(copy.deepcopy(model).bfloat16(), family_targets)
    runner = fxreplace.Runner(target, model.config, fxreplace.TensorReplacer(reference.store),
                              fxreplace.RunnerConfig(prefill_buckets=(bucket,), batch_buckets=(len(prompts),),
                                                     max_len=2 * bucket, teacher_forcing=True),
                              dtype=torch.bfloat16, observed=target)
    started = time.perf_counter()
    result = fxreplace.logit_validation(runner, reference, progress=False)
    result.floor = measure_floor(model, reference, torch.bfloat16)
    validate_s = time.perf_counter() - started
    del runner, target
    with tempfile.TemporaryDirectory() as folder:
        reference.save(folder)
        planted = copy.deepcopy(model)
        layer = model.config.num_hidden_layers // 2
        with torch.no_grad():
            planted.model.layers[layer].mlp.gate.weight.mul_(-1.0)
        started = time.perf_counter()
        found = fxreplace.blame(planted, folder, clean=model, dtype=torch.bfloat16, prompts=[0, 1], progress=False)
        blame_s = time.perf_counter() - started
    origin = found.origins[0].component if found.origins else "none"
    rows.append((label, "capture / validate+floor / blame", f"{capture_s:.1f} / {validate_s:.1f} / {blame_s:.1f} s",
                 result.verdict.sentence[:70], f"blamed: {origin} (planted: layers.{layer} router)"))
    return {"capture_s": capture_s, "validate_s": validate_s, "blame_s": blame_s, "origin": origin,
            "found": f"layers.{layer}." in origin}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke run (on the CPU too)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.quick:
        args.rounds, args.repeats = min(args.rounds, 3), min(args.repeats, 3)
    started = time.perf_counter()
    rows: list[tuple] = []
    params, steps = step_costs(device, args, rows)
    decode_us, prefill_of_copy = builder_costs(device, args, rows)
    graphs = one_graph(device, rows)
    demo_model = tiny_model("Qwen3MoeForCausalLM", init_std=0.3, seed=1).to(device)
    generator = torch.Generator().manual_seed(1)
    demo_prompts = [torch.randint(0, 128, (12,), generator=generator).tolist() for _ in range(8)]
    demo = validate_and_blame(device, rows, "demo model", demo_model, demo_prompts, 32, 64)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    big_shape = dict(hidden=256, layers=4, experts=8, moe_intermediate=128, vocab=1024, heads=4) if args.quick else dict(
        hidden=2048, layers=24, experts=64, moe_intermediate=768, vocab=32000, heads=16)
    big = qwen3_moe(device, torch.float32, **big_shape)
    big_params = sum(p.numel() for p in big.parameters())
    big_prompts = [torch.randint(0, big_shape["vocab"], (32,), generator=generator).tolist() for _ in range(4)]
    seven_b = validate_and_blame(device, rows, f"7B shape ({big_params / 1e9:.2f}B)", big, big_prompts, 16, 64)
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if peak_gib is not None:
        rows.append(("7B shape", "peak device memory", f"{peak_gib:.1f} GiB", "", ""))
    width = [max(len(str(r[i])) for r in rows) for i in range(5)]
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else device}; torch {torch.__version__}; "
          f"step model {params / 1e6:.0f}M parameters")
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, width)))
    summary = {
        "device": str(device), "step_params": params,
        "cudagraphs_off": steps[("cuda graphs", "off")], "cudagraphs_on": steps[("cuda graphs", "on")],
        "cudagraphs_build_run": steps[("cuda graphs", "build+run")],
        "cudagraphs_plain_twin": steps[("cuda graphs", "plain_twin")],
        "cudagraphs_host_us_over_plain": steps[("cuda graphs", "on", "host_us")],
        "eager_on": steps[("eager", "on")], "eager_no_context": steps[("eager", "no context")],
        "eager_plain_twin": steps[("eager", "plain_twin")],
        "decode_build_us": decode_us, "prefill_of_device_copy": prefill_of_copy, "graphs": graphs,
        "demo": demo, "seven_b": {**seven_b, "params": big_params, "peak_gib": peak_gib},
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
