"""The docs site builds with `mkdocs build --strict` (broken links, missing pages, API
entries that do not resolve fail it), and its CLI reference is the parser's own help."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cli = (tmp_path / "site" / "cli" / "index.html").read_text()
    assert "--fail-on" in cli and "fxreplace validate" in cli and "default: bfloat16" in cli
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "capture_reference" in api and "Greedy-generate" in api, "mkdocstrings rendered the docstrings"


def test_the_family_example_registers_a_working_family(monkeypatch):
    import runpy

    import torch

    import fxreplace
    import fxreplace.models
    from fxreplace.models import get_family, tiny_model

    # registered for this test only (tests/test_readme.py runs the same example from docs/extending.md)
    monkeypatch.setattr(fxreplace.models, "_FAMILIES", dict(fxreplace.models._FAMILIES))
    runpy.run_path(str(ROOT / "docs" / "examples" / "my_family.py"))
    family = get_family("MyMoeForCausalLM")
    model = fxreplace.instrument(tiny_model("MyMoeForCausalLM"), list(family.targets))
    assert model.targets == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert set(family.components) == {"attention", "router", "experts", "layer"}
