"""``fxreplace capture``: the reference, captured by the engine ``--engine`` names (its
:class:`~fxreplace.engines.registry.CaptureSpec`)."""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path

from ..engines.registry import BUILTIN, CaptureRun, CaptureSpec, get_engine
from ..floor import capture_floors
from ..loading import recorded_model
from ..store import describe_store
from ..store.publish import publish_directory, staging_directory
from .args import EXIT_INTERNAL, EXIT_OK, UsageError, say_interrupted
from .common import check_capture_out, components_arg, dispatch_args, engine_options, refuse_untaken
from .prompts import read_prompts, tokenize_args

#: Each option only some engines capture with: its attribute on the parsed arguments and the value meaning "not given".
CAPTURE_OPTIONS = {"--component": ("component", None), "--components": ("components", False),
                   "--noise-floor": ("noise_floor", None), "--device-map": ("device_map", None),
                   "--max-memory": ("max_memory", None), "--offload-folder": ("offload_folder", None),
                   "--engine-args": ("engine_args", "{}"), "--device": ("device", None)}


def run(args) -> int:
    spec = get_engine(args.engine)
    capture = _capture_spec(spec, args)
    dispatch, options = dispatch_args(args), engine_options(args, spec)
    prompts, texts = tokenize_args(read_prompts(args.prompts), args.model, args.prompts, args.chat)
    request = CaptureRun(model=args.model, prompts=prompts, prompts_source=args.prompts, out=args.out,
                         max_new_tokens=args.max_new_tokens, targets=args.target, dtype=args.dtype,
                         compile=args.compile, device=args.device, dispatch=dispatch, options=options,
                         metadata={"source_model": recorded_model(args.model), "prompt_texts": texts},
                         components=components_arg(args.component) if args.component else None,
                         family_components=args.components, noise_floor=args.noise_floor,
                         interrupted=lambda: say_interrupted(args.produced))
    if capture.check is not None:
        capture.check(request)
    out = Path(args.out)
    made = not out.exists()  # then a capture that fails before it writes leaves no empty folder behind
    check_capture_out(args.out, replace=capture.replaces)
    # prompts stream into the store as they complete; an earlier store at --out is replaced
    # whole at the end (captured beside it, then renamed into place)
    replacing = any(out.iterdir())
    into = staging_directory(out) if replacing else out
    if replacing:
        before = describe_store(out)
        args.produced.describe = lambda: (f"--out {out.resolve()} unchanged: it holds {before} (the new capture, "
                                          "written beside it, was removed); rerun the command to capture")
    else:
        args.produced.describe = lambda: capture.left(out) if capture.left else (
            f"--out {out.resolve()} holds {describe_store(out)}; capture again into a new --out (or delete this one) "
            "for every prompt")
    try:
        captured = capture.run(replace(request, out=str(into)))
        if request.noise_floor:  # the capture's model is gone: the floor's loads in its dtype
            captured.lines += capture_floors(replace(request, out=str(into)), spec.floor_compile)
        if replacing:
            publish_directory(into, out, replace=True)
    except FileExistsError as e:
        raise UsageError(f"--out {args.out}: {e}", "choose a new or empty --out") from None
    finally:
        if replacing:
            shutil.rmtree(into, ignore_errors=True)
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
    print(f"{captured.summary} -> {args.out}")
    for line in captured.lines:
        print(line)
    if captured.error:
        print(f"error: {captured.error}; hint: rerun with --debug and report it", file=sys.stderr)
        return EXIT_INTERNAL
    return EXIT_OK


def _capture_spec(spec, args) -> CaptureSpec:
    """The engine's capture; an engine that cannot capture, or a capture option it does not
    take, is refused here, before anything loads."""
    if spec.capture is None:
        capturing = [name for name in BUILTIN if get_engine(name).capture is not None]
        raise UsageError(f"--engine {spec.name} cannot capture a reference",
                         f"capture with {' or '.join(f'--engine {n}' for n in capturing)}")
    refuse_untaken(args, CAPTURE_OPTIONS, spec, takes=lambda engine: engine.capture.takes if engine.capture else (),
                   what="a capture option", takers="engines that capture with it")
    return spec.capture
