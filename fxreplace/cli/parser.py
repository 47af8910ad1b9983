"""The ``fxreplace`` command line (also what docs/cli.md is generated from): one function per
command adds its arguments. Parsing loads nothing heavy: each command's module is imported
when it runs."""

from __future__ import annotations

import argparse

from ..dtypes import LOW_PRECISION
from .args import (DTYPES, DefaultsFormatter, Parser, add_device_argument, add_dispatch_arguments, add_engine_arguments,
                   existing_file,
                   gate_condition, junit_path, model_spec, positive_int, reference_path)


def build_parser() -> Parser:
    """The command line (also what docs/cli.md is generated from)."""
    parser = Parser(prog="fxreplace", formatter_class=DefaultsFormatter,
                    description="Tensor replacement for accuracy debugging of compiled LLMs.",
                    epilog="exit codes: 0 success; 1 a --fail-on gate failed (or inspect --verify found damage); "
                           "2 a user's mistake; 3 an internal error; 130 interrupted (each one line saying what "
                           "was written; --debug adds the traceback)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="print the traceback of an error too")

    def command(name: str, help: str) -> Parser:
        return sub.add_parser(name, help=help, description=help, parents=[common], formatter_class=DefaultsFormatter)

    _add_demo(command)
    _add_capture(command)
    _add_validate(command)
    _add_blame(command)
    _add_repro(command, common)
    _add_inspect(command)
    _add_repack(command)
    return parser


def _add_demo(command) -> None:
    """``fxreplace demo``'s arguments."""
    demo = command("demo", "capture, run compiled bf16 with and without router replacement, validate, blame, report")
    demo.add_argument("--prompts", type=positive_int, default=8, help="random prompts of 8-24 tokens")
    demo.add_argument("--new-tokens", type=positive_int, default=32, help="tokens generated per prompt")
    demo.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                      help="torch.compile the target (inductor)")
    demo.add_argument("--eager", dest="compile", action="store_const", const=False, help="the same as --no-compile")
    demo.add_argument("--report-dir", default="fxreplace-report", help="folder for report.html and blame.html")
    add_device_argument(demo)
    demo.set_defaults(handler="fxreplace.cli.demo:run")


def _add_capture(command) -> None:
    """``fxreplace capture``'s arguments."""
    capture = command("capture", "capture reference tensors and logits from an HF model")
    capture.add_argument("model", type=model_spec, help="builtin:ARCH or a local HF checkpoint directory")
    capture.add_argument("--prompts", required=True, type=existing_file,
                         help="JSON list of texts or token id lists, or JSONL lines {\"prompt\": ...} / "
                              "{\"messages\": [...]}; text goes through the checkpoint's tokenizer")
    capture.add_argument("--chat", action="store_true",
                         help="send each text prompt as one user message through the tokenizer's chat template")
    capture.add_argument("--target", action="append",
                         help="target pattern, repeatable (default: the family's routers)")
    capture.add_argument("--max-new-tokens", type=positive_int, default=32, help="greedy tokens per prompt")
    capture.add_argument("--out", required=True, help="reference directory to write")
    capture.add_argument("--components", action="store_true",
                         help="also record the family's blame components (attention, router, experts, layer outputs)")
    capture.add_argument("--component", action="append", metavar="KIND=PATTERN[@POINT]",
                         help="record this component instead of the family's (repeatable)")
    capture.add_argument("--noise-floor", choices=LOW_PRECISION, metavar="DTYPE",
                         help="also measure the noise floor: the model in DTYPE (bfloat16, float16) teacher-forced "
                              "against this reference; stored in it, it gives validate's and blame's verdicts a scale "
                              "(with --compile also the floor of the compiled program, which validate --compile reads)")
    add_dispatch_arguments(capture, "the reference (and --noise-floor's model)")
    add_engine_arguments(capture, "embedded", "embedded: the HF model in this process, in float32")
    capture.add_argument("--dtype", choices=DTYPES, default="float32", help="--engine vllm: the engine's dtype")
    add_device_argument(capture, engines=True)
    capture.set_defaults(handler="fxreplace.cli.capture:run")


