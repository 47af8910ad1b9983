"""The vLLM engine's registration (``--engine vllm``): a vLLM engine started on the checkpoint
directory with the fxreplace plugin configured from the reference."""

from __future__ import annotations

from ...config import ReplacementConfig
from ...loading import SetupError, check_checkpoint_dir, check_checkpoint_matches, check_vocab, config_json, longest_sequence
from ..registry import EngineRun, EngineSpec, Opened, register_engine
from .preflight import check_engine_start


def open_validation(run: EngineRun) -> Opened:
    """A vLLM engine replacing the reference's targets (or ``run.targets``) in requests that ask for it."""
    from .engine import VllmEngine  # vLLM's engine loads when one opens

    check_checkpoint_dir(run.model, ENGINE.name)
    if run.logprobs == 0 or run.logprobs < -1:
        raise SetupError(f"--logprobs must be -1 (whole vocabulary) or a positive count, got {run.logprobs}")
    reference = run.reference
    check_checkpoint_matches(reference, run.reference_dir, run.model)
    replacement = ReplacementConfig(targets=run.targets, tensors_path=run.reference_dir)
    engine = VllmEngine(run.model, replacement, dtype=run.dtype, logprobs=run.logprobs,
                        enforce_eager=not ENGINE.compiled(run), **_llm_options(run, max_num_seqs=min(8, reference.num_prompts)))
    opened = Opened(engine, "", config_json(run.model).get("num_experts_per_tok"),
                    run.targets or reference.metadata.get("targets") or [])
    try:
        check_vocab(reference, run.model, engine.vocab_size)
    except SetupError:
        opened.close()
        raise
    return opened


def open_blame(run: EngineRun) -> Opened:
    """A vLLM engine that replaces the components the reference recorded, selected per request."""
    from .engine import VllmBlameEngine  # vLLM's engine loads when one opens

    check_checkpoint_dir(run.model, ENGINE.name)
    check_checkpoint_matches(run.reference, run.reference_dir, run.model)
    options = _llm_options(run, max_num_seqs=min(64, run.reference.num_prompts * 5))
    return Opened(VllmBlameEngine(run.model, run.reference_dir, dtype=run.dtype, logprobs=-1,
                                  enforce_eager=not ENGINE.compiled(run), **options))


def _llm_options(run: EngineRun, max_num_seqs: int) -> dict:
    """``vllm.LLM``'s keyword arguments for ``run`` beside the compile switch: room for the longest
    reference sequence and a retry's few more tokens, ``max_num_seqs`` requests; ``--engine-args`` last."""
    return {"max_model_len": max(longest_sequence(run.reference) + 8, 128), "max_num_seqs": max_num_seqs,
            **run.options}


ENGINE = register_engine(EngineSpec(
    name="vllm",
    summary="a vLLM engine with the fxreplace plugin (MODEL: a checkpoint directory; options: --engine-args, "
            "vllm.LLM's keyword arguments)",
    open_validation=open_validation,
    open_blame=open_blame,
    compiles=True,
    takes=frozenset({"--logprobs", "--engine-args"}),
    check_options=check_engine_start,
))
