"""``fxreplace validate --engine vllm`` end to end, tiny Qwen3-MoE in float32.

The reference is HF's greedy generation with forced router logits, except that at
step ``SWAP`` it takes the second-best token (and its logits say so). vLLM with
replacement must match every step but that one, which is a divergence: the
validation retries with the reference tokens as a new request, which the plugin
resolves by prefix, and every later step matches again. Without replacement vLLM
routes differently and diverges.

The CLI runs in a subprocess (an in-process engine there): a second in-process
engine in the pytest process after test_vllm.py's ngram engine would fail (see
that test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fxreplace.reference import Reference
from fxreplace.engines.vllm.testing import capture_router_logits, force_routing, hf_logprobs
from test_vllm import NEW, Ref

SWAP = 3
NAMES = ["short", "repeat"]


def forced_generation(ref: Ref, prompt: list[int]):
    """Greedy HF generation under forced routing, with the second-best token at step SWAP."""
    seq, tokens, logits = list(prompt), [], []
    for step in range(NEW):
        lp = hf_logprobs(ref.hf, seq, force_routing(capture_router_logits(ref.hf, ref.hf.targets, seq)))[-1]
        if step == SWAP:
            token = int(lp.topk(2).indices[1])
            lp = lp.clone()
            lp[token] = lp.max() + 1.0
        else:
            token = int(lp.argmax())
        tokens.append(token)
        logits.append(lp)
        seq.append(token)
    captures = force_routing(capture_router_logits(ref.hf, ref.hf.targets, seq))  # causal: rows match each step's
    return captures, tokens, torch.stack(logits)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny checkpoint and its forced-routing reference: ``(ref, reference_dir)``."""
    tmp = tmp_path_factory.mktemp("fxreplace_vllm_validate")
    ref = Ref(tmp)
    captures, prompts, tokens, logits = {}, [], [], []
    for i, name in enumerate(NAMES):
        c, t, lg = forced_generation(ref, ref.prompts[name])
        captures[i] = c
        prompts.append(ref.prompts[name])
        tokens.append(t)
        logits.append(lg)
    reference_dir = tmp / "reference"
    # what a capture with --components records beside the routers: the engine replaces the routers alone
    recorded = ["model.embed_tokens", "model.layers.*.self_attn", "model.layers.*.mlp.gate", "model.layers.*"]
    Reference.from_parts(captures, prompts, tokens, logits,
                         metadata={"source_model": ref.ckpt, "targets": recorded}).save(reference_dir)
    return ref, reference_dir


def validate(ref: Ref, reference_dir, report, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    """``fxreplace validate --engine vllm`` as a user runs it: vLLM's engine core in a process of its
    own, its memory sized by fxreplace for the run (``pythonpath`` first on the path of every process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "FXREPLACE_"))}
    env.update(OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "fxreplace", "validate", ref.ckpt, "--reference", str(reference_dir),
                           "--engine", "vllm", "--dtype", "float32", "--eager", "--report-dir", str(report)],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def validated(reference):
    ref, reference_dir = reference
    report = reference_dir.parent / "report"
    proc = validate(ref, reference_dir, report)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the engine's shared memory, removed by the command, is not reported leaked after its last line
    assert "resource_tracker" not in proc.stderr, proc.stderr[-4000:]
    return json.loads((report / "result.json").read_text()), proc.stdout


# Planted in every process of the engine (sitecustomize runs at each interpreter's start): fxreplace's
# injection returns more than it computed, so instrumenting changes vLLM's model.
CHANGED_INJECTION = """
import importlib
slots = importlib.import_module("fxreplace.slots")
given = slots._output_point_forward  # the forward instrumenting gives a target whose point is its output


def changed(self, *args, **kwargs):
    out = given(self, *args, **kwargs)  # vLLM's linear layers return (output, bias)
    return (out[0] + 1.0, *out[1:]) if isinstance(out, tuple) else out + 1.0


slots._output_point_forward = changed
"""


def test_validate_refuses_an_engine_whose_instrumentation_changed_the_model(reference, tmp_path):
    """The engine's start-up forward proves instrumenting changed nothing vLLM computes; when it did,
    the worker's error reaches the command in its own words: one line naming the module, exit 2, no report."""
    ref, reference_dir = reference
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(CHANGED_INJECTION)
    proc = validate(ref, reference_dir, tmp_path / "report", pythonpath=str(plant))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert last.startswith("error: instrumenting 'model.layers.0.mlp.gate' changed what it computes with nothing "
                           "replaced (max |diff| "), last
    assert not (tmp_path / "report").exists() or not any((tmp_path / "report").iterdir())


def test_validate_vllm_with_replacement_matches_but_the_swapped_step(validated):
    result, stdout = validated
    on = [s for s in result["steps"] if s["mode"] == "on"]
    assert sorted((s["prompt"], s["step"]) for s in on) == [(p, j) for p in range(len(NAMES)) for j in range(NEW)]
    for s in on:
        if s["step"] == SWAP:
            assert not s["top1_agree"] and s["round"] == 0, s
        else:
            assert s["status"] == "matched" and s["top5_error"] < 1e-4, s
            assert s["round"] == (0 if s["step"] < SWAP else 1), s  # later steps come from the retry
    retry_ids = {s["req_id"] for s in on if s["round"] == 1}
    first_ids = {s["req_id"] for s in on if s["round"] == 0}
    assert len(retry_ids) == len(NAMES) and not retry_ids & first_ids  # each retry is a new request
    summary = result["summary"]["on"]
    assert all(p["divergences"] == 1 and p["first_divergence"] == SWAP and p["retries"] == 1
               for p in summary["prompts"].values())
    assert "report:" in stdout


def test_validate_vllm_names_what_it_replaced(validated):
    """The verdict names the targets the engine replaced (the family's in vLLM's code), not every capture
    the reference holds."""
    result, stdout = validated
    assert "the targets (model.layers.*.mlp.gate)" in stdout, stdout
    assert "model.embed_tokens" not in stdout and "self_attn" not in stdout


def test_validate_vllm_without_replacement_diverges(validated):
    result, _ = validated
    off = result["summary"]["off"]
    assert off["prompts_diverged"] == len(NAMES)
    assert off["status_counts"]["matched"] < off["steps"] / 2
    assert off["mean_top5_error"] > 0.1
