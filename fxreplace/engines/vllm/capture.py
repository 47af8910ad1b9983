"""Reference capture from a running vLLM engine.

``additional_config={"fxreplace": {"capture": {"out": DIR, "targets": [...]}}}``
instruments vLLM's model at the same injection points replacement uses and
*observes* them (:func:`fxreplace.instrument.observe`): each target writes what it
computed into one static buffer (filled in place, so compiled graphs keep working).
After every forward the rows are mapped back to (request, position) from the
scheduler's batch, the inverse of ``TensorReplacer.build``, and
stored per request *by position*. Storing by position makes the awkward cases
simple:

* chunked prefill: chunks land at their positions, in order;
* preemption and recomputation: recomputed rows overwrite the old ones;
* speculative decoding: rows of rejected drafts sit past the accepted tokens and
  are overwritten by the next step or cut off when the request completes.

A request is complete when its sampled tokens meet vLLM's own stop rule
(``check_stop``: EOS, stop token ids, ``max_tokens``, model length); its prompt
ids, generated tokens, raw logits (``generated.logits``, as HF capture stores
them) and the rows of positions ``0 .. prompt + generated - 2`` are then written in
the reference format (:class:`fxreplace.reference.Reference`). A request the
scheduler finishes before that (an abort, or a stop string, which only the front
end sees) is dropped and counted.

Prefix caching would skip the cached tokens' forwards, so their rows would be
missing: capture refuses it. Only tensor-parallel rank 0 records and writes
(every rank computes the same replicated router logits).

Pipeline parallelism: each stage observes the targets of its own layers and writes
its own store, ``out/pp<rank>``; only the last stage computes logits and samples, so
it alone knows when a request meets its stop rule and writes the generated tokens
and logits. A stage before it writes a request's rows when the scheduler reports the
request finished (with the next step it schedules) or when :func:`finish_capture`
closes the store. Every stage numbers requests in the order the scheduler hands
them out (the same on every stage), and :func:`merge_stages` joins the stages'
stores into one by that number, checking that prompts and row counts agree; a
request a stage holds but the last stage did not complete (an abort) is left out.

This module is the front end's (the engine's arguments, the offline driver, joining the stages);
:mod:`fxreplace.engines.vllm.capture_worker` is what a worker keeps and writes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...config import ConfigError
from ...store import ReferenceStore, StoreError, StoreWriter
from . import internals, shm
from .startup import engine_start

PREFIX_CACHE_HINT = ("capture needs every prompt token computed: turn prefix caching off with "
                     "enable_prefix_caching=False (LLM/EngineArgs) or --no-enable-prefix-caching (server)")
ASYNC_HINT = "capture reads each step's sampled tokens: turn async scheduling off (async_scheduling=False / --no-async-scheduling)"
PP_SPECULATIVE_HINT = ("capture under pipeline parallelism cannot tell a stage before the last which speculative "
                       "tokens were accepted: drop speculative_config, or capture with tensor parallelism")
STAGE_DIR = "pp{}"
MERGED_DIR = "merged"  # capture_with_vllm's join of the stage stores, beside them
DATA_PARALLEL_KEY = "_data_parallel_size"  # set by the front end (prepare_engine_args), not by users


def prepare_engine_args(engine_args, capture: dict) -> None:
    """Front end: capture turns prefix caching and async scheduling off unless the
    user asked for them, in which case it refuses with how to turn them off; with
    data parallelism it tells the engines so (``capture`` travels to them): vLLM
    resets the data-parallel size of a dense model's replicas to 1, so an engine
    could not tell it has siblings writing beside it. An ``out`` that is not empty here is
    refused before any engine process starts (its writer would refuse it at load time)."""
    out = Path(capture["out"])
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        held = "a file" if not out.is_dir() else f"not empty ({sorted(p.name for p in out.iterdir())[:3]})"
        raise ConfigError(f"fxreplace capture out {str(out)!r} is {held}: a capture writes a new store; "
                          "give a new or empty directory")
    if engine_args.data_parallel_size > 1:
        capture[DATA_PARALLEL_KEY] = int(engine_args.data_parallel_size)
    if engine_args.pipeline_parallel_size > 1 and engine_args.speculative_config:
        raise ConfigError(f"fxreplace capture with pipeline_parallel_size={engine_args.pipeline_parallel_size} "
                          f"and speculative_config: {PP_SPECULATIVE_HINT}")
    if engine_args.enable_prefix_caching:
        raise ConfigError(f"fxreplace capture with prefix caching on: {PREFIX_CACHE_HINT}")
    if getattr(engine_args, "async_scheduling", None):
        raise ConfigError(f"fxreplace capture with async scheduling on: {ASYNC_HINT}")
    engine_args.enable_prefix_caching = False
    if hasattr(engine_args, "async_scheduling"):
        engine_args.async_scheduling = False


def merge_stages(stages, out) -> Path:
    """Join the stores of a pipeline's stages (``[out/pp0, out/pp1, ...]``, in stage
    order) into one store at ``out``: every request the last stage completed, with
    every stage's captures and the last stage's generation. The stages number
    requests alike; a stage whose prompt or row count for a request differs from the
    last stage's, or that lacks the request, is an error naming both."""
    paths = [Path(p) for p in stages]
    if not paths:
        raise ValueError("merge_stages needs at least one stage store")
    loaded = [ReferenceStore.load(p) for p in paths]
    names = [n for store in loaded for n in store.capture_names]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise StoreError(f"captures {twice[:4]} are in more than one of {[str(p) for p in paths]}: not stages of one pipeline")
    last, last_path = loaded[-1], paths[-1]
    with StoreWriter(out, metadata=dict(last.metadata, targets=names)) as writer:
        for p in sorted(last.prompt_ids):
            prompt = last.prompt_token_ids[last.internal_index(p)]
            length = int(last.lengths[last.internal_index(p)])
            captures = {}
            for path, store in zip(paths, loaded):
                if p not in store.prompt_ids:
                    raise StoreError(f"{path} holds no request {p}, which {last_path} completed")
                i = store.internal_index(p)
                if store.prompt_token_ids[i] != prompt or int(store.lengths[i]) != length:
                    raise StoreError(f"request {p}: {path} holds {len(store.prompt_token_ids[i])} prompt tokens and "
                                     f"{int(store.lengths[i])} rows, {last_path} {len(prompt)} and {length}: "
                                     "not stages of one capture")
                captures.update({n: store.rows(p, n) for n in store.capture_names})
            writer.add(prompt, captures, extras={e: last.extra(e, p) for e in last.extra_names})
    return Path(out)


