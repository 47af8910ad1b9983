"""``fxreplace repro``: the blamed component alone, run per backend in a fresh process.

Planted faults in the target's weights (an attention projection, a router, one expert) must
show already in eager ("the port"); a fault planted in the compiler (a backend perturbing one
op, an inductor lowering computing a product wrong) must leave eager agreeing and the backend
not ("the compiler"), and the compiler bisector must name inductor's lowerings; a clean
component agrees everywhere; the folder holds no pickle and runs without fxreplace, the model,
the reference store or vLLM."""

from __future__ import annotations

import copy
import types
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from fxreplace import repro_run
from fxreplace.capture import capture_reference
from fxreplace.cli import main as cli
from fxreplace.models import get_family, tiny_model
from fxreplace.repro import ReproError, blamed_component, write_repro
from repro_faults import wrong_mm_lowering

ARCH = "Qwen3MoeForCausalLM"
TESTS = Path(__file__).resolve().parent
FAULTS = {  # the component each planted fault lives in
    "model.layers.1.self_attn": lambda m: m.model.layers[1].self_attn.o_proj.weight.mul_(1.5),
    "model.layers.0.mlp.gate": lambda m: m.model.layers[0].mlp.gate.weight.mul_(-1.0),
    "model.layers.1.mlp": lambda m: m.model.layers[1].mlp.experts.gate_up_proj[0].mul_(3.0),  # expert 0 only
}


@pytest.fixture(scope="module")
def clean():
    return tiny_model(ARCH)  # what `builtin:` loads: 2 layers


@pytest.fixture(scope="module")
def reference(clean, tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 128, (n,), generator=g).tolist() for n in (6, 9, 12)]
    directory = tmp_path_factory.mktemp("repro") / "ref"
    capture_reference(clean, prompts, get_family(ARCH).targets, 6, progress=False).save(directory)
    return directory


def planted(clean, component):
    target = copy.deepcopy(clean)
    with torch.no_grad():
        FAULTS[component](target)
    return target


def run_fresh(directory: Path, *args: str) -> subprocess.CompletedProcess:
    """The folder's run.py in a new interpreter where fxreplace and vLLM cannot be imported
    (and transformers neither, unless the program calls one of its custom ops)."""
    meta = json.loads((directory / repro_run.META).read_text())
    blocked = ["fxreplace", "vllm"] + ([] if meta["op_libraries"] else ["transformers"])
    script = (f"import runpy, sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
              f"sys.argv = ['run.py', *{list(args)!r}]\n"
              f"runpy.run_path({str(directory / 'run.py')!r}, run_name='__main__')\n")
    env = dict(os.environ, PYTHONPATH=str(TESTS))  # only the planted compiler faults
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=directory,
                          timeout=300)


def table(stdout: str) -> list[dict]:
    """The runner's per-input rows: input, prompt, call (prefill or decode), cached, tokens, then the
    errors: eager vs the reference, and the backend's vs the reference and vs eager when it ran one."""
    rows = []
    for line in stdout.splitlines():
        if line[:5].strip().isdigit():
            i, prompt, call, cached, tokens, *errors = line.split()
            rows.append({"call": call, "cached": int(cached), "tokens": int(tokens), "eager": float(errors[0]),
                         **({"backend": float(errors[1]), "vs_eager": float(errors[2])} if len(errors) > 1 else {})})
    return rows


@pytest.mark.parametrize("component, backend", list(zip(FAULTS, ["aot_eager", "eager", "eager"])))
def test_a_fault_in_the_targets_weights_shows_in_eager_the_port(clean, reference, component, backend, tmp_path):
    out = write_repro(planted(clean, component), clean, reference, component, tmp_path / "repro", inputs=2)
    done = run_fresh(out, "--backend", backend)
    assert done.returncode == repro_run.EXIT_DISAGREES, done.stderr
    assert "verdict: the port: the target's component disagrees with the reference already in eager" in done.stdout
    rows = table(done.stdout)  # two calls of each kind: the prompt's prefill, a decode step with the cache
    assert [r["call"] for r in rows] == ["prefill"] * 2 + ["decode"] * 2, done.stdout
    assert all(r["eager"] > 0.05 for r in rows[:2]), done.stdout
    if component != "model.layers.1.mlp":  # one token per decode step need not reach expert 0: the others must show
        assert all(r["eager"] > 0.05 for r in rows) and "in its prefill and decode calls alike" in done.stdout
    if backend != "eager":  # the backend computes what eager computes: nothing for the compiler team
        assert all(r["vs_eager"] == 0.0 for r in rows), done.stdout
    meta = json.loads((out / repro_run.META).read_text())
    assert meta["component"] == component and len(meta["inputs"]) == 4
    assert all(i["error_at_write"] > 0.05 for i in meta["inputs"] if i["call"] == "prefill")


