"""``fxreplace blame --engine vllm`` on planted faults (eager vLLM, float32).

The checkpoint vLLM loads is a tiny 4-layer Qwen3-MoE with one planted fault; the
reference is the clean HF model with its components captured. One vLLM engine serves
every pass: its plugin instruments every component (vLLM's attention, router, MoE
block, and the decoder layer's ``(output, residual)`` pair through the
``residual_stream_pair`` adapter) with ``select_captures``, and each pass's requests
select the captures they replace. The CLI runs in a subprocess: in-process engines
must not follow test_vllm.py's ngram engine (see there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from fxreplace.capture import capture_reference
from fxreplace.models import get_family, tiny_model
from fxreplace.validation import EXPLAINS
from fxreplace.vllm.testing import save_tiny_checkpoint
from test_blame import ARCH, KINDS, LAYERS, NEW, PLANTED, prompts

FAULTS = {"attention": ("model.layers.1.self_attn.o_proj.weight", 1.5), "router": ("model.layers.2.mlp.gate.weight", -1.0)}


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("blame_vllm") / "reference"
    clean = tiny_model(ARCH, num_hidden_layers=LAYERS)  # the weights save_tiny_checkpoint writes
    capture_reference(clean, prompts(), [], NEW, components=get_family(ARCH).components, progress=False).save(directory)
    return directory


def planted_checkpoint(directory, fault: str):
    """The reference's tiny checkpoint with one weight scaled: the planted fault."""
    checkpoint = save_tiny_checkpoint(ARCH, directory, num_hidden_layers=LAYERS)
    weights = load_file(str(checkpoint / "model.safetensors"))
    key, scale = FAULTS[fault]
    weights[key] = weights[key] * scale
    save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    return checkpoint


@pytest.mark.parametrize("fault", list(FAULTS))
def test_vllm_blame_ranks_the_planted_fault_first(reference_dir, tmp_path, fault):
    checkpoint = planted_checkpoint(tmp_path / "ckpt", fault)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "FXREPLACE_"))}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "fxreplace", "blame", str(checkpoint), "--reference", str(reference_dir),
                           "--engine", "vllm", "--dtype", "float32", "--eager", "--report-dir", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((out / "blame.json").read_text())
    component, layer = PLANTED[fault]
    top = data["ranking"][0]
    assert (top["component"], top["kind"], top["layer"]) == (component, fault, layer), proc.stdout[-3000:]
    assert data["confident"] and data["origin_layer"] == layer and top["explained"] >= EXPLAINS
    assert data["passes"] < 1 + LAYERS * len(KINDS)
    # vLLM's residual stream after the faulty layer, replaced through the (0, stream) pair, restores agreement
    stream = next(b for b in data["ranking"] if b["kind"] == "layer" and b["layer"] == layer)
    assert stream["explained"] > 0.99 and stream["kl_on"] < 1e-6
    assert f"{component} ({fault}, layer {layer}) is the cause" in proc.stdout
    # one engine for the whole search: the plugin logs "instrumented" once per engine start
    assert (proc.stdout + proc.stderr).count("fxreplace: instrumented") == 1
