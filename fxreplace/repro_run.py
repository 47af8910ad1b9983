"""Run a repro folder written by ``fxreplace repro write``: one component, its inputs, the reference's outputs.

This file is copied into every repro folder as ``run.py`` and needs only torch and
safetensors (plus the op library the folder names, when the program calls a custom op):
no fxreplace, no model, no reference store, no serving engine. ``fxreplace repro run DIR``
runs the same code.

    python run.py [--backend eager|inductor|aot_eager|xla|MODULE:FUNCTION] [--bisect] [--tolerance T]

It runs the target's component (a ``torch.export`` program) eagerly and under the
backend, on every saved input, and prints each one's error against the reference's output.
The verdict is the first thing to fix: the component disagreeing already in eager is the
port (its weights, their conversion, or its code); eager agreeing and the backend not is
the compiler. ``--bisect`` (inductor) hands the check to PyTorch's CompilerBisector, which
names the first backend, stage or pass that breaks it. Exit status: 0 every output within
the tolerance, 1 a disagreement, 2 a folder that cannot be run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


PROGRAM, INPUTS, OUTPUTS, META = "component.pt2", "inputs.safetensors", "reference_outputs.safetensors", "repro.json"
EXIT_AGREES, EXIT_DISAGREES, EXIT_UNUSABLE = 0, 1, 2
#: Leading bytes of a pickle stream (protocols 2-5), which torch.export.load would unpickle.
PICKLE_MAGIC = tuple(bytes([0x80, p]) for p in range(2, 6))


class ReproError(Exception):
    """A folder this runner cannot run (missing file, a pickle inside the program, a bad backend)."""


def check_no_pickle(program: Path) -> None:
    """Refuse a program archive that would make ``torch.export.load`` unpickle something:
    weights or constants stored as pickles, sample inputs (always a pickle), or any member
    holding a pickle stream. The writer stores none, so a folder holding one was changed."""
    with zipfile.ZipFile(program) as archive:
        for info in archive.infolist():
            name = info.filename
            data = archive.read(info)
            if name.endswith("sample_inputs/model.pt") and data:
                raise ReproError(f"{program} holds sample inputs (a pickle): refusing to load it")
            if name.endswith(("model_weights_config.json", "model_constants_config.json")):
                for entry, payload in json.loads(data).get("config", {}).items():
                    if payload.get("use_pickle"):
                        raise ReproError(f"{program}: {entry} is stored as a pickle: refusing to load it")
            elif data[:2] in PICKLE_MAGIC or name.endswith((".pkl", ".pickle")):
                raise ReproError(f"{program}: {name} is a pickle: refusing to load it")


class Repro:
    """A repro folder, loaded: the program, its inputs, the reference's outputs, what it came from."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        missing = [f for f in (META, PROGRAM, INPUTS, OUTPUTS) if not (self.directory / f).is_file()]
        if missing:
            raise ReproError(f"{self.directory} is not a repro folder: it lacks {', '.join(missing)} "
                             "(written by `fxreplace repro write`)")
        self.meta = json.loads((self.directory / META).read_text())
        check_no_pickle(self.directory / PROGRAM)
        for library in self.meta.get("op_libraries", []):  # registers the custom ops the program calls
            importlib.import_module(library)
        import torch  # where it is used, as below: `fxreplace --help` builds this file's options without it
        from safetensors.torch import load_file

        self.program = torch.export.load(self.directory / PROGRAM)
        tensors, outputs = load_file(self.directory / INPUTS), load_file(self.directory / OUTPUTS)
        self.inputs = [[tensors[f"{i}.{j}"] for j in range(item["tensors"])] for i, item in enumerate(self.meta["inputs"])]
        self.outputs = [[outputs[f"{i}.{k}"] for k in range(len(self.meta["outputs"]))]
                        for i in range(len(self.meta["inputs"]))]
        self.compared = [k for k, o in enumerate(self.meta["outputs"]) if o["compared"]]

    def run(self, backend: str) -> list[list[torch.Tensor]]:
        """Every input through the program under ``backend``; outputs on the CPU."""
        import torch  # run.py answers --help and a bad folder without torch

        if backend == "xla":
            return _run_xla(self.program, self.inputs)
        module = self.program.module()
        if backend != "eager":
            torch.compiler.reset()
            module = torch.compile(module, backend=resolve_backend(backend))
        with torch.no_grad():
            return [[t.cpu() for t in module(*inputs)] for inputs in self.inputs]


