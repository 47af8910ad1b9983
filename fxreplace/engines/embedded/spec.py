"""The embedded engine's registration (``--engine embedded``): the target loaded in this process,
instrumented, and run by fxreplace's static-shape runner (for blame, a
:class:`~fxreplace.engines.embedded.blame_engine.BlameRunner` over it). It captures a reference
from the Hugging Face model's own eager forwards."""

from __future__ import annotations

from ...capture import capture_reference, checked_prompts
from ...components import ComponentError, family_components
from ...config import ReplacementConfig
from ...dtypes import as_dtype
from ...instrument import instrument
from ...loading import (SetupError, check_layer_count, check_reference_matches, check_vocab, default_targets,
                        load_model, longest_sequence)
from ...models import architecture
from ..registry import CaptureRun, CaptureSpec, Captured, EngineRun, EngineSpec, Opened, register_engine
from .blame_engine import BlameRunner
from .runner import Runner, RunnerConfig


#: the torch.compile backend a compiled target runs under (validate, blame; its noise floor's program)
BACKEND = "inductor"


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
        compile=BACKEND if compiled else None,
    )
    description = (f"target: {run.model} in {run.dtype}, {f'compiled ({BACKEND})' if compiled else 'eager'}, "
                   f"prefill bucket {bucket} tokens, decode batch {runner.cfg.batch_buckets[0]}; "
                   f"{reference.num_prompts} prompts")
    return Opened(runner, description, getattr(model.config, "num_experts_per_tok", None), targets)


def open_blame(run: EngineRun) -> Opened:
    """The target in ``run.dtype``, which :func:`fxreplace.blame` instruments at its components
    (``run.components``, else those the reference recorded, else the family's) and checks against
    the reference."""
    model = load_model(run.model, as_dtype(run.dtype), device=run.device)
    check_layer_count(run.reference, run.reference_dir, run.model, getattr(model.config, "num_hidden_layers", None))
    return Opened(BlameRunner(model, components=run.components, dtype=as_dtype(run.dtype),
                              compile=BACKEND if ENGINE.compiled(run) else None))


def capture(run: CaptureRun) -> Captured:
    """The model's own eager forwards in this process, in float32 (or placed by ``run.dispatch``):
    the family's targets (or ``run.targets``) and the blame components asked for (the command then
    measures the noise floor of ``run.noise_floor`` against what was captured)."""
    if run.compile and not run.noise_floor:
        raise SetupError("--compile: the runner captures the model's own eager forwards (the reference); --compile "
                         "says which program's noise floor --noise-floor measures beside the eager one",
                         "leave --compile out, give --noise-floor DTYPE with it, or capture with --engine vllm")
    model = load_model(run.model, dispatch=run.dispatch, device=run.device)
    prompts = checked_prompts(run.prompts, model.config.vocab_size, run.prompts_source)
    components = run.components
    targets = run.targets or _capture_targets(run, model)
    if run.family_components and not components:
        try:
            components = family_components(model)
        except ComponentError as e:
            raise SetupError(str(e).partition("; ")[0], "name them with --component KIND=PATTERN[@POINT] (repeatable; "
                             f"`fxreplace inspect {run.model}` lists the modules)") from None
    metadata = dict(run.metadata)
    if run.components:  # blame reuses them: --component need not be repeated there
        metadata["component_targets"] = {kind: {"pattern": t.pattern, "point": t.point}
                                         for kind, t in run.components.items()}
    reference = capture_reference(model, prompts, targets, run.max_new_tokens, components=components, out=run.out,
                                  metadata=metadata)
    return Captured(f"captured {reference.num_prompts} prompts x {run.max_new_tokens} tokens at "
                    f"{len(reference.store.capture_names)} targets")


def _capture_targets(run: CaptureRun, model) -> list:
    """The family's targets; for a family fxreplace does not register, none when components
    name what to capture, else an error naming --target."""
    try:
        return default_targets(model)
    except KeyError:
        if run.components:
            return []
        raise SetupError(f"{run.model} is a {architecture(model.config, type(model).__name__)}, a family fxreplace "
                         "does not register, so it knows no default targets",
                         f"name them with --target PATTERN (e.g. model.layers.*.mlp.gate; `fxreplace inspect "
                         f"{run.model}` lists the modules), or --component KIND=PATTERN[@POINT] for blame") from None


ENGINE = register_engine(EngineSpec(
    name="embedded",
    summary="the Hugging Face model in this process (capture: its own forwards; validate, blame: fxreplace's "
            "static-shape runner)",
    open_validation=open_validation,
    open_blame=open_blame,
    compiles=False,
    floor_compile=BACKEND,
    takes=frozenset({"--clean", "--component", "--bucket", "--device"}),
    capture=CaptureSpec(capture, takes=frozenset({"--component", "--components", "--noise-floor", "--device-map",
                                                  "--max-memory", "--offload-folder", "--device"}), replaces=True),
))
