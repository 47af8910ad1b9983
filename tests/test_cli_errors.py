"""A user's mistake gets one `error:` line naming the problem and the fix (exit 2), before any model loads."""

import subprocess
import sys

import pytest
import torch

from fxreplace.cli import main as cli
from fxreplace.store import ReferenceStore
from fxreplace.validation import Gate

ARCH = "Qwen3MoeForCausalLM"


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as raised:
        cli(argv)
    assert raised.value.code == 2
    return error_line(capsys)


def test_path_and_name_mistakes_fail_before_any_model_loads(tmp_path, capsys, no_model_loads):
    err = fails(["validate", f"builtin:{ARCH}", "--reference", str(tmp_path / "missing")], capsys)
    assert err.startswith("error: fxreplace validate: argument --reference: no reference store at")
    assert "hint: write one with `fxreplace capture" in err
    err = fails(["blame", "builtin:Qwen3Moe", "--reference", str(tmp_path)], capsys)
    assert "no builtin model 'builtin:Qwen3Moe'; hint: builtin:ARCH with ARCH one of" in err and ARCH in err
    err = fails(["capture", f"builtin:{ARCH}", "--prompts", str(tmp_path / "p.json"), "--out", str(tmp_path / "r")], capsys)
    assert "argument --prompts: no file" in err
    err = fails(["validate", f"builtin:{ARCH}", "--reference", str(tmp_path), "--fail-on", "kl=lots"], capsys)
    assert "'kl=lots': kl= needs a number, e.g. kl=0.05" in err
    err = fails(["validate", f"builtin:{ARCH}", "--reference", str(tmp_path), "--junit", str(tmp_path / "no" / "j.xml")], capsys)
    assert "argument --junit:" in err and "does not exist" in err


def test_inspect_on_a_reference_store_points_at_verify(tmp_path, capsys, no_model_loads):
    ReferenceStore.from_captures([{"m": [torch.zeros(1, 2, 3)]}], prompt_token_ids=[[1, 2]]).save(tmp_path / "ref")
    err = fails(["inspect", str(tmp_path / "ref")], capsys)
    assert "is a reference store, not a model directory; hint: `fxreplace inspect --verify" in err
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    err = fails(["validate", str(tmp_path / "ref"), "--reference", str(tmp_path / "ckpt")], capsys)  # swapped
    assert f"were the two swapped? the model comes first and the store after --reference: MODEL --reference {tmp_path / 'ref'}" in err


def test_a_wrong_target_is_one_line_with_the_close_matches_and_debug_adds_the_traceback(tmp_path, capsys):
    (tmp_path / "p.json").write_text("[[1, 2, 3]]")
    argv = ["capture", f"builtin:{ARCH}", "--prompts", str(tmp_path / "p.json"), "--out", str(tmp_path / "r"),
            "--target", "model.layers.*.mlp.gat", "--max-new-tokens", "1"]
    err = fails(argv, capsys)
    assert "target 'model.layers.*.mlp.gat' matches no module; closest qualified names: ['model.layers.0.mlp.gate'" in err
    assert f"hint: `fxreplace inspect builtin:{ARCH}` lists the injection points" in err
    with pytest.raises(SystemExit):
        cli(argv + ["--debug"])
    err = capsys.readouterr().err
    assert "Traceback" in err and "TargetError" in err and err.strip().endswith("lists the injection points")


def test_the_command_exits_2_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "fxreplace", "validate", f"builtin:{ARCH}", "--reference", "/nonexistent"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: ") and "Traceback" not in proc.stderr


def test_help_states_every_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at hyphens ("fxreplace-" "blame")
    for command, defaults in [("validate", ["default: bfloat16", "default: fxreplace-report", "default: embedded",
                                            "prefill bucket", "min(8, prompts)"]),
                              ("blame", ["default: bfloat16", "default: fxreplace-blame"]),
                              ("capture", ["default: 32", "default: float32", "the family's routers"]),
                              ("demo", ["default: 8", "default: fxreplace-report"])]:
        with pytest.raises(SystemExit):
            cli([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for default in defaults:
            assert default in text, (command, default)
    with pytest.raises(SystemExit):
        cli(["--help"])
    assert "exit codes: 0 success; 1 a --fail-on gate failed" in " ".join(capsys.readouterr().out.split())


def test_gate_conditions():
    assert Gate.parse(["diverged", "kl=0.05", "top5=0.1"]) == Gate(diverged=True, kl=0.05, top5=0.1)
    for bad in ("kl", "diverged=1", "top1=3"):
        with pytest.raises(ValueError, match="expected diverged, kl=X, top5=Y or floor=K"):
            Gate.parse([bad])
