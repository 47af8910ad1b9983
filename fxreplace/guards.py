"""``guard_filter``: a ``torch.compile`` guard filter that drops Dynamo's guards on fxreplace's own code.

A compiled instrumented model's trace runs fxreplace's Python (the forward that arms the targets,
each target's forward, the Injection), and Dynamo guards every module-level function, class and
registry that Python reaches: a few dozen checks on every call of the compiled model, whatever its
size, each re-proving that fxreplace's modules still hold what they held at import. They always
do (fxreplace never rebinds them; its registries only grow, and a graph reads them by a constant
number), so this filter drops exactly those guards:

- a guard whose source starts at one of fxreplace's modules and goes through one of its names (its
  functions, classes, registries and constants, and the functions it imported by name) but not
  through a module it imported (``torch.where`` keeps its guard),
- a guard on a global whose value fxreplace defines (a function, a class, a module, a singleton).

Everything that can change between calls keeps its guard: the inputs and the replacement tensors
(shape, dtype, device), the context's layout (its names), the model's and each target's identity,
whether the model is observed, and everything of the user's model. A changed shape, set of names
or dtype still recompiles (tests/test_host_guards.py)::

    compiled = torch.compile(model, options={"guard_filter_fn": fxreplace.guard_filter})

What it assumes: nobody monkeypatches fxreplace's modules after the model was compiled (a patch
would not recompile the graph). To combine it with your own filter, keep a guard both keep.
"""

from __future__ import annotations

import re
import sys
import types
from typing import Any, Sequence

_PACKAGE = __name__.split(".")[0]
# Dynamo names a module reached from a frame's globals "__import_" + its dotted name with "_dot_"
_THROUGH_MODULE = re.compile(r"^G\['__import_(\w+?)'\]\.(\w+)")


def guard_filter(entries: Sequence[Any]) -> list[bool]:
    """For ``torch.compile(options={"guard_filter_fn": ...})``: per guard entry, whether to keep it
    (see the module's docstring: every guard but those on fxreplace's own module-level objects)."""
    return [not _on_fxreplace(entry) for entry in entries]


def _on_fxreplace(entry) -> bool:
    through = _THROUGH_MODULE.match(entry.name)
    if through is not None:
        module = sys.modules.get(through.group(1).replace("_dot_", "."))
        if module is not None and _ours(module):
            if entry.guard_type == "DUPLICATE_INPUT":  # two of its globals naming one object (torch) stay so
                return True
            # its own names and the names it imported stay bound; what an imported module holds is not its own
            return not isinstance(getattr(module, through.group(2), None), types.ModuleType)
    return entry.is_global and entry.has_value and _defines(entry.value)


def _ours(module: types.ModuleType) -> bool:
    return module.__name__ == _PACKAGE or module.__name__.startswith(_PACKAGE + ".")


def _defines(value) -> bool:
    """Whether fxreplace defines ``value``: one of its modules, functions or classes, or an instance
    of one of its classes."""
    if isinstance(value, types.ModuleType):
        return _ours(value)
    owner = value if isinstance(value, (types.FunctionType, type)) else type(value)
    name = getattr(owner, "__module__", None) or ""
    return name == _PACKAGE or name.startswith(_PACKAGE + ".")
