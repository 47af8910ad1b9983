"""Store loading: ``TensorReplacer(ReferenceStore.load(path))`` on a generated 8 GiB store.

The store is one shard (48 modules x 128 experts, bf16; 2048 prompts of 300 prompt
tokens + 42 generated) written as a sparse file: its header and per-prompt tables
are real, its rows are zeros that take no disk space. Loading must cost O(index):
it reads the header and the per-prompt tables and memory-maps the rows.

Each measurement runs in a fresh interpreter (imports done, then the clock and the
peak-RSS counter start). Prints a table and a final JSON line::

    {"construct_s": median seconds, "peak_rss_delta_mib": max over runs, "time_vs_goal": construct_s / 0.5,
     "rss_vs_goal": peak / 64, ...}

Goals (issue 10): construction <= 0.5 s and peak RSS delta <= 64 MiB.

It also times ``StoreWriter.sync()`` after each of ``--sync-prompts`` one-prompt adds (an
engine capturing a sequential client idles after every request: one shard per sync) and
reports ``sync_ms_first`` / ``sync_ms_last`` (medians of the first and last 50 syncs) and
``sync_growth``, their ratio: a sync must not grow with the prompts written before it.
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
from pathlib import Path

import torch

from fxreplace.store import FORMAT_NAME, FORMAT_VERSION, INDEX_FILE, TENSORS_FILE, StoreWriter
from fxreplace.store.format import _offsets

MODULES, WIDTH, DTYPE, PROMPTS, PREFILL, STEPS = 48, 128, torch.bfloat16, 2048, 300, 42
GOAL_S, GOAL_MIB = 0.5, 64


def write_sparse_store(directory: Path, size_gib: float) -> tuple[int, int]:
    """A valid store whose group tensor is a hole in a sparse file; returns its size in bytes and prompt count."""
    row_bytes = MODULES * WIDTH * DTYPE.itemsize
    rows_per_prompt = PREFILL + STEPS - 1
    prompts = max(1, int(size_gib * 2**30 / row_bytes / rows_per_prompt))
    lengths = [rows_per_prompt] * prompts
    rows = sum(lengths)
    tables = {
        "prompt.offsets": _offsets(lengths)[:-1],
        "prompt.lengths": torch.tensor(lengths),
        "tokens.values": torch.randint(0, 150_000, (prompts * PREFILL,), generator=torch.Generator().manual_seed(0)),
        "tokens.offsets": _offsets([PREFILL] * prompts),
    }
    entries, blobs, at = {}, [], 0
    group_bytes = MODULES * (rows + 1) * WIDTH * DTYPE.itemsize
    entries["group.0"] = {"dtype": "BF16", "shape": [rows + 1, MODULES, WIDTH], "data_offsets": [0, group_bytes]}
    at = group_bytes
    for name, t in tables.items():
        raw = t.numpy().tobytes()
        entries[name] = {"dtype": "I64", "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    index = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION,
        "groups": [{"dtype": "bfloat16", "width": WIDTH, "modules": [f"model.layers.{i}.mlp.gate" for i in range(MODULES)]}],
        "prompts": list(range(prompts)), "num_steps": [STEPS] * prompts, "prefill": [PREFILL] * prompts,
        "has_token_ids": True, "extras": [], "metadata": {"vocab_size": 151_936}, "finite_checked": True,
        "digests": {},  # not measured here: --verify reads every byte by design
    }
    header = json.dumps({"__metadata__": {"fxreplace_index": json.dumps(index)}, **entries}).encode()
    header += b" " * (-len(header) % 8)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / TENSORS_FILE, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.seek(group_bytes, os.SEEK_CUR)  # the rows: a hole
        for raw in blobs:
            f.write(raw)
    (directory / INDEX_FILE).write_text(json.dumps({
        "format": FORMAT_NAME, "version": FORMAT_VERSION,
        "shards": [{"file": TENSORS_FILE, "prompts": list(range(prompts))}], "modules": {}, "metadata": {},
    }))
    return (directory / TENSORS_FILE).stat().st_size, prompts


CHILD = r"""
import json, sys, time
import torch
from fxreplace import ReferenceStore, TensorReplacer

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak-RSS counter
start = time.perf_counter()
store = ReferenceStore.load(sys.argv[1])
loaded = time.perf_counter() - start
replacer = TensorReplacer(store)
total = time.perf_counter() - start
peak = status("VmHWM:") - before
replacer.register_request("r", store.prompt_token_ids[7] + [5])
ctx = replacer.build_context_for_batch(["r"], [1], [310])
assert bool(ctx.mask.all())
print(json.dumps({"load_s": loaded, "construct_s": total, "peak_mib": peak, "after_mib": status("VmRSS:") - before}))
"""


def bench_sync(directory: Path, prompts: int) -> list[float]:
    """Seconds of each ``sync()`` of a writer given one prompt (48 x 128 bf16 rows, 24 tokens) before each."""
    captures = {f"model.layers.{i}.mlp.gate": torch.randn(24, WIDTH).to(DTYPE) for i in range(MODULES)}
    times = []
    with StoreWriter(directory, metadata={"vocab_size": 151_936}) as writer:
        for p in range(prompts):
            writer.add([p, *range(23)], captures)
            start = time.perf_counter()
            writer.sync()
            times.append(time.perf_counter() - start)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=8.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sync-prompts", type=int, default=2000, help="one-prompt adds, each followed by a sync")
    ap.add_argument("--dir", default=None, help="where to write the sparse store (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        size, prompts = write_sparse_store(Path(tmp) / "ref", args.size_gib)
        runs = []
        for _ in range(args.runs):
            out = subprocess.run([sys.executable, "-c", CHILD, str(Path(tmp) / "ref")], check=True, capture_output=True, text=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        syncs = bench_sync(Path(tmp) / "written", args.sync_prompts)
    print(f"store: {size / 2**30:.2f} GiB in one shard, {MODULES} modules x {WIDTH} bf16, "
          f"{prompts} prompts of {PREFILL} + {STEPS - 1} rows (sparse file)")
    print(f"{'run':>4}{'load s':>9}{'load+replacer s':>17}{'peak RSS MiB':>14}{'RSS after MiB':>15}")
    for i, r in enumerate(runs):
        print(f"{i:>4}{r['load_s']:>9.3f}{r['construct_s']:>17.3f}{r['peak_mib']:>14.1f}{r['after_mib']:>15.1f}")
    sync_first, sync_last = (statistics.median(t) * 1e3 for t in (syncs[:50], syncs[-50:]))
    print(f"StoreWriter.sync after each of {len(syncs)} one-prompt adds: {sync_first:.2f} ms median over the first 50, "
          f"{sync_last:.2f} ms over the last 50")
    construct = statistics.median(r["construct_s"] for r in runs)
    peak = max(r["peak_mib"] for r in runs)
    result = {
        "store_gib": round(size / 2**30, 2),
        "construct_s": round(construct, 3),
        "peak_rss_delta_mib": round(peak, 1),
        "time_vs_goal": round(construct / GOAL_S, 3),
        "rss_vs_goal": round(peak / GOAL_MIB, 3),
        "sync_ms_first": round(sync_first, 3),
        "sync_ms_last": round(sync_last, 3),
        "sync_growth": round(sync_last / sync_first, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
