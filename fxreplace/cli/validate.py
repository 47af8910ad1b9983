"""``fxreplace validate``: teacher-forced logit validation of a target through an engine."""

from __future__ import annotations

from pathlib import Path

from ..junit import write_validation_junit
from ..report import print_summary
from ..validation import Gate, logit_validation
from .args import EXIT_GATE_FAILED, EXIT_OK
from .common import check_writable_dir, dispatch_args, folder_state, load_reference_arg
from .running import decoder, engine_run, noise_floor, reference_caveat


def run(args) -> int:
    dispatch_args(args)  # its mistakes before anything loads
    spec, request = engine_run(args, "validate")
    reference = request.reference = load_reference_arg(args.reference)
    caveat = reference_caveat(args, reference)
    check_writable_dir(args.report_dir, "--report-dir")
    args.produced.describe = lambda: f"no report written ({folder_state(args.report_dir, '--report-dir')})"
    # the clean model, if measured, is gone before the target loads
    floor = noise_floor(args, reference, spec.floor_program(request))
    opened = spec.open_validation(request)
    try:
        if opened.description:
            print(opened.description)
        result = logit_validation(opened.engine, reference, router_topk=opened.router_topk,
                                  tokenizer=decoder(args.model, reference))
    finally:
        opened.close()
    compiled = spec.compiled(request)
    result.replaced = _targets_label(opened.replaced)
    result.floor, result.caveat = floor, caveat
    result.program = {"engine": spec.name, "compile": compiled, "dtype": args.dtype}
    graphs = opened.engine.graphs_compiled
    return _report(result, args, reference, f"graphs compiled: {graphs}" if compiled and graphs is not None else "")


def _report(result, args, reference, extra: str = "") -> int:
    """Write the report, print the summary and verdict; with a gate, the exit code says whether it passed."""
    gate = Gate.parse(args.fail_on or [])
    result.gate = gate.outcome(result, args.fail_on) if args.fail_on else None  # both reports record it
    result.write_report(args.report_dir)
    print_summary(result)
    if extra:
        print(extra)
    mismatch = _another_model(result, args.model, reference)
    if mismatch:
        print(mismatch)
    print(f"report: {Path(args.report_dir).resolve() / 'report.html'}")
    if args.junit:
        print(f"junit: {write_validation_junit(result, gate, args.junit).resolve()}")
    if result.gate is None:
        return EXIT_OK
    print(gate.describe(result.gate, result.num_prompts))
    return EXIT_OK if result.gate["passed"] else EXIT_GATE_FAILED


def _another_model(result, model: str, reference) -> str:
    """A target that picks another token than the reference at the first step of every prompt, and
    whose replaced targets do not change that, is most likely not the model the reference came from."""
    summary = result.summary()
    off, on = summary.get("off"), summary.get("on")
    if not off or len(off["prompts"]) < 2 or any(p["first_divergence"] != 0 for p in off["prompts"].values()):
        return ""
    if on and any(p["first_divergence"] != 0 for p in on["prompts"].values()):
        return ""
    source = reference.metadata.get("source_model") or "unrecorded"
    return (f"note: {model} picks another token than the reference at the first step of every prompt, with "
            f"and without replacement: is it the model the reference was captured from ({source}), or a port of it? "
            "A model with other weights (another checkpoint of the same architecture) drifts like this from the start")


def _targets_label(targets) -> str:
    """What mode "on" replaces, in the verdict's words."""
    names = [getattr(t, "pattern", t) for t in targets]
    return f"the targets ({', '.join(map(str, names[:3]))}{' ...' if len(names) > 3 else ''})"
