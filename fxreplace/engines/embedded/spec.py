"""The embedded engine's registration (``--engine runner``): the target loaded in this process,
instrumented, and run by fxreplace's static-shape runner; blame instruments it itself."""

from __future__ import annotations

from ...config import ReplacementConfig
from ...dtypes import as_dtype
from ...instrument import instrument
from ...loading import (SetupError, check_layer_count, check_reference_matches, check_vocab, default_targets,
                        load_model, longest_sequence)
from ...models import architecture
from ..registry import EngineRun, EngineSpec, Opened, register_engine
from .runner import Runner, RunnerConfig


def open_validation(run: EngineRun) -> Opened:
    """The target in ``run.dtype`` with its targets instrumented, teacher-forced by one runner
    whose prefill bucket holds the longest reference sequence."""
    reference = run.reference
    model = load_model(run.model, as_dtype(run.dtype), device=run.device)
    check_reference_matches(reference, run.reference_dir, run.model, architecture(model.config, type(model).__name__))
    check_layer_count(reference, run.reference_dir, run.model, getattr(model.config, "num_hidden_layers", None))
    check_vocab(reference, run.model, model.config.vocab_size)
    replacement = ReplacementConfig(targets=run.targets, tensors=reference.store)
    targets = list(replacement.targets or default_targets(model))
    target = instrument(model, targets)
    missing = [t for t in (t.capture_name for t in target._fxreplace.targets) if t not in reference.store.columns]
    if missing:
        raise SetupError(f"the reference holds no captures for targets {missing}; it has {reference.store.capture_names}",
                         "give --target patterns the reference captured, or capture them (`fxreplace capture --target`)")
    longest = longest_sequence(reference)
    bucket = run.bucket or 1 << (longest - 1).bit_length()
    if bucket < longest:
        raise SetupError(f"--bucket {bucket} is shorter than the longest reference sequence ({longest} tokens)",
                         "leave --bucket out to fit it")
    compiled = ENGINE.compiled(run)
    runner = Runner(
        target,
        model.config,
        replacer=replacement,
        # teacher-forced: the decode steps read the reference's tokens, so a divergence costs no re-run
        runner_config=RunnerConfig(prefill_buckets=(bucket,), batch_buckets=(min(8, reference.num_prompts),),
                                   max_len=2 * bucket, teacher_forcing=True),
        dtype=as_dtype(run.dtype),
        observed=target,
        compile="inductor" if compiled else None,
    )
    description = (f"target: {run.model} in {run.dtype}, {'compiled (inductor)' if compiled else 'eager'}, "
                   f"prefill bucket {bucket} tokens, decode batch {runner.cfg.batch_buckets[0]}; "
                   f"{reference.num_prompts} prompts")
    return Opened(runner, description, getattr(model.config, "num_experts_per_tok", None), targets)


def open_blame(run: EngineRun) -> Opened:
    """The target itself, in ``run.dtype``: :func:`fxreplace.blame` instruments its components
    and checks it against the reference."""
    model = load_model(run.model, as_dtype(run.dtype), device=run.device)
    check_layer_count(run.reference, run.reference_dir, run.model, getattr(model.config, "num_hidden_layers", None))
    return Opened(model)


ENGINE = register_engine(EngineSpec(
    name="runner",
    summary="the Hugging Face model in this process (capture: its own forwards; validate, blame: fxreplace's "
            "static-shape runner)",
    open_validation=open_validation,
    open_blame=open_blame,
    compiles=False,
    takes=frozenset({"--clean", "--component", "--bucket"}),
))
