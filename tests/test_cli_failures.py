"""Failures after the arguments are parsed are one line too, with an exit code of their own
(2 a user's mistake, 3 an internal error, 130 an interrupt), and the line says what the run
left on disk. Long runs check their output folders before they start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import fxreplace.cli
import fxreplace.cli.common
import fxreplace.engines.embedded.spec
from fxreplace.cli import main as cli
from fxreplace.store import ReferenceStore

ARCH = "Qwen3MoeForCausalLM"


def sigint_as_at_a_terminal():
    """A terminal's process gets SIGINT's default action; a test run started in the background by a
    shell (``cmd &``, nohup) would pass on SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def last_error_line(capsys) -> str:
    """The error line after a model loaded (transformers' progress bar writes to stderr too)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def exit_code(argv) -> int:
    with pytest.raises(SystemExit) as raised:
        cli(argv)
    return raised.value.code


def small_store(path, first: int = 1) -> None:
    ReferenceStore.from_captures([{"m": [torch.zeros(1, 2, 3)]}], prompt_token_ids=[[first, 2]]).save(path)


def test_ctrl_c_during_a_capture_exits_130_with_one_line_and_the_old_store_intact(tmp_path):
    """A script's Ctrl-C (SIGINT to the process group, as a terminal sends it) during
    `fxreplace capture` into a folder holding a store: one line saying the store is unchanged,
    exit 130, and the store still loads."""
    out = tmp_path / "ref"
    small_store(out)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[4 + i // 100, 4 + i % 100] + [4 + (i * 7 + j) % 100 for j in range(14)]
                                    for i in range(2000)]))
    proc = subprocess.Popen([sys.executable, "-m", "fxreplace", "capture", f"builtin:{ARCH}", "--prompts", str(prompts),
                             "--out", str(out), "--max-new-tokens", "8"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                            preexec_fn=sigint_as_at_a_terminal)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(1), "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while "capture:" not in "".join(err) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)  # the capture loop has started (its progress bar)
        assert proc.poll() is None, "".join(err)[-2000:]
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    text = "".join(err)
    last = text.strip().splitlines()[-1]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert last == (f"interrupted: --out {out.resolve()} unchanged: it holds a loadable store of 1 prompt (the new "
                    "capture, written beside it, was removed); rerun the command to capture"), last
    assert ReferenceStore.load(out).prompt_token_ids == [[1, 2]]


def test_an_internal_error_is_one_line_exit_3_naming_what_was_written_and_debug_adds_the_traceback(
        tmp_path, capsys, monkeypatch):
    (tmp_path / "p.json").write_text("[[1, 2, 3]]")

    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch\nin two lines")

    monkeypatch.setattr(fxreplace.engines.embedded.spec, "capture_reference", broken)  # a bug in fxreplace's capture
    argv = ["capture", f"builtin:{ARCH}", "--prompts", str(tmp_path / "p.json"), "--out", str(tmp_path / "r")]
    assert exit_code(argv) == 3
    err = one_error_line(capsys)
    assert err.startswith("error: internal error, RuntimeError: shape mismatch in two lines; --out ")
    assert "holds nothing; capture again into a new --out" in err and err.endswith("hint: rerun with --debug for the traceback and report it")
    assert exit_code(argv + ["--debug"]) == 3
    assert "Traceback" in capsys.readouterr().err


def test_capture_checks_its_out_folder_before_it_runs(tmp_path, capsys, no_model_loads):
    (tmp_path / "p.json").write_text("[[1, 2, 3]]")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    argv = ["capture", f"builtin:{ARCH}", "--prompts", str(tmp_path / "p.json"), "--out", str(tmp_path / "notes")]
    assert exit_code(argv) == 2
    err = one_error_line(capsys)
    assert "--out" in err and "holds files that are not a store's (['todo.txt']); the capture would fail at its end" in err
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


#: a KV cache that fits beside other jobs: the checks under test come after the engine's memory check
FITTING = ["--engine-args", '{"gpu_memory_utilization": 0.2}']


def test_a_vllm_capture_refuses_an_out_holding_a_store_before_the_engine_starts(tmp_path, capsys, monkeypatch):
    from fxreplace.engines.vllm.testing import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(ARCH, tmp_path / "ckpt")
    (tmp_path / "p.json").write_text("[[1, 2, 3]]")
    small_store(tmp_path / "ref")
    capsys.readouterr()
    import fxreplace.engines.vllm.capture

    monkeypatch.setattr(fxreplace.engines.vllm.capture, "capture_with_vllm", lambda *a, **k: pytest.fail("the engine started"))
    assert exit_code(["capture", str(ckpt), "--engine", "vllm", "--prompts", str(tmp_path / "p.json"),
                      "--out", str(tmp_path / "ref"), *FITTING]) == 2
    err = one_error_line(capsys)
    assert "holds a loadable store of 1 prompt; the capture would fail at its end; hint: give a new or empty --out" in err


@pytest.mark.parametrize("prompts", [[[5, 6, 7], [8, 9], [5, 6, 7]], ["the same text", "the same text"]])
def test_a_prompt_given_twice_is_refused_before_the_engine_starts(tmp_path, capsys, monkeypatch, prompts):
    """A prompt given twice (as ids, or as a text tokenized to the same ids) could only ever be matched
    to one capture: the store refused it after the engine had run; it is the user's to fix, exit 2."""
    from fxreplace.engines.vllm.testing import save_tiny_checkpoint
    import fxreplace.engines.vllm.capture

    ckpt = save_tiny_checkpoint(ARCH, tmp_path / "ckpt")
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    capsys.readouterr()
    monkeypatch.setattr(fxreplace.engines.vllm.capture, "capture_with_vllm", lambda *a, **k: pytest.fail("the engine started"))
    assert exit_code(["capture", str(ckpt), "--engine", "vllm", "--prompts", str(tmp_path / "p.json"),
                      "--out", str(tmp_path / "ref"), *FITTING]) == 2
    err = one_error_line(capsys)
    assert err.startswith(f"error: {tmp_path / 'p.json'}: prompt {len(prompts) - 1} has the same token ids as prompt 0")
    assert err.endswith("hint: give each prompt once"), err
    assert not (tmp_path / "ref").exists()


