"""What capture, validate, blame and blame --clean cost as the model grows: wall time and peak RSS.

Per size (``--sizes LAYERSxHIDDEN,...``; a random Qwen3-MoE in float32 with 8 experts of
width HIDDEN, HIDDEN / 64 heads, a 32000-token vocabulary), the CLI flow a user runs, each step
in a child process whose peak RSS (``ru_maxrss``) is read when it ends:

- ``capture``: ``fxreplace capture --components`` of ``--prompts`` prompts, and of 4x as many
  (the peak must not grow with the prompts); and the routers-only capture ``blame --clean`` starts from;
- ``validate``: ``fxreplace validate`` of the planted target (fp32), and inside it a
  teacher-forced pass with nothing replaced just before and one just after, each timed alone:
  the validation's time per mode over their mean is the ratio (side by side, as the load of a
  shared machine moves);
- ``blame``: ``fxreplace blame`` against the full reference; ``blame --clean`` against the
  routers-only one, components captured from the clean checkpoint on demand;
- ``ondemand``: one component captured on demand (``OnDemand.ensure``), before and after a full
  ``--components`` capture of the same prompts, all by one loaded model in one process (without
  the model load): the ratio is side by side.

The target is the clean checkpoint with one attention output projection scaled by 1.5 in layer
``0.6 L``; every blame must name it. Then the growth exponents (log-log slopes of time and
peak over the parameters), and a peak and time extrapolated to a Qwen3-30B-A3B shape from the
measured per-parameter terms (peak = a + b x weights and wall = c + d x parameters, fitted over the
sizes measured; the prompts and tokens as measured, so per-token terms stay at this run's).

Acceptance at the largest size: blame --clean peak <= two models' weights + 2 GiB; capture peak
<= one model + 1 GiB at both prompt counts; validate per mode <= 1.5x one teacher-forced pass;
on-demand capture of one component <= 1/3 of a full capture; the fault found at every size.

``--steps`` measures a subset (e.g. ``capture,blame_clean``); the acceptance then judges only
what was measured and ``goal_met`` needs all five.

Peak RSS is the child's ``ru_maxrss``: everything resident, file-backed pages included (the CLI
loads checkpoints without mapping them: what remains file-backed is ~0.2 GiB of shared libraries).

Prints a table and a final JSON line with every figure and ``acceptance``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARCH = "Qwen3MoeForCausalLM"
GIB = 1 << 30
# Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts of 768, 32 heads of 128 (4 KV), vocab 151936
TARGET_SHAPE = dict(layers=48, hidden=2048, experts=128, moe=768, heads=32, kv=4, head_dim=128, vocab=151936)


def config_of(layers: int, hidden: int, vocab: int = 32000):
    from transformers import Qwen3MoeConfig

    heads = max(1, hidden // 64)
    return Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden, moe_intermediate_size=hidden,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                          head_dim=64, num_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
                          decoder_sparse_step=1, initializer_range=0.2, architectures=[ARCH], tie_word_embeddings=False)


def fault_layer(layers: int) -> int:
    return int(0.6 * layers)


# ---------------------------------------------------------------------- steps (each in a child)

def step_make(args) -> dict:
    """The clean and the planted checkpoints (fp32 safetensors) and the prompt files."""
    import torch
    from transformers import AutoModelForCausalLM

    layers, hidden = map(int, args.size.split("x"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(layers, hidden), dtype=torch.float32).eval()
    work = Path(args.work)
    model.save_pretrained(work / "clean")
    with torch.no_grad():
        model.model.layers[fault_layer(layers)].self_attn.o_proj.weight.mul_(1.5)
    model.save_pretrained(work / "target")
    g = torch.Generator().manual_seed(1)
    for count in (args.prompts, 4 * args.prompts):
        prompts = [torch.randint(4, 32000, (args.prompt_len,), generator=g).tolist() for _ in range(count)]
        (work / f"prompts-{count}.json").write_text(json.dumps(prompts))
    return {"params": sum(p.numel() for p in model.parameters())}


def _timed(module, name: str, into: dict, key: str):
    """Wrap ``module.name`` so its calls' seconds add up in ``into[key]``."""
    original = getattr(module, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            into[key] = into.get(key, 0.0) + time.perf_counter() - t0

    setattr(module, name, wrapper)
    return original


def step_capture(args) -> dict:
    import fxreplace.capture
    from fxreplace.cli import main

    out: dict = {}
    _timed(fxreplace.capture, "capture_reference", out, "core_s")
    argv = ["capture", str(Path(args.work) / "clean"), "--prompts", str(Path(args.work) / f"prompts-{args.count}.json"),
            "--max-new-tokens", str(args.new_tokens), "--out", args.out]
    main(argv + (["--components"] if args.components else []))
    return out


def step_validate(args) -> dict:
    import fxreplace.validation
    from fxreplace.cli import main

    out: dict = {}
    original = fxreplace.validation.logit_validation

    def one_pass(engine, reference) -> float:
        t0 = time.perf_counter()
        original(engine, reference, modes=("off",), progress=False)
        return time.perf_counter() - t0

    def validation(engine, reference, **kwargs):
        before = one_pass(engine, reference)
        t0 = time.perf_counter()
        result = original(engine, reference, **kwargs)
        out["validate_s"] = time.perf_counter() - t0
        out["modes"] = len(result.modes)
        out["passes_s"] = [before, one_pass(engine, reference)]
        out["one_pass_s"] = sum(out["passes_s"]) / 2
        return result

    fxreplace.validation.logit_validation = validation
    main(["validate", str(Path(args.work) / "target"), "--dtype", "float32", "--reference", args.reference,
          "--report-dir", str(Path(args.work) / "validate-report")])
    return out


def step_blame(args) -> dict:
    from fxreplace.cli import main

    report = Path(args.work) / ("blame-clean" if args.clean else "blame")
    argv = ["blame", str(Path(args.work) / "target"), "--dtype", "float32", "--reference", args.reference,
            "--report-dir", str(report)]
    main(argv + (["--clean", str(Path(args.work) / "clean")] if args.clean else []))
    result = json.loads((report / "blame.json").read_text())
    layers = int(args.size.split("x")[0])
    origins = [(o["kind"], o["layer"]) for o in result["origins"]]
    return {"origins": origins, "found": origins[:1] == [("attention", fault_layer(layers))],
            "passes": result["passes"], "rounds": result["rounds"], "capture_s": result["capture_seconds"],
            "search_s": result["seconds"]}


def step_ondemand(args) -> dict:
    """One component captured on demand, before and after a full ``--components`` capture of the
    same prompts by the same loaded model, side by side in this process (the load of a shared
    machine moves between children): the on-demand time is the mean of the two."""
    import torch

    from fxreplace.blame import resolve_components
    from fxreplace.blame.ondemand import OnDemand
    from fxreplace.capture import capture_reference
    from fxreplace.loading import load_model
    from fxreplace.models import get_family
    from fxreplace.reference import load_reference

    clean = load_model(str(Path(args.work) / "clean"), torch.float32)
    family = get_family(ARCH)
    comps = resolve_components(clean, family.components)
    layers = int(args.size.split("x")[0])
    reference = load_reference(args.reference)

    def on_demand() -> float:
        t0 = time.perf_counter()
        OnDemand(clean, reference, comps, None).ensure({f"model.layers.{fault_layer(layers)}.self_attn"})
        return time.perf_counter() - t0

    before = on_demand()
    prompts = [reference.prompt_tokens(p) for p in range(reference.num_prompts)]
    with tempfile.TemporaryDirectory(dir=args.work) as out:
        t0 = time.perf_counter()
        capture_reference(clean, prompts, family.targets, args.new_tokens, components=family.components,
                          out=Path(out) / "ref", progress=False)
        full = time.perf_counter() - t0
    after = on_demand()
    return {"core_s": (before + after) / 2, "runs_s": [before, after], "capture_core_s": full}


STEPS = {"make": step_make, "capture": step_capture, "validate": step_validate, "blame": step_blame,
         "ondemand": step_ondemand}


# ---------------------------------------------------------------------- the driver

def child(step: str, **options) -> dict:
    """Run one step in a child process: its figures, wall seconds and peak RSS (GiB)."""
    argv = [sys.executable, __file__, "--step", step]
    for key, value in options.items():
        if value is True:
            argv.append(f"--{key.replace('_', '-')}")
        elif value not in (None, False):
            argv += [f"--{key.replace('_', '-')}", str(value)]
    result_file = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    argv += ["--result", result_file]
    with tempfile.TemporaryFile("w+") as log:  # the child's progress bars: a pipe nobody reads would fill up
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own rusage: its peak RSS
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            log.seek(0)
            raise SystemExit(f"step {step} {options} failed ({proc.returncode}):\n{log.read()[-3000:]}")
    figures = json.loads(Path(result_file).read_text())
    os.unlink(result_file)
    figures = {**figures, "wall_s": wall, "peak_gib": usage.ru_maxrss * 1024 / GIB}
    print(f"{step} {options.get('size')}: {json.dumps(figures)}", file=sys.stderr, flush=True)  # a long run's progress
    return figures


def slope(xs, ys) -> float | None:
    """Least-squares slope of log y over log x (the growth exponent)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def linear(xs, ys) -> tuple[float, float]:
    """Least-squares ``y = a + b x``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0
    return my - b * mx, b


def target_params() -> int:
    s = TARGET_SHAPE
    attention = s["hidden"] * s["heads"] * s["head_dim"] * 2 + s["hidden"] * s["kv"] * s["head_dim"] * 2
    experts = s["experts"] * 3 * s["hidden"] * s["moe"] + s["hidden"] * s["experts"]
    return s["layers"] * (attention + experts + 2 * s["hidden"]) + 2 * s["vocab"] * s["hidden"]


STEP_NAMES = ("capture", "validate", "blame", "blame_clean", "ondemand")


def run_size(size: str, args, root: Path) -> dict:
    work = root / size
    work.mkdir(parents=True)
    steps = set(args.steps.split(","))
    common = dict(size=size, work=work, prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    made = child("make", **common)
    row = {"size": size, "params": made["params"], "weights_gib": made["params"] * 4 / GIB}
    full, routers = work / "ref-full", work / "ref-routers"
    if steps & {"capture", "blame"}:
        row["capture"] = child("capture", **common, count=args.prompts, out=full, components=True)
    if "capture" in steps:
        row["capture_4x"] = child("capture", **common, count=4 * args.prompts, out=work / "ref-full-4x", components=True)
    if steps & {"validate", "blame_clean", "ondemand"}:
        child("capture", **common, count=args.prompts, out=routers)
    if "validate" in steps:
        row["validate"] = child("validate", **common, reference=routers)
    if "blame" in steps:
        row["blame"] = child("blame", **common, reference=full)
    if "blame_clean" in steps:
        row["blame_clean"] = child("blame", **common, reference=routers, clean=True)
    if "ondemand" in steps:  # captures held in memory: what blame --clean appended to the reference is not read
        row["ondemand"] = child("ondemand", **common, reference=routers)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4x256,12x512,24x1024",
                        help="LAYERSxHIDDEN per size, comma-separated (24x1024 is ~0.73B parameters)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--steps", default=",".join(STEP_NAMES),
                        help=f"which of {', '.join(STEP_NAMES)} to measure (comma-separated; default all): the "
                             "acceptance then judges only what was measured")
    parser.add_argument("--workdir", help="where checkpoints and references go (default: a temporary directory)")
    # a child's options
    parser.add_argument("--step", choices=sorted(STEPS))
    for name in ("size", "work", "out", "reference", "result"):
        parser.add_argument(f"--{name}")
    parser.add_argument("--count", type=int)
    parser.add_argument("--components", action="store_true")
    parser.add_argument("--clean", action="store_true")
    args = parser.parse_args()
    if args.step:
        figures = STEPS[args.step](args)
        Path(args.result).write_text(json.dumps(figures))
        return

    load = os.getloadavg()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_scale-"))
    rows = []
    for size in args.sizes.split(","):
        rows.append(run_size(size, args, root))
        print(f"{size} done: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    steps = [s for s in ("capture", "capture_4x", "validate", "blame", "blame_clean", "ondemand") if s in rows[0]]
    print(f"{'size':>9} {'params':>8} {'weights':>8} | " + " | ".join(f"{s:>20}" for s in steps))
    print(f"{'':>9} {'':>8} {'GiB':>8} | " + " | ".join(f"{'wall s   peak GiB':>20}" for _ in steps))
    for r in rows:
        print(f"{r['size']:>9} {r['params'] / 1e6:>7.0f}M {r['weights_gib']:>8.2f} | "
              + " | ".join(f"{r[s]['wall_s']:>9.1f} {r[s]['peak_gib']:>10.2f}" for s in steps))
    params = [r["params"] for r in rows]
    exponents = {s: {"wall": slope(params, [r[s]["wall_s"] for r in rows]),
                     "peak": slope(params, [r[s]["peak_gib"] for r in rows])} for s in steps}
    big = target_params()
    extrapolated = {}
    for s in steps:
        a, b = linear([r["weights_gib"] for r in rows], [r[s]["peak_gib"] for r in rows])
        c, d = linear(params, [r[s]["wall_s"] for r in rows])
        extrapolated[s] = {"peak_gib": a + b * big * 4 / GIB, "wall_s": max(c + d * big, 0.0)}
    last = rows[-1]
    w = last["weights_gib"]
    validate_ratio = (last["validate"]["validate_s"] / last["validate"]["modes"] / last["validate"]["one_pass_s"]
                      if "validate" in last else None)
    ondemand_ratio = last["ondemand"]["core_s"] / last["ondemand"]["capture_core_s"] if "ondemand" in last else None
    acceptance, said = {}, []  # the criteria whose steps this run measured
    if "blame_clean" in last:
        acceptance["blame_clean_peak_le_2w_plus_2"] = last["blame_clean"]["peak_gib"] <= 2 * w + 2
        said.append(f"blame --clean peak {last['blame_clean']['peak_gib']:.2f} GiB vs 2 x {w:.2f} + 2")
    if "capture_4x" in last:
        acceptance["capture_peak_le_w_plus_1"] = max(last["capture"]["peak_gib"], last["capture_4x"]["peak_gib"]) <= w + 1
        said.append(f"capture peak {last['capture']['peak_gib']:.2f} / {last['capture_4x']['peak_gib']:.2f} GiB "
                    f"({args.prompts} / {4 * args.prompts} prompts) vs {w:.2f} + 1")
    if validate_ratio is not None:
        acceptance["validate_per_mode_le_1.5_pass"] = validate_ratio <= 1.5
        said.append(f"validate per mode / one forced pass = {validate_ratio:.2f}")
    if ondemand_ratio is not None:
        acceptance["ondemand_one_le_third_capture"] = ondemand_ratio <= 1 / 3
        said.append(f"on-demand capture of one component / full capture = {ondemand_ratio:.2f}")
    if "blame" in last or "blame_clean" in last:
        acceptance["fault_found_every_size"] = all(r[k]["found"] for r in rows for k in ("blame", "blame_clean") if k in r)
    print(f"\nexponents (log-log over params): " + ", ".join(
        f"{s} wall {fmt(e['wall'])} peak {fmt(e['peak'])}" for s, e in exponents.items()))
    print(f"at {last['size']}: " + "; ".join(said))
    print(f"extrapolated to a Qwen3-30B-A3B shape ({big / 1e9:.1f}B params, {big * 4 / GIB:.0f} GiB fp32): " + ", ".join(
        f"{s} {v['peak_gib']:.0f} GiB {v['wall_s'] / 3600:.1f} h" for s, v in extrapolated.items()))
    print(f"load average at the start: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} ({os.cpu_count()} cores)")
    print(json.dumps({"sizes": rows, "exponents": exponents, "extrapolated_30b": extrapolated,
                      "validate_per_mode_over_pass": validate_ratio, "ondemand_over_capture": ondemand_ratio,
                      "load_average": load, "acceptance": acceptance,
                      "goal_met": len(acceptance) == 5 and all(acceptance.values())}))


def fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    main()
