"""``fxreplace blame --engine vllm`` on planted faults (float32; eager and compiled vLLM).

The checkpoint vLLM loads is a tiny 4-layer Qwen3-MoE with one planted fault (eager) or two (compiled); the
reference is the clean HF model with its components captured. One vLLM engine serves
every pass: its plugin instruments every component (vLLM's attention, router, MoE
block, and the decoder layer's ``(output, residual)`` pair through the
``residual_stream_pair`` adapter) with ``select_captures``, and each pass's requests
select the captures they replace (the passes of one round side by side, each request with
its own selection). The CLI runs in a subprocess: in-process engines
must not follow test_vllm.py's ngram engine (see there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from fxreplace.blame.result import engine_code
from fxreplace.capture import capture_reference
from fxreplace.models import get_family, tiny_model
from fxreplace.metrics import ENGINE_CODE_REPRO, EXPLAINS
from fxreplace.engines.vllm.testing import save_tiny_checkpoint
from test_blame import ARCH, KINDS, LAYERS, NEW, prompts

FAULTS = {"router": [("model.layers.2.mlp.gate.weight", -1.0)],
          "two": [("model.layers.0.self_attn.o_proj.weight", 1.5), ("model.layers.3.mlp.gate.weight", -1.0)]}
EXPECTED = {"router": [("model.layers.2.mlp.gate", "router", 2)],
            "two": [("model.layers.0.self_attn", "attention", 0), ("model.layers.3.mlp.gate", "router", 3)]}


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("blame_vllm") / "reference"
    clean = tiny_model(ARCH, num_hidden_layers=LAYERS)  # the weights save_tiny_checkpoint writes
    capture_reference(clean, prompts(), [], NEW, components=get_family(ARCH).components, progress=False).save(directory)
    return directory


def planted_checkpoint(directory, fault: str):
    """The reference's tiny checkpoint with the weights of ``FAULTS[fault]`` scaled: the planted faults."""
    checkpoint = save_tiny_checkpoint(ARCH, directory, num_hidden_layers=LAYERS)
    weights = load_file(str(checkpoint / "model.safetensors"))
    for key, scale in FAULTS[fault]:
        weights[key] = weights[key] * scale
    save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    return checkpoint


@pytest.mark.parametrize("fault, mode", [("router", "eager"), ("two", "compiled")])
def test_vllm_blame_names_the_planted_faults_first(reference_dir, tmp_path, fault, mode):
    checkpoint = planted_checkpoint(tmp_path / "ckpt", fault)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "FXREPLACE_"))}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "fxreplace", "blame", str(checkpoint), "--reference", str(reference_dir),
                           "--engine", "vllm", "--dtype", "float32", *(["--eager"] if mode == "eager" else []),
                           "--report-dir", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((out / "blame.json").read_text())
    expected = EXPECTED[fault]
    # the origins come by share, the largest first (EXPECTED is in layer order)
    named = [(o["component"], o["kind"], o["layer"]) for o in data["origins"]]
    assert sorted(named) == sorted(expected), proc.stdout[-3000:]
    assert [o["share"] for o in data["origins"]] == sorted((o["share"] for o in data["origins"]), reverse=True)
    assert [(b["component"], b["kind"], b["layer"]) for b in data["ranking"][:len(expected)]] == named
    assert data["confident"] and data["explained"] >= EXPLAINS and all(b["kind"] != "layer" for b in data["ranking"])
    assert data["passes"] < 1 + LAYERS * len(KINDS) and data["rounds"] <= 2 * len(expected)
    # vLLM's residual stream after the (last) faulty layer, replaced through the (0, stream) pair, restores agreement
    stream = next(s for s in data["layer_shares"] if s["layer"] == max(layer for _, _, layer in expected))
    assert stream["explained"] > 0.99
    assert data["verdict"].startswith("1 source: " if len(expected) == 1 else "2 independent sources: ")
    assert all(f"layer {layer} {kind} {component}" in proc.stdout for component, kind, layer in expected)
    # one engine for the whole search: the plugin logs "instrumented" once per engine start
    assert (proc.stdout + proc.stderr).count("fxreplace: instrumented") == 1


# port bugs planted as code in vLLM's own classes, in every process the engine starts (its worker included), each
# with the start of the verdict that names it as one fault
PORTED = {
    # vLLM's RMSNorm read as Gemma's norm (linkedin/Liger-Kernel#74: (1 + weight)): every norm of the model runs it
    "norm class": ("""
import torch
from vllm.model_executor.layers.layernorm import RMSNorm


def forward_native(self, x, residual=None):
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype) * (1.0 + self.weight)
    return out if residual is None else (out, residual)


RMSNorm.forward_native = forward_native
""", "1 systematic fault: RMSNorm, the class that the attention and the experts of every layer run (input_layernorm, "
     "self_attn.q_norm, self_attn.k_norm, post_attention_layernorm) and, after the last layer, model.norm: "),
    # the decoder layer takes its residual after the input norm (Howuhh/faster-trajectory-transformer#3): vLLM's layer
    # returns (MoE block output, residual), so replacing a layer's MoE block hands on part of its fault, which is the
    # layer's code's reach there, not a source of its own
    "layer code": ("""
from vllm.model_executor.models.qwen3_moe import Qwen3MoeDecoderLayer


def forward(self, positions, hidden_states, residual):
    if residual is None:
        hidden_states = self.input_layernorm(hidden_states)
    else:
        hidden_states, _ = self.input_layernorm(hidden_states, residual)
    residual = hidden_states
    hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    return self.mlp(hidden_states), residual


Qwen3MoeDecoderLayer.forward = forward
""", "1 fault in 3 layers: the layers' own code (Qwen3MoeDecoderLayer.forward) in layers 1, 2 and 3 (3 of 4): "),
}


@pytest.mark.parametrize("bug", list(PORTED))
def test_vllm_blame_names_a_bug_in_vllms_code_every_layer_runs_as_one_fault(reference_dir, tmp_path, bug):
    """Through vLLM, blame reads what each component's replacement spans in vLLM's own model (its worker runs one
    dummy forward with hooks), so a bug in the norm class every layer's attention and MoE block and the final norm
    run, or in the decoder layer's own forward, is one fault named by vLLM's class, not drift or several sources."""
    code, expected = PORTED[bug]
    checkpoint = save_tiny_checkpoint(ARCH, tmp_path / "ckpt", num_hidden_layers=LAYERS)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "FXREPLACE_"))}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(site))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "fxreplace", "blame", str(checkpoint), "--reference", str(reference_dir),
                           "--engine", "vllm", "--dtype", "float32", "--eager", "--report-dir", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((out / "blame.json").read_text())
    verdict = data["verdict"]
    assert verdict.startswith(expected), verdict
    assert "diffuse" not in verdict and "independent" not in verdict, verdict
    # a repro of the checkpoint runs transformers' classes with the target's weights, not vLLM's code: the verdict and
    # the next step say what its answer tells (the weights or vLLM's code), not that it runs the class blamed
    module = data["systematic"]["modules"][0] if bug == "norm class" else data["systematic"]["module"]
    assert verdict.endswith(f"; {engine_code(module)}.") and " alone" not in verdict.split("; ")[-1], verdict
    assert not data["repro"]
    # the class's origins are components, which `repro write --blame` takes; the layer code's are layers (no next step)
    next_step = proc.stdout.split("\nnext: ")[1] if "\nnext: " in proc.stdout else None
    assert (next_step is not None) == (bug == "norm class"), proc.stdout[-2000:]
    assert next_step is None or ENGINE_CODE_REPRO in next_step, next_step
