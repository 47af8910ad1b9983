"""The README and the docs cannot rot: every ```python block runs as written (on the
tiny models, in a fresh directory), and every ``fxreplace.<name>`` they mention exists."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPET = re.compile(r'^--8<-- "(.+?)"$', re.M)  # pymdownx.snippets: the page shows that file


def python_blocks(page: Path) -> list[str]:
    blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)
    return [SNIPPET.sub(lambda m: (ROOT / m.group(1)).read_text(), block) for block in blocks]


BLOCKS = [(page.relative_to(ROOT), i, code) for page in PAGES for i, code in enumerate(python_blocks(page))]
# dotted names in code spans, e.g. `fxreplace.uninstrument(model)`; entry-point groups are names, not attributes
NAMES = sorted({name for page in PAGES for name in re.findall(r"`[^`]*?\b(fxreplace(?:\.\w+)+)", page.read_text())}
               - {"fxreplace.families"})


def test_readme_and_docs_have_python_blocks():
    assert sum(str(page) == "README.md" for page, _, _ in BLOCKS) >= 1, "README lost its example"
    assert len(BLOCKS) >= 8, "the docs lost their runnable examples"


@pytest.mark.parametrize("page,index,code", BLOCKS, ids=[f"{page}-{i}" for page, i, _ in BLOCKS])
def test_python_block_runs(page, index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks write ref/, report/
    import fxreplace.engines.registry
    import fxreplace.models

    # a block that registers a family or an engine registers it for itself (tests/test_docs.py runs the same example)
    fxreplace.models.families()  # the built-ins registered before the copy
    monkeypatch.setattr(fxreplace.models.registry, "_FAMILIES", fxreplace.models.registry._FAMILIES.copy())
    monkeypatch.setattr(fxreplace.models.registry, "_SITES", fxreplace.models.registry._SITES.copy())
    for engine in fxreplace.engines.registry.BUILTIN:  # registered before the copy, as the families are
        fxreplace.engines.registry.get_engine(engine)
    monkeypatch.setattr(fxreplace.engines.registry, "_ENGINES", fxreplace.engines.registry._ENGINES.copy())
    exec(compile(code, f"{page} python block {index}", "exec"), {"__name__": f"docs_block_{index}"})


def resolve(dotted: str):
    """What ``fxreplace.a.b`` means in user code (after ``import fxreplace.a`` when ``a`` is a module)."""
    obj, path = importlib.import_module("fxreplace"), "fxreplace"
    for part in dotted.split(".")[1:]:
        path += "." + part
        if not hasattr(obj, part):
            try:
                importlib.import_module(path)
            except ModuleNotFoundError:
                pass
        obj = getattr(obj, part)  # AttributeError: the README names something that does not exist
    return obj


@pytest.mark.parametrize("name", NAMES)
def test_names_exist(name):
    resolve(name)


def test_the_getting_started_pages_run_one_after_the_other_in_one_folder(tmp_path, monkeypatch):
    """A reader runs the quick start's examples, then those of "Use it on your own model", in one folder:
    no example writes where an earlier one wrote (two stores at ref/ failed with FileExistsError)."""
    monkeypatch.chdir(tmp_path)
    for page in ("quickstart.md", "own-model.md"):
        for index, code in enumerate(python_blocks(ROOT / "docs" / page)):
            exec(compile(code, f"docs/{page} python block {index}", "exec"), {"__name__": f"docs_block_{index}"})
    assert (tmp_path / "ref" / "index.json").is_file() and (tmp_path / "big-ref" / "index.json").is_file()
