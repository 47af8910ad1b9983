"""``fxreplace.blame``: find every component that makes a target drift from its reference.

:func:`blame` checks its inputs, drives an engine (the embedded one's
:class:`~fxreplace.engines.embedded.blame_engine.BlameRunner` for an HF model, or any engine whose ``generate(prompts, n, replace)`` takes capture names, e.g.
:class:`fxreplace.engines.vllm.engine.VllmBlameEngine`) and runs the search of
:mod:`fxreplace.blame.search`; :mod:`fxreplace.blame.result` holds what it finds and
:mod:`fxreplace.blame.ondemand` captures missing components from the clean model.

Measures are continuous (see :data:`fxreplace.validation.EXPLAINS`): a replacement
*explains* the divergence when it removes at least 90% of both the mean KL and the mean
top-5 log-prob error.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from ..components import Component, ComponentError, layer_of, resolve_components
from ..dtypes import dtype_name, is_full_precision
from ..engines.embedded.blame_engine import MAX_BATCH, BlameRunner, blame_runner
from ..engines.protocol import check_engine
from ..floor import check_reference_precision, floor_for, stored_floors
from ..instrument import instrument
from ..metrics import Tolerances, no_scale
from ..models import architecture
from ..reference import load_reference
from ..targets import TargetLike
from ..covers import Cover
from .ondemand import OnDemand
from .result import (MAX_ORIGINS, SIGNIFICANT, Blame, BlameError, BlameResult, LayerShare, NonFinite, Origin, Pass,
                     LayerCode, SharedClass, Systematic)
from .passes import LAYER, PROBES, default_budget
from .search import Search
from .systematic import MEMBER

__all__ = ["blame", "search", "Component", "resolve_components", "check_inputs", "BlameError", "BlameResult", "Blame", "LayerShare", "Origin", "NonFinite", "Pass", "Systematic", "SharedClass", "LayerCode", "LAYER",
           "SIGNIFICANT", "MAX_ORIGINS", "MEMBER", "MAX_BATCH", "PROBES", "default_budget", "layer_of", "blame_runner"]


def check_inputs(reference, *, architecture: str | None, vocab_size: int | None, what: str,
                 prompts: Sequence[int] | None = None, label: str = "the reference") -> list[int]:
    """Refuse, before any pass, a reference from another architecture or vocabulary, or no
    prompts; returns the prompt indices to validate. ``label`` names the reference (its directory)."""
    hint = "hint: blame the model the reference was captured from, or capture a new reference from it"
    recorded = reference.metadata.get("architecture")
    if architecture and recorded and recorded != architecture:
        raise BlameError(f"{label} was captured from {recorded} (captures {reference.store.capture_names[:2]} "
                         f"...) but {what} is {architecture}; {hint}")
    if vocab_size is not None and vocab_size != reference.vocab_size:
        raise BlameError(f"{label} has vocab size {reference.vocab_size} but {what} has {vocab_size}: it was "
                         f"captured from another model; {hint}")
    indices = list(range(reference.num_prompts)) if prompts is None else list(prompts)
    if not indices:
        raise BlameError(f"no prompts to validate: give at least one of the reference's {reference.num_prompts} "
                         "prompts (prompts=None: all)")
    unknown = [p for p in indices if not isinstance(p, int) or not 0 <= p < reference.num_prompts]
    if unknown:
        raise BlameError(f"prompts {unknown[:5]} are not in the reference (it holds prompts 0-{reference.num_prompts - 1})")
    return indices


def missing_components(reference, components: Sequence[Component]) -> list[Component]:
    return [c for c in components if c.capture_name not in reference.store.columns]


def refuse_missing(reference, components: Sequence[Component], model_hint: str = "CLEAN_MODEL") -> None:
    """A reference lacking the components the search needs is refused, naming the missing
    kinds and the capture command that records them (or ``--clean`` to capture on demand)."""
    missing = missing_components(reference, components)
    if not missing:
        return
    kinds = sorted({c.kind for c in missing})
    source = reference.metadata.get("source_model") or model_hint
    steps = max(reference.num_generated(p) for p in range(reference.num_prompts))
    raise BlameError(
        f"the reference lacks {len(missing)} of the {len(components)} components the search needs (kinds "
        f"{', '.join(kinds)}; e.g. {missing[0].capture_name}); capture them with `fxreplace capture {source} "
        f"--prompts PROMPTS.json --max-new-tokens {steps} --components --out NEW_REFERENCE` (the reference's prompts), "
        f"or give the clean model to capture only what each pass needs: `fxreplace blame TARGET --reference REF "
        f"--clean {source}` (blame(..., clean=model))")


def search(engine, reference, components: Sequence[Component], *, tolerances: Tolerances = Tolerances(),
           prompts: Sequence[int] | None = None, budget: int | None = None, probes: int = PROBES,
           progress: bool = True, supply=None, observe=None, floor=None, dtype: str | None = None,
           batch_rows: int | None = None, drift_of=None, layer_types: Sequence[str] | None = None,
           covers: Mapping[str, Cover] | None = None) -> BlameResult:
    """The search of :mod:`fxreplace.blame.search` over ``components`` through ``engine``; ``floor``
    (:class:`fxreplace.floor.NoiseFloor`) scales it, else a target below float32 (``dtype``) is
    told its verdict has no scale. ``batch_rows``: the requests ``engine`` runs in one batch (default:
    a round of ``probes`` streams and "off"). ``drift_of``: each of the given capture names' part of the floor
    (:func:`precision_drift`). ``layer_types``: each layer's type (``config.layer_types``), naming the layers a
    systematic fault holds ("every sliding attention layer"). ``covers``: what each component's replacement spans
    (:func:`fxreplace.covers.component_covers`): the verdict names those modules and a class several kinds'
    covers share."""
    if not components:
        raise BlameError("no components to search: give the family's components or your own")
    indices = check_inputs(reference, architecture=None, vocab_size=None, what="the target", prompts=prompts)
    if supply is None:
        refuse_missing(reference, components)
    if floor is not None and not floor.covers(indices):
        raise BlameError(f"the noise floor covers prompts {sorted(floor.prompts)[:5]} ... but not all of {indices[:5]} ...: "
                         "it was measured on another reference")
    unscaled = no_scale(dtype) if dtype and not is_full_precision(dtype) else ""
    result = Search(engine, reference, components, tolerances=tolerances, prompts=indices, budget=budget,
                    probes=probes, progress=progress, supply=supply, observe=observe, floor=floor,
                    unscaled=unscaled, batch_rows=batch_rows, drift_of=drift_of, layer_types=layer_types,
                    covers=covers).run()
    return result


def blame(target, reference, *, clean: nn.Module | Callable[[], nn.Module] | None = None, components: Mapping[str, TargetLike] | None = None,
          dtype: torch.dtype | None = None, compile: str | None = None, tolerances: Tolerances = Tolerances(),
          prompts: Sequence[int] | None = None, budget: int | None = None, probes: int = PROBES,
          progress: bool = True, floor=None, allow_low_precision_reference: bool = False) -> BlameResult:
    """Which components of ``target`` make it drift from ``reference``?

    ``target``: an HF causal LM with the weights under test (converted to ``dtype`` in a copy
    when it has another dtype, else used itself and restored afterwards; instrumented at every component and run by the embedded
    engine's :class:`~fxreplace.engines.embedded.blame_engine.BlameRunner`, compiled with ``compile`` as backend if
    given), or an engine whose ``generate(prompts, n, replace)`` takes capture names and whose
    ``components`` lists what it can replace (``components``, ``dtype`` and ``compile`` are then
    its own). ``reference``: a :class:`~fxreplace.reference.Reference` or its directory. ``clean``: the clean HF model
    the reference came from (or a function loading it: then it is in memory only while it captures);
    components the reference lacks are then captured from it as the search needs them (appended
    under the reference directory and reused next time).
    ``components``: ``{kind: Target}`` for models whose family declares none.
    ``budget``: the most validation passes (default :func:`default_budget`); ``probes``:
    streams tested side by side per localisation round. ``floor``: the noise floor
    (:class:`fxreplace.floor.NoiseFloor`) that scales the verdict; default: the one the reference
    stored for the target's dtype (``capture --noise-floor``), else measured from ``clean``.
    A reference captured below float32 is refused unless ``allow_low_precision_reference``.
    """
    directory, label = None, "the reference"
    if isinstance(reference, (str, Path)):
        directory, reference, label = Path(reference), load_reference(reference), f"the reference {reference}"
    try:
        caveat = check_reference_precision(reference, allow_low_precision_reference)
    except ValueError as e:
        raise BlameError(str(e)) from None
    if isinstance(target, nn.Module):
        target = BlameRunner(target, components=components, dtype=dtype, compile=compile)
    result = _blame(target, reference, directory, label, clean=clean, tolerances=tolerances, prompts=prompts,
                    budget=budget, probes=probes, progress=progress, floor=floor)
    if caveat:
        result.verdict = f"{caveat}. {result.verdict}"
    return result


def _blame(engine, reference, directory, label, *, clean, tolerances, prompts, budget, probes, progress,
           floor) -> BlameResult:
    """:func:`blame` past its reference's checks: an engine that replaces what it holds (its
    ``components``), or the embedded one, which also captures from ``clean`` and measures there."""
    if isinstance(engine, BlameRunner):
        return _blame_in_process(engine, reference, directory, label, clean=clean, tolerances=tolerances,
                                 prompts=prompts, budget=budget, probes=probes, progress=progress, floor=floor)
    check_engine(engine, "blame's target (when not an nn.Module)")
    check_inputs(reference, architecture=None, vocab_size=engine.vocab_size, what="the target engine", prompts=prompts,
                 label=label)
    engine_dtype = None if engine.dtype is None else dtype_name(engine.dtype)
    return search(engine, reference, engine.components, tolerances=tolerances, prompts=prompts, budget=budget,
                  probes=probes, progress=progress, dtype=engine_dtype,
                  floor=floor if floor is not None else stored_floors(reference, directory).get(engine_dtype or ""),
                  covers=engine.covers(engine.components))


def _blame_in_process(engine: BlameRunner, reference, directory, label, *, clean, tolerances, prompts, budget,
                      probes, progress, floor) -> BlameResult:
    """:func:`blame` through the embedded engine: components the reference lacks captured from
    ``clean`` as the search needs them, the floor measured from it, each component's part of it too."""
    indices = check_inputs(reference, architecture=engine.architecture, vocab_size=engine.vocab_size,
                           what=f"the target ({type(engine.target).__name__})", prompts=prompts, label=label)
    if isinstance(clean, nn.Module):  # a function loading it: its caller checks it
        check_inputs(reference, architecture=architecture(clean.config, type(clean).__name__),
                     vocab_size=clean.config.vocab_size, what=f"the clean model ({type(clean).__name__})",
                     prompts=prompts, label=label)
    try:
        comps = engine.resolve(reference, clean)
    except ComponentError as e:
        raise BlameError(str(e)) from None
    covers = engine.covers(comps)  # (before instrumenting)
    on_demand = None
    if clean is not None:
        on_demand = OnDemand(clean, reference, comps, directory, progress=progress)
    else:
        refuse_missing(reference, comps, model_hint="CLEAN_MODEL")
    dtype = engine.torch_dtype
    try:
        engine.open(on_demand.store() if on_demand else reference.store, reference, indices, probes)
        before_search = on_demand.seconds if on_demand else 0.0  # capture_seconds counts the search's part

        def supply(names):
            if on_demand.ensure(names):
                engine.use_store(on_demand.store())

        name = dtype_name(dtype)
        floor, floor_seconds = ((floor, 0.0) if floor is not None else
                                floor_for(reference, dtype, directory, indices, clean, compile=engine.compile))
        drift_of = None
        if clean is not None and floor is not None:
            def drift_of(names):
                return precision_drift(clean, on_demand.store(), reference, dtype, comps, names, indices, probes,
                                       loaded_in_dtype=engine.same)
        result = search(engine, reference, comps, tolerances=tolerances, prompts=indices, budget=budget, probes=probes,
                        progress=progress, supply=supply if on_demand else None, observe=engine.observe, floor=floor,
                        dtype=name, batch_rows=engine.batch_rows, drift_of=drift_of, layer_types=engine.layer_types,
                        covers=covers)
    finally:
        engine.close()
    result.floor_seconds = floor_seconds
    result.seconds += floor_seconds
    result.program = {"engine": "embedded", "compile": bool(engine.compile), "dtype": name}
    if on_demand:
        result.captured, result.capture_seconds = list(on_demand.captured), on_demand.seconds - before_search
    return result


