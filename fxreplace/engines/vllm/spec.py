"""The vLLM engine's registration (``--engine vllm``): a vLLM engine started on the checkpoint
directory with the fxreplace plugin configured from the reference, or capturing one."""

from __future__ import annotations

from pathlib import Path

from ...config import ReplacementConfig
from ...capture import checked_prompts
from ...loading import (SetupError, check_checkpoint_dir, check_checkpoint_matches, check_vocab, config_json,
                        longest_sequence, recorded_model)
from ...models import architecture, get_family
from ...store import describe_store
from ..registry import CaptureRun, CaptureSpec, Captured, EngineRun, EngineSpec, Opened, register_engine
from . import capture as vllm_capture
from .preflight import check_engine_start, with_kv_cache
from .sites import MODEL_CODE

#: the most requests a capture runs at once (its KV cache is sized for them)
CAPTURE_SEQS = 64


def open_validation(run: EngineRun) -> Opened:
    """A vLLM engine replacing the reference's targets (or ``run.targets``) in requests that ask for it."""
    from .engine import VllmEngine  # vLLM's engine loads when one opens

    check_checkpoint_dir(run.model, ENGINE.name)
    if run.logprobs == 0 or run.logprobs < -1:
        raise SetupError(f"--logprobs must be -1 (whole vocabulary) or a positive count, got {run.logprobs}")
    reference = run.reference
    check_checkpoint_matches(reference, run.reference_dir, run.model)
    replacement = ReplacementConfig(targets=run.targets, tensors_path=run.reference_dir)
    replaced = run.targets or list(vllm_targets(run.model))
    engine = VllmEngine(run.model, replacement, dtype=run.dtype, logprobs=run.logprobs, interrupted=run.interrupted,
                        enforce_eager=not ENGINE.compiled(run), **_llm_options(run, max_num_seqs=min(8, reference.num_prompts)))
    opened = Opened(engine, "", config_json(run.model).get("num_experts_per_tok"), replaced)
    try:
        check_vocab(reference, run.model, engine.vocab_size)
    except SetupError:
        opened.close()
        raise
    return opened


def vllm_targets(model_dir: str) -> tuple:
    """What the plugin's workers instrument when no targets are given: the family's targets in vLLM's
    model code (a reference may hold more captures, e.g. blame's components, which it leaves alone)."""
    arch = architecture(config_json(model_dir), "?")
    try:
        targets = get_family(arch).targets_for(MODEL_CODE)
    except KeyError as e:
        raise SetupError(e.args[0], "give --target patterns of vLLM's model code") from None
    if not targets:
        raise SetupError(f"the {arch} family declares no targets in vLLM's model code",
                         "give --target patterns of vLLM's model code")
    return targets


def open_blame(run: EngineRun) -> Opened:
    """A vLLM engine that replaces the components the reference recorded, selected per request."""
    from .engine import VllmBlameEngine  # vLLM's engine loads when one opens

    check_checkpoint_dir(run.model, ENGINE.name)
    check_checkpoint_matches(run.reference, run.reference_dir, run.model)
    options = _llm_options(run, max_num_seqs=min(64, run.reference.num_prompts * 5))
    return Opened(VllmBlameEngine(run.model, run.reference_dir, dtype=run.dtype, logprobs=-1,
                                  interrupted=run.interrupted, enforce_eager=not ENGINE.compiled(run), **options))


def _llm_options(run: EngineRun, max_num_seqs: int) -> dict:
    """``vllm.LLM``'s keyword arguments for ``run`` beside the compile switch: room for the longest
    reference sequence and a retry's few more tokens, ``max_num_seqs`` requests; ``--engine-args`` last."""
    max_model_len = max(longest_sequence(run.reference) + 8, 128)
    options = {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs, **run.options}
    return with_kv_cache(run.model, options, options["max_num_seqs"] * options["max_model_len"], run.dtype)


def capture(run: CaptureRun) -> Captured:
    """A vLLM engine in capture mode (:mod:`fxreplace.engines.vllm.capture`) generating greedily,
    with room for the longest prompt and its tokens unless ``--engine-args`` sizes it."""
    prompts = _checked_prompts(run)
    options = {"max_model_len": max(max(len(p) for p in prompts) + run.max_new_tokens, 128),
               "max_num_seqs": min(len(prompts), CAPTURE_SEQS), **run.options}
    options = with_kv_cache(run.model, options, options["max_num_seqs"] * options["max_model_len"], run.dtype)
    counts = vllm_capture.capture_with_vllm(recorded_model(run.model), prompts, run.out,
                                            max_new_tokens=run.max_new_tokens, targets=run.targets, dtype=run.dtype,
                                            enforce_eager=run.compile is False, interrupted=run.interrupted,
                                            **options)
    completed = counts.get("completed", 0)
    captured = Captured(f"captured {completed} prompts x {run.max_new_tokens} tokens with vLLM "
                        f"({counts.get('dropped', 0)} dropped)")
    if completed != len(prompts):
        captured.error = f"the engine completed {completed} of {len(prompts)} prompts; {stores_state(run.out)}"
    return captured


def _checked_prompts(run: CaptureRun) -> list:
    """The prompts as token id lists, checked against the checkpoint's vocabulary before vLLM starts."""
    check_checkpoint_dir(run.model, ENGINE.name)
    return checked_prompts(run.prompts, config_json(run.model)["vocab_size"], run.prompts_source)


def stores_state(out) -> str:
    """What a vLLM capture left in ``out``: one store, or (pipeline parallel) one per stage."""
    stages = vllm_capture.stage_dirs(out)
    if not stages:
        return f"--out {Path(out).resolve()} holds {describe_store(out)}"
    merged = Path(out) / vllm_capture.MERGED_DIR
    return (f"--out {Path(out).resolve()} holds the stages' stores "
            f"({', '.join(f'{p.name}: {describe_store(p)}' for p in stages)}) and {merged.name}: {describe_store(merged)}")


def _left(out) -> str:
    return f"{stores_state(out)}; the requests in flight were not written: capture again into a new --out for every prompt"


ENGINE = register_engine(EngineSpec(
    name="vllm",
    summary="a vLLM engine with the fxreplace plugin (MODEL: a checkpoint directory; options: --engine-args, "
            "vllm.LLM's keyword arguments)",
    open_validation=open_validation,
    open_blame=open_blame,
    compiles=True,
    takes=frozenset({"--logprobs", "--engine-args"}),
    check_options=check_engine_start,
    capture=CaptureSpec(capture, takes=frozenset({"--engine-args"}), check=_checked_prompts, left=_left),
))
