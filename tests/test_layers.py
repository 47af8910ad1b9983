"""The package's modules form layers that point down only: each module belongs to one layer of
:data:`LAYERS` and imports its own layer and those below, never one above; no module, and no
package of the table, imports one that imports it back. Imports inside functions count (a lazy
import is still a dependency, only a later one), as do those under ``TYPE_CHECKING``.
``fxreplace.models`` is checked where the installed package finds it (``models/`` in the tree)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import fxreplace

PACKAGE = Path(fxreplace.__file__).parent

#: The layers, lowest first, each the modules and packages in it (names under ``fxreplace.``;
#: "" is ``fxreplace`` itself, whose top-level names load everything). A new module goes in one.
LAYERS = [
    ("words, dtypes, devices and the helpers everything uses",
     ["words", "errors", "dtypes", "devices", "_compat", "registries", "extensions", "checkpoint", "matching", "gather",
      "testing"]),
    ("the graph core", ["targets", "sharding", "adapters", "points", "injection", "passes", "bypass", "slots", "feeding",
                        "instrument", "unchanged", "liveness", "export", "context", "active_context",
                        "guards"]),
    ("families, components", ["models", "components", "covers"]),
    ("store, reference, config, capture", ["store", "reference", "config", "loading", "capture"]),
    ("the replacer", ["replacer"]),
    ("the engine seam", ["engines", "engines.protocol", "engines.registry"]),
    ("the engines", ["engines.embedded", "engines.vllm", "engines.recording", "engines.replacement", "vllm"]),
    ("validation, floor, blame, repro, report", ["metrics", "validation", "floor", "blame", "repro", "repro_calls",
                                                 "repro_run", "report", "junit"]),
    ("the command line", ["cli", "__main__", "demo", ""]),
]


def _walk(root: Path, prefix: tuple[str, ...], skip: str | None = None) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] == skip:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(prefix + parts)] = path
    return found


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name; ``fxreplace.models`` where the installed package finds it."""
    models = Path(importlib.util.find_spec("fxreplace.models").submodule_search_locations[0])
    return {**_walk(PACKAGE, ("fxreplace",), skip="models"), **_walk(models, ("fxreplace", "models"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in it: ``from pkg import sub`` names the
    submodule, ``from pkg import name`` the package itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    # a module importing one of its own package's __init__ only runs that package first
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _place(name: str, layers=LAYERS, root: str = "fxreplace") -> tuple[int, str]:
    """The layer (its index) and the table's entry (the package) ``name`` belongs to: its longest
    entry; KeyError for a module the table does not place."""
    relative = "" if name == root else name.removeprefix(root + ".")
    best = None
    for index, (_, entries) in enumerate(layers):
        for entry in entries:
            if (relative == entry or (entry and relative.startswith(entry + "."))) and (
                    best is None or len(entry) > len(best[1])):
                best = (index, entry)
    if best is None:
        raise KeyError(f"{name} is in no layer of LAYERS: add it to the layer it belongs to")
    return best


def _upward(graph: dict[str, set[str]], layers=LAYERS, root: str = "fxreplace") -> list[str]:
    """Every import of ``graph`` that points to a higher layer, in words."""
    found = []
    for name in sorted(graph):
        low = _place(name, layers, root)[0]
        for dep in sorted(graph[name]):
            high = _place(dep, layers, root)[0]
            if high > low:
                found.append(f"{name} ({layers[low][0]}) imports {dep} ({layers[high][0]}, above it)")
    return found


def _packages(graph: dict[str, set[str]], layers=LAYERS, root: str = "fxreplace") -> dict[str, set[str]]:
    """``graph`` between the table's entries (packages): an import inside one entry is dropped."""
    collapsed: dict[str, set[str]] = {}
    for name, deps in graph.items():
        own = _place(name, layers, root)[1]
        collapsed.setdefault(own, set()).update(d for d in map(lambda d: _place(d, layers, root)[1], deps) if d != own)
    return collapsed


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_cycle_finder_sees_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_layer_check_sees_an_import_pointing_up_even_inside_a_function(tmp_path):
    """A planted import of a higher layer, made inside a function, is found and named."""
    layers = [("low", ["low"]), ("mid", ["mid", "mid.part"]), ("high", ["high", ""])]
    (tmp_path / "low.py").write_text("import os\n\ndef later():\n    from .high import run\n")
    (tmp_path / "mid.py").write_text("from .low import later\n")
    modules = {"pkg.low": tmp_path / "low.py", "pkg.mid": tmp_path / "mid.py", "pkg.high": tmp_path / "high.py"}
    graph = {name: _imports(name, path, modules) for name, path in modules.items() if path.exists()}
    assert graph == {"pkg.low": {"pkg.high"}, "pkg.mid": {"pkg.low"}}
    graph["pkg.high"] = {"pkg.mid"}
    assert _upward(graph, layers, "pkg") == ["pkg.low (low) imports pkg.high (high, above it)"]
    assert _place("pkg.mid.part.x", layers, "pkg") == (1, "mid.part") and _place("pkg", layers, "pkg") == (2, "")
    assert _packages({"pkg.mid.part.a": {"pkg.mid.part.b", "pkg.mid"}}, layers, "pkg") == {"mid.part": {"mid"}}
    assert _cycle(_packages(graph, layers, "pkg")) == ["high", "mid", "low", "high"]
    graph["pkg.low"] = set()
    assert _upward(graph, layers, "pkg") == []


def test_every_module_imports():
    """Every module found is importable on its own (so the graph below is the package's);
    ``__main__`` runs the CLI, so it is only parsed."""
    for name in _modules():
        if not name.endswith(".__main__"):
            importlib.import_module(name)


def test_every_module_has_a_layer_and_imports_none_above_it():
    graph = _graph()
    assert graph["fxreplace.passes"], "the import parser found nothing"  # it reads imports at all
    assert "fxreplace.models.registry" in graph, "fxreplace.models is outside the check"
    unplaced = []
    for name in graph:
        try:
            _place(name)
        except KeyError as e:
            unplaced.append(e.args[0])
    assert not unplaced, unplaced
    upward = _upward(graph)
    assert not upward, "imports pointing up a layer:\n" + "\n".join(upward)


def test_no_import_circle():
    graph = _graph()
    cycle = _cycle(graph)
    assert cycle is None, f"import circle: {' -> '.join(cycle)} (a lower layer must not import a higher one)"
    cycle = _cycle(_packages(graph))
    assert cycle is None, f"packages importing each other: {' -> '.join(cycle)}"
