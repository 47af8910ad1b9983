"""``fxreplace repro write|run``: the blamed component alone, as a ticket for the compiler team."""

from __future__ import annotations

import json
from pathlib import Path

from ..loading import load_model
from ..repro import README, ReproError, blamed_component, check_out_dir, write_repro
from ..repro_run import META, unrecorded
from ..repro_run import run as run_repro
from .args import UsageError
from .common import load_reference_arg, torch_dtype


def write(args) -> int:
    """Write the repro folder of a blamed (or named) component (see :mod:`fxreplace.repro`)."""
    if not args.blame and not args.component:
        raise UsageError("repro write needs the component: --blame BLAME_JSON (its first origin) or --component NAME")
    try:
        check_out_dir(args.out)
    except ReproError as e:
        raise UsageError(str(e), "--out names a new folder, or one holding a repro to replace") from None
    out = Path(args.out).resolve()
    args.produced.describe = lambda: f"--out {out} " + (
        "holds a complete repro" if (out / README).is_file() else "holds no complete repro: rerun the command")
    reference = load_reference_arg(args.reference)
    try:
        component = args.component or blamed_component(args.blame)
    except (OSError, ValueError) as e:
        raise UsageError(f"--blame {args.blame}: {e}", "give the blame.json `fxreplace blame` wrote") from None
    if args.clean is None:
        args.clean = str(reference.metadata.get("source_model") or "")
        if not args.clean or not (args.clean.startswith("builtin:") or Path(args.clean).is_dir()):
            raise UsageError(f"the reference {args.reference} records no clean model that is still at hand "
                             f"({args.clean or 'none recorded'})", "give it as --clean CKPT")
    target, clean = load_model(args.model, device=args.device), load_model(args.clean, device=args.device)
    dtype = torch_dtype(args.dtype)
    chosen = f"--blame {args.blame}" if not args.component else f"--component {args.component}"
    command = (f"fxreplace repro write {args.model} --reference {args.reference} --clean {args.clean} {chosen} "
               f"--dtype {args.dtype} --inputs {args.inputs} --out {args.out}")
    try:
        out = write_repro(target, clean, reference, component, args.out, dtype=dtype, inputs=args.inputs,
                          command=command, source={"model": args.clean, "target": args.model})
    except ReproError as e:
        raise UsageError(str(e)) from None
    meta = json.loads((out / META).read_text())
    held = " and ".join(f"{sum(i['call'] == kind for i in meta['inputs'])} {kind}" for kind in meta["programs"])
    print(f"repro of {component} ({held} calls) -> {out}; run it: fxreplace repro run {out} --backend inductor "
          f"(or python {out / 'run.py'} --backend inductor)")
    for line in unrecorded(meta):
        print(f"not recorded: {line}")
    return 0


def run(args) -> int:
    """Run a repro folder per backend (see :mod:`fxreplace.repro_run`)."""
    try:
        return run_repro(args.dir, args.backend, args.bisect, args.tolerance)
    except ReproError as e:
        raise UsageError(str(e), "write the folder with `fxreplace repro write`") from None
