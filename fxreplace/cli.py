"""The ``fxreplace`` command: demo, capture, validate, blame, inspect."""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

HF_EXTRA = {"transformers", "tqdm", "matplotlib"}  # the `hf` extra: every command needs it


def load_model(spec: str):
    """``builtin:ARCH`` (a tiny random model from fxreplace.models) or a local HF directory (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    if spec.startswith("builtin:"):
        from fxreplace.models import tiny_model

        return tiny_model(spec.removeprefix("builtin:"))
    check_model_dir(spec)
    try:
        return AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32).eval()
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: cannot load the model in {spec}: {e}") from None


def check_model_dir(spec: str) -> None:
    """A local model directory must at least hold a Hugging Face ``config.json``."""
    if not Path(spec).is_dir():
        raise SystemExit(f"error: model {spec!r} is neither builtin:ARCH nor a local directory")
    if not (Path(spec) / "config.json").is_file():
        raise SystemExit(f"error: {spec} holds no config.json: not a Hugging Face model directory")


def model_architecture(spec: str) -> str:
    """The architecture a ``builtin:ARCH`` spec or a model directory's config.json names."""
    if spec.startswith("builtin:"):
        return spec.removeprefix("builtin:")
    try:
        config = json.loads((Path(spec) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: cannot read {Path(spec) / 'config.json'}: {e}") from None
    return (config.get("architectures") or ["unknown"])[0]


def check_writable_dir(path: str, option: str) -> None:
    """Create ``path`` now and check it takes files, so a long run cannot fail at its end."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".fxreplace-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise SystemExit(f"error: {option} {path} is not a writable directory: {e}") from None


def check_reference_matches(reference, reference_path: str, model_name: str, arch: str) -> None:
    """A reference captured from another architecture would be replayed into the wrong
    modules (or the same names with another meaning) without any shape error."""
    recorded = reference.metadata.get("architecture")
    if recorded and recorded != arch:
        raise SystemExit(f"error: the reference {reference_path} was captured from {recorded} "
                         f"(captures {reference.store.capture_names[:2]} ...) but {model_name} is {arch}")


def default_targets(model) -> list:
    from fxreplace.models import architecture, get_family

    return list(get_family(architecture(model.config, type(model).__name__)).targets)


def read_prompts(path: str, vocab_size: int) -> list[list[int]]:
    """The prompts file (a JSON list of token id lists), checked against the model's vocabulary."""
    from .capture import check_prompts

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: cannot read prompts file {path}: {e}") from None
    if not isinstance(data, list) or not all(isinstance(p, list) for p in data):
        raise SystemExit(f"error: {path} must hold a JSON list of token id lists")
    try:
        return check_prompts(data, vocab_size)
    except ValueError as e:
        raise SystemExit(f"error: {path}: {e}") from None


def _demo(args) -> int:
    from .demo import DemoConfig, run_demo

    run_demo(DemoConfig(prompts=args.prompts, new_tokens=args.new_tokens, compile=not args.eager, report_dir=args.report_dir))
    return 0


def _capture(args) -> int:
    if args.engine == "vllm":
        if args.components or args.component:
            raise SystemExit("error: --components/--component are for --engine hf (blame components are captured "
                             "from the HF reference)")
        return _capture_vllm(args)
    from .blame import family_components
    from .capture import capture_reference

    check_writable_dir(args.out, "--out")
    model = load_model(args.model)
    prompts = read_prompts(args.prompts, model.config.vocab_size)
    targets = args.target or default_targets(model)
    components = _components(args.component) if args.component else family_components(model) if args.components else None
    reference = capture_reference(model, prompts, targets, args.max_new_tokens, components=components)
    reference.metadata["source_model"] = args.model
    reference.save(args.out)
    print(f"captured {reference.num_prompts} prompts x {args.max_new_tokens} tokens at {len(reference.store.capture_names)} targets -> {args.out}")
    return 0


def _capture_vllm(args) -> int:
    """Capture through a vLLM engine in capture mode (see :mod:`fxreplace.vllm.capture`)."""
    if not Path(args.model).is_dir():
        raise SystemExit(f"error: --engine vllm needs a local checkpoint directory, got {args.model!r}")
    try:
        engine_args = json.loads(args.engine_args)
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: --engine-args is not JSON: {e}") from None
    if not isinstance(engine_args, dict):
        raise SystemExit("error: --engine-args must be a JSON object of vllm.LLM keyword arguments")
    with open(Path(args.model) / "config.json") as f:
        vocab_size = json.load(f)["vocab_size"]
    prompts = read_prompts(args.prompts, vocab_size)
    from .vllm.capture import capture_with_vllm

    longest = max(len(p) for p in prompts) + args.max_new_tokens
    engine_args.setdefault("max_model_len", max(longest, 128))
    counts = capture_with_vllm(args.model, prompts, args.out, max_new_tokens=args.max_new_tokens, targets=args.target,
                               dtype=args.dtype, enforce_eager=args.eager, **engine_args)
    print(f"captured {counts.get('completed', 0)} prompts x {args.max_new_tokens} tokens with vLLM "
          f"({counts.get('dropped', 0)} dropped) -> {args.out}")
    return 0 if counts.get("completed") == len(prompts) else 1


def _check_vocab(reference, model_name: str, vocab_size: int) -> None:
    if vocab_size != reference.vocab_size:
        raise SystemExit(f"error: the reference has vocab size {reference.vocab_size} but {model_name} has "
                         f"{vocab_size}: it was captured from another model")


def _longest_sequence(reference) -> int:
    """Prompt plus generated tokens of the longest reference prompt: what a retry can reach."""
    return max(len(reference.prompt_tokens(p)) + reference.num_generated(p) for p in range(reference.num_prompts))


def _replacement_config(args, **source):
    """The ReplacementConfig of a command line; a bad ``--target`` is a usage error naming it."""
    from .config import ConfigError, ReplacementConfig

    try:
        return ReplacementConfig(targets=args.target, **source)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


def _report(result, report_dir: str, extra: str = "") -> int:
    from .report import print_summary

    result.write_report(report_dir)
    print_summary(result)
    if extra:
        print(extra)
    print(f"report: {Path(report_dir).resolve() / 'report.html'}")
    return 0


def _validate(args) -> int:
    if args.engine == "vllm":
        return _validate_vllm(args)
    import torch

    from .config import ReplacementConfig
    from .instrument import instrument
    from .models import architecture
    from .reference import load_reference
    from .runner import Runner, RunnerConfig
    from .validation import logit_validation

    reference = load_reference(args.reference)
    check_writable_dir(args.report_dir, "--report-dir")
    model = load_model(args.model)
    check_reference_matches(reference, args.reference, args.model, architecture(model.config, type(model).__name__))
    _check_vocab(reference, args.model, model.config.vocab_size)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    replacement = _replacement_config(args, tensors=reference.store)
    targets = list(replacement.targets or default_targets(model))
    target = instrument(copy.deepcopy(model).to(dtype), targets)
    missing = [t for t in (t.capture_name for t in target._fxreplace.targets) if t not in reference.store.columns]
    if missing:
        raise SystemExit(f"error: the reference holds no captures for targets {missing}; it has {reference.store.capture_names}")
    bucket = 1 << (_longest_sequence(reference) - 1).bit_length()
    runner = Runner(
        target,
        model.config,
        replacer=replacement,
        runner_config=RunnerConfig(prefill_buckets=(bucket,), batch_buckets=(min(8, reference.num_prompts),), max_len=2 * bucket),
        dtype=dtype,
        observed=target,
        compile="inductor" if args.compile else None,
    )
    result = logit_validation(runner, reference, router_topk=getattr(model.config, "num_experts_per_tok", None))
    return _report(result, args.report_dir, f"graphs compiled: {runner.graphs_compiled}" if args.compile else "")


def _validate_vllm(args) -> int:
    """Teacher-forced validation through a real vLLM engine (the fxreplace plugin
    configured with the reference; see :mod:`fxreplace.vllm.engine`)."""
    from .reference import load_reference
    from .validation import logit_validation

    if args.model.startswith("builtin:"):
        raise SystemExit(f"error: --engine vllm needs a local checkpoint directory, got {args.model!r}")
    check_model_dir(args.model)
    if args.compile:
        raise SystemExit("error: --compile is for --engine runner; vLLM compiles by default (--eager to disable)")
    if args.logprobs == 0 or args.logprobs < -1:
        raise SystemExit(f"error: --logprobs must be -1 (whole vocabulary) or a positive count, got {args.logprobs}")
    reference = load_reference(args.reference)
    check_reference_matches(reference, args.reference, args.model, model_architecture(args.model))
    check_writable_dir(args.report_dir, "--report-dir")
    from .vllm.engine import VllmEngine

    longest = _longest_sequence(reference)
    engine = VllmEngine(args.model, _replacement_config(args, tensors_path=args.reference), dtype=args.dtype,
                        logprobs=args.logprobs,
                        enforce_eager=args.eager, max_model_len=max(longest + 8, 128),
                        max_num_seqs=min(8, reference.num_prompts))
    try:
        _check_vocab(reference, args.model, engine.vocab_size)
        with open(Path(args.model) / "config.json") as f:
            topk = json.load(f).get("num_experts_per_tok")
        result = logit_validation(engine, reference, router_topk=topk)
    finally:
        engine.close()
    return _report(result, args.report_dir)


def _components(specs: list[str]) -> dict:
    """``KIND=PATTERN[@POINT]`` options as ``{kind: Target}``."""
    from .targets import Target

    out = {}
    for spec in specs:
        kind, sep, rest = spec.partition("=")
        if not sep or not kind or not rest:
            raise SystemExit(f"error: --component {spec!r}: expected KIND=PATTERN[@POINT], e.g. "
                             "attention=model.layers.*.self_attn@output[0]")
        pattern, _, point = rest.partition("@")
        out[kind] = Target(pattern, point=point or "auto")
    return out


def _blame(args) -> int:
    """Search for the components that explain the divergence (see :mod:`fxreplace.blame`)."""
    import torch

    from .blame import BlameError, blame
    from .reference import load_reference

    reference = load_reference(args.reference)
    check_writable_dir(args.report_dir, "--report-dir")
    try:
        if args.engine == "vllm":
            if args.model.startswith("builtin:"):
                raise SystemExit(f"error: --engine vllm needs a local checkpoint directory, got {args.model!r}")
            check_model_dir(args.model)
            check_reference_matches(reference, args.reference, args.model, model_architecture(args.model))
            if args.compile or args.component or args.clean:
                raise SystemExit("error: --compile, --component and --clean are for --engine runner (vLLM compiles "
                                 "unless --eager; its components come from the family's vllm_components and the "
                                 "reference must hold them: capture them with `fxreplace capture --components`)")
            from .vllm.engine import VllmBlameEngine

            engine = VllmBlameEngine(args.model, args.reference, dtype=args.dtype, logprobs=-1, enforce_eager=args.eager,
                                     max_model_len=max(_longest_sequence(reference) + 8, 128),
                                     max_num_seqs=min(64, reference.num_prompts * 5))
            try:
                _check_vocab(reference, args.model, engine.vocab_size)
                result = blame(engine, reference, budget=args.budget)
            finally:
                engine.close()
        else:
            model = load_model(args.model)
            clean = load_model(args.clean) if args.clean else None
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
            result = blame(model, args.reference, clean=clean,
                           components=_components(args.component) if args.component else None,
                           dtype=dtype, compile="inductor" if args.compile else None, budget=args.budget)
    except BlameError as e:
        raise SystemExit(f"error: {e}") from None
    report = result.write_report(args.report_dir)
    print()
    print(result.table())
    print(f"verdict: {result.verdict}")
    print(f"report: {report.resolve()}   ranking: {Path(args.report_dir).resolve() / 'blame.json'}")
    return 0


def _inspect(args) -> int:
    import torch

    if args.verify:
        return _verify_store(args.verify)
    if args.model is None:
        raise SystemExit("error: inspect needs a model (builtin:ARCH or a directory) or --verify REF")
    model = load_model(args.model)
    shapes: dict[str, tuple] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or "gate" in name.rsplit(".", 1)[-1] or "router" in name.rsplit(".", 1)[-1]:
            def hook(mod, inputs, output, name=name):
                first = output[0] if isinstance(output, tuple) else output
                if isinstance(first, torch.Tensor):
                    shapes[name] = (type(mod).__name__, tuple(first.shape), isinstance(output, tuple))
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=torch.zeros(1, args.tokens, dtype=torch.long))
    for h in hooks:
        h.remove()
    print(f"candidate injection points for {args.model} ({args.tokens} tokens; routers first):")
    routers = [n for n in shapes if n.endswith((".gate", ".router"))]
    for name in routers + [n for n in shapes if n not in routers]:
        cls, shape, is_tuple = shapes[name]
        note = "returns a tuple: point 'auto' injects at its logits" if is_tuple else ""
        print(f"  {name:<40} {cls:<24} {str(shape):<16} {note}")
    return 0


def _verify_store(path: str) -> int:
    """Read every byte of a reference store: digests recorded at write, then finiteness."""
    from .store import CaptureError, ReferenceStore

    try:
        summary = ReferenceStore.load(path).verify()
    except (CaptureError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    finite = "every row finite" if summary["finite"] else "rows not checked for NaN/Inf (written with allow_nonfinite)"
    print(f"{path}: OK: {summary['prompts']} prompts in {summary['shards']} shard(s), "
          f"{summary['bytes'] / 2**20:.1f} MiB match the SHA-256 digests recorded at write; {finite}")
    return 0


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxreplace", description="Tensor replacement for accuracy debugging of compiled LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="capture, run compiled bf16 with and without router replacement, validate, report")
    demo.add_argument("--prompts", type=positive_int, default=8)
    demo.add_argument("--new-tokens", type=positive_int, default=32)
    demo.add_argument("--eager", action="store_true", help="do not torch.compile the target")
    demo.add_argument("--report-dir", default="fxreplace-report")
    demo.set_defaults(func=_demo)

    capture = sub.add_parser("capture", help="capture reference tensors and logits from an HF model")
    capture.add_argument("model", help="builtin:ARCH or a local HF directory")
    capture.add_argument("--prompts", required=True, help="JSON file: a list of token id lists")
    capture.add_argument("--target", action="append", help="target pattern (default: the family's routers); repeatable")
    capture.add_argument("--max-new-tokens", type=positive_int, default=32)
    capture.add_argument("--out", required=True, help="reference directory to write")
    capture.add_argument("--components", action="store_true",
                         help="also record the family's blame components (attention, router, experts, layer outputs)")
    capture.add_argument("--component", action="append", metavar="KIND=PATTERN[@POINT]",
                         help="record this component instead of the family's (repeatable)")
    capture.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                         help="hf: the HF model in this process; vllm: a vLLM engine in capture mode (MODEL: a checkpoint directory)")
    capture.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="--engine vllm")
    capture.add_argument("--eager", action="store_true", help="--engine vllm: enforce eager mode (no vLLM compile)")
    capture.add_argument("--engine-args", default="{}",
                         help='--engine vllm: JSON of vllm.LLM arguments, e.g. \'{"tensor_parallel_size": 2}\'')
    capture.set_defaults(func=_capture)

    validate = sub.add_parser("validate", help="teacher-forced logit validation of a target against a reference")
    validate.add_argument("model", help="builtin:ARCH or a local HF directory (the target's weights)")
    validate.add_argument("--reference", required=True, help="directory written by `fxreplace capture`")
    validate.add_argument("--engine", choices=["runner", "vllm"], default="runner",
                          help="runner: fxreplace's static-shape runner; vllm: a vLLM engine with the fxreplace plugin")
    validate.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    validate.add_argument("--compile", action="store_true", help="torch.compile the target (inductor; --engine runner)")
    validate.add_argument("--eager", action="store_true", help="--engine vllm: enforce eager mode (no vLLM compile)")
    validate.add_argument("--logprobs", type=int, default=-1,
                          help="--engine vllm: log-probs per step, -1 = whole vocabulary (exact metrics); "
                               "k > 0 fills the rest with the smallest returned value")
    validate.add_argument("--target", action="append")
    validate.add_argument("--report-dir", default="fxreplace-report")
    validate.set_defaults(func=_validate)

    blame = sub.add_parser("blame", help="find every component that explains the divergence (split over the layers' "
                                          "streams, then each kind of the origin layer, origin after origin)")
    blame.add_argument("model", help="builtin:ARCH or a local HF directory (the target's weights)")
    blame.add_argument("--reference", required=True, help="directory written by `fxreplace capture --components`")
    blame.add_argument("--engine", choices=["runner", "vllm"], default="runner")
    blame.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    blame.add_argument("--compile", action="store_true", help="torch.compile the target (inductor; --engine runner)")
    blame.add_argument("--eager", action="store_true", help="--engine vllm: enforce eager mode")
    blame.add_argument("--component", action="append", metavar="KIND=PATTERN[@POINT]",
                       help="candidate component for a family that declares none (repeatable)")
    blame.add_argument("--clean", metavar="CKPT", help="the clean model the reference came from (builtin:ARCH or an "
                       "HF directory): components the reference lacks are captured from it as the search needs them, "
                       "stored under the reference directory and reused (--engine runner)")
    blame.add_argument("--budget", type=int, help="the most validation passes the search may run "
                       "(default: enough for 4 origins and the diffuse heat map)")
    blame.add_argument("--report-dir", default="fxreplace-blame")
    blame.set_defaults(func=_blame)

    inspect = sub.add_parser("inspect", help="list candidate injection points with their shapes, or --verify a reference")
    inspect.add_argument("model", nargs="?", help="builtin:ARCH or a local HF directory")
    inspect.add_argument("--verify", metavar="REF", help="check a reference store byte by byte against its recorded digests")
    inspect.add_argument("--tokens", type=positive_int, default=4)
    inspect.set_defaults(func=_inspect)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ModuleNotFoundError as error:
        if error.name not in HF_EXTRA:
            raise
        sys.exit(f"fxreplace {args.command} needs {error.name}: pip install 'fxreplace[hf]'")


if __name__ == "__main__":
    sys.exit(main())
