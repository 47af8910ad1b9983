"""Every flow on a CUDA device, as a user with a GPU runs it: capture, validation (eager and under
CUDA graphs), the noise floor, blame with a planted fault and the CLI's ``--device``, each with
the verdict the CPU gives. Skipped where torch sees no CUDA device (CI); the CPU half of the
``--device`` contract (a machine without CUDA refuses it in one line) runs everywhere."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import fxreplace
from fxreplace.floor import measure_floor
from fxreplace.models import get_family, tiny_model

ARCH = "Qwen3MoeForCausalLM"
PROMPTS = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24]]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA accepts --device cuda")
def test_device_cuda_without_cuda_is_one_line(tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(PROMPTS))
    done = subprocess.run([sys.executable, "-m", "fxreplace", "capture", f"builtin:{ARCH}", "--prompts", str(prompts),
                           "--out", str(tmp_path / "ref"), "--device", "cuda"], capture_output=True, text=True, env=_env())
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert "no CUDA device" in lines[-1] and "--device" in lines[-1], done.stderr
    assert not (tmp_path / "ref").exists()


def _runner(model, reference, compile=None):
    target = fxreplace.instrument(copy.deepcopy(model).bfloat16(), list(get_family(ARCH).targets))
    return fxreplace.Runner(target, model.config, fxreplace.TensorReplacer(reference.store),
                            fxreplace.RunnerConfig(prefill_buckets=(16,), batch_buckets=(2,), max_len=64, teacher_forcing=True),
                            dtype=torch.bfloat16, observed=target, compile=compile)


@pytest.fixture(scope="module")
def on_both():
    """The same fp32 model and its reference on the CPU and on the GPU: a copy per device (``.to()`` moves a
    module in place, so one model would end on the GPU under both keys)."""
    model = tiny_model(ARCH, init_std=0.3, seed=1)
    targets = list(get_family(ARCH).targets)
    both = {}
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ():
        placed = copy.deepcopy(model).to(device)
        both[device] = (placed, fxreplace.capture_reference(copy.deepcopy(placed), PROMPTS, targets, max_new_tokens=8,
                                                            progress=False))
    assert not both or next(both["cpu"][0].parameters()).device.type == "cpu"
    return both


@cuda
def test_capture_on_the_gpu_equals_the_cpu(on_both):
    (_, cpu), (_, gpu) = on_both["cpu"], on_both["cuda"]
    assert [gpu.tokens(p) for p in range(len(PROMPTS))] == [cpu.tokens(p) for p in range(len(PROMPTS))]
    for name in cpu.store.capture_names:
        for p in range(len(PROMPTS)):
            torch.testing.assert_close(gpu.store.rows(p, name).cpu(), cpu.store.rows(p, name), rtol=1e-4, atol=1e-4)


@cuda
@pytest.mark.parametrize("compile", [None, "inductor"])
def test_validation_and_floor_on_the_gpu_give_the_cpus_verdict(on_both, compile):
    results = {}
    for device, (model, reference) in on_both.items():
        result = fxreplace.logit_validation(_runner(model, reference, compile if device == "cuda" else None), reference,
                                            progress=False)
        result.floor = measure_floor(model, reference, torch.bfloat16, progress=False)
        results[device] = result
    cpu, gpu = results["cpu"], results["cuda"]
    assert gpu.summary()["on"]["prompts_diverged"] == cpu.summary()["on"]["prompts_diverged"] == 0
    assert gpu.verdict.within_floor == cpu.verdict.within_floor


@cuda
def test_planted_fault_blamed_on_the_gpu_as_on_the_cpu(on_both, tmp_path):
    found = {}
    for device, (model, reference) in on_both.items():
        reference.save(tmp_path / device)
        planted = copy.deepcopy(model)
        with torch.no_grad():
            planted.model.layers[1].mlp.gate.weight.mul_(-1.0)
        found[device] = fxreplace.blame(planted, tmp_path / device, clean=model, prompts=[0, 1], progress=False)
    assert [o.component for o in found["cuda"].origins] == [o.component for o in found["cpu"].origins]
    assert found["cuda"].origins and "layers.1" in found["cuda"].origins[0].component


@cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])  # reduce-overhead: replayed CUDA graphs
def test_one_cuda_graph_for_hand_made_warm_up_and_built_contexts(on_both, mode):
    model, reference = on_both["cuda"]
    target = fxreplace.instrument(copy.deepcopy(model), list(get_family(ARCH).targets))
    replacer = fxreplace.TensorReplacer(reference.store, device="cuda")
    replacer.register_request("a", PROMPTS[0])
    names = replacer.capture_names
    built = replacer.build_context(["a"], list(range(6)), is_prefill=True)
    contexts = [replacer.warmup_context(6, device="cuda"), built,
                fxreplace.ReplacementContext({n: built[n].clone() for n in reversed(names)}, built.mask.clone()),
                replacer.build_context(["a"], list(range(6)), is_prefill=True, out=replacer.warmup_context(6, device="cuda"))]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(target, mode=mode)
    ids = torch.tensor([PROMPTS[0]], device="cuda")
    with torch.no_grad():
        for ctx in contexts * 2:
            torch.testing.assert_close(compiled(input_ids=ids, use_cache=False, replacements=ctx).logits,
                                       target(input_ids=ids, use_cache=False, replacements=ctx).logits, rtol=1e-4, atol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@cuda
def test_cli_capture_and_validate_on_the_gpu(tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(PROMPTS))
    for argv in (["capture", f"builtin:{ARCH}", "--prompts", str(prompts), "--max-new-tokens", "4", "--out", str(tmp_path / "ref")],
                 ["validate", f"builtin:{ARCH}", "--reference", str(tmp_path / "ref"), "--report-dir", str(tmp_path / "out")]):
        done = subprocess.run([sys.executable, "-m", "fxreplace", *argv, "--device", "cuda"], capture_output=True,
                              text=True, env=_env())
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "result.json").is_file()
