"""The README cannot rot: every ```python block runs as written (on the tiny
models, in a fresh directory), and every ``fxreplace.<name>`` it mentions exists."""

import importlib
import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)
# dotted names in code spans, e.g. `fxreplace.uninstrument(model)`; entry-point groups are names, not attributes
NAMES = sorted(set(re.findall(r"`[^`]*?\b(fxreplace(?:\.\w+)+)", README)) - {"fxreplace.families"})


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 5, "README lost its runnable examples"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks write ref/, report/
    code = compile(BLOCKS[index], f"README.md python block {index}", "exec")
    exec(code, {"__name__": f"readme_block_{index}"})


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
def test_readme_names_exist(name):
    resolve(name)
