"""``fxreplace blame``: the components that explain the divergence, through an engine."""

from __future__ import annotations

import json
from pathlib import Path

from ..blame import BlameError, blame
from ..components import ComponentError
from ..junit import write_blame_junit
from ..loading import check_reference_matches, check_vocab, load_model, model_architecture
from ..report import describe_program, repro_step, write_blame_report
from ..store.publish import BLAME_COMPONENTS_DIR
from .args import EXIT_OK, UsageError
from .common import check_writable_dir, dispatch_args, folder_state, load_reference_arg
from .running import engine_run, noise_floor, reference_caveat


def run(args) -> int:
    """Search for the components that explain the divergence (see :mod:`fxreplace.blame`)."""
    program_of_validation(args)
    dispatch_args(args)  # its mistakes before anything loads
    spec, request = engine_run(args, "blame")
    reference = request.reference = load_reference_arg(args.reference)
    reference_caveat(args, reference)  # refused here; blame() states the caveat
    check_writable_dir(args.report_dir, "--report-dir")
    args.produced.describe = lambda: blame_state(args)
    # the clean model, if measured, is gone before the target loads
    floor = noise_floor(args, reference, spec.floor_program(request))
    try:
        opened = spec.open_blame(request)  # an engine may refuse the reference (e.g. vLLM: no components recorded)
    except ComponentError as e:
        raise UsageError(str(e)) from None
    try:
        # the embedded engine captures the components the reference lacks from --clean on demand
        result = blame(opened.engine, args.reference, clean=_clean_loader(args, reference), budget=args.budget,
                       floor=floor, allow_low_precision_reference=args.allow_low_precision_reference)
    except BlameError as e:
        raise UsageError(str(e)) from None
    finally:
        opened.close()
    result.program = {"engine": spec.name, "compile": spec.compiled(request), "dtype": args.dtype}
    _say(result, args)
    return EXIT_OK


def _clean_loader(args, reference):
    """``--clean`` as a function loading the clean model for each capture only (blame holds the
    target's weights alone), checked against the reference first; None without ``--clean``."""
    if not args.clean:
        return None
    check_reference_matches(reference, args.reference, args.clean, model_architecture(args.clean))

    def clean():
        loaded = load_model(args.clean, dispatch=dispatch_args(args), device=args.device)
        check_vocab(reference, args.clean, loaded.config.vocab_size)
        return loaded
    return clean


def _say(result, args) -> None:
    """Write the report and print the ranking, the program examined, the verdict and what to do
    next: the terminal says what blame.html says."""
    ranking = Path(args.report_dir).resolve() / "blame.json"
    next_step = (repro_step(args.model, args.reference, ranking, result.repro)
                 if any(o.component for o in result.origins) else "")  # repro takes a component, not a layer
    report = write_blame_report(result, args.report_dir, next_step)
    print()
    print(result.table())
    validated = "" if args.from_validation else " (no validation given: --from-validation DIR examines the program it ran)"
    print(f"program examined: {describe_program(result.program)}{validated}")
    print(f"verdict: {result.verdict}")
    print(f"report: {report.resolve()}   ranking: {ranking}")
    if next_step:
        print(f"next: {next_step}")
    if args.junit:
        print(f"junit: {write_blame_junit(result, args.junit).resolve()}")


def program_of_validation(args) -> None:
    """Blame examines the program validate ran: with --from-validation (or a --report-dir where
    validate wrote its result.json), its engine, compile mode and dtype (recorded in result.json)
    fill what the command line leaves out; a flag contradicting them is refused. Without one: the
    same defaults as validate (runner, eager, bfloat16). The report goes beside the validation's."""
    if not args.from_validation and args.report_dir and (Path(args.report_dir) / "result.json").is_file():
        args.from_validation = args.report_dir
        print(f"blame examines the program validated in {args.report_dir} (its result.json)")
    args.report_dir = args.report_dir or args.from_validation or "fxreplace-blame"
    program = {}
    if args.from_validation:
        path = Path(args.from_validation) / "result.json"
        try:
            program = json.loads(path.read_text()).get("program") or {}
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"--from-validation: cannot read {path}: {e}",
                             "give the --report-dir a `fxreplace validate` run wrote") from None
        if not program:
            raise UsageError(f"--from-validation: {path} records no program (written by an older fxreplace)",
                             "run `fxreplace validate` again, or give --engine/--compile/--dtype")
    for option, key in (("--engine", "engine"), ("--dtype", "dtype")):
        given = getattr(args, key)
        if given is not None and key in program and given != program[key]:
            raise UsageError(f"{option} {given} contradicts the validation in {args.from_validation} ({option} "
                             f"{program[key]})", f"leave {option} out: blame examines the program validate ran")
    args.engine = args.engine or program.get("engine", "embedded")
    args.dtype = args.dtype or program.get("dtype", "bfloat16")
    if "compile" in program:
        if args.compile is not None and args.compile != program["compile"]:
            raise UsageError(f"--{'compile' if args.compile else 'no-compile'} contradicts the validation in "
                             f"{args.from_validation} ({'compiled' if program['compile'] else 'eager'})",
                             "leave it out: blame examines the program validate ran")
        args.compile = program["compile"]


def blame_state(args) -> str:
    """An unfinished blame's products: components captured from ``--clean`` are kept in the
    reference and reused by the next run."""
    components = Path(args.reference).resolve() / BLAME_COMPONENTS_DIR
    kept = (f"; the components captured from --clean are kept in {components} and reused by a rerun"
            if components.is_dir() else "")
    return f"no blame report written ({folder_state(args.report_dir, '--report-dir')}){kept}"
