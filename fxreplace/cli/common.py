"""What the commands share once the command line is parsed: the reference it reads, the
folders it writes, the reference model's placement and the blame components a command line names."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..dtypes import as_dtype
from ..engines import registry
from ..reference import load_reference
from ..store import CaptureError, describe_store, unfinished
from ..store.publish import foreign_entries
from ..targets import Target
from .args import UsageError


def folder_state(path, option: str) -> str:
    """What a report folder holds now."""
    directory = Path(path).resolve()
    names = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if not names:
        return f"{option} {directory} holds nothing"
    return f"{option} {directory} holds {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"


def torch_dtype(name: str):
    """The torch dtype a ``--dtype`` choice names."""
    return as_dtype(name)


def load_reference_arg(path: str):
    """The reference a command line names; a damaged or foreign file is a usage error."""

    try:
        reference = load_reference(path)
    except (CaptureError, ValueError, OSError) as e:
        raise UsageError(f"cannot read the reference {path}: {e}",
                         f"`fxreplace inspect --verify {path}` checks it; `fxreplace capture` writes one") from None
    if unfinished(path):
        print(f"warning: the reference {path} is unfinished (its capture is running or was stopped): it holds the "
              f"{reference.num_prompts} prompts written so far", file=sys.stderr)
    return reference


def check_writable_dir(path: str, option: str) -> None:
    """Create ``path`` now and check it takes files, so a long run cannot fail at its end."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".fxreplace-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{option} {path} is not a writable directory: {e}", f"choose another {option}") from None


def check_capture_out(path: str, *, replace: bool) -> None:
    """``capture --out``, checked before the capture runs: a writable folder that is new or
    empty, or (``replace``: the HF capture, which writes at its end) holds only a store, which
    the capture replaces with what fxreplace derived from it."""

    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--out {path} is a file", "give a new or empty directory")
    if directory.is_dir() and any(directory.iterdir()):
        foreign = foreign_entries(directory)
        if foreign or not replace:
            what = f"holds files that are not a store's ({foreign[:3]})" if foreign else f"holds {describe_store(path)}"
            raise UsageError(f"--out {path} {what}; the capture would fail at its end",
                             "give a new or empty --out, or delete it first")
    check_writable_dir(path, "--out")


def dispatch_args(args) -> dict | None:
    """``--device-map`` and its budget as from_pretrained's keyword arguments, for the reference
    model (``capture``'s MODEL, ``validate``'s and ``blame``'s ``--clean``)."""
    if args.device_map is not None and hasattr(args, "clean") and not args.clean:
        raise UsageError(f"--device-map places the reference model, which {args.command} loads from --clean only "
                         "(the target loads whole, in --dtype)", "give the clean model as --clean CKPT, or drop --device-map")
    if args.device_map is None:
        if args.max_memory or args.offload_folder:
            raise UsageError("--max-memory and --offload-folder bound where --device-map places the layers",
                             "add --device-map auto")
        return None
    if args.offload_folder:
        check_writable_dir(args.offload_folder, "--offload-folder")
    return {"device_map": args.device_map, "max_memory": args.max_memory, "offload_folder": args.offload_folder}


def components_arg(specs: list[str]) -> dict:
    """``KIND=PATTERN[@POINT]`` options as ``{kind: Target}``."""
    out = {}
    for spec in specs:
        kind, sep, rest = spec.partition("=")
        if not sep or not kind or not rest:
            raise UsageError(f"--component {spec!r}: expected KIND=PATTERN[@POINT], e.g. "
                             "attention=model.layers.*.self_attn@output[0]")
        pattern, _, point = rest.partition("@")
        out[kind] = Target(pattern, point=point or "auto")
    return out


def refuse_untaken(args, options: dict, spec: registry.EngineSpec, takes=lambda engine: engine.takes,
                   what: str = "an option", takers: str = "engines that take it") -> None:
    """Refuse, before anything loads, each of ``options`` (option -> its attribute on the parsed
    arguments and the value meaning "not given") given for an engine whose ``takes(spec)`` lacks
    it; the hint names the built-in engines that take it."""
    for option, (attribute, unset) in options.items():
        if getattr(args, attribute, unset) not in (unset, None) and option not in takes(spec):
            names = [f"--engine {name}" for name in registry.BUILTIN if option in takes(registry.get_engine(name))]
            raise UsageError(f"{option} is not {what} of --engine {spec.name}",
                             f"{takers}: {', '.join(names) or 'none built in'}")


def engine_options(args, spec: registry.EngineSpec | None = None) -> dict:
    """``--engine-args``: a JSON object of the engine's own options, checked by the engine against
    what this machine can start (vLLM: :mod:`fxreplace.engines.vllm.preflight`) before any engine
    does."""
    try:
        options = json.loads(args.engine_args)
    except json.JSONDecodeError as e:
        raise UsageError(f"--engine-args is not JSON: {e}") from None
    if not isinstance(options, dict):
        raise UsageError("--engine-args must be a JSON object of the engine's keyword arguments (vllm: vllm.LLM's)")
    spec = spec or registry.get_engine(args.engine)
    if spec.check_options is not None:
        spec.check_options(options)
    return options
