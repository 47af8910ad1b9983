"""A reference larger than memory, loaded as users load one: ``from_pretrained(device_map="auto",
max_memory=..., offload_folder=...)``, accelerate placing layers on the CPU and disk and moving each
offloaded layer's weights in as it runs. Its capture is the capture of the model in memory."""

import json
import shutil
import sys

import pytest
import torch

from fxreplace.components import family_components
from fxreplace.capture import capture_forced, capture_reference
from fxreplace.checkpoint import load_checkpoint
from conftest import forbid_model_loads
from fxreplace.cli import main as cli
from fxreplace.models import get_family, tiny_model
from fxreplace.reference import load_reference

ARCH = "Qwen3MoeForCausalLM"  # its experts are fused as they load: offloaded, they go to the offload folder
PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26], [43, 38]]
STEPS = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tiny_model(ARCH, num_hidden_layers=4).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def in_memory(checkpoint):
    return load_checkpoint(checkpoint, torch.float32)


def bytes_of(model, name: str) -> int:
    return sum(p.numel() * p.element_size() for p in model.get_submodule(name).parameters())


def placed_on(model, name: str) -> str:
    """Where the device map puts module ``name`` (it names the outermost module placed whole)."""
    return next(device for key, device in model.hf_device_map.items() if key in ("", name) or name.startswith(key + "."))


def same_capture(captured, expected) -> None:
    assert captured.metadata == expected.metadata
    assert captured.store.capture_names == expected.store.capture_names
    for p in range(len(PROMPTS)):
        assert captured.tokens(p) == expected.tokens(p)
        assert torch.equal(captured.logits(p), expected.logits(p))
        for name in expected.store.capture_names:
            assert torch.equal(captured.store.rows(p, name), expected.store.rows(p, name)), (p, name)


@pytest.mark.parametrize("layers_in_memory", [0, 1])  # 0: the embedding on disk too (inputs on the host)
def test_capture_of_a_dispatched_model_equals_the_capture_in_memory(checkpoint, in_memory, layers_in_memory, tmp_path):
    # accelerate keeps room for the largest offloaded layer beside what it places: 2.5 layers place one
    budget = bytes_of(in_memory, "model.embed_tokens") + int(2.5 * bytes_of(in_memory, "model.layers.0"))
    model = load_checkpoint(checkpoint, torch.float32, {"device_map": "auto", "offload_folder": str(tmp_path / "off"),
                                                         "max_memory": {"cpu": budget if layers_in_memory else 0}})
    assert [placed_on(model, f"model.layers.{i}") for i in range(4)] == ["cpu"] * layers_in_memory + ["disk"] * (
        4 - layers_in_memory)
    assert placed_on(model, "model.embed_tokens") == ("cpu" if layers_in_memory else "disk")
    offloaded = {n for n, p in model.named_parameters() if p.device.type == "meta"}
    assert "model.layers.3.mlp.gate.weight" in offloaded

    targets = get_family(ARCH).targets
    expected = capture_reference(in_memory, PROMPTS, targets, STEPS, components=family_components(in_memory),
                                 progress=False, out=tmp_path / "plain")
    captured = capture_reference(model, PROMPTS, targets, STEPS, components=family_components(model),
                                 progress=False, out=tmp_path / "dispatched")
    same_capture(captured, expected)
    # on-demand capture (blame --clean): teacher-forced over the known tokens
    sequences = [PROMPTS[p] + expected.tokens(p) for p in range(len(PROMPTS))]
    attention = [family_components(in_memory)["attention"]]
    for (rows, picks), (want, want_picks) in zip(capture_forced(model, sequences, attention),
                                                 capture_forced(in_memory, sequences, attention)):
        assert picks == want_picks and list(rows) == list(want) and len(rows) == 4
        assert all(torch.equal(rows[name], want[name]) for name in want)
    # the model is left as accelerate dispatched it: weights still offloaded, its forward the plain one
    assert {n for n, p in model.named_parameters() if p.device.type == "meta"} == offloaded
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, in_memory(ids).logits)


def on_disk(offload_folder) -> list[str]:
    """Every layer of the reference model on disk (20 KB of CPU memory), read in as it runs."""
    return ["--device-map", "auto", "--max-memory", "cpu=20KB", "--offload-folder", str(offload_folder)]


def timeless(floor: dict) -> dict:
    """A noise floor's figures without the seconds it took to measure."""
    return {key: value for key, value in floor.items() if key != "seconds"}


def floor_of(reference_dir) -> dict:
    return timeless(json.loads((reference_dir / "noise_floors.json").read_text())["bfloat16"])


