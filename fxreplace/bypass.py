"""Bypass hints: what skipped a target that a forward did not reach, said by the family that knows.

A family whose model code can route around a target (a fused kernel behind a config flag)
registers a hint; :class:`~fxreplace.slots.TargetNotHitError` carries the first that speaks.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from .registries import Registry

BypassHint = Callable[[nn.Module, str], "str | None"]
_HINTS: Registry[BypassHint] = Registry("bypass hint")


def register_bypass_hint(hint: BypassHint, *, replace: bool = False) -> BypassHint:
    """``hint(model, module_name)`` says what skipped a target that a forward did not reach and
    what to turn off (e.g. a fused kernel a model family enables by a config flag), or None.
    Families register theirs (see ``fxreplace.models.nxd``); :class:`~fxreplace.TargetNotHitError` shows them.
    Registered by its qualified name, which another hint takes only with ``replace=True``."""
    return _HINTS.register(f"{hint.__module__}.{hint.__qualname__}", hint, replace=replace)


def bypass_hint(model: nn.Module, missed: list[str]) -> str:
    """What the hints say of the ``missed`` targets, as the tail of the error ("" when none speaks)."""
    hints = [h for name in missed for h in (hint(model, name) for hint in _HINTS.values()) if h]
    if not hints:
        return ""
    more = f" (and {len(hints) - 1} more like it)" if len(hints) > 1 else ""
    return f"; {hints[0]}{more}"
