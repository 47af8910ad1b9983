"""The serving-style example engine (docs/examples/batch_engine, docs/extending.md "Adding an
engine"): one package, found through the ``fxreplace.engines`` entry-point group as an installed
package's would be, run through `fxreplace validate` and `fxreplace blame` like the built-in ones."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from fxreplace.cli import main as cli
from fxreplace.engines import registry
from fxreplace.models import registry as families
from fxreplace.models import tiny_model

ROOT = Path(__file__).resolve().parents[1]
ARCH = "Qwen3MoeForCausalLM"


@pytest.fixture
def batch_engine(tmp_path_factory, monkeypatch):
    """The example package on sys.path, declared in the entry-point group by a dist-info beside it
    (as `pip install` would leave it); its engine and sites unregistered after."""
    site = tmp_path_factory.mktemp("site")
    info = site / "batch_engine_example-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: batch-engine-example\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fxreplace.engines]\nbatch = batch_engine\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples"))
    yield
    registry._ENGINES.unregister("batch")
    families._SITES.unregister(f"batch/{ARCH}")
    for name in [m for m in sys.modules if m == "batch_engine" or m.startswith("batch_engine.")]:
        del sys.modules[name]


def test_the_scheduler_batches_a_prefill_then_decodes_and_pads_each_row(batch_engine):
    from batch_engine.scheduler import DECODE, PREFILL, Request, Scheduler

    scheduler = Scheduler(max_batch=2)
    requests = [Request(f"r{i}", [1] * n, 2, replace) for i, (n, replace) in enumerate(((3, True), (5, True), (4, False)))]
    for request in requests:
        scheduler.add(request)
    steps = []
    while (step := scheduler.step()) is not None:
        steps.append((step.kind, [r.req_id for r in step.requests], step.width,
                      [step.tokens(i) for i in range(len(step.requests))],
                      [step.position(i) for i in range(len(step.requests))]))
        for request in step.requests:
            request.tokens.append(0)
    assert steps == [(PREFILL, ["r0", "r1"], 5, [3, 5], [0, 0]),  # r0's row: 3 tokens, 2 padding slots
                     (DECODE, ["r0", "r1"], 1, [1, 1], [3, 5]),
                     (PREFILL, ["r2"], 4, [4], [0]),  # another selection: another wave
                     (DECODE, ["r2"], 1, [1], [4])]


def test_the_batch_engine_runs_validate_and_blame(batch_engine, tmp_path, capsys):
    """A fault planted in layer 1's attention: the batch engine, found by name through its entry
    point, measures what the built-in runner measures, and its blame names that attention."""
    assert "batch" in registry.engine_names() and "batch_engine" not in sys.modules  # listed, not imported
    clean = tiny_model(ARCH, num_hidden_layers=2)
    faulty = copy.deepcopy(clean)
    faulty.model.layers[1].self_attn.o_proj.weight.data.mul_(1.5)
    for name, model in (("clean", clean), ("target", faulty)):
        model.save_pretrained(tmp_path / name)
    # four prompts of different lengths: two batches of two, each prefill padding its shorter prompt
    lengths, g = (7, 11, 9, 5), torch.Generator().manual_seed(1)
    prompts = torch.randint(4, 128, (len(lengths), max(lengths)), generator=g)
    (tmp_path / "prompts.json").write_text(json.dumps([row[:n].tolist() for row, n in zip(prompts, lengths)]))
    ref, tgt = str(tmp_path / "ref"), str(tmp_path / "target")
    assert cli(["capture", str(tmp_path / "clean"), "--prompts", str(tmp_path / "prompts.json"), "--max-new-tokens",
                "6", "--components", "--out", ref]) == 0

    summaries = {}
    for engine, extra in (("batch", ["--engine-args", '{"max_batch": 2}']), ("embedded", [])):
        assert cli(["validate", tgt, "--reference", ref, "--engine", engine, "--dtype", "float32", "--report-dir",
                    str(tmp_path / engine), *extra]) == 0
        summaries[engine] = json.loads((tmp_path / engine / "result.json").read_text())["summary"]
    assert "served in batches of 2" in capsys.readouterr().out
    for mode in ("off", "on"):
        mine, builtin = summaries["batch"][mode], summaries["embedded"][mode]
        assert mine["steps"] == builtin["steps"] and mine["prompts_diverged"] == builtin["prompts_diverged"]
        assert mine["mean_kl"] == pytest.approx(builtin["mean_kl"], rel=1e-3, abs=1e-6)
    assert summaries["batch"]["off"]["mean_kl"] > 1e-3  # the fault shows

    assert cli(["blame", tgt, "--reference", ref, "--engine", "batch", "--dtype", "float32", "--report-dir",
                str(tmp_path / "blame")]) == 0
    assert "program examined: engine batch, eager, float32" in capsys.readouterr().out
    found = json.loads((tmp_path / "blame" / "blame.json").read_text())
    first = found["origins"][0]
    assert (first["component"], first["kind"], first["layer"]) == ("model.layers.1.self_attn", "attention", 1), found