def resolve_backend(spec: str):
    """A torch.compile backend by its registered name, or ``MODULE:FUNCTION`` (imported)."""
    if ":" not in spec:
        import torch  # run.py answers --help and a bad folder without torch

        if spec not in torch.compiler.list_backends(exclude_tags=()):
            raise ReproError(f"--backend {spec}: not a torch.compile backend here (one of eager, "
                             f"{', '.join(torch.compiler.list_backends(exclude_tags=()))}, xla, or MODULE:FUNCTION)")
        return spec
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ReproError(f"--backend {spec}: cannot import it ({e})") from None


def _run_xla(program, inputs):
    """The program on torch_xla's lazy device (its device-specific nodes moved there too), one
    graph per input synced, outputs back on the CPU."""
    try:
        import torch_xla  # the xla backend only
    except ImportError:
        raise ReproError("--backend xla needs torch_xla (PJRT_DEVICE=CPU runs it on the CPU)") from None
    import torch  # run.py answers --help and a bad folder without torch
    from torch.export.passes import move_to_device_pass

    device = torch_xla.device()
    module = move_to_device_pass(program, device).module()
    outs = []
    with torch.no_grad():
        for item in inputs:
            out = module(*[t.to(device) for t in item])
            torch_xla.sync()
            outs.append([t.cpu() for t in out])
    return outs


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error: the norm of the difference over the norm of ``want`` (floating outputs), or
    the fraction of entries that differ (integer outputs such as expert indices); inf for a shape
    mismatch or a non-finite output where the reference is finite."""
    if got.shape != want.shape:
        return float("inf")
    if not want.is_floating_point():
        return float((got != want).float().mean()) if want.numel() else 0.0
    got, want = got.double(), want.double()
    if not bool(got.isfinite().all()) and bool(want.isfinite().all()):
        return float("inf")
    scale = float(want.norm()) or 1.0
    return float((got - want).norm()) / scale


def worst(outputs, references, compared) -> list[float]:
    """Per input, the largest error over the compared outputs."""
    return [max(error(o[k], r[k]) for k in compared) for o, r in zip(outputs, references)]


def verdict(eager: list[float], backend: list[float] | None, name: str, tolerance: float) -> tuple[str, bool]:
    """The first thing to fix, and whether everything agrees."""
    e_max = max(eager)
    if e_max > tolerance:
        tail = ""
        if backend is not None and max(backend) > tolerance:
            tail = f"; {name} also differs from eager by up to {max(backend):.3g}: fix the port first"
        return (f"the port: the target's component disagrees with the reference already in eager (error up to "
                f"{e_max:.3g} > tolerance {tolerance:.3g}): its weights, their conversion or its code{tail}"), False
    if backend is not None and max(backend) > tolerance:
        return (f"the compiler: eager agrees with the reference (error up to {e_max:.3g}) but {name} differs from "
                f"eager by up to {max(backend):.3g} (tolerance {tolerance:.3g})"), False
    where = "eager" if backend is None else f"eager and {name}"
    return f"agrees: {where} match the reference within {tolerance:.3g} on every input", True


def bisect(repro: Repro, eager_outputs, tolerance: float):
    """PyTorch's CompilerBisector over inductor: the first backend, stage or pass whose output
    leaves eager's by more than ``tolerance``."""
    import torch  # run.py answers --help and a bad folder without torch
    from torch._inductor.compiler_bisector import CompilerBisector

    def good() -> bool:
        torch.compiler.reset()
        compiled = torch.compile(repro.program.module(), backend=CompilerBisector.get_backend())
        with torch.no_grad():
            outs = [[t.cpu() for t in compiled(*inputs)] for inputs in repro.inputs]
        return max(worst(outs, eager_outputs, repro.compared)) <= tolerance

    return CompilerBisector.do_bisect(good)