def test_a_reference_blame_extended_stays_a_reference(tmp_path, capsys):
    """``blame --clean`` keeps the components it captured in REF/blame-components: re-capture
    replaces them with the store (they describe its prompts), repack carries them, verify checks them."""
    ref = tmp_path / "ref"
    small_store(ref)
    small_store(ref / "blame-components" / "00000")
    assert cli(["inspect", "--verify", str(ref)]) == 0
    out = capsys.readouterr().out
    assert f"{ref}: OK: 1 prompts" in out and f"{ref / 'blame-components' / '00000'}: OK: 1 prompts" in out
    assert cli(["repack", str(ref), "--out", str(tmp_path / "packed")]) == 0
    assert ReferenceStore.load(tmp_path / "packed" / "blame-components" / "00000").prompt_token_ids == [[1, 2]]
    (tmp_path / "p.json").write_text("[[5, 6, 7]]")
    assert cli(["capture", f"builtin:{ARCH}", "--prompts", str(tmp_path / "p.json"), "--out", str(ref),
                "--max-new-tokens", "1"]) == 0
    assert ReferenceStore.load(ref).prompt_token_ids == [[5, 6, 7]]
    assert not (ref / "blame-components").exists()  # the old prompts' components went with the old store


def test_the_demo_checks_its_report_dir_before_it_runs(tmp_path, capsys, monkeypatch):
    import fxreplace.cli.demo

    monkeypatch.setattr(fxreplace.cli.demo, "run_demo", lambda config: pytest.fail("the demo ran"))
    (tmp_path / "file").write_text("")
    assert exit_code(["demo", "--report-dir", str(tmp_path / "file" / "report")]) == 2
    assert "--report-dir" in one_error_line(capsys)


def test_a_store_whose_writer_died_says_so_in_the_line(tmp_path, capsys, monkeypatch):
    """An interrupted run reports a store left by a writer that did not close as such."""
    from fxreplace.store import StoreWriter

    writer = StoreWriter(tmp_path / "ref")
    writer.add([1, 2], {"m": torch.zeros(2, 3)})
    writer.sync()  # then the process dies: the marker stays
    assert fxreplace.store.describe_store(tmp_path / "ref") == ("an unfinished store: the 1 prompt written so far load, "
                                                          "the later ones are missing")
    assert fxreplace.store.describe_store(tmp_path / "empty") == "nothing"


