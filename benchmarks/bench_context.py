"""Context builder: vectorised TensorReplacer vs a per-slot Python loop, side by side.

Prints a table and a final JSON line::

    {"speedup_vs_loop": min over cases, "copy_bandwidth_fraction": per case, the out= build vs a
     memcpy of the same bytes, "copy_bandwidth_fraction_fresh": the same for a fresh build,
     "fresh_vs_out": a fresh build over the out= build at the 8192-token prefill,
     "decode_gather_floor_fraction": per decode case, the builder's gather primitive alone on
     the same store rows (no lookup, no mask) over the out= build: how much of the gap to
     memcpy is the builder's and how much the memory system's (scattered store rows, each a contiguous
     [capture names, E] run: 12 KiB here),
     "decode8_us": build_context_for_batch(out=) for 8 decode requests, "decode8_floor_us": the
     bare index_select + mask copy it cannot go below, "register_ms": median register_request
     with 10,000 stored prompts, "sharded_vs_one_shard": per decode batch, a step's build from a
     store of 8 shard files over the same build from the same prompts in one shard (both
     loaded from disk, positions advancing step by step), "small_pages_vs_huge": per decode
     batch, the build from a copy of the store in ordinary 4 KiB pages over the build from the
     store itself (an in-memory store asks for transparent huge pages), ...}

Goals: speedup >= 100x at the 8192-token prefill and >= 150x at the 256x4 decode case
(issues 2, 25); register_request <= 1 ms; at 48 modules x E=128 bf16, the 8192-token
prefill and the 256x4 (speculative) and 1024x1 decode batches at >= 0.8 of memcpy bandwidth,
fresh and out= (issue 25); a fresh build <= 1.3x the out= time; <= 20 us per 8-request
decode step (issue 10).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time

import numpy as np
import torch

from fxreplace import ReferenceStore, StoreWriter, TensorReplacer
from fxreplace.engines.protocol import StepLayout
from fxreplace.gather import index_select_rows
from fxreplace.store.format import Shard
from fxreplace.testing import build_context_loop, slot_owners

MODULES, WIDTH, DTYPE = 48, 128, torch.bfloat16


def timed(fn, reps):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(fns: dict, reps: int) -> dict:
    """Median seconds per function, alternating calls so machine noise hits all alike. Each
    round starts one function later, so no function always runs right after the same one: a
    call's time depends on what the call before it left in the cache (a gather right after
    another of the same rows into the same buffer reads them from the cache; a build after a
    copy finds its output buffer evicted), by as much as 1.3x."""
    times = {k: [] for k in fns}
    calls = list(fns.items())
    for rep in range(reps):
        shift = rep % len(calls)
        for k, fn in calls[shift:] + calls[:shift]:
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller loop baseline runs")
    args = ap.parse_args()
    torch.manual_seed(0)
    reps = 12 if args.quick else 24  # multiples of the 4 and 6 functions timed per case: each starts a round as often
    loop_reps = 1 if args.quick else 3

    prompts, positions_per_prompt = 4, 8192 + 256
    flat = {
        p: {f"model.layers.{m}.mlp.gate": torch.randn(positions_per_prompt, WIDTH).to(DTYPE) for m in range(MODULES)}
        for p in range(prompts)
    }
    replacer = TensorReplacer(flat)

    cases = [("prefill", n, 1, 1) for n in (1024, 4096, 8192)] + [("decode", 0, b, k) for b in (64, 256) for k in (1, 4)] + [
        ("decode", 0, 1024, 1)]
    rows, speedups, fractions, fresh_fractions, fresh_ratio, floor_fractions = [], {}, {}, {}, {}, {}
    for kind, n, batch, k in cases:
        if kind == "prefill":
            req_ids = ["p0"]
            replacer.register_request("p0", None, prompt_idx=0)
            positions = list(range(100, 100 + n - 16)) + [0] * 16  # a chunk mid-prompt, then padding
            req_prompts = [0]
            owners = slot_owners(len(positions), 1, positions=positions, is_prefill=True)
            build = lambda out=None: replacer.build_context(req_ids, position_ids, True, out=out)  # noqa: E731
            label = f"prefill {n}"
        else:
            req_ids = [f"d{i}" for i in range(batch)]
            req_prompts = [i % prompts for i in range(batch)]
            for r, p in zip(req_ids, req_prompts):
                replacer.register_request(r, None, prompt_idx=p)
            starts = np.random.default_rng(batch).integers(0, 8000, batch)
            positions = [int(s) + j for s in starts for j in range(k)]
            positions += [0] * (batch * k // 8)  # batch-bucket padding
            owners = slot_owners(len(positions), batch, is_prefill=False, tokens_per_req=k)
            build = lambda out=None: replacer.build_context(req_ids, position_ids, False, tokens_per_req=k, out=out)  # noqa: E731
            label = f"decode {batch}x{k}"
        position_ids = torch.tensor(positions)  # engines hand positions as a tensor (vLLM's, Neuron's position_ids)
        loop = lambda: build_context_loop(flat, req_prompts, positions, owners)  # noqa: E731

        reused = replacer.warmup_context(len(positions))
        expected, mask = loop()
        for ctx in (build(), build(reused)):
            assert torch.equal(ctx.mask, mask) and all(torch.equal(ctx[m], expected[m]) for m in expected), label

        nbytes = len(positions) * MODULES * WIDTH * torch.finfo(DTYPE).bits // 8
        src = replacer.store.packed[0][: len(positions)].clone()
        dst = torch.empty_like(src)
        fns = {
            "reused": lambda: build(reused),  # steady state of an engine: one context per bucket
            "fresh": lambda: replacer.release(build()),  # a runner's forward: built, read, handed back
            "copy": lambda: dst.copy_(src),
            "clone": src.clone,
        }
        if kind == "decode":
            store_rows = case_rows(replacer, req_prompts, positions, k)
            # the bare gathers write a buffer of their own: written by them too, the out= build's
            # would be in the cache more often than the fresh build's, and read faster
            apart = replacer.warmup_context(len(positions))
            fns["floor"] = gather_floor(replacer, store_rows, apart)
            for gather in ("floor",):
                apart.storage[0].zero_()
                fns[gather]()
                assert torch.equal(apart.storage[0], reused.storage[0]), f"{label}: {gather} gathers other rows than the build"
        t = interleaved(fns, reps)
        if kind == "decode":
            floor_fractions[label] = t["floor"] / t["reused"]
        t_loop = timed(loop, loop_reps)
        speedups[label] = t_loop / t["reused"]
        fractions[label] = t["copy"] / t["reused"]
        fresh_fractions[label] = t["copy"] / t["fresh"]
        fresh_ratio[label] = t["fresh"] / t["reused"]
        rows.append((label, t_loop, t["reused"], t["fresh"], speedups[label], nbytes / t["reused"], nbytes / t["copy"], t["clone"] / t["fresh"]))

    print("reused = build_context(out=ctx) into a context kept per bucket; fresh = a build without out=, released after")
    print("copy = dst.copy_(src) of the same bytes; fresh/clone compares the allocating paths")
    print(f"{'case':<14}{'loop ms':>9}{'reused ms':>11}{'fresh ms':>10}{'speedup':>9}{'GB/s':>7}{'copy GB/s':>11}"
          f"{'fresh/clone':>13}{'fresh/reused':>14}")
    for label, tl, tr, tf, sp, bw, cbw, fc in rows:
        print(f"{label:<14}{tl*1e3:>9.1f}{tr*1e3:>11.3f}{tf*1e3:>10.3f}{sp:>8.0f}x{bw/1e9:>7.2f}{cbw/1e9:>11.2f}"
              f"{fc:>13.2f}{tf/tr:>14.2f}")

    print("decode gather floor (the bare gather primitive on the same rows) / out= build: "
          + ", ".join(f"{label} {f:.2f}" for label, f in floor_fractions.items()))
    decode_us, floor_us = bench_small_decode(replacer, quick=args.quick)
    print(f"8 decode requests, build_context_for_batch(out=) into a bound 8192-slot feed: {decode_us:.1f} us median "
          f"(floor: one index_select + mask copy {floor_us:.1f} us)")

    huge = bench_huge_pages(replacer, reps)
    print("decode build from the store in ordinary 4 KiB pages / from the same rows on huge pages (out=): "
          + ", ".join(f"{label} {ratio:.2f}" for label, ratio in huge.items()) + f" ({_anon_huge_pages()})")

    sharded = bench_sharded()
    print("decode step from a store of 8 shards / from one shard (same prompts, out=): "
          + ", ".join(f"{label} {ratio:.2f}" for label, ratio in sharded.items()))

    register_ms, init_s = bench_register(quick=args.quick)
    print(f"register_request with 10,000 stored prompts: {register_ms:.3f} ms median (index built in {init_s:.1f} s)")
    result = {
        "speedup_vs_loop": round(min(speedups.values()), 1),
        "speedup_prefill_8192": round(speedups["prefill 8192"], 1),
        "speedup_decode_256x4": round(speedups["decode 256x4"], 1),
        "copy_bandwidth_fraction": {label: round(f, 3) for label, f in fractions.items()},
        "copy_bandwidth_fraction_fresh": {label: round(f, 3) for label, f in fresh_fractions.items()},
        "fresh_vs_out": round(fresh_ratio["prefill 8192"], 3),
        "decode_gather_floor_fraction": {label: round(f, 3) for label, f in floor_fractions.items()},
        "decode8_us": round(decode_us, 1),
        "decode8_floor_us": round(floor_us, 1),
        "register_ms": round(register_ms, 4),
        "sharded_vs_one_shard": {label: round(ratio, 3) for label, ratio in sharded.items()},
        "small_pages_vs_huge": {label: round(ratio, 3) for label, ratio in huge.items()},
    }
    print(json.dumps(result))


def case_rows(replacer: TensorReplacer, req_prompts: list[int], positions: list[int], k: int) -> torch.Tensor:
    """The store rows of a decode case's slots (the zero row for padding)."""
    store = replacer.store
    padding = len(positions) - len(req_prompts) * k
    zero_row = store.packed[0].shape[0] - 1
    return torch.tensor([int(store.offsets[p]) + pos for p, pos in zip(np.repeat(req_prompts, k), positions)]
                        + [zero_row] * padding)


