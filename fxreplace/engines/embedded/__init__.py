"""The embedded engine: fxreplace's own static-shape runner over a Hugging Face causal LM in
this process (:class:`~fxreplace.engines.embedded.runner.Runner`; blame's in
:mod:`~fxreplace.engines.embedded.blame_engine`)."""

from .runner import Runner, RunnerConfig

__all__ = ["Runner", "RunnerConfig"]
