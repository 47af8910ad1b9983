"""``fxreplace capture``: the reference, from the HF model in this process or a vLLM engine."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from ..blame import BlameError, family_components
from ..capture import capture_reference
from ..floor import measure_floor, save_floor
from ..loading import check_checkpoint_dir, config_json, default_targets, load_model
from ..models import architecture
from ..reference import load_reference
from ..store.format import publish_directory, staging_directory
from .args import EXIT_INTERNAL, EXIT_OK, UsageError
from .common import (check_capture_out, components_arg, dispatch_args, engine_options, store_state, torch_dtype)
from .prompts import checked_ids, read_prompts, tokenize_args

#: The engines a reference is captured with (capture is not part of an engine's registration yet).
CAPTURE_ENGINES = ("runner", "vllm")


def run(args) -> int:
    if args.engine not in CAPTURE_ENGINES:
        raise UsageError(f"--engine {args.engine} cannot capture a reference", "capture with --engine runner or vllm")
    if args.engine == "vllm":
        if args.components or args.component or args.noise_floor:
            raise UsageError("--components/--component/--noise-floor are for --engine runner (blame components and "
                             "the noise floor are captured from the HF reference)")
        if args.device_map or args.max_memory or args.offload_folder:
            raise UsageError("--device-map/--max-memory/--offload-folder are for --engine runner",
                             "vLLM places the model itself: pass its options in --engine-args")
        return _capture_vllm(args)
    if args.compile:
        raise UsageError("--compile: the runner captures the model's own eager forwards (the reference)",
                         "leave --compile out, or capture with --engine vllm")

    dispatch = dispatch_args(args)
    ids, texts = tokenize_args(read_prompts(args.prompts), args.model, args.prompts, args.chat)
    components = components_arg(args.component) if args.component else None
    check_capture_out(args.out, replace=True)
    model = load_model(args.model, dispatch=dispatch, device=args.device)
    prompts = checked_ids(ids, model.config.vocab_size, args.prompts)
    targets = args.target or _capture_targets(args, model, components)
    if args.components and not args.component:
        try:
            components = family_components(model)
        except BlameError as e:
            raise UsageError(str(e).partition("; ")[0], "name them with --component KIND=PATTERN[@POINT] (repeatable; "
                             f"`fxreplace inspect {args.model}` lists the modules)") from None
    metadata = {"source_model": _absolute(args.model), "prompt_texts": texts}
    if args.component:  # blame reuses them: --component need not be repeated there
        metadata["component_targets"] = {kind: {"pattern": t.pattern, "point": t.point} for kind, t in components.items()}
    # prompts stream into the store as they complete; an earlier store at --out is replaced
    # whole at the end (captured beside it, then renamed into place)
    out = Path(args.out)
    replacing = any(out.iterdir())
    into = staging_directory(out) if replacing else out
    if replacing:
        before = store_state(out)
        args.produced.describe = lambda: (f"--out {out.resolve()} unchanged: it holds {before} (the new capture, "
                                          "written beside it, was removed); rerun the command to capture")
    else:
        args.produced.describe = lambda: (f"--out {out.resolve()} holds {store_state(out)}; capture again into a "
                                          "new --out (or delete this one) for every prompt")
    try:
        reference = capture_reference(model, prompts, targets, args.max_new_tokens, components=components, out=into,
                                      metadata=metadata)
        if replacing:
            publish_directory(into, out, replace=True)
    except FileExistsError as e:
        raise UsageError(f"--out {args.out}: {e}", "choose a new or empty --out") from None
    finally:
        if replacing:
            shutil.rmtree(into, ignore_errors=True)
    floor = None
    if args.noise_floor:
        reference = load_reference(args.out)
        del model  # the floor's model is loaded in its dtype, as validate and blame load the target
        floor = measure_floor(load_model(args.model, torch_dtype(args.noise_floor), dispatch, args.device), reference,
                              torch_dtype(args.noise_floor), progress=True)
        save_floor(floor, args.out)
    print(f"captured {reference.num_prompts} prompts x {args.max_new_tokens} tokens at {len(reference.store.capture_names)} targets -> {args.out}")
    if floor:
        whole = floor.aggregate(range(reference.num_prompts))
        print(f"noise floor (the model in {floor.dtype}, {floor.seconds:.1f} s): mean KL {whole['mean_kl']:.3g}, mean "
              f"top-5 error {whole['mean_top5_error']:.3g}, {whole['prompts_diverged']} of {reference.num_prompts} "
              "prompts diverge")
    return 0


def _absolute(model: str) -> str:
    """A model directory as an absolute path: the reference records it, and hints built from it
    (``--clean ...``) are run from other directories."""
    return model if model.startswith("builtin:") else str(Path(model).resolve())


def _capture_vllm(args) -> int:
    """Capture through a vLLM engine in capture mode (see :mod:`fxreplace.engines.vllm.capture`)."""
    check_checkpoint_dir(args.model, "vllm")
    engine_args = engine_options(args)
    vocab_size = config_json(args.model)["vocab_size"]
    ids = tokenize_args(read_prompts(args.prompts), args.model, args.prompts, args.chat)[0]
    prompts = checked_ids(ids, vocab_size, args.prompts)
    check_capture_out(args.out, replace=False)
    from ..engines.vllm.capture import capture_with_vllm  # vLLM's capture loads for --engine vllm only

    args.produced.describe = lambda: (f"{vllm_capture_state(args.out)}; the requests in flight were not written: "
                                      "capture again into a new --out for every prompt")
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    engine_args.setdefault("max_model_len", max(longest, 128))
    counts = capture_with_vllm(_absolute(args.model), prompts, args.out, max_new_tokens=args.max_new_tokens, targets=args.target,
                               dtype=args.dtype, enforce_eager=args.compile is False,
                               **engine_args)
    print(f"captured {counts.get('completed', 0)} prompts x {args.max_new_tokens} tokens with vLLM "
          f"({counts.get('dropped', 0)} dropped) -> {args.out}")
    if counts.get("completed") != len(prompts):
        print(f"error: the engine completed {counts.get('completed', 0)} of {len(prompts)} prompts; "
              f"{vllm_capture_state(args.out)}; hint: rerun with --debug and report it", file=sys.stderr)
        return EXIT_INTERNAL
    return EXIT_OK


def vllm_capture_state(out) -> str:
    """What a vLLM capture left in ``out``: one store, or (pipeline parallel) one per stage."""
    from ..engines.vllm.capture import MERGED_DIR, stage_dirs  # for --engine vllm only

    stages = stage_dirs(out)
    if not stages:
        return f"--out {Path(out).resolve()} holds {store_state(out)}"
    merged = Path(out) / MERGED_DIR
    return (f"--out {Path(out).resolve()} holds the stages' stores ({', '.join(f'{p.name}: {store_state(p)}' for p in stages)})"
            f" and {MERGED_DIR}: {store_state(merged)}")


def _capture_targets(args, model, components) -> list:
    """The family's targets; for a family fxreplace does not register, none when --component
    names what to capture, else a usage error naming --target."""
    try:
        return default_targets(model)
    except KeyError:
        if components:
            return []
        raise UsageError(f"{args.model} is a {architecture(model.config, type(model).__name__)}, a family fxreplace "
                         "does not register, so it knows no default targets",
                         f"name them with --target PATTERN (e.g. model.layers.*.mlp.gate; `fxreplace inspect "
                         f"{args.model}` lists the modules), or --component KIND=PATTERN[@POINT] for blame") from None