def gather_floor(replacer: TensorReplacer, rows: torch.Tensor, out):
    """The builder's gather primitive (:func:`fxreplace.gather.index_select_rows`) of ``rows``
    over every module into ``out``'s storage, alone: the bare gather of those bytes,
    without the builder's lookups and mask."""
    return lambda: index_select_rows(replacer.store.packed[0], out.storage[0], rows)


def bench_small_decode(replacer: TensorReplacer, quick: bool) -> tuple[float, float]:
    """The vLLM plugin's per-step call: 8 decode requests gathered into the first 8 rows of
    a bound max-size feed (``feed.leading(8)``), numpy counts and a CPU positions tensor."""
    req_ids = [f"small{i}" for i in range(8)]
    for i, r in enumerate(req_ids):
        replacer.register_request(r, None, prompt_idx=i % 4)
    feed = replacer.warmup_context(8192)
    out = feed.leading(8)
    counts = np.ones(8, dtype=np.int64)
    positions = torch.arange(4000, 4008)
    rows = torch.arange(8)
    mask = torch.ones(8, dtype=torch.bool)
    src = replacer.store.packed[0]
    fns = {
        "build": lambda: replacer.build_context_for_batch(req_ids, counts, positions, out=out),
        "floor": lambda: (torch.index_select(src, 0, rows, out=out.storage[0]), out.mask.copy_(mask)),
    }
    for fn in fns.values():
        for _ in range(200):
            fn()
    t = interleaved(fns, 2000 if quick else 20000)
    for r in req_ids:
        replacer.release_request(r)
    return t["build"] * 1e6, t["floor"] * 1e6


