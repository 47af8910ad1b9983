"""Every difference between the torch versions fxreplace supports (2.8 to 2.13), in one place."""

try:  # torch >= 2.10
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw as size_hint
except ImportError:  # torch 2.8 / 2.9: the same hint under its older name
    from torch.fx.experimental.symbolic_shapes import hint_int as size_hint

import itertools
import weakref

import torch

__all__ = ["SUBSTITUTES_MODULE_METHODS", "size_hint", "trace_key", "traced"]

#: whether Dynamo runs a function's substitute (``torch.compiler.substitute_in_graph``) where it meets the
#: function as a method held in a module's ``__dict__``: torch 2.13 does, in every trace; 2.9 traces the
#: function itself (checked), and the versions between were not checked. Without it the targets' given
#: forwards are never put in place (see :class:`~fxreplace.slots.GivenForwards`).
SUBSTITUTES_MODULE_METHODS = torch.__version__ >= "2.13"

# torch 2.8 / 2.9's assume_constant_result takes Python constants only (2.10+ also takes an object,
# guarded by its identity): the trace-time functions take an object's key and look it up here
_TRACED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_TRACE_KEYS = itertools.count()


def trace_key(obj) -> str:
    """A name, unique in this process, that stands for ``obj`` in a compiled graph's trace-time
    functions (also a valid attribute name); held weakly."""
    key = f"{type(obj).__name__}_{next(_TRACE_KEYS)}"
    _TRACED[key] = obj
    return key


def traced(key: str):
    """The object :func:`trace_key` named ``key``."""
    return _TRACED[key]
