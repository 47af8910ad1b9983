"""The engine seam: engines found by name, and the documented example engine (docs/extending.md)
run through `fxreplace validate` and `fxreplace blame` like the built-in ones."""

from __future__ import annotations

import copy
import json
import runpy
from pathlib import Path

import pytest
import torch

from fxreplace.cli import main as cli
from fxreplace.engines import registry
from fxreplace.models import tiny_model
from fxreplace.reference import load_reference

ROOT = Path(__file__).resolve().parents[1]
ARCH = "Qwen3MoeForCausalLM"


def test_engines_are_found_by_name_and_a_wrong_name_lists_them(capsys):
    assert registry.get_engine("embedded").name == "embedded" and registry.get_engine("hf").name == "embedded"
    assert registry.get_engine("runner").name == "embedded"  # the name before one vocabulary
    assert registry.get_engine("vllm").compiles and not registry.get_engine("embedded").compiles
    with pytest.raises(KeyError, match="no engine 'sglang'; engines: embedded, vllm"):
        registry.get_engine("sglang")
    with pytest.raises(SystemExit) as exit_:
        cli(["validate", f"builtin:{ARCH}", "--reference", str(ROOT), "--engine", "sglang"])
    assert exit_.value.code == 2
    assert "argument --engine: no engine 'sglang'; engines: embedded, vllm" in capsys.readouterr().err


def test_an_option_the_engine_does_not_take_is_refused_before_anything_loads(tmp_path, capsys, no_model_loads):
    (tmp_path / "config.json").write_text("{}")  # a model directory, never loaded
    for argv, option in ((["validate", "--bucket", "64", "--engine", "vllm"], "--bucket"),
                         (["validate", "--engine-args", '{"a": 1}'], "--engine-args"),
                         (["blame", "--clean", f"builtin:{ARCH}", "--engine", "vllm"], "--clean")):
        with pytest.raises(SystemExit) as exit_:
            cli([argv[0], str(tmp_path), "--reference", str(tmp_path), *argv[1:]])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {option} is not an option of --engine "), err


def test_a_capture_option_the_engine_does_not_take_is_refused_before_anything_loads(tmp_path, capsys, no_model_loads):
    (tmp_path / "config.json").write_text("{}")  # a model directory, never loaded
    (tmp_path / "p.json").write_text("[[1, 2, 3]]")
    for argv, option, engine, takers in (
            (["--engine", "vllm", "--noise-floor", "bfloat16"], "--noise-floor", "vllm", "--engine embedded"),
            (["--engine", "vllm", "--device-map", "auto"], "--device-map", "vllm", "--engine embedded"),
            (["--engine-args", '{"a": 1}'], "--engine-args", "embedded", "--engine vllm")):
        with pytest.raises(SystemExit) as exit_:
            cli(["capture", str(tmp_path), "--prompts", str(tmp_path / "p.json"), "--out", str(tmp_path / "ref"), *argv])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"error: {option} is not a capture option of --engine {engine}; hint: engines that capture "
                       f"with it: {takers}"), err
    assert not (tmp_path / "ref").exists()


def test_a_registered_engine_captures_through_its_capture_spec(tmp_path, capsys):
    """`fxreplace capture --engine NAME` hands the engine one CaptureRun (prompts as ids, what the
    reference records) and prints what it did; an engine that does not replace a store refuses
    an --out holding one before it runs."""
    runner = registry.get_engine("embedded").capture
    given = []

    def spy(run):
        given.append(copy.deepcopy(run))
        return runner.run(run)

    registry.register_engine(registry.EngineSpec(name="spy", summary="the runner's capture, watched",
                                                 open_validation=None, open_blame=None,
                                                 capture=registry.CaptureSpec(spy)))
    try:
        (tmp_path / "p.json").write_text("[[5, 6, 7], [8, 9]]")
        out = tmp_path / "ref"
        argv = ["capture", f"builtin:{ARCH}", "--prompts", str(tmp_path / "p.json"), "--max-new-tokens", "3",
                "--engine", "spy", "--out", str(out)]
        assert cli(argv) == 0
        (run,) = given
        assert run.prompts == [[5, 6, 7], [8, 9]] and run.out == str(out) and run.max_new_tokens == 3
        assert run.metadata == {"source_model": f"builtin:{ARCH}", "prompt_texts": [None, None]}
        assert capsys.readouterr().out.strip().endswith(f"captured 2 prompts x 3 tokens at 2 targets -> {out}")
        reference = load_reference(out)
        assert reference.store.prompt_token_ids == [[5, 6, 7], [8, 9]]

        with pytest.raises(SystemExit) as exit_:
            cli(argv)
        assert exit_.value.code == 2 and len(given) == 1
        assert "holds a loadable store of 2 prompts; the capture would fail at its end" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            cli(["capture", f"builtin:{ARCH}", "--prompts", str(tmp_path / "p.json"), "--out", str(tmp_path / "r2"),
                 "--engine", "recompute-like"])
        assert "no engine 'recompute-like'" in capsys.readouterr().err
    finally:
        registry._ENGINES.unregister("spy")


