"""The ``fxreplace`` command: demo, capture, validate, blame, repro, inspect.

Exit codes: 0 success (every ``--fail-on`` gate passed); 1 a check failed (a ``--fail-on``
gate, or ``inspect --verify`` found a damaged store); 2 a user's mistake (a bad argument, a
missing file or extra, a wrong target, an unwritable folder): one ``error:`` line that names
the problem and the fix; 3 an internal error (fxreplace's fault: one line, ``--debug`` for
the traceback); 130 interrupted (Ctrl-C). Every failure after the arguments are parsed is
one line that ends with what the run left on disk (:class:`Produced`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import traceback
from pathlib import Path

from .dtypes import LOW_PRECISION, as_dtype, is_full_precision

HF_EXTRA = {"transformers", "tqdm", "matplotlib"}  # the `hf` extra: every command needs it
EXIT_OK, EXIT_GATE_FAILED, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
DTYPES = ["float32", *LOW_PRECISION]  # --dtype: the reference's float32, or below it (a noise floor's precisions)


def torch_dtype(name: str):
    """The torch dtype a ``--dtype`` choice names."""
    return as_dtype(name)


#: Files that make a directory hold a tokenizer (transformers 5 builds an empty one from a bare config).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class UsageError(SystemExit):
    """A user's mistake: the command exits 2 after one ``error: ... hint: ...`` line."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(EXIT_USAGE)
        self.message = message if hint is None else f"{message}; hint: {hint}"

    def __str__(self) -> str:
        return f"error: {self.message}"


class Produced:
    """What the running command has left on disk so far: the end of the one line an
    interrupted or failed run prints. Commands replace the description as they go."""

    def __init__(self):
        self.describe = lambda: "nothing was written"

    def __str__(self) -> str:
        try:
            return self.describe()
        except Exception as e:  # never hide the failure being reported behind a second one
            return f"what was written could not be read back ({type(e).__name__}: {e})"


def say_interrupted(produced: Produced) -> None:
    """The one line an interrupted command ends with: what it left on disk."""
    below_a_bar = "\n" if sys.stderr.isatty() else ""  # a progress bar's line has no end on a terminal
    print(f"{below_a_bar}interrupted: {produced}", file=sys.stderr, flush=True)


def one_line(text: str, limit: int = 600) -> str:
    """``text`` (an exception's message may span lines) as one line of at most ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def store_state(path) -> str:
    """What a store folder holds, in a few words: nothing, a loadable store of N prompts, or
    one that does not load (and why)."""
    from .metrics import plural
    from .store import ReferenceStore, unfinished

    directory = Path(path)
    if not directory.is_dir() or not any(directory.iterdir()):
        return "nothing"
    try:
        store = ReferenceStore.load(directory)
    except Exception as e:  # noqa: BLE001 - any reason it does not load is what to report
        if unfinished(directory):
            return "an unfinished store with no prompt written yet"
        return f"a store that does not load ({one_line(e, 160)})"
    if unfinished(directory):
        return (f"an unfinished store: the {plural(store.num_prompts, 'prompt')} written so far load, "
                "the later ones are missing")
    return f"a loadable store of {plural(store.num_prompts, 'prompt')}"


def folder_state(path, option: str) -> str:
    """What a report folder holds now."""
    directory = Path(path).resolve()
    names = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if not names:
        return f"{option} {directory} holds nothing"
    return f"{option} {directory} holds {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error:`` line (exit 2) like every other mistake."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}", None if "hint:" in message else f"see `{self.prog} --help`")


def load_model(spec: str, dtype=None, dispatch: dict | None = None, device: str | None = None):
    """``builtin:ARCH`` (a tiny random model from fxreplace.models) or a local HF directory
    (sharded or not), in ``dtype`` (default fp32): loaded in it, never converted from a copy,
    each weight in memory once, or placed across devices, the CPU and disk by ``dispatch``
    (:func:`fxreplace.checkpoint.load_checkpoint`); else moved to ``device`` (``--device``)."""
    import torch

    from .checkpoint import load_checkpoint

    dtype = dtype or torch.float32
    if spec.startswith("builtin:"):
        if dispatch:
            raise UsageError("--device-map places a checkpoint's layers as it loads them; a builtin model is built "
                             "in memory", "save it with save_pretrained(DIR) and capture DIR")
        from fxreplace.models import tiny_model

        return tiny_model(spec.removeprefix("builtin:")).to(device or "cpu", dtype)
    check_model_dir(spec)
    try:
        model = load_checkpoint(spec, dtype, dispatch)
    except (OSError, ValueError, KeyError) as e:
        hint = ("--max-memory DEVICE=SIZE,... bounds each device; the layers that do not fit go to --offload-folder DIR"
                if dispatch else "a checkpoint directory holds config.json and its weights (save_pretrained)")
        raise UsageError(f"cannot load the model in {spec}: {one_line(e)}", hint) from None
    return model if dispatch or device is None else model.to(device)


def device_arg(text: str) -> str:
    """``--device``: a torch device this machine has (checked before anything loads)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device ({one_line(e)}); e.g. cpu, cuda, cuda:1") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has no CUDA device torch {torch.__version__} can use")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def add_device_argument(parser) -> None:
    parser.add_argument("--device", type=device_arg, metavar="DEVICE",
                        help="where the models run, e.g. cuda or cuda:1 (default: where they load, the CPU); a reference "
                             "larger than one device: --device-map auto")


def device_map_arg(text: str) -> str:
    """``--device-map``: accelerate dispatches the layers; checked to be installed before anything loads."""
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise argparse.ArgumentTypeError(f"{text!r} needs accelerate, which is not installed; hint: pip install "
                                         "accelerate")
    return text


