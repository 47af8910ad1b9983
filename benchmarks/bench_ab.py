"""One benchmark script run on two trees in turn: this checkout against an earlier commit.

    python benchmarks/bench_ab.py --base REV [--this REV] [--rounds 2] bench_graph.py --quick

Checks REV out into a temporary git worktree (and ``--this`` where given: by default this
checkout, uncommitted changes included), then runs ``benchmarks/SCRIPT ARGS...`` from each
tree in turn (base, this tree, base, ...; every other round the other first, so a machine that
slows down during the run does not favour one tree), each in its own process with that tree first
on the import path and the same Python environment. Each run's last JSON line is the script's
result; the table shows every numeric key per round for both trees, and the final JSON line each
key's median per tree and the ratio of the medians (this tree over the base). Read the ratios
against the rounds' spread: machines are shared and noisy. A figure that docs/benchmarks.md quotes
"side by side with" an earlier main comes from this script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def last_json(output: str) -> dict:
    """The last line of ``output`` that parses as a JSON object (a script's result line)."""
    for line in reversed(output.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    raise SystemExit(f"error: the script printed no JSON line; its output ended:\n{output[-2000:]}")


def numbers(result: dict, prefix: str = "") -> dict[str, float]:
    """Every number of a (nested) result, by dotted key."""
    found = {}
    for key, value in result.items():
        if isinstance(value, dict):
            found.update(numbers(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found[f"{prefix}{key}"] = float(value)
    return found


def run(tree: Path, script: str, args: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    done = subprocess.run([sys.executable, str(tree / "benchmarks" / script), *args], cwd=tree, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {script} failed in {tree} (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return numbers(last_json(done.stdout))


def revision(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=HERE, capture_output=True, text=True,
                          check=True).stdout.strip()


def checkout(rev: str, folder: Path) -> Path:
    """``rev`` in a worktree under ``folder``, its families importable as ``fxreplace.models``."""
    tree = folder / revision(rev)
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=HERE, check=True, capture_output=True)
    if not (tree / "fxreplace" / "models").exists():
        # the families install as fxreplace.models from models/ (pyproject's package-dir): the same in this tree
        (tree / "fxreplace" / "models").symlink_to(Path("..") / "models")
    return tree


def _cells(values: list[float]) -> str:
    return " ".join(f"{v:.4g}" for v in values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (e.g. main~3, a hash)")
    parser.add_argument("--this", help="the commit measured against the base (default: this checkout as it is)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree (default 2)")
    parser.add_argument("script", help="a script in benchmarks/, e.g. bench_graph.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    options = parser.parse_args()
    base_rev = revision(options.base)
    this_rev = revision(options.this or "HEAD") + ("" if options.this else "+")
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as folder:
        trees = {"base": checkout(base_rev, Path(folder)), "this": checkout(options.this, Path(folder)) if options.this else HERE}
        try:
            results: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
            for round_ in range(options.rounds):
                for side in ("base", "this") if round_ % 2 == 0 else ("this", "base"):
                    results[side].append(run(trees[side], options.script, options.args))
                    print(f"round {round_ + 1}/{options.rounds}: {side} done", file=sys.stderr, flush=True)
        finally:
            for tree in trees.values():
                if tree != HERE:
                    subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=HERE, capture_output=True)
    keys = [k for k in results["this"][0] if all(k in r for side in results.values() for r in side)]
    summary = {}
    print(f"{'key':<44} {base_rev + ' (base)':>24} {this_rev + ' (this)':>24} {'ratio':>7}")
    for key in keys:
        old = [r[key] for r in results["base"]]
        new = [r[key] for r in results["this"]]
        ratio = statistics.median(new) / statistics.median(old) if statistics.median(old) else None
        summary[key] = {"base": statistics.median(old), "this": statistics.median(new),
                        "ratio": round(ratio, 4) if ratio is not None else None}
        print(f"{key:<44} {_cells(old):>24} {_cells(new):>24} {ratio if ratio is None else round(ratio, 3):>7}")
    print(json.dumps({"bench": "ab", "script": options.script, "args": options.args, "base": base_rev,
                      "this": this_rev, "rounds": options.rounds, "keys": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
