"""What validate and blame share: the engine run a command line asks for (options the engine
does not take refused before anything loads), the reference's caveat and its noise floor."""

from __future__ import annotations

from pathlib import Path

from ..dtypes import is_full_precision
from ..engines.registry import EngineRun, EngineSpec, get_engine
from ..floor import FloorFileError, check_reference_precision, floor_for, stored_floors
from ..loading import check_reference_matches, check_vocab, load_model, load_tokenizer, model_architecture
from ..store.publish import FLOOR_FILE
from .args import UsageError, say_interrupted
from .common import components_arg, dispatch_args, engine_options, refuse_untaken, torch_dtype

#: Each engine-specific option: its attribute on the parsed arguments and the value meaning "not given".
ENGINE_OPTIONS = {"--component": ("component", None), "--bucket": ("bucket", None), "--logprobs": ("logprobs", -1),
                  "--engine-args": ("engine_args", "{}"), "--clean": ("clean", None), "--device": ("device", None)}


def engine_run(args, command: str) -> tuple[EngineSpec, EngineRun]:
    """The engine ``args.engine`` names and the run the command line asks of it; an engine-specific
    option the engine does not take is refused here, before anything loads (``--clean`` only
    for blame: validate's clean model measures the noise floor, whatever the engine)."""
    spec = get_engine(args.engine)
    refuse_untaken(args, {option: given for option, given in ENGINE_OPTIONS.items()
                          if option != "--clean" or command == "blame"}, spec)
    run = EngineRun(model=args.model, reference=None, reference_dir=args.reference, dtype=args.dtype,
                    compile=args.compile, targets=getattr(args, "target", None), device=args.device,
                    options=engine_options(args, spec), bucket=getattr(args, "bucket", None),
                    logprobs=getattr(args, "logprobs", -1),
                    components=components_arg(args.component) if getattr(args, "component", None) else None,
                    interrupted=lambda: say_interrupted(args.produced))
    return spec, run


def reference_caveat(args, reference) -> str:
    """A reference below float32 is refused unless --allow-low-precision-reference; the caveat the verdict states."""
    try:
        return check_reference_precision(reference, args.allow_low_precision_reference,
                                         "--allow-low-precision-reference")
    except ValueError as e:
        message, _, hint = str(e).rpartition("; ")
        raise UsageError(message, hint) from None


def gates_on_floor(args) -> bool:
    return any(c.startswith("floor=") for c in getattr(args, "fail_on", None) or [])


def noise_floor(args, reference, compile: str | None = None):
    """The noise floor for ``args.dtype`` of the program the target runs (``compile``: the torch.compile
    backend of the runner's compiled program, None: eager): stored in the reference (``capture
    --noise-floor``) when it covers its prompts, else measured from ``--clean``; None for a float32
    target or when neither is at hand (a ``--fail-on floor=K`` then refuses before any pass). A stored
    floor that cannot be read, that covers other prompts while no ``--clean`` can measure one, or that
    is another program's while the gate needs this one's, is refused before the target loads."""
    if is_full_precision(args.dtype):
        if gates_on_floor(args):
            raise UsageError(f"--fail-on floor=K scores a target below float32 against its noise floor; this target "
                             f"runs in {args.dtype}", "give --dtype bfloat16 (or float16), or gate on kl=X / top5=Y")
        return None

    def clean():
        check_reference_matches(reference, args.reference, args.clean, model_architecture(args.clean))
        # in the dtype, as the target is
        model = load_model(args.clean, torch_dtype(args.dtype), dispatch_args(args), args.device)
        check_vocab(reference, args.clean, model.config.vocab_size)
        print(f"noise floor: {args.clean} in {args.dtype} against the reference")
        return model
    try:
        floor, _ = floor_for(reference, torch_dtype(args.dtype), args.reference,
                             clean=clean if getattr(args, "clean", None) else None, progress=True, compile=compile)
        others = [f for f in stored_floors(reference, args.reference).values() if f.dtype == args.dtype]
    except FloorFileError as e:
        raise UsageError(str(e), f"capture the reference again with `--noise-floor {args.dtype}`") from None
    if floor is not None and floor.covers(range(reference.num_prompts)):
        return floor
    if floor is not None:  # stored, for other prompts (given --clean, floor_for measured one on these)
        raise UsageError(f"the noise floor stored with {args.reference} ({FLOOR_FILE}) covers prompts "
                         f"{sorted(floor.prompts)[:5]} but the reference holds {reference.num_prompts}: it was measured "
                         "on another capture", f"give the clean model as --clean MODEL to measure it on these prompts, "
                         f"or capture the reference again with `--noise-floor {args.dtype}`")
    if others:  # of another program: its kernels round otherwise, so it does not scale this target
        program = f"compiled with {compile}" if compile else "eager"
        held = ", ".join(f.programme for f in others)
        if gates_on_floor(args):
            raise UsageError(f"--fail-on floor=K needs the noise floor of the program gated (the reference in "
                             f"{args.dtype}, {program}), and {args.reference} holds {held}: a floor of another program "
                             "does not scale this one", f"capture the reference with `--noise-floor {args.dtype}"
                             f"{' --compile' if compile else ''}`, or give the clean model as --clean MODEL")
        print(f"noise floor: none of this program ({args.dtype}, {program}) in {args.reference}, which holds {held}: "
              "the verdict has no scale")
        return None
    if gates_on_floor(args):
        raise UsageError(f"--fail-on floor=K needs the noise floor in {args.dtype}, and {args.reference} holds none",
                         f"capture the reference with `--noise-floor {args.dtype}`, or give the clean model as "
                         "--clean MODEL")
    return None


def decoder(model: str, reference):
    """A tokenizer to decode the tokens at divergences: the target checkpoint's, else the
    reference model's (its directory recorded at capture); None when neither has one."""
    for spec in (model, str(reference.metadata.get("source_model") or "")):
        if spec and not spec.startswith("builtin:") and Path(spec).is_dir():
            tokenizer = load_tokenizer(spec)
            if tokenizer is not None:
                return tokenizer
    return None
