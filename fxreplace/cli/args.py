"""The command line's vocabulary, read when it is parsed (before anything heavy loads): the
parser and its formatting, the exit codes, the one line every failure becomes (with what the
run left on disk), and the argument types that check a value before any model loads."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ..dtypes import LOW_PRECISION
from ..engines.registry import ALIASES, BUILTIN, engine_name
from ..loading import SetupError, check_model_dir
from ..words import one_line

EXIT_OK, EXIT_GATE_FAILED, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
DTYPES = ["float32", *LOW_PRECISION]  # --dtype: the reference's float32, or below it (a noise floor's precisions)


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


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error:`` line (exit 2) like every other mistake."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}", None if "hint:" in message else f"see `{self.prog} --help`")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` states every default that has a value (not the None or False of unset options)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def device_arg(text: str) -> str:
    """``--device``: a torch device this machine has (checked before anything loads)."""
    import torch  # only when --device is given: --help and most commands parse without torch

    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device ({one_line(e)}); e.g. cpu, cuda, cuda:1") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has no CUDA device torch {torch.__version__} can use")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def add_device_argument(parser, engines: bool = False) -> None:
    """``--device``; ``engines``: the command takes ``--engine``, and vLLM refuses it."""
    vllm = "; not with --engine vllm, which places the model itself (CUDA_VISIBLE_DEVICES)" if engines else ""
    parser.add_argument("--device", type=device_arg, metavar="DEVICE",
                        help="where the models run, e.g. cuda or cuda:1 (default: where they load, the CPU); a reference "
                             f"larger than one device: --device-map auto{vllm}")


def device_map_arg(text: str) -> str:
    """``--device-map``: accelerate dispatches the layers; checked to be installed before anything loads."""
    import importlib.util  # noqa: PLC0415 - only when --device-map is given

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
        from ..models import families  # only for builtin: models: a directory is checked without the registry

        if spec.removeprefix("builtin:") not in families():
            raise argparse.ArgumentTypeError(f"no builtin model {spec!r}; hint: builtin:ARCH with ARCH one of "
                                             f"{', '.join(families())}")
        return spec
    try:
        check_model_dir(spec)
    except SetupError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


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


def gate_condition(text: str) -> str:
    """One ``--fail-on`` condition, checked when the command line is parsed."""
    from ..validation import Gate  # only when --fail-on is given: it imports torch

    try:
        Gate.parse([text])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def engine_arg(text: str) -> str:
    """``--engine``: an engine there is (built-in, registered, or declared by an installed package),
    by its name; checked without loading it."""
    try:
        return engine_name(text)
    except KeyError as e:
        raise argparse.ArgumentTypeError(e.args[0]) from None


def add_engine_arguments(parser, default: str | None, what: str) -> None:
    """The one ``--engine`` vocabulary and compile switch of every command that runs a model:
    ``--engine NAME`` and ``--compile/--no-compile`` (``--eager``: the same as ``--no-compile``),
    unset meaning ``default`` and the engine's own choice. ``what``: the default, in words."""
    names = ", ".join([*BUILTIN, *(f"{old} (= {new})" for old, new in ALIASES.items())])
    unset = "" if default else f" (default: {what})"  # a set default is stated by the formatter
    parser.add_argument("--engine", type=engine_arg, default=default, metavar="NAME",
                        help=f"what runs the model: {names}, or an engine an installed package registers{unset}; "
                             "runner: the Hugging Face model in this process; vllm: a vLLM engine with the fxreplace "
                             "plugin (MODEL: a checkpoint directory)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compile the target (runner: torch.compile with inductor; vllm: its own compile and "
                             "CUDA graphs); default: the engine's choice (runner eager, vllm compiled)")
    parser.add_argument("--eager", dest="compile", action="store_const", const=False,
                        help="the same as --no-compile")
    parser.add_argument("--engine-args", default="{}", metavar="JSON",
                        help="the engine's own options as a JSON object (vllm: vllm.LLM keyword arguments, e.g. "
                             "'{\"tensor_parallel_size\": 2}')")