def bench_huge_pages(replacer: TensorReplacer, reps: int) -> dict[str, float]:
    """The decode builds from the bench's store (its rows on transparent huge pages where the
    OS grants them) and from a copy of it in ordinary memory, interleaved: what the huge
    pages save on a random gather (one page-table walk per 2 MiB instead of per 4 KiB)."""
    store = replacer.store
    small_pages = dataclasses.replace(store, shards=[Shard([t.clone() for t in s.packed], s.rows, s.extras)
                                                     for s in store.shards])
    replacers = {"huge": replacer, "small": TensorReplacer(small_pages)}
    ratios = {}
    for batch, k in ((256, 4), (1024, 1)):
        req_ids = [f"h{i}" for i in range(batch)]
        starts = np.random.default_rng(batch).integers(0, 8000, batch)
        positions = [int(s) + j for s in starts for j in range(k)]
        fns = {}
        for name, r in replacers.items():
            for i, req in enumerate(req_ids):
                r.register_request(req, None, prompt_idx=i % len(store.prompt_ids))
            out = r.warmup_context(len(positions))
            fns[name] = lambda r=r, out=out: r.build_context(req_ids, positions, False, tokens_per_req=k, out=out)
        t = interleaved(fns, reps * 4)
        ratios[f"decode {batch}x{k}"] = t["small"] / t["huge"]
        for r in replacers.values():
            for req in req_ids:
                r.release_request(req)
    return ratios