def test_a_fault_in_the_compiler_leaves_eager_agreeing(clean, reference, tmp_path):
    out = write_repro(clean, clean, reference, "model.layers.1.self_attn", tmp_path / "repro", inputs=2)
    done = run_fresh(out, "--backend", "repro_faults:perturb_last_linear")
    assert done.returncode == repro_run.EXIT_DISAGREES, done.stderr
    assert "verdict: the compiler: eager agrees with the reference" in done.stdout
    assert "but perturb_last_linear differs from eager by up to 0.1" in done.stdout
    rows = table(done.stdout)
    assert len(rows) == 4 and all(r["eager"] < 1e-5 and r["vs_eager"] > 0.05 for r in rows), done.stdout


def test_a_routing_fault_is_reproduced_by_the_block_that_computes_the_routing(clean, reference, tmp_path):
    """Blame's routing component is the routing the experts are called with; its code lives in their caller
    (here a router that skips the top-k renormalisation). The repro holds that block: the experts alone,
    given the reference's routing, would agree and clear the component blame named."""
    from test_routing import skip_renorm

    target = copy.deepcopy(clean)
    gate = target.model.layers[1].mlp.gate
    gate.forward = types.MethodType(skip_renorm, gate)
    out = write_repro(target, clean, reference, "model.layers.1.mlp.experts", tmp_path / "repro", inputs=2)
    meta = json.loads((out / repro_run.META).read_text())
    assert (meta["component"], meta["kind"], meta["module_name"]) == ("model.layers.1.mlp.experts", "routing",
                                                                       "model.layers.1.mlp")
    done = run_fresh(out, "--backend", "eager")
    assert done.returncode == repro_run.EXIT_DISAGREES, done.stdout + done.stderr
    assert "verdict: the port" in done.stdout
    assert repro_run.run(write_repro(clean, clean, reference, "model.layers.1.mlp.experts", tmp_path / "clean",
                                     inputs=2)) == repro_run.EXIT_AGREES


@pytest.fixture(scope="module")
def clean_router(clean, reference, tmp_path_factory):
    return write_repro(clean, clean, reference, "model.layers.0.mlp.gate", tmp_path_factory.mktemp("router") / "r",
                       inputs=1)


def test_a_clean_component_agrees_under_inductor(clean_router):
    done = run_fresh(clean_router, "--backend", "inductor")
    assert done.returncode == repro_run.EXIT_AGREES, done.stdout + done.stderr
    assert "verdict: agrees: eager and inductor match the reference within 0.001 on every input" in done.stdout


def test_bisect_names_the_inductor_stage_that_breaks_it(clean_router, capsys):
    with wrong_mm_lowering():
        assert repro_run.run(clean_router, "inductor", bisect_stages=True) == repro_run.EXIT_DISAGREES
    printed = capsys.readouterr().out
    assert "verdict: the compiler: eager agrees" in printed
    assert "bisect: first failing: backend inductor, stage lowerings" in printed and "(mm)" in printed


def test_a_bf16_component_agrees_within_its_dtypes_tolerance(clean, reference, tmp_path, capsys):
    out = write_repro(clean, clean, reference, "model.layers.1.mlp", tmp_path / "repro", dtype=torch.bfloat16, inputs=2)
    assert repro_run.run(out) == repro_run.EXIT_AGREES
    meta = json.loads((out / repro_run.META).read_text())
    assert meta["dtype"] == "bfloat16" and meta["tolerance"] == 0.05
    assert 0 < max(i["error_at_write"] for i in meta["inputs"]) < 0.05  # bf16 rounding, not zero