def precision_drift(clean, store, reference, dtype: torch.dtype, components: Sequence[Component], names: Sequence[str],
                    prompts: Sequence[int], probes: int = PROBES, loaded_in_dtype: bool = False) -> dict[str, float]:
    """The part of the noise floor each component of ``names`` removes when replaced in the clean model
    run in ``dtype`` (``clean``: it, or a function loading it): the precision drift arising there, which a
    target's replacement of it removes too, fault or none. ``loaded_in_dtype``: the target was loaded in
    ``dtype`` (the CLI's), and the clean model is built as loading builds it, not cast: the same program."""

    # the caller's model is copied (it is instrumented here); one loaded for this is used itself
    model = copy.deepcopy(clean) if isinstance(clean, nn.Module) else clean()
    model = _as_loaded(model, dtype) if loaded_in_dtype else model.to(dtype)
    wanted = set(names)
    chosen = [c for c in components if c.capture_name in wanted]
    instrument(model, [c.target for c in chosen])
    engine = blame_runner(model, model.config, store, reference, prompts, chosen, probes=probes)
    floor = Search(engine, reference, chosen, tolerances=Tolerances(), prompts=prompts, budget=len(chosen) + 1,
                   probes=probes, progress=False, supply=None, observe=None)
    (_, floor.off_summary), *_ = floor.measure([()] + [[c.capture_name] for c in chosen])
    return {c.capture_name: floor.E([c.capture_name]) for c in chosen}


def _as_loaded(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with what a checkpoint holds (parameters, persistent buffers) in ``dtype`` and the buffers
    it computes (rotary frequencies) kept as they are: what loading it in ``dtype`` builds, where ``.to()``
    would round those too."""
    held = set(model.state_dict())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name in held and tensor.is_floating_point():
            tensor.data = tensor.data.to(dtype)
    return model
