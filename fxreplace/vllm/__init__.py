"""Deprecated import path: the vLLM engine lives in :mod:`fxreplace.engines.vllm` (its plugin's
``vllm.general_plugins`` entry point is ``fxreplace.engines.vllm.plugin:register``). This path
gives the same public names, with a warning, so code and installs made before the move still run."""

import warnings

from ..engines.vllm import *  # noqa: F403 - the public names
from ..engines.vllm import __all__  # noqa: F401

warnings.warn("fxreplace.vllm is deprecated: import fxreplace.engines.vllm (the same names)", DeprecationWarning,
              stacklevel=2)
