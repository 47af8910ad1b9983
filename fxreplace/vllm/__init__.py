"""``fxreplace.vllm``: the vLLM engine's public import path (the ``vllm.general_plugins`` entry
point, user code, the docs). The code lives in :mod:`fxreplace.engines.vllm` and
:mod:`fxreplace.engines.vllm_neuron`; this path stays so installed entry points and imports made
before the engines moved keep working, and its submodules are those modules themselves (patching
``fxreplace.vllm.internals`` patches the one the plugin reads)."""

import sys

from ..engines import vllm as _engine
from ..engines.vllm import *  # noqa: F403 - the public names, as before the move
from ..engines.vllm import __all__  # noqa: F401
from ..engines.vllm import (capture, config, engine, internals, plugin, preflight, replacement, runners, shm,
                            startup, testing)
from ..engines import protocol, vllm_neuron as neuron
from ..engines.vllm_neuron import internals as neuron_internals

for _name in ("capture", "config", "engine", "internals", "plugin", "preflight", "replacement", "runners", "shm",
              "startup", "testing", "protocol", "neuron", "neuron_internals"):
    sys.modules[f"{__name__}.{_name}"] = globals()[_name]
del _engine, _name
