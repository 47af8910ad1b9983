"""The docs site builds with `mkdocs build --strict` (broken links, missing pages, API
entries that do not resolve fail it), and its CLI reference is the parser's own help."""

import re
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
    # the docstrings' Sphinx roles are links (or code where the site documents no such object), never raw text
    raw = {str(page.relative_to(tmp_path)): re.findall(r":(?:meth|func|class|attr|mod|data|exc|obj):`?[\w.~<]{0,40}",
                                                       page.read_text())
           for page in (tmp_path / "site").rglob("*.html")}
    assert not {page: found for page, found in raw.items() if found}
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]*href="#fxreplace.store.StoreWriter"><code>StoreWriter</code>',
                     api), "a :class: role became a link"
    # code blocks and the CLI help wrap at the column's edge rather than run past it
    assert "css/fxreplace.css" in cli and "white-space: pre-wrap" in (tmp_path / "site" / "css" / "fxreplace.css").read_text()


def test_the_family_example_registers_a_working_family(monkeypatch):
    import runpy

    import torch

    import fxreplace
    import fxreplace.models
    from fxreplace.components import resolve_components
    from fxreplace.models import get_family, tiny_model

    # registered for this test only (tests/test_readme.py runs the same example from docs/extending.md)
    fxreplace.models.families()  # the built-ins registered before the copy
    monkeypatch.setattr(fxreplace.models.registry, "_FAMILIES", fxreplace.models.registry._FAMILIES.copy())
    monkeypatch.setattr(fxreplace.models.registry, "_SITES", fxreplace.models.registry._SITES.copy())
    runpy.run_path(str(ROOT / "docs" / "examples" / "my_family.py"))
    family = get_family("MyMoeForCausalLM")
    assert [t.point for t in family.targets_for("vllm")] == ["output[0]"]
    model = fxreplace.instrument(tiny_model("MyMoeForCausalLM"), list(family.targets))
    assert model.targets == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert list(family.components) == ["embedding", "attention", "router", "routing", "experts", "layer"]
    assert len(resolve_components(tiny_model("MyMoeForCausalLM"), family.components)) == 1 + 2 * 5  # 2 layers


def _api_entries() -> dict[str, list[str]]:
    """docs/api.md's ``::: dotted.path`` entries by section heading."""
    sections: dict[str, list[str]] = {}
    heading = ""
    for line in (ROOT / "docs" / "api.md").read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:]
            sections[heading] = []
        elif line.startswith("::: "):
            sections[heading].append(line[4:].strip())
    return sections


def test_the_top_level_names_are_what_the_api_page_documents_at_the_top():
    """A section whose heading names no module documents names importable from ``fxreplace`` itself;
    ``__all__`` is those (and aliases of them), nothing else."""
    import importlib

    import fxreplace

    documented, elsewhere = {}, []
    for heading, entries in _api_entries().items():
        for path in entries:
            module, _, name = path.rpartition(".")
            obj = getattr(importlib.import_module(module), name)
            (elsewhere.append(path) if "`fxreplace." in heading else documented.setdefault(name, obj))
    assert documented and elsewhere, "the parser found the page's entries"
    for name, obj in documented.items():
        assert getattr(fxreplace, name, None) is obj, f"api.md documents {name} at the top; fxreplace.{name} is not it"
    undocumented = [name for name in fxreplace.__all__
                    if not any(getattr(fxreplace, name) is obj for obj in documented.values())]
    assert not undocumented, f"fxreplace.__all__ holds names docs/api.md does not document at the top: {undocumented}"
    assert set(documented) <= set(fxreplace.__all__), sorted(set(documented) - set(fxreplace.__all__))
    assert not [p for p in elsewhere if p.rpartition(".")[2] in fxreplace.__all__], "a module's section holds a top name"
