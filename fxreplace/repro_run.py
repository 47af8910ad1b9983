"""Run a repro folder written by ``fxreplace repro write``: one component, its inputs, the reference's outputs.

This file is copied into every repro folder as ``run.py`` and needs only torch and
safetensors (plus the op library the folder names, when the program calls a custom op):
no fxreplace, no model, no reference store, no serving engine. ``fxreplace repro run DIR``
runs the same code.

    python run.py [--backend eager|inductor|aot_eager|xla|MODULE:FUNCTION] [--bisect] [--tolerance T]

It runs the target's component (a ``torch.export`` program per kind of call: the prompt's
prefill, a decode step with the KV cache it read) eagerly and under the backend, on every
saved input, and prints each one's error against the reference's output. The verdict is the
first thing to fix, and in which kind of call: the component disagreeing already in eager is
the port (its weights, their conversion, or its code; in decode calls only, a fault that
arises with the cache); eager agreeing and the backend not is the compiler. ``--bisect``
(inductor) hands the check to PyTorch's CompilerBisector, which names the first backend,
stage or pass that breaks it. Exit status: 0 every output within the tolerance, 1 a
disagreement, 2 a folder that cannot be run, 3 the calls it holds agree but a kind of call
could not be recorded (it cannot say the component agrees).
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


INPUTS, OUTPUTS, META = "inputs.safetensors", "reference_outputs.safetensors", "repro.json"
#: The kinds of call a component makes in an engine's run: the prompt's prefill (an empty cache),
#: a decode step (one token, the keys and values of the earlier positions in the cache); one program each.
PREFILL, DECODE = "prefill", "decode"
KINDS = (PREFILL, DECODE)
PROGRAMS = {PREFILL: "prefill.pt2", DECODE: "decode.pt2"}
#: repro.json's layout: 2 records calls per kind (1, one full forward per prompt, had one program)
FORMAT = 2
EXIT_AGREES, EXIT_DISAGREES, EXIT_UNUSABLE, EXIT_INCOMPLETE = 0, 1, 2, 3
#: Leading bytes of a pickle stream (protocols 2-5), which torch.export.load would unpickle.
PICKLE_MAGIC = tuple(bytes([0x80, p]) for p in range(2, 6))


class ReproError(ValueError):
    """A repro that cannot be written (unknown component, no component in the verdict, an input the
    export cannot take) or run (missing file, a pickle inside the program, a bad backend). Defined
    here, where the folder's own ``run.py`` (this file, without fxreplace) finds it too."""


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
    """A repro folder, loaded: a program per kind of call, the inputs, the reference's outputs, what
    it came from."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not (self.directory / META).is_file():
            raise ReproError(f"{self.directory} is not a repro folder: it lacks {META} "
                             "(written by `fxreplace repro write`)")
        self.meta = json.loads((self.directory / META).read_text())
        if self.meta.get("format") != FORMAT:
            raise ReproError(f"{self.directory} was written by another fxreplace (repro format "
                             f"{self.meta.get('format')}, this runner reads {FORMAT}): run the folder's own run.py, "
                             "or write it again")
        files = [*self.meta["programs"].values(), INPUTS, OUTPUTS]
        missing = [f for f in files if not (self.directory / f).is_file()]
        if missing:
            raise ReproError(f"{self.directory} is not a complete repro folder: it lacks {', '.join(missing)}")
        for name in self.meta["programs"].values():
            check_no_pickle(self.directory / name)
        for library in self.meta.get("op_libraries", []):  # registers the custom ops the programs call
            importlib.import_module(library)
        import torch  # where it is used, as below: `fxreplace --help` builds this file's options without it
        from safetensors.torch import load_file

        self.programs = {kind: torch.export.load(self.directory / name) for kind, name in self.meta["programs"].items()}
        tensors, outputs = load_file(self.directory / INPUTS), load_file(self.directory / OUTPUTS)
        self.inputs = [[tensors[f"{i}.{j}"] for j in range(item["tensors"])] for i, item in enumerate(self.meta["inputs"])]
        self.kinds = [item["call"] for item in self.meta["inputs"]]
        self.outputs = [[outputs[f"{i}.{k}"] for k in range(len(self.meta["outputs"]))]
                        for i in range(len(self.meta["inputs"]))]
        self.compared = [k for k, o in enumerate(self.meta["outputs"]) if o["compared"]]

    def run(self, backend: str, compile_with=None) -> list[list[torch.Tensor]]:
        """Every input through its kind's program under ``backend`` (``compile_with``: a backend
        object to compile with instead, the bisector's); outputs on the CPU."""
        import torch  # run.py answers --help and a bad folder without torch

        if backend == "xla":
            return _run_xla(self.programs, self.kinds, self.inputs)
        modules = {kind: program.module() for kind, program in self.programs.items()}
        if backend != "eager" or compile_with is not None:
            torch.compiler.reset()
            chosen = compile_with if compile_with is not None else resolve_backend(backend)
            modules = {kind: torch.compile(module, backend=chosen) for kind, module in modules.items()}
        with torch.no_grad():
            return [[t.cpu() for t in modules[kind](*inputs)] for kind, inputs in zip(self.kinds, self.inputs)]


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


def _run_xla(programs, kinds, inputs):
    """Each input through its kind's program on torch_xla's lazy device (the programs'
    device-specific nodes moved there too), one graph per input synced, outputs back on the CPU."""
    try:
        import torch_xla  # the xla backend only
    except ImportError:
        raise ReproError("--backend xla needs torch_xla (PJRT_DEVICE=CPU runs it on the CPU)") from None
    import torch  # run.py answers --help and a bad folder without torch
    from torch.export.passes import move_to_device_pass

    device = torch_xla.device()
    modules = {kind: move_to_device_pass(program, device).module() for kind, program in programs.items()}
    outs = []
    with torch.no_grad():
        for kind, item in zip(kinds, inputs):
            out = modules[kind](*[t.to(device) for t in item])
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