def test_the_folder_holds_no_pickle_and_a_pickled_program_is_refused(clean_router, tmp_path):
    for path in clean_router.iterdir():
        data = path.read_bytes()
        assert data[:2] not in repro_run.PICKLE_MAGIC, path
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                for info in archive.infolist():
                    assert archive.read(info)[:2] not in repro_run.PICKLE_MAGIC, info.filename
                    assert not info.filename.endswith((".pkl", "data.pkl")), info.filename
    assert sum(p.stat().st_size for p in clean_router.iterdir()) < 200_000  # a handful of inputs, one component
    # the same program saved by torch.export with its sample inputs (a pickle): the runner refuses it
    program = torch.export.load(clean_router / repro_run.PROGRAMS["decode"])
    program.example_inputs = ((torch.zeros(3, 64),), {})
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    for path in clean_router.iterdir():
        (tampered / path.name).write_bytes(path.read_bytes())
    torch.export.save(program, tampered / repro_run.PROGRAMS["decode"])
    done = run_fresh(tampered)
    assert done.returncode == repro_run.EXIT_UNUSABLE and "holds sample inputs (a pickle): refusing" in done.stderr


def test_readme_names_the_command_model_component_and_prompts(clean_router):
    readme = (clean_router / "README.md").read_text()
    meta = json.loads((clean_router / repro_run.META).read_text())
    assert "model.layers.0.mlp.gate" in readme and ARCH in readme and "python run.py --backend inductor" in readme
    assert f"prompts {meta['inputs'][0]['prompt']} (" in readme
    assert meta["prompt_tokens"][str(meta["inputs"][0]["prompt"])][:3] and meta["torch"] == torch.__version__


def test_cli_from_blame_to_repro(clean, reference, tmp_path, capsys):
    """`fxreplace blame` names the planted router; `fxreplace repro write --blame` exports it;
    `fxreplace repro run` says the port."""
    target_dir = tmp_path / "target"
    planted(clean, "model.layers.0.mlp.gate").save_pretrained(target_dir)
    common = ["--reference", str(reference), "--clean", f"builtin:{ARCH}", "--dtype", "float32"]
    assert cli(["blame", str(target_dir), *common, "--report-dir", str(tmp_path / "blame")]) == 0
    assert blamed_component(tmp_path / "blame" / "blame.json") == "model.layers.0.mlp.gate"
    out = tmp_path / "repro"
    assert cli(["repro", "write", str(target_dir), *common, "--blame", str(tmp_path / "blame" / "blame.json"),
                "--inputs", "2", "--out", str(out)]) == 0
    readme = (out / "README.md").read_text()
    assert f"fxreplace repro write {target_dir}" in readme and f"builtin:{ARCH}" in readme
    capsys.readouterr()
    assert cli(["repro", "run", str(out)]) == repro_run.EXIT_DISAGREES
    assert "verdict: the port" in capsys.readouterr().out


def test_mistakes_are_one_line(clean, reference, tmp_path, capsys):
    with pytest.raises(ReproError, match="names no component"):
        blamed_component({"origins": [{"layer": 1, "component": None}], "verdict": "layer 1: none of ..."})
    with pytest.raises(SystemExit) as raised:
        cli(["repro", "run", str(tmp_path)])
    assert raised.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "is not a repro folder" in err and "\n" not in err
    with pytest.raises(SystemExit):
        cli(["repro", "run", str(tmp_path), "--backend", "eager", "--bisect"])
    assert "--bisect bisects inductor's stages" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("mine")  # --out holding something else: refused before any model loads
    with pytest.raises(SystemExit) as raised:
        cli(["repro", "write", f"builtin:{ARCH}", "--reference", str(reference), "--clean", f"builtin:{ARCH}",
             "--component", "model.layers.0.mlp.gate", "--out", str(tmp_path)])
    assert raised.value.code == 2 and "is not empty and holds no repro" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.xla
def test_xla_on_the_cpu_runs_the_folder(clean, reference, tmp_path):
    """torch-xla's CPU device (the Neuron path's tracing): a clean router agrees, a flipped one is
    the port, whatever XLA does."""
    component = "model.layers.0.mlp.gate"
    out = write_repro(clean, clean, reference, component, tmp_path / "clean", inputs=2)
    done = run_fresh(out, "--backend", "xla")
    assert done.returncode == repro_run.EXIT_AGREES, done.stdout + done.stderr
    assert "verdict: agrees: eager and xla match the reference" in done.stdout
    out = write_repro(planted(clean, component), clean, reference, component, tmp_path / "flipped", inputs=2)
    done = run_fresh(out, "--backend", "xla")
    assert done.returncode == repro_run.EXIT_DISAGREES and "verdict: the port" in done.stdout, done.stderr
    assert all(r["vs_eager"] < 1e-5 for r in table(done.stdout)), done.stdout
