"""A serving-style engine as one package: the example of docs/extending.md ("Adding an engine"),
run through validate and blame by tests/test_batch_engine.py.

"batch" serves requests the way a serving engine does, in miniature: its scheduler
(``scheduler.py``) batches requests into a prefill step (prompts padded to the longest) and decode
steps (one token each), and its engine (``engine.py``) runs each step through the model with a
KV cache, handing the model the replacement context of the step's layout. The family's sites in
its model code are its own to declare (``sites.py``). This module registers it: how
``fxreplace validate/blame --engine batch`` open it.
"""

from __future__ import annotations

from fxreplace import TensorReplacer, instrument
from fxreplace.components import resolve_components
from fxreplace.dtypes import as_dtype
from fxreplace.engines.registry import EngineRun, EngineSpec, Opened, register_engine
from fxreplace.loading import SetupError, check_vocab, load_model
from fxreplace.models import architecture, get_family

from .engine import BatchEngine
from .sites import MODEL_CODE


def _load(run: EngineRun):
    """The target in ``run.dtype``, checked against the reference, and its family's sites in this engine's code."""
    model = load_model(run.model, as_dtype(run.dtype), device=run.device)
    check_vocab(run.reference, run.model, model.config.vocab_size)
    arch = architecture(model.config, type(model).__name__)
    family = get_family(arch)
    if not family.targets_for(MODEL_CODE):
        raise SetupError(f"the batch engine declares no sites for {arch}", "register them in batch_engine/sites.py")
    return model, family


def open_validation(run: EngineRun) -> Opened:
    """The target with the family's targets in this engine's code (or ``run.targets``) instrumented."""
    model, family = _load(run)
    targets = run.targets or list(family.targets_for(MODEL_CODE))
    instrument(model, targets)
    engine = BatchEngine(model, TensorReplacer(run.reference.store), dtype=run.dtype, **run.options)
    return Opened(engine, f"target: {run.model} in {run.dtype}, served in batches of {engine.max_batch}",
                  getattr(model.config, "num_experts_per_tok", None), list(targets))


def open_blame(run: EngineRun) -> Opened:
    """The target with every component of its family in this engine's code instrumented."""
    model, family = _load(run)
    components = resolve_components(model, family.components_for(MODEL_CODE))
    instrument(model, [c.target for c in components])
    return Opened(BatchEngine(model, TensorReplacer(run.reference.store), components, dtype=run.dtype, **run.options))


ENGINE = register_engine(EngineSpec(
    name="batch",
    summary="the HF model served in batches: a prefill step, then decode steps (an example engine)",
    open_validation=open_validation,
    open_blame=open_blame,
    takes=frozenset({"--engine-args"}),  # {"max_batch": N}
))