def _anon_huge_pages() -> str:
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next(line.split(":")[1].strip() for line in f if line.startswith("AnonHugePages")) + " on huge pages"
    except (OSError, StopIteration):
        return "no transparent huge pages here"


def bench_sharded() -> dict[str, float]:
    """Decode steps from 64 prompts written 8 to a shard file (a capture that synced as it
    went) over the same steps from the same prompts in one shard: 8 requests whose prompts
    share a shard (prompts captured together, replayed together), 8 and 256 spread over
    every shard."""
    prompts, rows, per_shard = 64, 256, 8
    rng = torch.Generator().manual_seed(2)
    captures = [{f"model.layers.{m}.mlp.gate": torch.randn(rows, WIDTH, generator=rng).to(DTYPE) for m in range(MODULES)}
                for _ in range(prompts)]
    prompt_bytes = rows * MODULES * WIDTH * DTYPE.itemsize
    cases = {"8 in one shard": [i for i in range(8)], "8 over 8 shards": [i * per_shard for i in range(8)],
             "256 over 8 shards": [(i * 9) % prompts for i in range(256)]}
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        replacers = {}
        for name, shard_bytes in (("one", 1 << 40), ("sharded", per_shard * prompt_bytes)):
            with StoreWriter(f"{tmp}/{name}", shard_bytes=shard_bytes) as writer:
                for caps in captures:
                    writer.add(None, caps)
            replacers[name] = TensorReplacer(ReferenceStore.load(f"{tmp}/{name}"))
        assert len(replacers["sharded"].store.shards) == prompts // per_shard
        for label, request_prompts in cases.items():
            batch = len(request_prompts)
            req_ids = [f"s{i}" for i in range(batch)]
            starts = np.random.default_rng(batch).integers(0, rows // 2, batch)
            outs = {}
            for name, r in replacers.items():
                for req, p in zip(req_ids, request_prompts):
                    r.register_request(req, None, prompt_idx=p)
                outs[name] = r.warmup_context(batch)
            counts = [1] * batch
            times = {name: [] for name in replacers}
            for step in range(rows // 2):
                positions = torch.from_numpy(starts + step)
                for name, r in replacers.items():
                    start = time.perf_counter()
                    r.step_into(StepLayout(req_ids, counts, positions), outs[name])  # an engine's step
                    times[name].append(time.perf_counter() - start)
            assert all(torch.equal(a, b) for a, b in zip(outs["one"].storage, outs["sharded"].storage))
            ratios[label] = statistics.median(times["sharded"]) / statistics.median(times["one"])
            for r in replacers.values():
                for req in req_ids:
                    r.release_request(req)
    return ratios


def bench_register(quick: bool) -> tuple[float, float]:
    """Median cost of register_request against 10,000 stored prompts of 1..2048 tokens."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 2049, 10_000)
    token_ids = [rng.integers(0, 150_000, int(n)).tolist() for n in lengths]
    flat = {p: {"m": torch.zeros(int(n), 1)} for p, n in enumerate(lengths)}
    start = time.perf_counter()
    replacer = TensorReplacer(flat, prompt_token_ids=token_ids)
    init_s = time.perf_counter() - start
    calls = 200 if quick else 1000
    times = []
    for i in range(calls):
        p = int(rng.integers(0, len(token_ids)))
        request = token_ids[p] + rng.integers(0, 150_000, 32).tolist()  # a teacher-forcing retry
        start = time.perf_counter()
        found = replacer.register_request(f"r{i}", request)
        times.append(time.perf_counter() - start)
        assert found is not None and token_ids[found] == token_ids[p]
        replacer.release_request(f"r{i}")
    return statistics.median(times) * 1e3, init_s


if __name__ == "__main__":
    main()