def _add_validate(command) -> None:
    """``fxreplace validate``'s arguments."""
    validate = command("validate", "teacher-forced logit validation of a target against a reference")
    validate.add_argument("model", type=model_spec, help="builtin:ARCH or a local HF directory (the target's weights)")
    validate.add_argument("--reference", required=True, type=reference_path, help="directory written by `fxreplace capture`")
    add_engine_arguments(validate, "embedded", "embedded")
    validate.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the target's dtype")
    validate.add_argument("--bucket", type=positive_int,
                          help="--engine embedded: prefill bucket in tokens (default: the longest reference sequence "
                               "rounded up to a power of two); decode batch: min(8, prompts)")
    validate.add_argument("--logprobs", type=int, default=-1,
                          help="--engine vllm: log-probs per step, -1 = whole vocabulary (exact metrics); "
                               "k > 0 fills the rest with the smallest returned value")
    validate.add_argument("--target", action="append", help="target pattern, repeatable (default: the family's routers)")
    validate.add_argument("--clean", metavar="CKPT", type=model_spec,
                          help="the clean model the reference came from: measures the noise floor (it in --dtype) when "
                               "the reference holds none for --dtype (`capture --noise-floor`)")
    add_dispatch_arguments(validate, "--clean")
    validate.add_argument("--report-dir", default="fxreplace-report",
                          help="folder for report.html, result.json and the plots")
    validate.add_argument("--fail-on", action="append", type=gate_condition, metavar="{diverged,kl=X,top5=Y,floor=K}",
                          help="exit 1 when the target without replacement fails: a prompt's top-1 token differs "
                               "(diverged), its mean KL > X, its mean top-5 error > Y; over every prompt, its mean KL "
                               "or top-5 error > K times the noise floor's (the verdict's scale) (repeatable)")
    validate.add_argument("--allow-low-precision-reference", action="store_true",
                          help="accept a reference captured below float32 (refused otherwise: its own rounding is part "
                               "of every measure); the verdict says so")
    validate.add_argument("--junit", type=junit_path, metavar="FILE",
                          help="write JUnit XML: one test case per prompt, failed by --fail-on")
    add_device_argument(validate, engines=True)
    validate.set_defaults(handler="fxreplace.cli.validate:run")


def _add_blame(command) -> None:
    """``fxreplace blame``'s arguments."""
    blame = command("blame", "find every component that explains the divergence (split over the layers' streams, "
                             "then each kind of the origin layer, origin after origin)")
    blame.add_argument("model", type=model_spec, help="builtin:ARCH or a local HF directory (the target's weights)")
    blame.add_argument("--reference", required=True, type=reference_path,
                       help="directory written by `fxreplace capture --components`")
    blame.add_argument("--from-validation", metavar="DIR",
                       help="the --report-dir of a `fxreplace validate` run: blame examines the program it ran (its "
                            "engine, compile mode and dtype, from DIR/result.json)")
    add_engine_arguments(blame, None, "runner, or the validation's")
    blame.add_argument("--dtype", choices=DTYPES, help="the target's dtype (default: bfloat16, or the validation's)")
    blame.add_argument("--component", action="append", metavar="KIND=PATTERN[@POINT]",
                       help="candidate component for a family that declares none (repeatable)")
    blame.add_argument("--clean", metavar="CKPT", type=model_spec,
                       help="the clean model the reference came from (builtin:ARCH or an HF directory): components the "
                            "reference lacks are captured from it as the search needs them, stored under the reference "
                            "directory and reused (--engine embedded)")
    add_dispatch_arguments(blame, "--clean (for the noise floor and the components captured on demand)")
    blame.add_argument("--allow-low-precision-reference", action="store_true",
                       help="accept a reference captured below float32 (refused otherwise); the verdict says so")
    blame.add_argument("--budget", type=positive_int, help="the most validation passes the search may run "
                       "(default: enough for 4 origins and the diffuse heat map)")
    blame.add_argument("--report-dir", help="folder for blame.html and blame.json (default: fxreplace-blame, or the "
                       "--from-validation folder, where the two reports link); a validation's folder given here is "
                       "its --from-validation too")
    blame.add_argument("--junit", type=junit_path, metavar="FILE",
                       help="write JUnit XML: one test case per ranked component, failed when it accounts for a share "
                            "of the divergence")
    add_device_argument(blame, engines=True)
    blame.set_defaults(handler="fxreplace.cli.blame:run")


