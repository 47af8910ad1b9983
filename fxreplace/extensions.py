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

from .registries import load_entry_point

GROUP = "fxreplace.families"
_failures: list[str] | None = None  # one message per entry point that failed, once they were loaded


def load_extensions() -> list[str]:
    """Load every ``fxreplace.families`` entry point (once), each on its own, so a broken one
    never keeps the others from registering. Returns, at every call, one message per entry
    point that failed, naming it: the callers put them into their "not found" errors."""
    global _failures
    if _failures is None:
        _failures = []
        _failures = [f for f in (load_entry_point(ep, GROUP) for ep in entry_points(group=GROUP)) if f]
    return list(_failures)