def max_memory_arg(text: str) -> dict:
    """``--max-memory DEVICE=SIZE,...`` as from_pretrained's ``max_memory``: a GPU as its index,
    a size in bytes or as accelerate reads one (e.g. 20GiB, 500MB)."""
    budget = {}
    for item in text.split(","):
        device, _, size = item.strip().partition("=")
        if not device or not re.fullmatch(r"\d+|\d+(\.\d+)?[KMG]i?B", size):
            raise argparse.ArgumentTypeError(f"{item!r} is not DEVICE=SIZE; hint: e.g. 0=20GiB,cpu=64GiB (a GPU's "
                                             "index or cpu; bytes, or a number and KB, MB, GB, KiB, MiB or GiB)")
        budget[int(device) if device.isdigit() else device] = int(size) if size.isdigit() else size
    return budget


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


def add_dispatch_arguments(parser, loaded: str) -> None:
    """--device-map and its budget, for the reference model wherever a command loads it."""
    parser.add_argument("--device-map", type=device_map_arg, choices=["auto", "balanced", "balanced_low_0", "sequential"],
                        help=f"load {loaded} dispatched by accelerate (from_pretrained's device_map): its layers "
                             "across the GPUs, the CPU and disk, each offloaded layer's weights moved in as it runs, "
                             "for a model larger than memory")
    parser.add_argument("--max-memory", type=max_memory_arg, metavar="DEVICE=SIZE,...",
                        help="--device-map: the most each device holds, e.g. 0=20GiB,1=20GiB,cpu=64GiB; what does not "
                             "fit goes to the CPU, then to disk")
    parser.add_argument("--offload-folder", metavar="DIR",
                        help="--device-map: where layers offloaded to disk are written when the checkpoint's own files "
                             "cannot serve them (a MoE's fused experts, converted as they load)")


def model_spec(spec: str) -> str:
    """The MODEL argument, checked before anything loads: ``builtin:ARCH`` of a registered
    family, or a local Hugging Face directory."""
    if spec.startswith("builtin:"):
        from fxreplace.models import families

        if spec.removeprefix("builtin:") not in families():
            raise argparse.ArgumentTypeError(f"no builtin model {spec!r}; hint: builtin:ARCH with ARCH one of "
                                             f"{', '.join(families())}")
        return spec
    check_model_dir(spec, argparse.ArgumentTypeError)
    return spec


def check_model_dir(spec: str, error=UsageError) -> None:
    """A local model directory must at least hold a Hugging Face ``config.json``."""
    path = Path(spec)
    if not path.is_dir():
        raise error(f"model {spec!r} is neither builtin:ARCH nor a local directory; hint: "
                    "give a checkpoint directory (config.json and weights) or builtin:ARCH")
    if not (path / "config.json").is_file():
        from .store import INDEX_FILE, TENSORS_FILE

        if (path / INDEX_FILE).is_file() or (path / TENSORS_FILE).is_file():
            raise error(f"{spec} is a reference store, not a model directory; hint: "
                        f"`fxreplace inspect --verify {spec}` checks a store; were the two swapped? the model comes "
                        f"first and the store after --reference: MODEL --reference {spec}")
        raise error(f"{spec} holds no config.json: not a Hugging Face model directory; hint: "
                    "save the model with save_pretrained(DIR)")


def reference_path(path: str) -> str:
    """``--reference``: checked to exist before any model loads."""
    if not Path(path).exists():
        raise argparse.ArgumentTypeError(f"no reference store at {path}; hint: write one with "
                                         f"`fxreplace capture MODEL --prompts FILE --out {path}`")
    return path


def existing_file(path: str) -> str:
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"no file {path}")
    return path


def junit_path(path: str) -> str:
    if not Path(path).resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: its folder {Path(path).resolve().parent} does not exist")
    return path


def load_reference_arg(path: str):
    """The reference a command line names; a damaged or foreign file is a usage error."""
    from .reference import load_reference
    from .store import CaptureError, unfinished

    try:
        reference = load_reference(path)
    except (CaptureError, ValueError, OSError) as e:
        raise UsageError(f"cannot read the reference {path}: {e}",
                         f"`fxreplace inspect --verify {path}` checks it; `fxreplace capture` writes one") from None
    if unfinished(path):
        print(f"warning: the reference {path} is unfinished (its capture is running or was stopped): it holds the "
              f"{reference.num_prompts} prompts written so far", file=sys.stderr)
    return reference


def load_tokenizer(spec: str, *, required_by: str | None = None):
    """The checkpoint's own tokenizer (``AutoTokenizer`` from the model directory), or None
    where it has none; ``required_by`` (what needs it) turns its absence into an error."""
    if spec.startswith("builtin:") or not any((Path(spec) / f).is_file() for f in TOKENIZER_FILES):
        if required_by is None:
            return None
        raise UsageError(f"{required_by} needs a tokenizer but {spec} has none ({' / '.join(TOKENIZER_FILES[:2])})",
                         "give --prompts as token id lists, e.g. [[1, 2, 3]], or save the tokenizer into the "
                         "checkpoint (tokenizer.save_pretrained(DIR))")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot load the tokenizer in {spec}: {e}", "give --prompts as token id lists") from None


def model_architecture(spec: str) -> str:
    """The architecture a ``builtin:ARCH`` spec or a model directory's config.json names."""
    from .models import architecture

    if spec.startswith("builtin:"):
        return spec.removeprefix("builtin:")
    return architecture(_config_json(spec), "unknown")


