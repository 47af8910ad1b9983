"""Families and adapters from installed packages: the ``fxreplace.families`` entry-point group.

A package registers its own model family or adapter by declaring, in its
``pyproject.toml``::

    [project.entry-points."fxreplace.families"]
    my_moe = "my_package.fxreplace_family"          # a module: importing it registers
    # or   = "my_package.fxreplace_family:register" # a callable: called once

The module (or callable) calls :func:`fxreplace.models.register_family` and/or
:func:`fxreplace.register_adapter`. Entry points load once, the first time a
family or adapter name is not found among those already registered (or all
families are listed), so ``import fxreplace`` stays light.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from types import ModuleType

GROUP = "fxreplace.families"
_loaded = False


def load_extensions() -> bool:
    """Load every ``fxreplace.families`` entry point once; returns whether this call loaded them."""
    global _loaded
    if _loaded:
        return False
    _loaded = True
    for ep in entry_points(group=GROUP):
        try:
            obj = ep.load()
            if not isinstance(obj, ModuleType):
                obj()
        except Exception as exc:
            raise ImportError(f"fxreplace: the {GROUP!r} entry point {ep.name!r} = {ep.value!r} "
                              f"failed to register: {type(exc).__name__}: {exc}") from exc
    return True
