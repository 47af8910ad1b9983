"""Loading what a command names (a model, its tokenizer, its config) and checking it against a
reference before anything long runs. The CLI and the engines use these alike; a mistake is a
:class:`SetupError` that says what is wrong and how to fix it."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import SetupError
from .words import one_line

#: Files that make a directory hold a tokenizer (transformers 5 builds an empty one from a bare config).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_model(spec: str, dtype=None, dispatch: dict | None = None, device: str | None = None):
    """``builtin:ARCH`` (a tiny random model from fxreplace.models) or a local HF directory
    (sharded or not), in ``dtype`` (default fp32): loaded in it, never converted from a copy,
    each weight in memory once, or placed across devices, the CPU and disk by ``dispatch``
    (:func:`fxreplace.checkpoint.load_checkpoint`); else moved to ``device``."""
    import torch  # read when the command line parses: torch loads with a model

    from .checkpoint import load_checkpoint

    dtype = dtype or torch.float32
    if spec.startswith("builtin:"):
        if dispatch:
            raise SetupError("--device-map places a checkpoint's layers as it loads them; a builtin model is built "
                             "in memory", "save it with save_pretrained(DIR) and capture DIR")
        from fxreplace.models import tiny_model  # the families import torch: loaded with a model

        return tiny_model(spec.removeprefix("builtin:")).to(device or "cpu", dtype)
    check_model_dir(spec)
    try:
        model = load_checkpoint(spec, dtype, dispatch)
    except (OSError, ValueError, KeyError) as e:
        hint = ("--max-memory DEVICE=SIZE,... bounds each device; the layers that do not fit go to --offload-folder DIR"
                if dispatch else "a checkpoint directory holds config.json and its weights (save_pretrained)")
        raise SetupError(f"cannot load the model in {spec}: {one_line(e)}", hint) from None
    return model if dispatch or device is None else model.to(device)


def recorded_model(spec: str) -> str:
    """A model as a reference records it: ``builtin:ARCH``, or its directory as an absolute path
    (hints built from it, ``--clean ...``, are run from other directories)."""
    return spec if spec.startswith("builtin:") else str(Path(spec).resolve())


def check_model_dir(spec: str) -> None:
    """A local model directory must at least hold a Hugging Face ``config.json``."""
    path = Path(spec)
    if not path.is_dir():
        raise SetupError(f"model {spec!r} is neither builtin:ARCH nor a local directory",
                         "give a checkpoint directory (config.json and weights) or builtin:ARCH")
    if not (path / "config.json").is_file():
        from .store import INDEX_FILE, TENSORS_FILE  # the store imports torch: only to name a store given as a model

        if (path / INDEX_FILE).is_file() or (path / TENSORS_FILE).is_file():
            raise SetupError(f"{spec} is a reference store, not a model directory",
                             f"`fxreplace inspect --verify {spec}` checks a store; were the two swapped? the model "
                             f"comes first and the store after --reference: MODEL --reference {spec}")
        raise SetupError(f"{spec} holds no config.json: not a Hugging Face model directory",
                         "save the model with save_pretrained(DIR)")


def check_checkpoint_dir(spec: str, engine: str) -> None:
    """An engine that loads the checkpoint itself (vLLM) needs a local directory, not ``builtin:``."""
    if spec.startswith("builtin:"):
        arch = spec.removeprefix("builtin:")
        raise SetupError(f"--engine {engine} loads the checkpoint itself and needs a local directory, got {spec!r}",
                         f"save the tiny model with its tokenizer as one: python -c \"from fxreplace.engines.vllm.testing import "
                         f"save_tiny_checkpoint; save_tiny_checkpoint('{arch}', 'tiny-{arch}')\", then give tiny-{arch}")
    check_model_dir(spec)


def load_tokenizer(spec: str, *, required_by: str | None = None):
    """The checkpoint's own tokenizer (``AutoTokenizer`` from the model directory), or None
    where it has none; ``required_by`` (what needs it) turns its absence into an error."""
    if spec.startswith("builtin:") or not any((Path(spec) / f).is_file() for f in TOKENIZER_FILES):
        if required_by is None:
            return None
        raise SetupError(f"{required_by} needs a tokenizer but {spec} has none ({' / '.join(TOKENIZER_FILES[:2])})",
                         "give --prompts as token id lists, e.g. [[1, 2, 3]], or save the tokenizer into the "
                         "checkpoint (tokenizer.save_pretrained(DIR))")
    from transformers import AutoTokenizer  # the hf extra: loaded with a tokenizer only

    try:
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as e:
        raise SetupError(f"cannot load the tokenizer in {spec}: {e}", "give --prompts as token id lists") from None


def config_json(spec: str) -> dict:
    """A model directory's config.json."""
    try:
        return json.loads((Path(spec) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SetupError(f"cannot read {Path(spec) / 'config.json'}: {e}") from None


def model_architecture(spec: str) -> str:
    """The architecture a ``builtin:ARCH`` spec or a model directory's config.json names."""
    from .models import architecture  # the families import torch: loaded with a model

    if spec.startswith("builtin:"):
        return spec.removeprefix("builtin:")
    return architecture(config_json(spec), "unknown")


def default_targets(model) -> list:
    """The targets the model's family declares (KeyError for a family fxreplace does not register)."""
    from .models import architecture, get_family  # the families import torch: loaded with a model

    return list(get_family(architecture(model.config, type(model).__name__)).targets)


def check_reference_matches(reference, reference_path: str, model_name: str, arch: str) -> None:
    """A reference captured from another architecture would be replayed into the wrong
    modules (or the same names with another meaning) without any shape error."""
    recorded = reference.metadata.get("architecture")
    if recorded and recorded != arch:
        raise SetupError(f"the reference {reference_path} was captured from {recorded} "
                         f"(captures {reference.store.capture_names[:2]} ...) but {model_name} is {arch}",
                         "validate the model the reference was captured from, or capture a new one")


def check_layer_count(reference, reference_path: str, model_name: str, layers: int | None) -> None:
    """A reference captured from a model with another layer count comes from another model,
    which no --target fixes (recorded at capture as ``num_hidden_layers``)."""
    recorded = reference.metadata.get("num_hidden_layers")
    if recorded is not None and layers is not None and recorded != layers:
        raise SetupError(f"the reference {reference_path} was captured from a model with {recorded} layers but "
                         f"{model_name} has {layers}: it was captured from another model",
                         "validate the model the reference was captured from, or capture a new reference from "
                         f"{model_name}")


def check_vocab(reference, model_name: str, vocab_size: int) -> None:
    """A reference whose vocabulary is another size comes from another model."""
    if vocab_size != reference.vocab_size:
        raise SetupError(f"the reference has vocab size {reference.vocab_size} but {model_name} has "
                         f"{vocab_size}: it was captured from another model",
                         "validate the model the reference was captured from, or capture a new one")


def check_checkpoint_matches(reference, reference_path: str, model: str) -> None:
    """A checkpoint directory an engine loads itself, checked against the reference from its
    config.json alone (before the engine starts)."""
    check_reference_matches(reference, reference_path, model, model_architecture(model))
    check_layer_count(reference, reference_path, model, config_json(model).get("num_hidden_layers"))


def longest_sequence(reference) -> int:
    """Prompt plus generated tokens of the longest reference prompt: what a retry can reach."""
    return max(len(reference.prompt_tokens(p)) + reference.num_generated(p) for p in range(reference.num_prompts))
