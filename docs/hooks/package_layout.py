"""MkDocs hook: lay out the package as it is installed, for the API reference.

mkdocstrings (griffe) reads packages from the file system, where ``fxreplace.models``
lives in ``models/`` (pyproject's ``package-dir``), not under ``fxreplace/``. The hook
builds a directory of links with the installed layout and points the handler at it.
"""

import atexit
import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[2]


@event_priority(100)  # before mkdocstrings reads its handler options
def on_config(config):
    layout = Path(tempfile.mkdtemp(prefix="fxreplace-docs-"))
    atexit.register(shutil.rmtree, layout, ignore_errors=True)
    package = layout / "fxreplace"
    package.mkdir()
    for entry in (ROOT / "fxreplace").iterdir():
        if entry.name != "models" and entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    (package / "models").symlink_to(ROOT / "models")
    python = config["plugins"]["mkdocstrings"].config["handlers"]["python"]
    python["paths"] = [str(layout)]
    return config
