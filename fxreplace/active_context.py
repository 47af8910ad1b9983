"""The context-local "active context" of hand-instrumented models.

Models edited by hand in the style of vllm-neuron's ``tensor_replacement`` call
``get_replacement_tensor(name)`` at each injection point; :func:`instrument` needs none
of this. Context-local (``contextvars``): concurrent forward passes in different threads
or asyncio tasks each see their own context.
"""

from __future__ import annotations

import contextvars

import torch

from .context import ReplacementContext

_active: contextvars.ContextVar[ReplacementContext | None] = contextvars.ContextVar(
    "fxreplace_active_context", default=None
)


def set_active_context(ctx: ReplacementContext | None) -> None:
    """Make ``ctx`` the context that :func:`get_replacement_tensor` reads.

    Context-local (``contextvars``): concurrent forward passes in different
    threads or asyncio tasks each see their own context.
    """
    _active.set(ctx)


def get_active_context() -> ReplacementContext | None:
    return _active.get()


def get_replacement_tensor(name: str) -> torch.Tensor | None:
    """The active context's tensor for ``name``, or None when there is none."""
    ctx = _active.get()
    if ctx is None:
        return None
    return ctx.get(name)
