"""The errors fxreplace raises for what a user gave it, in one place: each names what it refuses
(the module, the shape, the field, the request) and is a ValueError, so a caller catching bad input
catches them all. Imports nothing, so every layer raises them. (``TargetNotHitError`` and the other
errors of a running instrumented model are RuntimeErrors; ``repro_run.ReproError`` stays in the repro
folder's own script, which runs without fxreplace.)"""

from __future__ import annotations


class ConfigError(ValueError):
    """A replacement configuration that cannot be used; the message names the field."""


class TargetError(ValueError):
    """A target pattern or injection point that does not exist in the model."""


class TargetNotLiveError(TargetError):
    """A target whose replacement cannot reach the model's output: replacing it would change
    nothing, and a run would wrongly clear the component it names."""


class ShapeError(ValueError):
    """A replacement whose shape does not fit the tensor it replaces."""


class ComponentError(ValueError):
    """No components to work with: the family declares none, or the reference records none an
    engine's model code holds (what to give instead is named)."""


class CaptureError(ValueError):
    """Captures that cannot be flattened; the message names prompt, capture name and step."""


class StoreError(CaptureError):
    """A store file that does not hold what its index says; the message names the file and the field."""


class PromptError(ValueError):
    """A prompt that cannot be captured; ``hint``: how to fix it."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


class SetupError(ValueError):
    """What a command was given cannot be used: ``problem``, and the ``hint`` that fixes it."""

    def __init__(self, problem: str, hint: str | None = None):
        super().__init__(problem if hint is None else f"{problem}; hint: {hint}")
        self.problem, self.hint = problem, hint


class FloorFileError(ValueError):
    """A reference's stored noise floor that cannot be read."""


class BlameError(ValueError):
    """Inputs blame refuses before its first pass (both sides named)."""


class TargetNotHitError(RuntimeError):
    """A target's injection point ran zero or several times in one forward,
    e.g. because a kernel-replaced forward skips the router."""


class ConcurrentForwardError(RuntimeError):
    """An instrumented model was called while it was running a forward (from another thread):
    its targets' slots hold one forward's replacements at a time."""


class InstrumentationChangedError(TargetError):
    """Instrumenting changed what a target computes with nothing replaced: a verdict on this model
    would judge another program than the one the user gave."""