def run(directory: str | Path, backend: str = "eager", bisect_stages: bool = False,
        tolerance: float | None = None) -> int:
    """Run the folder under ``backend``; print the per-input errors and the verdict; the exit
    status. A folder or backend that cannot run raises :class:`ReproError`."""
    if bisect_stages and backend != "inductor":
        raise ReproError(f"--bisect bisects inductor's stages; got --backend {backend}")
    repro = Repro(directory)
    meta = repro.meta
    tolerance = tolerance if tolerance is not None else meta["tolerance"]
    print(f"{meta['component']} ({meta.get('kind') or 'component'}, {meta['module']}) of {meta.get('target')}, "
          f"{meta['dtype']}: {len(repro.inputs)} inputs from the reference run of {meta.get('model')}; "
          f"compared: {', '.join(meta['outputs'][k]['name'] for k in repro.compared)}")
    eager_out = repro.run("eager")
    eager = worst(eager_out, repro.outputs, repro.compared)
    compiled = against_eager = None
    if backend != "eager":
        outs = repro.run(backend)
        compiled = worst(outs, repro.outputs, repro.compared)
        against_eager = worst(outs, eager_out, repro.compared)
    name = backend.rpartition(":")[2]  # a MODULE:FUNCTION backend by its function's name
    wide, wider = max(13, len(name) + 7), max(15, len(name) + 9)
    head = f"{'input':>5} {'prompt':>6} {'tokens':>6} {'eager vs ref':>13}"
    print(head + (f" {name + ' vs ref':>{wide}} {name + ' vs eager':>{wider}}" if compiled is not None else ""))
    for i, item in enumerate(meta["inputs"]):
        line = f"{i:>5} {item['prompt']:>6} {item['tokens']:>6} {eager[i]:>13.3g}"
        print(line + (f" {compiled[i]:>{wide}.3g} {against_eager[i]:>{wider}.3g}" if compiled is not None else ""))
    text, agrees = verdict(eager, against_eager, name, tolerance)
    print(f"verdict: {text}")
    if bisect_stages:
        if max(against_eager) <= tolerance:
            print("bisect: inductor agrees with eager; nothing to bisect")
        else:
            found = bisect(repro, eager_out, tolerance)
            print("bisect: " + ("every backend and stage agrees with eager" if found is None else
                                f"first failing: backend {found.backend}"
                                + (f", stage {found.subsystem}" if found.subsystem else "")
                                + (f", application {found.bisect_number}" if found.bisect_number is not None else "")
                                + (f" ({found.debug_info})" if found.debug_info else "")))
    return EXIT_AGREES if agrees else EXIT_DISAGREES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The runner's options (``run.py`` and ``fxreplace repro run`` take the same)."""
    parser.add_argument("--backend", default="eager",
                        help="eager, a torch.compile backend (inductor, aot_eager, ...), xla (torch_xla), or "
                             "MODULE:FUNCTION (a backend of your own)")
    parser.add_argument("--bisect", action="store_true",
                        help="with --backend inductor: name the first failing stage with PyTorch's CompilerBisector")
    parser.add_argument("--tolerance", type=float, help="relative error allowed (default: the folder's, by its dtype)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", nargs="?", default=str(Path(__file__).resolve().parent),
                        help="the repro folder (default: this file's)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args.dir, args.backend, args.bisect, args.tolerance)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_UNUSABLE


if __name__ == "__main__":
    sys.exit(main())