def _config_json(spec: str) -> dict:
    """A model directory's config.json."""
    try:
        return json.loads((Path(spec) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read {Path(spec) / 'config.json'}: {e}") from None


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
    from .store.format import foreign_entries

    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--out {path} is a file", "give a new or empty directory")
    if directory.is_dir() and any(directory.iterdir()):
        foreign = foreign_entries(directory)
        if foreign or not replace:
            what = f"holds files that are not a store's ({foreign[:3]})" if foreign else f"holds {store_state(path)}"
            raise UsageError(f"--out {path} {what}; the capture would fail at its end",
                             "give a new or empty --out, or delete it first")
    check_writable_dir(path, "--out")


def check_reference_matches(reference, reference_path: str, model_name: str, arch: str) -> None:
    """A reference captured from another architecture would be replayed into the wrong
    modules (or the same names with another meaning) without any shape error."""
    recorded = reference.metadata.get("architecture")
    if recorded and recorded != arch:
        raise UsageError(f"the reference {reference_path} was captured from {recorded} "
                         f"(captures {reference.store.capture_names[:2]} ...) but {model_name} is {arch}",
                         "validate the model the reference was captured from, or capture a new one")


def check_layer_count(reference, reference_path: str, model_name: str, layers: int | None) -> None:
    """A reference captured from a model with another layer count comes from another model,
    which no --target fixes (recorded at capture as ``num_hidden_layers``)."""
    recorded = reference.metadata.get("num_hidden_layers")
    if recorded is not None and layers is not None and recorded != layers:
        raise UsageError(f"the reference {reference_path} was captured from a model with {recorded} layers but "
                         f"{model_name} has {layers}: it was captured from another model",
                         "validate the model the reference was captured from, or capture a new reference from "
                         f"{model_name}")


def _capture_targets(args, model, components) -> list:
    """The family's targets; for a family fxreplace does not register, none when --component
    names what to capture, else a usage error naming --target."""
    try:
        return default_targets(model)
    except KeyError:
        if components:
            return []
        from .models import architecture

        raise UsageError(f"{args.model} is a {architecture(model.config, type(model).__name__)}, a family fxreplace "
                         "does not register, so it knows no default targets",
                         f"name them with --target PATTERN (e.g. model.layers.*.mlp.gate; `fxreplace inspect "
                         f"{args.model}` lists the modules), or --component KIND=PATTERN[@POINT] for blame") from None


def default_targets(model) -> list:
    from fxreplace.models import architecture, get_family

    return list(get_family(architecture(model.config, type(model).__name__)).targets)


def read_prompts(path: str) -> list:
    """The prompts file, parsed before any model loads: a JSON list whose items are texts,
    token id lists, ``{"prompt": text or ids}`` or ``{"messages": [...]}`` (a chat), or the
    same items one per line (JSONL)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"cannot read prompts file {path}: {e}") from None
    try:
        data = json.loads(text)
        items = [(f"item {i}", item) for i, item in enumerate(data)] if isinstance(data, list) else None
    except json.JSONDecodeError:
        items = None
    if items is None:  # JSONL: one prompt per line
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append((f"line {n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise UsageError(f"{path} line {n} is not JSON: {e}", PROMPTS_HINT) from None
    if not items:
        raise UsageError(f"{path} holds no prompts", PROMPTS_HINT)
    return [_prompt(path, where, item) for where, item in items]


PROMPTS_HINT = ('a JSON list of texts or token id lists, or JSONL lines {"prompt": "..."} or '
                '{"messages": [{"role": "user", "content": "..."}]}')


def _prompt(path: str, where: str, item):
    if isinstance(item, dict):
        if "messages" in item and isinstance(item["messages"], list):
            return item["messages"]
        if "prompt" not in item:
            raise UsageError(f"{path} {where}: a dict with neither 'prompt' nor 'messages' (it has {sorted(item)[:4]})",
                             PROMPTS_HINT)
        item = item["prompt"]
    if isinstance(item, str) or (isinstance(item, list) and item and all(_is_token_id(t) for t in item)):
        return item
    raise UsageError(f"{path} {where}: {_not_a_prompt(item)}", PROMPTS_HINT)


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _not_a_prompt(item) -> str:
    """What is wrong with an item that is not a prompt, in the user's terms."""
    if isinstance(item, int) and not isinstance(item, bool):
        return (f"{item!r} is a number, not a prompt: a file of one prompt of token ids is a list of lists "
                "([[1, 2, 3]], not [1, 2, 3])")
    if isinstance(item, list):
        if not item:
            return "an empty prompt"
        bad = next(t for t in item if not _is_token_id(t))
        what = ("a float" if isinstance(bad, float) else "negative" if isinstance(bad, int) and not isinstance(bad, bool)
                else f"a {type(bad).__name__}")
        return f"token id {bad!r} is {what}; token ids are non-negative integers"
    return f"a {type(item).__name__} ({str(item)[:40]}), not a text or a list of token ids"


def tokenize_args(prompts: list, model_spec: str, path: str, chat: bool = False) -> tuple[list, list]:
    """Token ids and texts of parsed prompts, text through the checkpoint's tokenizer
    (loaded before the model, so a missing one fails fast)."""
    from .capture import tokenize_prompts

    texts_given = chat or any(not (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompts)
    tokenizer = load_tokenizer(model_spec, required_by=f"text prompts in {path}") if texts_given else None
    try:
        return tokenize_prompts(prompts, tokenizer, chat=chat)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None


def checked_ids(ids: list, vocab_size: int, path: str) -> list[list[int]]:
    from .capture import check_prompts

    try:
        return check_prompts(ids, vocab_size)
    except ValueError as e:
        raise UsageError(f"{path}: {e}", f"give each prompt once, as token ids below the model's vocab_size "
                         f"({vocab_size}) or as text") from None


def _demo(args) -> int:
    from .demo import DemoConfig, run_demo

    check_writable_dir(args.report_dir, "--report-dir")
    args.produced.describe = lambda: f"{folder_state(args.report_dir, '--report-dir')}; rerun `fxreplace demo`"
    run_demo(DemoConfig(prompts=args.prompts, new_tokens=args.new_tokens, compile=not args.eager, report_dir=args.report_dir,
                        device=args.device or "cpu"))
    return 0


def _capture(args) -> int:
    if args.engine == "vllm":
        if args.components or args.component or args.noise_floor:
            raise UsageError("--components/--component/--noise-floor are for --engine hf (blame components and the "
                             "noise floor are captured from the HF reference)")
        if args.device_map or args.max_memory or args.offload_folder:
            raise UsageError("--device-map/--max-memory/--offload-folder are for --engine hf",
                             "vLLM places the model itself: pass its options in --engine-args")
        return _capture_vllm(args)
    from .blame import BlameError, family_components
    from .capture import capture_reference
    from .store.format import publish_directory, staging_directory

    dispatch = dispatch_args(args)
    ids, texts = tokenize_args(read_prompts(args.prompts), args.model, args.prompts, args.chat)
    components = _components(args.component) if args.component else None
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
        from .floor import measure_floor, save_floor
        from .reference import load_reference

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
    """Capture through a vLLM engine in capture mode (see :mod:`fxreplace.vllm.capture`)."""
    if not Path(args.model).is_dir():
        raise UsageError(f"--engine vllm needs a local checkpoint directory, got {args.model!r}")
    engine_args = _engine_args(args)
    with open(Path(args.model) / "config.json") as f:
        vocab_size = json.load(f)["vocab_size"]
    ids = tokenize_args(read_prompts(args.prompts), args.model, args.prompts, args.chat)[0]
    prompts = checked_ids(ids, vocab_size, args.prompts)
    check_capture_out(args.out, replace=False)
    from .engines.vllm.capture import capture_with_vllm

    args.produced.describe = lambda: (f"{vllm_capture_state(args.out)}; the requests in flight were not written: "
                                      "capture again into a new --out for every prompt")
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    engine_args.setdefault("max_model_len", max(longest, 128))
    counts = capture_with_vllm(_absolute(args.model), prompts, args.out, max_new_tokens=args.max_new_tokens, targets=args.target,
                               dtype=args.dtype, enforce_eager=args.eager, **engine_args)
    print(f"captured {counts.get('completed', 0)} prompts x {args.max_new_tokens} tokens with vLLM "
          f"({counts.get('dropped', 0)} dropped) -> {args.out}")
    if counts.get("completed") != len(prompts):
        print(f"error: the engine completed {counts.get('completed', 0)} of {len(prompts)} prompts; "
              f"{vllm_capture_state(args.out)}; hint: rerun with --debug and report it", file=sys.stderr)
        return EXIT_INTERNAL
    return EXIT_OK


def vllm_capture_state(out) -> str:
    """What a vLLM capture left in ``out``: one store, or (pipeline parallel) one per stage."""
    from .engines.vllm.capture import MERGED_DIR, stage_dirs

    stages = stage_dirs(out)
    if not stages:
        return f"--out {Path(out).resolve()} holds {store_state(out)}"
    merged = Path(out) / MERGED_DIR
    return (f"--out {Path(out).resolve()} holds the stages' stores ({', '.join(f'{p.name}: {store_state(p)}' for p in stages)})"
            f" and {MERGED_DIR}: {store_state(merged)}")


def _engine_args(args) -> dict:
    """``--engine-args``: a JSON object of ``vllm.LLM`` keyword arguments, checked against what this
    machine can start (:mod:`fxreplace.vllm.preflight`) before any engine does. An engine's start
    interrupted says what the command left (:mod:`fxreplace.vllm.startup`)."""
    try:
        engine_args = json.loads(args.engine_args)
    except json.JSONDecodeError as e:
        raise UsageError(f"--engine-args is not JSON: {e}") from None
    if not isinstance(engine_args, dict):
        raise UsageError("--engine-args must be a JSON object of vllm.LLM keyword arguments")
    from .engines.vllm.preflight import EngineSetupError, check_engine_start

    try:
        check_engine_start(engine_args)
    except EngineSetupError as e:
        raise UsageError(e.problem, e.fix) from None
    from .engines.vllm import startup

    startup.last_words = lambda: say_interrupted(args.produced)
    return engine_args


def _check_vocab(reference, model_name: str, vocab_size: int) -> None:
    if vocab_size != reference.vocab_size:
        raise UsageError(f"the reference has vocab size {reference.vocab_size} but {model_name} has "
                         f"{vocab_size}: it was captured from another model",
                         "validate the model the reference was captured from, or capture a new one")


def _longest_sequence(reference) -> int:
    """Prompt plus generated tokens of the longest reference prompt: what a retry can reach."""
    return max(len(reference.prompt_tokens(p)) + reference.num_generated(p) for p in range(reference.num_prompts))


def _replacement_config(args, **source):
    """The ReplacementConfig of a command line; a bad ``--target`` is a usage error naming it."""
    from .config import ConfigError, ReplacementConfig

    try:
        return ReplacementConfig(targets=args.target, **source)
    except ConfigError as e:
        raise UsageError(str(e), "`fxreplace inspect MODEL` lists the injection points") from None


def _report(result, args, reference, extra: str = "") -> int:
    """Write the report, print the summary and verdict; with a gate, the exit code says whether it passed."""
    from .report import print_summary
    from .validation import Gate

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
        from .junit import write_validation_junit

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


def gate_condition(text: str) -> str:
    """One ``--fail-on`` condition, checked when the command line is parsed."""
    from .validation import Gate

    try:
        Gate.parse([text])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _noise_floor(args, reference):
    """The noise floor for ``args.dtype``: stored in the reference (``capture --noise-floor``), else
    measured from ``--clean``; None for a float32 target or when neither is at hand (a
    ``--fail-on floor=K`` then refuses before any pass)."""
    from .floor import FloorFileError, floor_for

    if is_full_precision(args.dtype):
        if _gates_on_floor(args):
            raise UsageError(f"--fail-on floor=K scores a target below float32 against its noise floor; this target "
                             f"runs in {args.dtype}", "give --dtype bfloat16 (or float16), or gate on kl=X / top5=Y")
        return None

    def clean():
        check_reference_matches(reference, args.reference, args.clean, model_architecture(args.clean))
        # in the dtype, as the target is
        model = load_model(args.clean, torch_dtype(args.dtype), dispatch_args(args), args.device)
        _check_vocab(reference, args.clean, model.config.vocab_size)
        print(f"noise floor: {args.clean} in {args.dtype} against the reference")
        return model
    try:
        floor, _ = floor_for(reference, torch_dtype(args.dtype), args.reference,
                             clean=clean if getattr(args, "clean", None) else None, progress=True)
    except FloorFileError as e:
        raise UsageError(str(e), f"capture the reference again with `--noise-floor {args.dtype}`") from None
    if floor is not None and floor.covers(range(reference.num_prompts)):
        return floor
    if _gates_on_floor(args):
        raise UsageError(f"--fail-on floor=K needs the noise floor in {args.dtype}, and {args.reference} holds none",
                         f"capture the reference with `--noise-floor {args.dtype}`, or give the clean model as "
                         "--clean MODEL")
    return None


def _reference_caveat(args, reference) -> str:
    """A reference below float32 is refused unless --allow-low-precision-reference; the caveat the verdict states."""
    from .floor import check_reference_precision

    try:
        return check_reference_precision(reference, args.allow_low_precision_reference,
                                         "--allow-low-precision-reference")
    except ValueError as e:
        message, _, hint = str(e).rpartition("; ")
        raise UsageError(message, hint) from None


def _gates_on_floor(args) -> bool:
    return any(c.startswith("floor=") for c in getattr(args, "fail_on", None) or [])


def _targets_label(targets) -> str:
    """What mode "on" replaces, in the verdict's words."""
    names = [getattr(t, "pattern", t) for t in targets]
    return f"the targets ({', '.join(map(str, names[:3]))}{' ...' if len(names) > 3 else ''})"


def _validate(args) -> int:
    dispatch_args(args)  # its mistakes before anything loads
    if args.engine == "vllm":
        return _validate_vllm(args)
    import torch

    from .instrument import instrument
    from .models import architecture
    from .engines.embedded import Runner, RunnerConfig
    from .validation import logit_validation

    reference = load_reference_arg(args.reference)
    caveat = _reference_caveat(args, reference)
    check_writable_dir(args.report_dir, "--report-dir")
    args.produced.describe = lambda: f"no report written ({folder_state(args.report_dir, '--report-dir')})"
    dtype = torch_dtype(args.dtype)
    model = load_model(args.model, dtype, device=args.device)
    check_reference_matches(reference, args.reference, args.model, architecture(model.config, type(model).__name__))
    check_layer_count(reference, args.reference, args.model, getattr(model.config, "num_hidden_layers", None))
    _check_vocab(reference, args.model, model.config.vocab_size)
    replacement = _replacement_config(args, tensors=reference.store)
    targets = list(replacement.targets or default_targets(model))
    target = instrument(model, targets)
    missing = [t for t in (t.capture_name for t in target._fxreplace.targets) if t not in reference.store.columns]
    if missing:
        raise UsageError(f"the reference holds no captures for targets {missing}; it has {reference.store.capture_names}",
                         "give --target patterns the reference captured, or capture them (`fxreplace capture --target`)")
    bucket = args.bucket or 1 << (_longest_sequence(reference) - 1).bit_length()
    if bucket < _longest_sequence(reference):
        raise UsageError(f"--bucket {bucket} is shorter than the longest reference sequence "
                         f"({_longest_sequence(reference)} tokens)", "leave --bucket out to fit it")
    runner = Runner(
        target,
        model.config,
        replacer=replacement,
        # teacher-forced: the decode steps read the reference's tokens, so a divergence costs no re-run
        runner_config=RunnerConfig(prefill_buckets=(bucket,), batch_buckets=(min(8, reference.num_prompts),), max_len=2 * bucket,
                                   teacher_forcing=True),
        dtype=dtype,
        observed=target,
        compile="inductor" if args.compile else None,
    )
    floor = _noise_floor(args, reference)
    print(f"target: {args.model} in {args.dtype}, {'compiled (inductor)' if args.compile else 'eager'}, "
          f"prefill bucket {bucket} tokens, decode batch {runner.cfg.batch_buckets[0]}; {reference.num_prompts} prompts")
    result = logit_validation(runner, reference, router_topk=getattr(model.config, "num_experts_per_tok", None),
                              tokenizer=_decoder(args.model, reference))
    result.replaced = _targets_label(targets)
    result.floor, result.caveat = floor, caveat
    result.program = {"engine": "runner", "compile": bool(args.compile), "dtype": args.dtype}
    return _report(result, args, reference, f"graphs compiled: {runner.graphs_compiled}" if args.compile else "")


def _decoder(model: str, reference):
    """A tokenizer to decode the tokens at divergences: the target checkpoint's, else the
    reference model's (its directory recorded at capture); None when neither has one."""
    for spec in (model, str(reference.metadata.get("source_model") or "")):
        if spec and not spec.startswith("builtin:") and Path(spec).is_dir():
            tokenizer = load_tokenizer(spec)
            if tokenizer is not None:
                return tokenizer
    return None


def _validate_vllm(args) -> int:
    """Teacher-forced validation through a real vLLM engine (the fxreplace plugin
    configured with the reference; see :mod:`fxreplace.vllm.engine`)."""
    from .validation import logit_validation

    if args.model.startswith("builtin:"):
        raise UsageError(f"--engine vllm needs a local checkpoint directory, got {args.model!r}")
    check_model_dir(args.model)
    if args.compile:
        raise UsageError("--compile is for --engine runner; vLLM compiles by default (--eager to disable)")
    if args.logprobs == 0 or args.logprobs < -1:
        raise UsageError(f"--logprobs must be -1 (whole vocabulary) or a positive count, got {args.logprobs}")
    engine_args = _engine_args(args)
    reference = load_reference_arg(args.reference)
    caveat = _reference_caveat(args, reference)
    check_reference_matches(reference, args.reference, args.model, model_architecture(args.model))
    check_layer_count(reference, args.reference, args.model, _config_json(args.model).get("num_hidden_layers"))
    check_writable_dir(args.report_dir, "--report-dir")
    args.produced.describe = lambda: f"no report written ({folder_state(args.report_dir, '--report-dir')})"
    from .engines.vllm.engine import VllmEngine

    floor = _noise_floor(args, reference)
    longest = _longest_sequence(reference)
    engine = VllmEngine(args.model, _replacement_config(args, tensors_path=args.reference), dtype=args.dtype,
                        logprobs=args.logprobs, enforce_eager=args.eager,
                        **{"max_model_len": max(longest + 8, 128), "max_num_seqs": min(8, reference.num_prompts),
                           **engine_args})
    try:
        _check_vocab(reference, args.model, engine.vocab_size)
        with open(Path(args.model) / "config.json") as f:
            topk = json.load(f).get("num_experts_per_tok")
        result = logit_validation(engine, reference, router_topk=topk, tokenizer=_decoder(args.model, reference))
    finally:
        engine.close()
    result.replaced = _targets_label(args.target or reference.metadata.get("targets") or [])
    result.floor, result.caveat = floor, caveat
    result.program = {"engine": "vllm", "compile": not args.eager, "dtype": args.dtype}
    return _report(result, args, reference)


def _components(specs: list[str]) -> dict:
    """``KIND=PATTERN[@POINT]`` options as ``{kind: Target}``."""
    from .targets import Target

    out = {}
    for spec in specs:
        kind, sep, rest = spec.partition("=")
        if not sep or not kind or not rest:
            raise UsageError(f"--component {spec!r}: expected KIND=PATTERN[@POINT], e.g. "
                             "attention=model.layers.*.self_attn@output[0]")
        pattern, _, point = rest.partition("@")
        out[kind] = Target(pattern, point=point or "auto")
    return out


def _program_of_validation(args) -> None:
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
    args.engine = args.engine or program.get("engine", "runner")
    args.dtype = args.dtype or program.get("dtype", "bfloat16")
    if "compile" in program:
        compiled = args.compile if args.engine == "runner" else not args.eager
        if (args.compile or args.eager) and compiled != program["compile"]:
            raise UsageError(f"--{'compile' if args.compile else 'eager'} contradicts the validation in "
                             f"{args.from_validation} ({'compiled' if program['compile'] else 'eager'})",
                             "leave it out: blame examines the program validate ran")
        if args.engine == "runner":
            args.compile = program["compile"]
        else:
            args.eager = not program["compile"]


def _blame(args) -> int:
    """Search for the components that explain the divergence (see :mod:`fxreplace.blame`)."""
    import torch

    from .blame import BlameError, blame

    _program_of_validation(args)
    dispatch_args(args)  # its mistakes before anything loads
    engine_args = _engine_args(args) if args.engine == "vllm" else {}
    reference = load_reference_arg(args.reference)
    _reference_caveat(args, reference)  # refused here; blame() states the caveat
    check_writable_dir(args.report_dir, "--report-dir")
    args.produced.describe = lambda: blame_state(args)
    try:
        if args.engine == "vllm":
            if args.model.startswith("builtin:"):
                raise UsageError(f"--engine vllm needs a local checkpoint directory, got {args.model!r}")
            check_model_dir(args.model)
            check_reference_matches(reference, args.reference, args.model, model_architecture(args.model))
            check_layer_count(reference, args.reference, args.model, _config_json(args.model).get("num_hidden_layers"))
            if args.compile or args.component or args.clean:
                raise UsageError("--compile, --component and --clean are for --engine runner (vLLM compiles unless "
                                 "--eager; its components come from the family's vllm_components)",
                                 "capture the components into the reference with `fxreplace capture --components`")
            from .engines.vllm.engine import VllmBlameEngine

            engine_args = {"max_model_len": max(_longest_sequence(reference) + 8, 128),
                           "max_num_seqs": min(64, reference.num_prompts * 5), **engine_args}
            engine = VllmBlameEngine(args.model, args.reference, dtype=args.dtype, logprobs=-1,
                                     enforce_eager=args.eager, **engine_args)
            floor = _noise_floor(args, reference)
            try:
                result = blame(engine, reference, budget=args.budget, floor=floor,
                               allow_low_precision_reference=args.allow_low_precision_reference)
            finally:
                engine.close()
            result.program = {"engine": "vllm", "compile": not args.eager, "dtype": args.dtype}
        else:
            dtype = torch_dtype(args.dtype)
            floor = _noise_floor(args, reference)  # the clean model, if measured, is gone before the target loads
            model = load_model(args.model, dtype, device=args.device)  # blame() checks it and the clean model against the reference
            check_layer_count(reference, args.reference, args.model, getattr(model.config, "num_hidden_layers", None))
            clean = None
            if args.clean:
                check_reference_matches(reference, args.reference, args.clean, model_architecture(args.clean))

                def clean():
                    """The clean model, loaded for each capture only: blame holds the target's weights alone."""
                    loaded = load_model(args.clean, dispatch=dispatch_args(args), device=args.device)
                    _check_vocab(reference, args.clean, loaded.config.vocab_size)
                    return loaded
            result = blame(model, args.reference, clean=clean,
                           components=_components(args.component) if args.component else None,
                           dtype=dtype, compile="inductor" if args.compile else None, budget=args.budget, floor=floor,
                           allow_low_precision_reference=args.allow_low_precision_reference)
    except BlameError as e:
        raise UsageError(str(e)) from None
    report = result.write_report(args.report_dir)
    print()
    print(result.table())
    from .report import describe_program

    validated = "" if args.from_validation else " (no validation given: --from-validation DIR examines the program it ran)"
    print(f"program examined: {describe_program(result.program)}{validated}")
    print(f"verdict: {result.verdict}")
    ranking = Path(args.report_dir).resolve() / "blame.json"
    print(f"report: {report.resolve()}   ranking: {ranking}")
    if result.origins:
        print(f"next: the first origin alone, for the compiler team: fxreplace repro write {args.model} --reference "
              f"{args.reference} --blame {ranking} --out repro/ (then fxreplace repro run repro/ --backend inductor)")
    if args.junit:
        from .junit import write_blame_junit

        print(f"junit: {write_blame_junit(result, args.junit).resolve()}")
    return 0


def blame_state(args) -> str:
    """An unfinished blame's products: components captured from ``--clean`` are kept in the
    reference and reused by the next run."""
    from .store.format import BLAME_COMPONENTS_DIR

    components = Path(args.reference).resolve() / BLAME_COMPONENTS_DIR
    kept = (f"; the components captured from --clean are kept in {components} and reused by a rerun"
            if components.is_dir() else "")
    return f"no blame report written ({folder_state(args.report_dir, '--report-dir')}){kept}"


def _repro_write(args) -> int:
    """Write the repro folder of a blamed (or named) component (see :mod:`fxreplace.repro`)."""
    import torch

    from .repro import README, ReproError, blamed_component, check_out_dir, write_repro

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
    print(f"repro of {component} -> {out}; run it: fxreplace repro run {out} --backend inductor "
          f"(or python {out / 'run.py'} --backend inductor)")
    return 0


def _repro_run(args) -> int:
    from .repro_run import ReproError, run

    try:
        return run(args.dir, args.backend, args.bisect, args.tolerance)
    except ReproError as e:
        raise UsageError(str(e), "write the folder with `fxreplace repro write`") from None


def _inspect(args) -> int:
    import torch

    from .points import locate_injection_point

    if args.verify:
        return _verify_store(args.verify)
    if args.model is None:
        raise UsageError("inspect needs a model (builtin:ARCH or a directory) or --verify REF")
    model = load_model(args.model)
    if args.check_live is not None:
        return _check_live(model, args.check_live, args.tokens)
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
        note = ""
        if is_tuple:  # where 'auto' lands is points.py's rule: ask it
            inside = locate_injection_point(model.get_submodule(name), name).graph_module is not None
            note = "returns a tuple: point 'auto' " + ("injects at its logits" if inside else "is its output")
        print(f"  {name:<40} {cls:<24} {str(shape):<16} {note}")
    return 0


def _check_live(model, specs: list[str], tokens: int) -> int:
    """``inspect --check-live``: one forward per target with a random replacement must move the logits."""
    import torch

    from .instrument import instrument
    from .liveness import check_live
    from .targets import Target

    instrument(model, [Target(*spec.split("@", 1)) for spec in specs] or default_targets(model))
    moved = check_live(model, lambda: model(input_ids=torch.zeros(1, tokens, dtype=torch.long)))
    print(f"every target reaches the logits ({tokens} tokens, one random replacement per target):")
    for name, change in moved.items():
        print(f"  {name:<40} max |logit change| {change:.3g}")
    return 0


def _repack(args) -> int:
    from .store import CaptureError, ReferenceStore, repack_store

    args.produced.describe = lambda: (f"--out {Path(args.out).resolve()} holds {store_state(args.out)} (a repack "
                                      f"appears whole or not at all); {args.reference} unchanged")
    try:
        before = len(ReferenceStore.load(args.reference).shards)
        store = ReferenceStore.load(repack_store(args.reference, args.out, shard_bytes=args.shard_mib << 20))
    except (CaptureError, OSError) as e:
        raise UsageError(one_line(e), f"`fxreplace inspect --verify {args.reference}` checks the store") from None
    print(f"{args.out}: {store.num_prompts} prompts in {len(store.shards)} shard(s), repacked from {before} "
          f"shard(s) of {args.reference}; every source shard matched its recorded digests")
    return 0


def _verify_store(path: str) -> int:
    """Read every byte of a reference store: digests recorded at write, then finiteness."""
    from .store import CaptureError, ReferenceStore

    from .store.format import DERIVED_DIRS

    parts = [Path(path)] + sorted(p.parent for name in DERIVED_DIRS for p in Path(path).glob(f"{name}/*/index.json"))
    for part in parts:  # the store, then the stores fxreplace added to it (blame's components)
        try:
            summary = ReferenceStore.load(part).verify()
        except (CaptureError, OSError) as e:
            print(f"error: {one_line(e)}", file=sys.stderr)
            return EXIT_GATE_FAILED
        finite = "every row finite" if summary["finite"] else "rows not checked for NaN/Inf (written with allow_nonfinite)"
        print(f"{part}: OK: {summary['prompts']} prompts in {summary['shards']} shard(s), "
              f"{summary['bytes'] / 2**20:.1f} MiB match the SHA-256 digests recorded at write; {finite}")
    return EXIT_OK


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` states every default that has a value (not the None or False of unset options)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


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
    demo.add_argument("--eager", action="store_true", help="do not torch.compile the target")
    demo.add_argument("--report-dir", default="fxreplace-report", help="folder for report.html and blame.html")
    add_device_argument(demo)
    demo.set_defaults(func=_demo)


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
                              "against this reference; stored in it, it gives validate's and blame's verdicts a scale")
    add_dispatch_arguments(capture, "the reference (and --noise-floor's model)")
    capture.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                         help="hf: the HF model in this process (fp32); vllm: a vLLM engine in capture mode "
                              "(MODEL: a checkpoint directory)")
    capture.add_argument("--dtype", choices=DTYPES, default="float32", help="--engine vllm: the engine's dtype")
    capture.add_argument("--eager", action="store_true", help="--engine vllm: enforce eager mode (no vLLM compile)")
    capture.add_argument("--engine-args", default="{}",
                         help='--engine vllm: JSON of vllm.LLM arguments, e.g. \'{"tensor_parallel_size": 2}\'')
    add_device_argument(capture)
    capture.set_defaults(func=_capture)


def _add_validate(command) -> None:
    """``fxreplace validate``'s arguments."""
    validate = command("validate", "teacher-forced logit validation of a target against a reference")
    validate.add_argument("model", type=model_spec, help="builtin:ARCH or a local HF directory (the target's weights)")
    validate.add_argument("--reference", required=True, type=reference_path, help="directory written by `fxreplace capture`")
    validate.add_argument("--engine", choices=["runner", "vllm"], default="runner",
                          help="runner: fxreplace's static-shape runner; vllm: a vLLM engine with the fxreplace plugin")
    validate.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the target's dtype")
    validate.add_argument("--compile", action="store_true", help="torch.compile the target (inductor; --engine runner)")
    validate.add_argument("--bucket", type=positive_int,
                          help="--engine runner: prefill bucket in tokens (default: the longest reference sequence "
                               "rounded up to a power of two); decode batch: min(8, prompts)")
    validate.add_argument("--eager", action="store_true", help="--engine vllm: enforce eager mode (no vLLM compile)")
    validate.add_argument("--engine-args", default="{}",
                          help='--engine vllm: JSON of vllm.LLM arguments, e.g. \'{"gpu_memory_utilization": 0.5}\'')
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
    add_device_argument(validate)
    validate.set_defaults(func=_validate)


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
    blame.add_argument("--engine", choices=["runner", "vllm"],
                       help="runner: fxreplace's static-shape runner; vllm: a vLLM engine with the fxreplace plugin "
                            "(default: runner, or the validation's)")
    blame.add_argument("--dtype", choices=DTYPES, help="the target's dtype (default: bfloat16, or the validation's)")
    blame.add_argument("--compile", action="store_true", help="torch.compile the target (inductor; --engine runner)")
    blame.add_argument("--eager", action="store_true", help="--engine vllm: enforce eager mode")
    blame.add_argument("--engine-args", default="{}",
                       help="--engine vllm: JSON object of vllm.LLM keyword arguments (e.g. tensor_parallel_size, "
                            "distributed_executor_backend)")
    blame.add_argument("--component", action="append", metavar="KIND=PATTERN[@POINT]",
                       help="candidate component for a family that declares none (repeatable)")
    blame.add_argument("--clean", metavar="CKPT", type=model_spec,
                       help="the clean model the reference came from (builtin:ARCH or an HF directory): components the "
                            "reference lacks are captured from it as the search needs them, stored under the reference "
                            "directory and reused (--engine runner)")
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
    add_device_argument(blame)
    blame.set_defaults(func=_blame)


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
                       help="calls kept: the prompts where the target's component departs most from the reference's")
    write.add_argument("--out", required=True, help="the repro folder to write")
    add_device_argument(write)
    write.set_defaults(func=_repro_write)
    run = steps.add_parser("run", help="run a repro folder under a backend: the port or the compiler?",
                           parents=[common], formatter_class=DefaultsFormatter)
    run.add_argument("dir", help="a folder written by `fxreplace repro write`")
    from .repro_run import add_arguments  # run.py's own options (it runs without fxreplace): one home for both

    add_arguments(run)
    run.set_defaults(func=_repro_run)


def _add_inspect(command) -> None:
    """``fxreplace inspect``'s arguments."""
    inspect = command("inspect", "list candidate injection points with their shapes, or --verify a reference")
    inspect.add_argument("model", nargs="?", type=model_spec, help="builtin:ARCH or a local HF directory")
    inspect.add_argument("--verify", metavar="REF", type=reference_path,
                         help="check a reference store byte by byte against its recorded digests")
    inspect.add_argument("--tokens", type=positive_int, default=4, help="tokens of the probe forward")
    inspect.add_argument("--check-live", nargs="*", metavar="TARGET",
                         help="prove each target reaches the logits: PATTERN or PATTERN@POINT (default: the family's)")
    inspect.set_defaults(func=_inspect)


def _add_repack(command) -> None:
    """``fxreplace repack``'s arguments."""
    repack = command("repack", "rewrite a reference store of many small shards (a vLLM capture writes one per idle) "
                               "as few large ones; prompts and rows unchanged")
    repack.add_argument("reference", type=reference_path, help="the store directory to read (left as it is)")
    repack.add_argument("--out", required=True, help="a new or empty directory for the repacked store")
    repack.add_argument("--shard-mib", type=positive_int, default=256,
                        help="MiB per output shard (consecutive shards are joined up to it; a larger one stays whole)")
    repack.set_defaults(func=_repack)


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every failure is one line on stderr (``--debug`` adds the traceback)
    and an exit code of its own: a user's mistake raises :class:`UsageError` (2), an
    interrupt exits 130 and an internal error 3, each line ending with what was left on disk."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    produced = Produced()
    try:
        args = build_parser().parse_args(argv)
        args.produced = produced
        from .config import ConfigError  # after the parse: --help answers without loading torch
        from .targets import TargetError

        try:
            return args.func(args)
        except (TargetError, ConfigError) as e:  # a --target that names no module, a bad replacement config
            raise UsageError(str(e), f"`fxreplace inspect {getattr(args, 'model', None) or 'MODEL'}` lists the "
                             "injection points") from e
        except ModuleNotFoundError as e:
            if e.name not in HF_EXTRA:
                raise
            raise UsageError(f"fxreplace {argv[0]} needs {e.name}", "pip install 'fxreplace[hf]'") from None
        except OSError as e:  # the environment's: a full disk, a folder removed or made read-only meanwhile
            raise UsageError(f"{one_line(e)}; {produced}") from e
    except UsageError as error:
        if debug:
            traceback.print_exc()
        print(error, file=sys.stderr)
        raise
    except KeyboardInterrupt as interrupt:
        if debug:
            traceback.print_exc()
        # what the interrupted frames held open goes now: a progress bar closed at exit would print below this line
        traceback.clear_frames(interrupt.__traceback__)
        say_interrupted(produced)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except Exception as error:  # noqa: BLE001 - fxreplace's own fault: one line, the traceback on demand
        if debug:
            traceback.print_exc()
        print(f"error: internal error, {type(error).__name__}: {one_line(error)}; {produced}; hint: rerun with "
              "--debug for the traceback and report it", file=sys.stderr)
        raise SystemExit(EXIT_INTERNAL) from None


if __name__ == "__main__":
    sys.exit(main())
