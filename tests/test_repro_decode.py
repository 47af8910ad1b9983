"""Faults that arise in one phase only (benchmarks/decode_faults.py: code planted in the attention of
Llama and Qwen3-MoE). Validation runs the target as an engine does (prefill, then decode steps with
a cache) and must say, per prompt, that the prefill steps match and only the decode steps diverge
(or the reverse); a repro records the guilty component's calls as they ran (decode steps with the
keys and values they read) and must not agree, naming decode; a kind of call it cannot record is
named, never "agrees"."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxreplace import repro_run
from fxreplace.capture import capture_reference
from fxreplace.cli import main as cli
from fxreplace.metrics import DECODE, MATCHED, PREFILL
from fxreplace.models import get_family, tiny_model
from fxreplace.repro import write_repro
from fxreplace.targets import Target

# the planted faults live beside the code-fault benchmark, which plants them too (loaded by path, as
# test_bench_blame_suite.py loads the suite; a child process imports them from there by name)
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if "decode_faults" not in sys.modules:  # one module, whichever loads it first
    spec = importlib.util.spec_from_file_location("decode_faults", BENCHMARKS / "decode_faults.py")
    sys.modules["decode_faults"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["decode_faults"])
decode_faults = sys.modules["decode_faults"]
DECODE_FAULTS, PREFILL_FAULT, plant = decode_faults.DECODE_FAULTS, decode_faults.PREFILL_FAULT, decode_faults.plant
ATTENTION = "model.layers.1.self_attn"  # the last layer's: what it computes reaches the logits directly
CASES = [("LlamaForCausalLM", "rope_again"), ("Qwen3MoeForCausalLM", "position_off_by_one")]
assert {fault for _, fault in CASES} == set(DECODE_FAULTS)


def reference_of(clean, directory: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 128, (n,), generator=g).tolist() for n in (6, 9, 12)]
    arch = type(clean).__name__
    capture_reference(clean, prompts, get_family(arch).targets, 6, progress=False).save(directory)
    return directory


@pytest.fixture(scope="module", params=CASES, ids=lambda case: f"{case[0]}-{case[1]}")
def case(request, tmp_path_factory):
    """(clean model, reference directory, the target with the decode fault, its checkpoint directory)."""
    arch, fault = request.param
    root = tmp_path_factory.mktemp(fault)
    clean = tiny_model(arch)
    target = plant(copy.deepcopy(clean), fault, layer=1)
    target.save_pretrained(root / "target")  # its config.json names the fault
    return clean, reference_of(clean, root / "ref"), target, root / "target"


def validate(target_dir: Path, reference: Path, report: Path, capsys) -> tuple[dict, str]:
    """`fxreplace validate` (the runner, eager, float32): its result.json and what it printed."""
    capsys.readouterr()
    assert cli(["validate", str(target_dir), "--reference", str(reference), "--dtype", "float32",
                "--report-dir", str(report)]) == 0
    return json.loads((report / "result.json").read_text()), capsys.readouterr().out


def test_validate_says_the_prefill_matches_and_only_decode_diverges(case, tmp_path, capsys):
    _, reference, _, target_dir = case
    result, printed = validate(target_dir, reference, tmp_path, capsys)
    off = [s for s in result["steps"] if s["mode"] == "off"]
    assert {s["phase"] for s in off if s["step"] == 0} == {PREFILL}
    assert {s["phase"] for s in off if s["step"]} == {DECODE}
    assert all(s["status"] == MATCHED for s in off if s["phase"] == PREFILL)  # the planted code never runs there
    prompts = result["summary"]["off"]["prompts"]
    assert all(p["diverges_in"] == DECODE and p["phases"][DECODE]["diverged"] > 0 for p in prompts.values()), prompts
    verdict = printed.split("verdict: ", 1)[1]
    assert "On 3 prompts (0, 1, 2) the prefill steps match (3 steps, top-5 error at most " in verdict
    assert "and only the decode steps diverge (" in verdict
    assert "a fault that arises only in decode, with the KV cache" in verdict
    assert "only the decode steps diverge" in result["verdict"]["sentence"]


def test_repro_of_a_decode_fault_disagrees_in_its_decode_calls(case, tmp_path, capsys):
    clean, reference, target, _ = case
    out = write_repro(target, clean, reference, ATTENTION, tmp_path / "repro", inputs=2)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["README.md", "decode.pt2", "prefill.pt2", "inputs.safetensors", "reference_outputs.safetensors", "repro.json",
         "run.py"])
    capsys.readouterr()
    assert repro_run.run(out) == repro_run.EXIT_DISAGREES
    printed = capsys.readouterr().out
    assert ("verdict: the port: the target's component disagrees with the reference already in eager" in printed
            and "in its decode calls only (its prefill calls agree, error up to 0)" in printed
            and "the fault arises only in decode, with the cache of earlier positions" in printed), printed
    meta = json.loads((out / repro_run.META).read_text())
    assert meta["calls"] == {PREFILL: 3, DECODE: 15} and meta["unrecorded"] == {}
    decode = [i for i in meta["inputs"] if i["call"] == DECODE]
    prefill = [i for i in meta["inputs"] if i["call"] == PREFILL]
    assert len(decode) == len(prefill) == 2
    assert all(i["error_at_write"] == 0 and i["cached"] == 0 for i in prefill)
    assert all(i["error_at_write"] > 0.05 and i["cached"] >= 6 and i["tokens"] == 1 for i in decode)
    # a decode call's inputs hold the cache it read: one layer's keys and values over its earlier positions
    assert all([1, 1, i["cached"], 32] in i["shapes"] for i in decode), decode


def test_a_clean_component_agrees_in_prefill_and_decode_under_aot_eager(case, tmp_path, capsys):
    clean, reference, _, _ = case
    out = write_repro(clean, clean, reference, ATTENTION, tmp_path / "repro", inputs=2)
    capsys.readouterr()
    assert repro_run.run(out, backend="aot_eager") == repro_run.EXIT_AGREES
    printed = capsys.readouterr().out
    assert "verdict: agrees: eager and aot_eager match the reference within 0.001 on every input (prefill and decode " \
           "calls)" in printed
    meta = json.loads((out / repro_run.META).read_text())  # a folder of the one-program layout: its own run.py runs it
    (out / repro_run.META).write_text(json.dumps({**meta, "format": 1}))
    with pytest.raises(SystemExit) as raised:
        cli(["repro", "run", str(out)])
    err = capsys.readouterr().err.strip()
    assert raised.value.code == 2 and "was written by another fxreplace (repro format 1" in err and "\n" not in err


def test_a_sliding_window_layers_decode_calls_replay_its_window(tmp_path, capsys):
    """GPT-OSS's layer 0 attends a window of 4: past it, its cache holds the last 3 positions, and the
    decode program rebuilds that cache (of the model's layer types) from them exactly."""
    clean = tiny_model("GptOssForCausalLM", sliding_window=4)
    out = write_repro(clean, clean, reference_of(clean, tmp_path / "ref"), "model.layers.0.self_attn", tmp_path / "r",
                      inputs=2)
    decode = [i for i in json.loads((out / repro_run.META).read_text())["inputs"] if i["call"] == DECODE]
    assert decode and all(i["cached"] >= 6 and [1, 1, 3, 32] in i["shapes"] for i in decode), decode
    capsys.readouterr()
    assert repro_run.run(out) == repro_run.EXIT_AGREES, capsys.readouterr().out


def fxreplace_process(*args: str, faults: bool) -> subprocess.CompletedProcess:
    """`python -m fxreplace ARGS` in a new process, as a user runs it; with ``faults``, the planted
    faults' code is installed first (the checkpoint's config names which one its attention runs)."""
    plant_them = "import decode_faults; decode_faults.install(); " if faults else ""
    script = (f"{plant_them}import runpy, sys; sys.argv[0] = 'fxreplace'; "
              "runpy.run_module('fxreplace', run_name='__main__')")
    path = os.pathsep.join(p for p in (str(BENCHMARKS), str(BENCHMARKS.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600)


def test_cli_validate_blame_repro_name_the_decode_fault(case, tmp_path):
    """The whole path in fresh processes: validate says decode; blame names the attention of layer 1;
    `repro write --blame` records its decode calls; `repro run` (which needs no planted code: the
    fault is in the exported program) disagrees in decode."""
    clean, reference, _, target_dir = case
    common = ["--reference", str(reference), "--dtype", "float32"]
    done = fxreplace_process("validate", str(target_dir), *common, "--report-dir", str(tmp_path / "v"), faults=True)
    assert done.returncode == 0 and "only the decode steps diverge" in done.stdout, done.stdout + done.stderr
    common += ["--clean", f"builtin:{type(clean).__name__}"]  # the model the reference was captured from
    done = fxreplace_process("blame", str(target_dir), *common, "--report-dir", str(tmp_path / "b"), faults=True)
    assert done.returncode == 0, done.stdout + done.stderr
    blamed = json.loads((tmp_path / "b" / "blame.json").read_text())
    assert blamed["origins"][0]["component"] == ATTENTION, blamed["verdict"]
    assert "the prefill steps match" in blamed["verdict"] and "only the decode steps diverge" in blamed["verdict"]
    done = fxreplace_process("repro", "write", str(target_dir), *common, "--blame", str(tmp_path / "b" / "blame.json"),
                             "--inputs", "2", "--out", str(tmp_path / "repro"), faults=True)
    assert done.returncode == 0 and f"repro of {ATTENTION} (2 prefill and 2 decode calls)" in done.stdout, done.stderr
    done = fxreplace_process("repro", "run", str(tmp_path / "repro"), "--backend", "inductor", faults=False)
    assert done.returncode == repro_run.EXIT_DISAGREES, done.stdout + done.stderr
    assert "verdict: the port" in done.stdout and "in its decode calls only" in done.stdout, done.stdout


def test_a_prefill_only_fault_is_named_the_reverse_way(tmp_path, capsys):
    """The attention's output scaled in a prefill only (its cache right, so decode steps stay exact)."""
    clean = tiny_model("LlamaForCausalLM")
    reference = reference_of(clean, tmp_path / "ref")
    target = plant(copy.deepcopy(clean), PREFILL_FAULT, layer=1)
    target.save_pretrained(tmp_path / "target")
    result, printed = validate(tmp_path / "target", reference, tmp_path / "report", capsys)
    prompts = result["summary"]["off"]["prompts"]
    assert all(p["diverges_in"] == PREFILL for p in prompts.values()), prompts
    assert "On 3 prompts (0, 1, 2) the decode steps match (15 steps, top-5 error at most " in printed
    assert "and only the prefill steps diverge (3 of 3, mean top-5 error " in printed
    out = write_repro(target, clean, reference, ATTENTION, tmp_path / "repro", inputs=2)
    capsys.readouterr()
    assert repro_run.run(out) == repro_run.EXIT_DISAGREES
    assert "in its prefill calls only (its decode calls agree, error up to 0)" in capsys.readouterr().out


def test_a_fault_in_both_phases_names_neither(tmp_path, capsys):
    """A weight fault shows in prefill and decode alike: no phase is named."""
    clean = tiny_model("LlamaForCausalLM")
    reference = reference_of(clean, tmp_path / "ref")
    target = copy.deepcopy(clean)
    with torch.no_grad():
        target.model.layers[1].self_attn.o_proj.weight.mul_(1.5)
    target.save_pretrained(tmp_path / "target")
    result, printed = validate(tmp_path / "target", reference, tmp_path / "report", capsys)
    prompts = result["summary"]["off"]["prompts"]
    assert all(p["phases"][PREFILL]["diverged"] and p["diverges_in"] is None for p in prompts.values()), prompts
    assert "steps match" not in printed and "arises only" not in printed


def test_precision_drift_names_no_phase(tmp_path, capsys):
    """A bf16 target drifts in prefill and decode alike: a prefill step within tolerance beside
    diverged decode steps is not a decode fault (the phase's errors must differ by PHASE_CONTRAST)."""
    clean = tiny_model("Qwen3MoeForCausalLM")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 128, (n,), generator=g).tolist() for n in (6, 9, 12, 7, 10, 8)]
    reference = capture_reference(clean, prompts, get_family("Qwen3MoeForCausalLM").targets, 12, progress=False)
    reference.save(tmp_path / "ref")
    clean.save_pretrained(tmp_path / "target")
    capsys.readouterr()
    assert cli(["validate", str(tmp_path / "target"), "--reference", str(tmp_path / "ref"), "--dtype", "bfloat16",
                "--report-dir", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out
    prompts = json.loads((tmp_path / "report" / "result.json").read_text())["summary"]["off"]["prompts"]
    decode_alone = [p for p in prompts.values()
                    if p["phases"][DECODE]["diverged"] and not p["phases"][PREFILL]["diverged"]]
    assert decode_alone, prompts  # what a rule on the diverged counts alone would call a decode fault
    assert all(p["diverges_in"] is None for p in prompts.values()) and "steps match" not in printed


def test_a_call_whose_cache_cannot_be_recorded_is_named_never_agrees(tmp_path, capsys):
    """Qwen3-Next's linear attention caches a convolution and a recurrent state, not keys and values:
    its decode calls cannot be replayed, so the folder holds its prefill calls and says so."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    config = Qwen3NextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_value_heads=2,
                             linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                             layer_types=["linear_attention", "full_attention"], initializer_range=0.2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "model")
    capture_reference(model, [[5, 9, 33, 17, 8, 90], [4, 8, 15, 16, 23, 42, 7]], [Target("model.layers.*.mlp.gate")], 4,
                      progress=False).save(tmp_path / "ref")
    out = tmp_path / "repro"
    capsys.readouterr()
    assert cli(["repro", "write", str(tmp_path / "model"), "--reference", str(tmp_path / "ref"), "--clean",
                str(tmp_path / "model"), "--component", "model.layers.0.linear_attn", "--dtype", "float32",
                "--inputs", "2", "--out", str(out)]) == 0
    written = capsys.readouterr().out
    assert "(2 prefill calls)" in written and "not recorded: its 6 decode calls cannot be replayed" in written, written
    meta = json.loads((out / repro_run.META).read_text())
    assert list(meta["programs"]) == [PREFILL] and meta["calls"] == {PREFILL: 2, DECODE: 6}
    assert meta["unrecorded"][DECODE].startswith("its cache layer 0 is a LinearAttentionLayer, not keys and values")
    assert "its 6 decode calls cannot be replayed: its cache layer 0" in (out / "README.md").read_text()
    capsys.readouterr()
    assert repro_run.run(out) == repro_run.EXIT_INCOMPLETE
    printed = capsys.readouterr().out
    assert "not recorded: its 6 decode calls cannot be replayed: its cache layer 0 is a LinearAttentionLayer" in printed
    assert "verdict: not conclusive: the prefill calls held match the reference" in printed
    assert "agrees" not in printed
