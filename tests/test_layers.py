"""The package's modules form layers: no module imports, directly or through others,
a module that imports it back (imports inside functions included: a lazy import
is still a dependency, only a later one)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import fxreplace

PACKAGE = Path(fxreplace.__file__).parent


def _modules() -> dict[str, Path]:
    """Every module of the package (``fxreplace.models`` included), by dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(("fxreplace",) + parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports: ``from pkg import sub`` names the
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
        for dep in sorted(graph[node]):
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


def test_cycle_finder_sees_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_module_imports():
    """Every module found is importable on its own (so the graph below is the package's);
    ``__main__`` runs the CLI, so it is only parsed."""
    for name in _modules():
        if not name.endswith(".__main__"):
            importlib.import_module(name)


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["fxreplace.passes"], "the import parser found nothing"  # it reads imports at all
    cycle = _cycle(graph)
    assert cycle is None, f"import circle: {' -> '.join(cycle)} (a lower layer must not import a higher one)"