@pytest.fixture(scope="module")
def recompute():
    """The example engine, registered as its page shows (and unregistered after)."""
    runpy.run_path(str(ROOT / "docs" / "examples" / "recompute_engine.py"))
    yield registry.get_engine("recompute")
    registry._ENGINES.unregister("recompute")


def test_the_example_engine_runs_validate_and_blame(recompute, tmp_path, capsys):
    """A fault planted in layer 1's attention: the example engine measures what the built-in
    runner measures, and its blame names that attention as the origin."""
    clean = tiny_model(ARCH, num_hidden_layers=2)
    target = copy.deepcopy(clean)
    with torch.no_grad():
        target.model.layers[1].self_attn.o_proj.weight.mul_(1.5)
    clean.save_pretrained(tmp_path / "clean")
    target.save_pretrained(tmp_path / "target")
    g = torch.Generator().manual_seed(0)
    (tmp_path / "prompts.json").write_text(json.dumps([torch.randint(4, 128, (n,), generator=g).tolist()
                                                       for n in (7, 11, 9)]))
    ref, tgt = str(tmp_path / "ref"), str(tmp_path / "target")
    assert cli(["capture", str(tmp_path / "clean"), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens",
                "6", "--components", "--out", ref]) == 0

    summaries = {}
    for engine in ("recompute", "embedded"):
        assert cli(["validate", tgt, "--reference", ref, "--engine", engine, "--dtype", "float32", "--report-dir",
                    str(tmp_path / engine)]) == 0
        result = json.loads((tmp_path / engine / "result.json").read_text())
        assert result["program"] == {"engine": engine, "compile": False, "dtype": "float32"}
        summaries[engine] = result["summary"]
    for mode in ("off", "on"):
        mine, builtin = summaries["recompute"][mode], summaries["embedded"][mode]
        assert mine["steps"] == builtin["steps"] and mine["prompts_diverged"] == builtin["prompts_diverged"]
        assert mine["mean_kl"] == pytest.approx(builtin["mean_kl"], rel=1e-3, abs=1e-6)
    assert summaries["recompute"]["off"]["mean_kl"] > 1e-3  # the fault shows

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # it registers no capture
        cli(["capture", str(tmp_path / "clean"), "--prompts", str(tmp_path / "prompts.json"), "--engine", "recompute",
             "--out", str(tmp_path / "ref2")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: --engine recompute cannot capture a reference; hint: capture "
                                               "with --engine embedded or --engine vllm")
    assert cli(["blame", tgt, "--reference", ref, "--engine", "recompute", "--dtype", "float32", "--report-dir",
                str(tmp_path / "blame")]) == 0
    assert "program examined: engine recompute, eager, float32" in capsys.readouterr().out
    found = json.loads((tmp_path / "blame" / "blame.json").read_text())
    assert found["program"] == {"engine": "recompute", "compile": False, "dtype": "float32"}
    first = found["origins"][0]
    assert (first["component"], first["kind"], first["layer"]) == ("model.layers.1.self_attn", "attention", 1), found


def test_a_family_s_sites_are_keyed_by_the_model_code_that_registers_them():
    """Each runner side finds a family's sites under its own name, registered by its own package
    (a family names no engine); a name nobody registered has none; registering again needs replace."""
    from fxreplace.engines.vllm import sites as vllm_sites
    from fxreplace.engines.vllm.neuron import NeuronRunner
    from fxreplace.engines.vllm.runners import VllmRunner
    from fxreplace.models import get_family, register_sites

    family = get_family(ARCH)
    assert family.targets_for(VllmRunner.model_code) == (vllm_sites.GATE,) != family.targets
    vllm_components = family.components_for(VllmRunner.model_code)
    assert vllm_components["router"] == vllm_sites.GATE and vllm_components["layer"].adapter == "residual_stream_pair"
    assert [(t.pattern, t.name) for t in family.targets_for(NeuronRunner.model_code)] == [
        ("layers.*.mlp.router", "model.layers.{}.mlp.gate")]
    assert family.targets_for("sglang") == () and family.components_for("sglang") == {}
    with pytest.raises(ValueError, match="model-code sites 'vllm/Qwen3MoeForCausalLM' is already registered; pass "
                                         "replace=True"):
        register_sites("vllm", ARCH, targets=family.targets)
