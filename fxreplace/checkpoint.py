"""A Hugging Face checkpoint directory loaded with each weight in memory once.

``from_pretrained`` memory-maps the safetensors files: the parameters it has to convert (a
MoE's per-expert weights fused into one tensor, a bf16 checkpoint upcast) are copies, and the
file pages they were read from stay resident in the mapping beside them until it closes, while
the parameters it does not convert stay views of the file. A process then peaks at up to twice
the weights (measured: 1.39 GiB for a 0.65 GiB model, 0.58 GiB of it the mapped file).
Here the files are read with ``pread`` (safetensors' other backend) into tensors transformers
loads or converts as it would the mapped ones: no mapping, every parameter in the process's
own memory once, the reads freed as transformers converts them.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

# transformers' names for a checkpoint's safetensors files
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# glibc's mallopt parameter number for M_MMAP_THRESHOLD
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 1 << 20


def weight_files(directory: str | Path) -> list[Path]:
    """The checkpoint's safetensors files (its index's shards, or its one file); [] when it has none."""
    directory = Path(directory)
    index = directory / WEIGHTS_INDEX_FILE
    if index.is_file():
        return [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [directory / WEIGHTS_FILE] if (directory / WEIGHTS_FILE).is_file() else []


def load_checkpoint(directory: str | Path, dtype, dispatch: dict | None = None):
    """The causal LM saved in ``directory`` (``save_pretrained``), in ``dtype``, eval mode: its
    safetensors read without a mapping. A checkpoint without safetensors files, of an
    architecture transformers' causal-LM registry lacks, or under transformers 4 (whose loader
    takes a state dict of tensors only, not of slices read as it goes) goes through ``from_pretrained``.

    ``dispatch``: ``from_pretrained``'s ``device_map`` (and ``max_memory``, ``offload_folder``), for
    a model larger than memory: accelerate places each layer on a device, the CPU or disk and
    moves offloaded weights in as each layer runs. It goes through ``from_pretrained``, which
    reads the layers it leaves on disk from the checkpoint's own files."""
    from safetensors import safe_open  # the hf extra: the core imports without transformers
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM, GenerationConfig

    files = weight_files(directory)
    config = AutoConfig.from_pretrained(directory)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if dispatch or not files or model_class is None or not _loads_slices():
        return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **(dispatch or {})).eval()
    _return_large_blocks_to_system()
    handles = [safe_open(str(f), framework="pt", backend="pread") for f in files]
    try:
        # slices: each tensor is read when transformers loads it, as with its own mapped files
        weights = {name: h.get_slice(name) for h in handles for name in h.keys()}
        model = model_class.from_pretrained(None, config=config, state_dict=weights, dtype=dtype)
    finally:
        for h in handles:
            h.__exit__(None, None, None)
    model.config.name_or_path = str(directory)  # from_pretrained(directory) records it; metadata names it
    if model.can_generate() and (Path(directory) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model.eval()


def _loads_slices() -> bool:
    import transformers  # the hf extra: the core imports without transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def _return_large_blocks_to_system() -> None:
    """Serve allocations of 1 MiB and more with their own mappings (glibc), so a freed block goes
    back to the system. Loading reads tensors that live only until transformers has converted
    them, between parameters that stay: with glibc's default (a threshold that rises to the
    largest block freed, up to 32 MiB) they are carved from the heap, which the parameters then
    pin: +0.4 GiB resident for a 0.65 GiB model. The setting stays for the process (glibc has no
    way back to its adaptive default): a forward's blocks that large then cost a mapping each,
    little beside the matrix products that fill them."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):  # not glibc: its own allocator's policy applies
        pass