def test_cli_capture_with_a_device_map_equals_the_plain_capture(checkpoint, tmp_path, capsys):
    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS))
    common = ["capture", str(checkpoint), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", str(STEPS),
              "--components", "--noise-floor", "bfloat16"]
    assert cli([*common, "--out", str(tmp_path / "plain")]) == 0
    assert cli([*common, "--out", str(tmp_path / "dispatched"), *on_disk(tmp_path / "off")]) == 0
    assert any((tmp_path / "off").iterdir()), "the fused experts were offloaded to disk"
    same_capture(load_reference(tmp_path / "dispatched"), load_reference(tmp_path / "plain"))
    assert floor_of(tmp_path / "dispatched") == floor_of(tmp_path / "plain")  # the floor's model dispatched too


def test_cli_blame_with_a_dispatched_clean_model_equals_the_plain_blame(checkpoint, tmp_path, capsys):
    """blame --clean loads the reference model twice, for the noise floor (in bfloat16) and for each
    on-demand capture: dispatched, it gives the verdict and every figure the model in memory gives."""
    target = load_checkpoint(checkpoint, torch.float32)
    with torch.no_grad():
        target.model.layers[2].self_attn.o_proj.weight.mul_(1.5)  # the planted fault
    target.save_pretrained(tmp_path / "target")
    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS))
    assert cli(["capture", str(checkpoint), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens", str(STEPS),
                "--out", str(tmp_path / "plain")]) == 0  # routers only: blame captures what it needs
    shutil.copytree(tmp_path / "plain", tmp_path / "dispatched")  # (each run keeps its captures under its reference)
    results = {}
    for run, dispatch in (("plain", []), ("dispatched", on_disk(tmp_path / "off"))):
        assert cli(["blame", str(tmp_path / "target"), "--reference", str(tmp_path / run), "--dtype", "bfloat16",
                    "--clean", str(checkpoint), "--report-dir", str(tmp_path / f"blame-{run}"), *dispatch]) == 0
        results[run] = json.loads((tmp_path / f"blame-{run}" / "blame.json").read_text())
    assert any((tmp_path / "off").iterdir())
    plain, dispatched = results["plain"], results["dispatched"]
    assert plain["captured"] and plain["origins"][0]["component"] == "model.layers.2.self_attn", plain["verdict"]
    for key in ("verdict", "origins", "ranking", "layer_shares", "captured"):
        assert dispatched[key] == plain[key], key
    assert timeless(dispatched["noise_floor"]) == timeless(plain["noise_floor"])


def fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as raised:
        cli(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err.strip()  # (transformers' loading progress may come before it)
    assert "Traceback" not in err and [line for line in err.splitlines() if "error" in line] == [err.splitlines()[-1]], err
    return err.splitlines()[-1]


def test_cli_device_map_mistakes_are_one_line(checkpoint, tmp_path, capsys, monkeypatch):
    (tmp_path / "p.json").write_text("[[1, 2, 3]]")
    argv = ["capture", str(checkpoint), "--prompts", str(tmp_path / "p.json"), "--out", str(tmp_path / "r")]
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "accelerate", None)  # as where it is not installed
        forbid_model_loads(m)
        err = fails([*argv, "--device-map", "auto"], capsys)
    assert err == ("error: fxreplace capture: argument --device-map: 'auto' needs accelerate, which is not installed; "
                   "hint: pip install accelerate")
    err = fails([*argv, "--device-map", "auto", "--max-memory", "cpu=1e3"], capsys)
    assert "argument --max-memory: 'cpu=1e3' is not DEVICE=SIZE; hint: e.g. 0=20GiB,cpu=64GiB" in err
    err = fails([*argv, "--offload-folder", str(tmp_path / "off")], capsys)
    assert err == ("error: --max-memory and --offload-folder bound where --device-map places the layers; "
                   "hint: add --device-map auto")
    err = fails([*argv, "--device-map", "auto", "--max-memory", "cpu=1000"], capsys)  # the experts need a folder
    assert err.startswith(f"error: cannot load the model in {checkpoint}: ") and "offload_folder" in err
    assert err.endswith("; hint: --max-memory DEVICE=SIZE,... bounds each device; the layers that do not fit go to "
                        "--offload-folder DIR")
    err = fails([*argv[:1], f"builtin:{ARCH}", *argv[2:], "--device-map", "auto"], capsys)
    assert "a builtin model is built in memory; hint: save it with save_pretrained(DIR)" in err
    for command in ("validate", "blame"):  # they load the reference model from --clean only
        err = fails([command, str(checkpoint), "--reference", str(tmp_path), "--device-map", "auto"], capsys)
        assert err == (f"error: --device-map places the reference model, which {command} loads from --clean only (the "
                       "target loads whole, in --dtype); hint: give the clean model as --clean CKPT, or drop --device-map")