#: Where a fault in one kind of call only arises, as the verdict says it.
ARISES = {DECODE: "decode, with the cache of earlier positions (the cached keys and values it reads, their positions)",
          PREFILL: "the prefill, over the prompt at once with an empty cache, or the decode calls held do not reach it "
                   "(an expert none of their tokens is routed to)"}


def unrecorded(meta: dict) -> list[str]:
    """Per kind of call the folder could not record, one line saying so and why."""
    return [f"its {meta['calls'][kind]} {kind} calls cannot be replayed: {why}"
            for kind, why in meta["unrecorded"].items()]


def verdict(eager: list[float], backend: list[float] | None, kinds: list[str], name: str, tolerance: float,
            missing: list[str] = ()) -> tuple[str, int]:
    """The first thing to fix and in which kinds of call (``kinds``: each input's), and the exit
    status. A kind of call the folder could not record (``missing``: :func:`unrecorded`'s lines)
    keeps it from "agrees"."""
    held = list(dict.fromkeys(kinds))
    missing = "".join(f"; {line}" for line in missing)

    def by_kind(errors):
        return {kind: max(e for e, k in zip(errors, kinds) if k == kind) for kind in held}

    e_worst = by_kind(eager)
    bad = [kind for kind in held if e_worst[kind] > tolerance]
    if bad:
        tail = ""
        if backend is not None and max(backend) > tolerance:
            tail = f"; {name} also differs from eager by up to {max(backend):.3g}: fix the port first"
        where, arises = _where(bad, held, e_worst)
        return (f"the port: the target's component disagrees with the reference already in eager (error up to "
                f"{max(eager):.3g} > tolerance {tolerance:.3g}) {where}: its weights, their conversion or its code"
                f"{arises}{tail}{missing}"), EXIT_DISAGREES
    if backend is not None:
        b_worst = by_kind(backend)
        bad = [kind for kind in held if b_worst[kind] > tolerance]
        if bad:
            where, arises = _where(bad, held, b_worst)
            return (f"the compiler: eager agrees with the reference (error up to {max(eager):.3g}) but {name} differs "
                    f"from eager by up to {max(backend):.3g} (tolerance {tolerance:.3g}) {where}{arises}{missing}"), \
                EXIT_DISAGREES
    where = "eager" if backend is None else f"eager and {name}"
    calls = " and ".join(held)
    if missing:
        return (f"not conclusive: the {calls} calls held match the reference within {tolerance:.3g} in {where}"
                f"{missing}: this folder cannot say whether the component is at fault there"), EXIT_INCOMPLETE
    return f"agrees: {where} match the reference within {tolerance:.3g} on every input ({calls} calls)", EXIT_AGREES


def _where(bad: list[str], held: list[str], worst: dict[str, float]) -> tuple[str, str]:
    """In which kinds of call the outputs disagree, and where the fault arises when one kind agrees ("")."""
    if len(bad) == len(held):
        return f"in its {' and '.join(bad)} calls" + (" alike" if len(bad) > 1 else ""), ""
    good = next(kind for kind in held if kind not in bad)
    return (f"in its {bad[0]} calls only (its {good} calls agree, error up to {worst[good]:.3g})",
            f"; the fault arises only in {ARISES[bad[0]]}")


def bisect(repro: Repro, eager_outputs, tolerance: float):
    """PyTorch's CompilerBisector over inductor: the first backend, stage or pass whose output
    leaves eager's by more than ``tolerance``."""
    from torch._inductor.compiler_bisector import CompilerBisector

    def good() -> bool:
        outs = repro.run("inductor", compile_with=CompilerBisector.get_backend())
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
    held = ", ".join(f"{repro.kinds.count(kind)} {kind}" for kind in meta["programs"])
    print(f"{meta['component']} ({meta.get('kind') or 'component'}, {meta['module']}) of {meta.get('target')}, "
          f"{meta['dtype']}: {held} calls from the reference run of {meta.get('model')}; "
          f"compared: {', '.join(meta['outputs'][k]['name'] for k in repro.compared)}")
    for line in unrecorded(meta):
        print(f"not recorded: {line}")
    eager_out = repro.run("eager")
    eager = worst(eager_out, repro.outputs, repro.compared)
    compiled = against_eager = None
    if backend != "eager":
        outs = repro.run(backend)
        compiled = worst(outs, repro.outputs, repro.compared)
        against_eager = worst(outs, eager_out, repro.compared)
    name = backend.rpartition(":")[2]  # a MODULE:FUNCTION backend by its function's name
    wide, wider = max(13, len(name) + 7), max(15, len(name) + 9)
    head = f"{'input':>5} {'prompt':>6} {'call':>7} {'cached':>6} {'tokens':>6} {'eager vs ref':>13}"
    print(head + (f" {name + ' vs ref':>{wide}} {name + ' vs eager':>{wider}}" if compiled is not None else ""))
    for i, item in enumerate(meta["inputs"]):
        line = f"{i:>5} {item['prompt']:>6} {item['call']:>7} {item['cached']:>6} {item['tokens']:>6} {eager[i]:>13.3g}"
        print(line + (f" {compiled[i]:>{wide}.3g} {against_eager[i]:>{wider}.3g}" if compiled is not None else ""))
    text, status = verdict(eager, against_eager, repro.kinds, name, tolerance, unrecorded(meta))
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
    return status


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