def _add_repro(command, common) -> None:
    """``fxreplace repro``'s arguments."""
    repro = command("repro", "the blamed component alone, as a ticket for the compiler team: write its folder "
                             "(exported program, inputs from the reference run, reference outputs), run it per backend")
    steps = repro.add_subparsers(dest="step", required=True, metavar="STEP")
    write = steps.add_parser("write", help="export the target's component with its reference inputs and outputs",
                             parents=[common], formatter_class=DefaultsFormatter)
    write.add_argument("model", type=model_spec, help="builtin:ARCH or a local HF directory (the target's weights)")
    write.add_argument("--reference", required=True, type=reference_path, help="the reference blame used")
    write.add_argument("--clean", type=model_spec, help="the reference model (its component's inputs; default: the "
                       "model the reference was captured from, as its metadata records it)")
    write.add_argument("--blame", metavar="BLAME_JSON", type=existing_file,
                       help="blame.json of `fxreplace blame`: its first origin's component")
    write.add_argument("--component", metavar="NAME", help="the component instead (a capture name or module path)")
    write.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the target's dtype (as blamed)")
    write.add_argument("--inputs", type=positive_int, default=4,
                       help="calls kept of each kind (prefill, decode with the KV cache): those where the target's "
                            "component departs most from the reference's")
    write.add_argument("--out", required=True, help="the repro folder to write")
    add_device_argument(write)
    write.set_defaults(handler="fxreplace.cli.repro:write")
    run = steps.add_parser("run", help="run a repro folder under a backend: the port or the compiler?",
                           parents=[common], formatter_class=DefaultsFormatter)
    run.add_argument("dir", help="a folder written by `fxreplace repro write`")
    from ..repro_run import add_arguments  # run.py's own options (it runs without fxreplace): one home for both

    add_arguments(run)
    run.set_defaults(handler="fxreplace.cli.repro:run")


def _add_inspect(command) -> None:
    """``fxreplace inspect``'s arguments."""
    inspect = command("inspect", "list candidate injection points with their shapes, or --verify a reference")
    inspect.add_argument("model", nargs="?", type=model_spec, help="builtin:ARCH or a local HF directory")
    inspect.add_argument("--verify", metavar="REF", type=reference_path,
                         help="check a reference store byte by byte against its recorded digests")
    inspect.add_argument("--tokens", type=positive_int, default=4, help="tokens of the probe forward")
    inspect.add_argument("--check-live", nargs="*", metavar="TARGET",
                         help="prove each target reaches the logits: PATTERN or PATTERN@POINT (default: the family's)")
    inspect.set_defaults(handler="fxreplace.cli.inspection:inspect")


def _add_repack(command) -> None:
    """``fxreplace repack``'s arguments."""
    repack = command("repack", "rewrite a reference store of many small shards (a vLLM capture writes one per idle) "
                               "as few large ones; prompts and rows unchanged")
    repack.add_argument("reference", type=reference_path, help="the store directory to read (left as it is)")
    repack.add_argument("--out", required=True, help="a new or empty directory for the repacked store")
    repack.add_argument("--shard-mib", type=positive_int, default=256,
                        help="MiB per output shard (consecutive shards are joined up to it; a larger one stays whole)")
    repack.set_defaults(handler="fxreplace.cli.inspection:repack")