def stage_dirs(out) -> list[Path]:
    """The stage stores a pipeline-parallel capture wrote under ``out``, in stage order (empty: none)."""
    found = {int(p.name[2:]): p for p in Path(out).glob(STAGE_DIR.format("*")) if p.name[2:].isdigit()}
    return [found[k] for k in sorted(found)]


def capture_with_vllm(model: str, prompt_token_ids, out, *, max_new_tokens: int, targets=None,
                      dtype: str = "float32", interrupted=None, **llm_kwargs) -> dict:
    """Greedy-generate ``max_new_tokens`` per prompt with a vLLM engine in capture
    mode and write the reference to ``out``; returns the writing worker's counts
    (``completed``, ``dropped``, ``in_flight``, ``preemptions``, ``drafts_accepted``; the last
    pipeline stage's). ``interrupted``: what a Ctrl-C during the start says last. ``llm_kwargs`` go to
    ``vllm.LLM`` (``enforce_eager``, ``tensor_parallel_size``, ``pipeline_parallel_size``,
    ``speculative_config``, ...).
    Under pipeline parallelism the stages write ``out/pp<rank>`` and their join goes to
    ``out/merged`` (:func:`merge_stages`)."""
    from vllm import LLM, SamplingParams  # vLLM loads when an engine starts, not with fxreplace

    capture: dict[str, Any] = {"out": os.fspath(out)}
    if targets:
        capture["targets"] = list(targets)
    llm_kwargs.setdefault("seed", 0)
    cleanup = shm.Cleanup()
    try:
        with engine_start(interrupted):
            llm = LLM(model=model, dtype=dtype, additional_config={"fxreplace": {"capture": capture}}, **llm_kwargs)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
            llm.generate([{"prompt_token_ids": list(p)} for p in prompt_token_ids], params)  # its progress bar
            counts = [c for c in llm.collective_rpc(internals.FINISH_CAPTURE_METHOD) if c is not None]
        finally:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
    finally:
        cleanup.after_teardown()
    stages = stage_dirs(out)
    if stages:
        merge_stages(stages, Path(out) / MERGED_DIR)
    return counts[-1] if counts else {}  # workers in rank order: the last stage's writer is last