def test_hints_point_at_the_actual_fix(tmp_path, capsys, monkeypatch):
    """A reference from a model with another layer count is another model (no --target fixes
    it; a reference of a subset of the targets is not); the commands a hint suggests name the reference model by its absolute path, so they
    work from any directory."""
    from fxreplace.models import tiny_model

    monkeypatch.chdir(tmp_path)
    tiny_model(ARCH).save_pretrained("clean")
    (tmp_path / "p.json").write_text("[[5, 6, 7]]")
    assert cli(["capture", "clean", "--prompts", "p.json", "--out", "ref", "--max-new-tokens", "1"]) == 0
    layers = tiny_model(ARCH).config.num_hidden_layers
    assert ReferenceStore.load(tmp_path / "ref").metadata["source_model"] == str(tmp_path / "clean")
    tiny_model(ARCH, num_hidden_layers=layers + 1).save_pretrained("deeper")
    capsys.readouterr()
    for command in (["validate"], ["blame"]):
        assert exit_code(command + ["deeper", "--reference", "ref", "--dtype", "float32"]) == 2
        err = last_error_line(capsys)
        assert (f"the reference ref was captured from a model with {layers} layers but deeper has {layers + 1}: it "
                "was captured from another model; hint: validate the model the reference was captured from") in err, err
    assert cli(["capture", "clean", "--prompts", "p.json", "--out", "layer0", "--max-new-tokens", "1",
                "--target", "model.layers.0.mlp.gate"]) == 0
    capsys.readouterr()
    assert exit_code(["validate", "clean", "--reference", "layer0", "--dtype", "float32"]) == 2
    assert "give --target patterns the reference captured" in last_error_line(capsys)  # the same model: a subset
    monkeypatch.chdir(tmp_path / "clean")  # elsewhere: the hint's --clean still names the reference model
    assert exit_code(["blame", str(tmp_path / "clean"), "--reference", str(tmp_path / "ref"), "--dtype", "float32",
                      "--report-dir", str(tmp_path / "blame")]) == 2
    assert f"--clean {tmp_path / 'clean'}`" in last_error_line(capsys)


def _fxreplace(args, tmp_path, pythonpath=()):
    """The command in a subprocess, as a user runs it (no test environment variable besides PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), os.getcwd()])
    return subprocess.run([sys.executable, "-m", "fxreplace", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)


@pytest.fixture
def vllm_ready(tmp_path):
    """A checkpoint, prompts and a reference store: everything a vLLM command needs before its engine."""
    from fxreplace.models import tiny_model

    tiny_model(ARCH).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "p.json").write_text(json.dumps([[1, 2, 3]]))
    small_store(tmp_path / "ref")
    return tmp_path


def test_a_torch_companion_that_does_not_match_torch_is_one_line_before_the_engine(vllm_ready):
    """PyPI's torchvision beside the CPU torch fails at import (the operator it registers is missing);
    vLLM imports it, so the engine would die after its start-up with an 'internal error'."""
    fake = vllm_ready / "site" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    meta = vllm_ready / "site" / "torchvision-0.29.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.29.1\n")
    done = _fxreplace(["capture", "ckpt", "--engine", "vllm", "--prompts", "p.json", "--out", "new"], vllm_ready,
                      pythonpath=[vllm_ready / "site"])
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: vLLM cannot load beside torch") and "torchvision 0.29.1" in line
    assert "hint: pip uninstall -y torchvision torchaudio torchcodec" in line and not (vllm_ready / "new").exists()


@pytest.mark.parametrize("command", ["capture", "validate", "blame"])
def test_every_vllm_command_takes_engine_args_and_checks_the_memory_they_ask_for(vllm_ready, command):
    """More memory than is free (vLLM's CPU backend reserves gpu_memory_utilization of the machine's)
    is one line naming the --engine-args that fits, before the engine starts."""
    rest = (["--prompts", "p.json", "--out", "new"] if command == "capture" else ["--reference", "ref"])
    done = _fxreplace([command, "ckpt", "--engine", "vllm", *rest, "--engine-args", '{"gpu_memory_utilization": 1.0}'],
                      vllm_ready)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: vLLM would reserve 1 of this machine's memory") and "GiB are free" in line, line
    assert "hint: --engine-args '{\"gpu_memory_utilization\": 0." in line


def test_vllm_blame_on_a_reference_without_components_is_one_line_before_the_engine(vllm_ready):
    """vLLM's blame replays the components a reference recorded: a reference of router logits alone is the
    user's to capture again (exit 2, the command that does), refused before any engine starts."""
    captured = _fxreplace(["capture", "ckpt", "--prompts", "p.json", "--out", "routers", "--max-new-tokens", "2"],
                          vllm_ready)
    assert captured.returncode == 0, captured.stderr
    done = _fxreplace(["blame", "ckpt", "--engine", "vllm", "--reference", "routers"], vllm_ready)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the reference routers records no components: capture them with `fxreplace "), line
    assert "--components --out NEW_REFERENCE" in line and "Starting to load model" not in done.stderr
