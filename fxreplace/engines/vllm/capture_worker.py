"""vLLM capture's worker side (:mod:`fxreplace.engines.vllm.capture` describes the mode): the state
:class:`VllmCapture` one model runner keeps (instrumented model, observation buffer, the requests in flight,
the writer), and the worker method that closes its store."""

from __future__ import annotations

import itertools
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from ...config import ConfigError
from ...dtypes import dtype_name
from ...gather import host_bits
from ...instrument import observe
from ...reference import Reference
from ...store import StoreWriter
from ...store.publish import CAPTURE_STATS_FILE
from ...targets import TargetError
from . import internals
from ..protocol import StepHooks
from ..recording import ObservationBuffer, RequestRows, observe_targets, runner_targets
from .capture import ASYNC_HINT, DATA_PARALLEL_KEY, PREFIX_CACHE_HINT, STAGE_DIR

logger = logging.getLogger("fxreplace.vllm")

SHARD_BYTES = 32 << 20  # rows and logits of finished requests held before they go to disk as one shard
FIRST_LOGIT_ROWS = 1024  # a request's first logits allocation holds at most this many (its max_tokens may be the
                          # model length; a longer generation grows it)
STATS_FILE = CAPTURE_STATS_FILE


class VllmCapture:
    """Capture state of one model runner: instrumented model, observation buffer,
    the requests in flight and the writer."""

    def __init__(self, side, capture: dict):
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank  # in a vLLM worker only

        runner = side.runner
        self.side, self.runner, self.model = side, runner, side.model
        _refuse_skipped_tokens(runner)
        pp = get_pp_group()
        self.stage = pp.rank_in_group if pp.world_size > 1 else None  # None: no pipeline
        self.samples = pp.is_last_rank  # computes logits and samples: knows when a request is complete
        self.out = _store_dir(runner, capture, self.stage)
        self.writes = get_tensor_model_parallel_rank() == 0
        self.max_tokens = int(side.max_tokens)
        self.max_model_len = int(runner.model_config.max_model_len)
        self.vocab = runner.model_config.get_vocab_size()
        self.arch, targets = runner_targets(side, capture.get("targets") or None, who="fxreplace capture",
                                            give="capture 'targets'")
        targets, elsewhere = side.split_by_stage(targets)
        if not targets:  # every stage writes a store of its own layers, joined by merge_stages
            raise TargetError(f"fxreplace capture: pipeline stage {self.stage} holds none of the targets "
                              f"{[t if isinstance(t, str) else t.pattern for t in elsewhere][:4]}; give every stage "
                              "one (e.g. a pattern such as 'model.layers.*.mlp.gate')")
        self.names = [r.capture_name for r in observe_targets(self.model, targets, self.max_tokens)]
        self.dtype = next(self.model.parameters()).dtype
        probed = _probe_widths(side, self.model, self.max_tokens)
        device = next(self.model.parameters()).device
        # each target fills its columns in place (inside the compiled graph); each step's rows go to the host once
        self.observation = ObservationBuffer(self.model, self.names, [probed[name] for name in self.names],
                                             self.max_tokens, self.dtype, device)
        self.columns, self.width, self.buffer = self.observation.columns, self.observation.width, self.observation.buffer
        self.host_buffer = self.buffer if device.type == "cpu" else torch.zeros_like(self.buffer, device="cpu")
        self.buffer_bits = host_bits(self.host_buffer)  # the same memory as numpy (any dtype, bf16 included)
        self.spec_tokens = int(getattr(runner, "num_spec_tokens", 0) or 0)
        self.check_stop = internals.check_stop()
        self.active: dict[str, RequestRows] = {}
        self.arrivals = 0  # requests registered so far
        self.step = None  # this step's (records, token ends, positions), from the forward to the logits
        self.completed = 0
        self.closed = False  # finish_capture() closed the store
        self.dropped = 0
        self.preemptions = 0  # of captured requests (their positions are recomputed in place)
        self.drafts_accepted = 0  # speculative tokens accepted beyond one per step
        if self.writes:  # refuses a non-empty out at engine start, before any request runs
            self.writer = StoreWriter(self.out, shard_bytes=SHARD_BYTES, metadata=self._metadata())
        logger.info("fxreplace: capturing %d target(s) of %s (%s ...) into %s%s", len(self.names), self.arch,
                    self.names[0] if self.names else "-", self.out, "" if self.writes else " (written by TP rank 0)")

    def _metadata(self) -> dict:
        """The store's metadata: the model vLLM serves and what is captured of it."""
        config = self.runner.model_config
        return {"source_model": str(config.model), "architecture": self.arch, "engine": "vllm",
                "model_type": getattr(config.hf_config, "model_type", ""), "vocab_size": self.vocab,
                "num_hidden_layers": getattr(config.hf_config, "num_hidden_layers", None),
                "dtype": dtype_name(self.dtype), "targets": self.names}

    # ------------------------------------------------------------ per step

    def hooks(self) -> StepHooks:
        """Per-step hooks on one capturing runner instance."""
        return StepHooks(begin_step=self.begin_step, after_forward=self.after_forward, end_step=self.end_step,
                         after_sample=self.after_sample)

    def begin_step(self, scheduler_output) -> None:
        """Drop requests the scheduler finished before they completed (a stage before the
        last: write them); register new ones."""
        if not self.writes:
            return
        self.step = None  # not rows a step left behind when its execute_model raised after the forward
        finished = [r for r in scheduler_output.finished_req_ids if r in self.active]
        if not self.samples:  # a stage before the last: finished means its rows are all computed
            for req_id in finished:
                self._complete(req_id, self.active[req_id])
            if finished and not self.active:
                self.sync()
            finished = []
        dropped = [r for r in finished if self.active.pop(r, None) is not None]
        for req_id in dropped:
            self.dropped += 1
            logger.warning("fxreplace: request %s ended before its stop condition (aborted, or a stop string, "
                           "which only the front end sees): not captured (%d dropped so far)", req_id, self.dropped)
        if dropped and not self.active:
            self.sync()
        self.preemptions += sum(r in self.active for r in scheduler_output.preempted_req_ids or ())
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self.active:  # resumed after preemption: positions are recomputed in place
                continue
            if new.prompt_token_ids is None or new.sampling_params is None:
                logger.warning("fxreplace: request %s has no prompt token ids (embeddings or pooling): not captured",
                               new.req_id)
                continue
            if new.num_computed_tokens:
                self.dropped += 1
                logger.warning("fxreplace: request %s arrived with %d tokens already computed (%s): not captured",
                               new.req_id, new.num_computed_tokens, PREFIX_CACHE_HINT)
                continue
            prompt = list(new.prompt_token_ids)
            capacity = len(prompt) + int(new.sampling_params.max_tokens) + self.spec_tokens
            logit_rows = min(int(new.sampling_params.max_tokens) + self.spec_tokens, FIRST_LOGIT_ROWS)
            self.active[new.req_id] = RequestRows(prompt, new.sampling_params, self.width,
                                                   min(capacity, self.max_model_len + self.spec_tokens),
                                                   self.buffer_bits.dtype, self.arrivals, logit_rows)
            self.arrivals += 1

    def after_forward(self, scheduler_output, positions: torch.Tensor) -> None:
        """Note whose rows this forward observed, at which positions (:meth:`after_execute`
        copies them, with the logits)."""
        if not self.writes or not self.active:
            return
        layout = self.side.layout(scheduler_output, positions)  # vLLM pads only after the last request
        ends = list(itertools.accumulate(layout.counts))
        total = ends[-1] if ends else 0
        if self.host_buffer is not self.buffer:
            self.host_buffer[:total].copy_(self.buffer[:total])
        self.step = (list(map(self.active.get, layout.req_ids)), ends, layout.positions[:total].tolist())

    def end_step(self, output) -> None:
        """After ``execute_model``: keep the step's rows and the raw logits of every sampled row
        (before the sampler may modify them in place); a step that sampled nothing returns its
        output here."""
        self.after_execute()
        if output is not None:
            self.after_sample(output)

    def after_execute(self) -> None:
        step, self.step = self.step, None
        if step is None:
            return
        records, ends, pos = step
        rows = self.buffer_bits
        state = getattr(self.runner, internals.EXECUTE_MODEL_STATE, None)
        logits = None if state is None or state.logits is None else _host_float32(state.logits)
        spec = None if state is None else state.spec_decode_metadata
        if logits is not None and spec is None and len(pos) == len(records):
            # a decode step: each request one row and the logits sampled from it, in one call
            for record, position, row, sampled in zip(records, pos, rows, logits):
                if record is not None:
                    record.put_token(position, row, sampled)
            return
        start = 0
        for record, end in zip(records, ends):
            if record is not None and end > start:
                record.put_rows(pos[start], rows[start:end])
            start = end
        if logits is None:
            return
        if spec is None:  # one sampled row per request, at its last scheduled token
            for record, end, row in zip(records, ends, logits):
                if record is not None:
                    record.put_logits(pos[end - 1], row)
            return
        indices = spec.logits_indices.cpu().numpy()
        owners = np.searchsorted(ends, indices, side="right").tolist()
        for i, index, row in zip(owners, indices.tolist(), logits):
            record = records[i]
            if record is not None:
                record.put_logits(pos[index], row)

    def after_sample(self, output) -> None:
        """Append sampled tokens; write each request whose stop rule is met."""
        if not self.writes or not self.active or not getattr(output, "req_ids", None):
            return
        for req_id, tokens in zip(output.req_ids, output.sampled_token_ids):
            record = self.active.get(req_id)
            if record is None:
                continue
            if len(tokens) > 1:
                self.drafts_accepted += len(tokens) - 1
            for token in tokens:
                record.stop.output_token_ids.append(int(token))
                if self.check_stop(record.stop, self.max_model_len):
                    self._complete(req_id, record)
                    break
        if not self.active:
            self.sync()

    # ------------------------------------------------------------ writing

    def _complete(self, req_id: str, record: RequestRows) -> None:
        """Stream one request that met its stop rule to the store."""
        del self.active[req_id]
        if self.closed:
            self.dropped += 1
            logger.error("fxreplace: request %s completed after finish_capture() closed %s: not captured", req_id, self.out)
            return
        self._write(record)

    def _write(self, record: RequestRows) -> None:
        """One request's rows (the last stage: and its generation) to the store; they
        leave memory with the shard. Under pipeline parallelism the request's number
        is its prompt index, so the stages' stores join by it."""
        if self.samples:
            tokens = record.stop.output_token_ids
            length = len(record.prompt) + len(tokens) - 1  # the last token is never fed back
            extras = Reference.extras(tokens, torch.from_numpy(record.generated_logits(len(tokens))))
        else:
            length, extras = record.computed, None
        rows = torch.from_numpy(record.rows[:length]).view(self.dtype)
        captures = {name: rows[:, columns] for name, columns in self.columns.items()}
        self.writer.add(record.prompt, captures, extras=extras,
                        prompt_idx=None if self.stage is None else record.arrival)
        self.completed += 1

    def sync(self) -> None:
        """Make ``out`` a complete store of every request written so far (the engine
        is idle: nothing in flight); the counts go to ``capture.json`` beside it."""
        if self.completed:
            self.writer.sync()
        self._write_counts()
        logger.info("fxreplace: %d captured request(s) in %s (%d dropped)", self.completed, self.out, self.dropped)

    def _write_counts(self) -> None:
        """``capture.json``, rewritten in place: a file emptied and rewritten (``write_text``) is
        flushed to disk when closed (ext4's and XFS's guard for truncate-and-rewrite): a synchronous
        disk write at every idle of the engine. As before, a reader may see it half written."""
        data = (json.dumps(self.counts()) + "\n").encode()
        fd = os.open(self.out / STATS_FILE, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)

    def close(self) -> None:
        """Write the last shard and the index (:func:`finish_capture`); no request may follow.
        A pipeline stage before the last writes every request it still holds: the engine is
        idle, so their rows are complete (one the last stage did not complete is left out
        when the stages are merged)."""
        if self.writes and not self.closed:
            if not self.samples:
                for record in self.active.values():
                    self._write(record)
                self.active.clear()
            self.sync()
            if self.completed:
                self.writer.close()
            self.closed = True

    def held_bytes(self) -> dict:
        """What capture holds in memory now, in bytes: the in-flight requests' logits
        and rows, the observation buffer and the shard not yet written (safe to call
        from another thread: it only reads)."""
        records = list(self.active.values())
        return {"in_flight_logits": sum(r.generated * r.logits.shape[1] * r.logits.itemsize
                                        for r in records if r.logits is not None),
                "in_flight_rows": sum(r.rows.nbytes for r in records),
                "observation_buffer": self.buffer.numel() * self.buffer.element_size(),
                "unwritten_shard": self.writer.pending_bytes if self.writes else 0}

    def counts(self) -> dict:
        return {"completed": self.completed, "dropped": self.dropped, "in_flight": len(self.active),
                "preemptions": self.preemptions, "drafts_accepted": self.drafts_accepted}

    def summary(self) -> dict:
        """What this runner captured so far (``fxreplace_worker_state``; JSON-able)."""
        return {"names": self.names, "out": str(self.out), "writes": self.writes, **self.counts()}


def _refuse_skipped_tokens(runner) -> None:
    """Refuse what would leave tokens' rows uncomputed or unread: prefix caching, async scheduling (the front
    end turned both off unless asked for them; this is the worker's own check)."""
    if runner.cache_config.enable_prefix_caching:
        raise ConfigError(f"fxreplace capture with prefix caching on: {PREFIX_CACHE_HINT}")
    if runner.use_async_scheduling:
        raise ConfigError(f"fxreplace capture with async scheduling on: {ASYNC_HINT}")


def _store_dir(runner, capture: dict, stage: int | None) -> Path:
    """Where this runner writes its store: ``out``, per data-parallel engine ``dp<rank>`` below it and per
    pipeline stage ``pp<stage>``."""
    out = Path(capture["out"])
    parallel = runner.vllm_config.parallel_config
    if max(capture.get(DATA_PARALLEL_KEY, 1), parallel.data_parallel_size) > 1:
        out = out / f"dp{internals.data_parallel_rank(runner)}"  # each engine its own store
    if stage is not None:
        out = out / STAGE_DIR.format(stage)  # each stage its own layers
    return out


def _host_float32(t: torch.Tensor) -> np.ndarray:
    """``t`` as float32 numpy on the host; a view when it is one already (this runs every
    step, and a conversion that returns its tensor unchanged is still a torch call)."""
    if t.dtype != torch.float32:
        t = t.float()
    return t.numpy() if t.is_cpu else t.cpu().numpy()


def _probe_widths(side, model, max_tokens: int) -> dict[str, int]:
    """Each target's feature width, seen in one eager dummy forward before the engine
    serves (so any module works, and a target the forward misses fails the start-up)."""
    widths = {}

    def record(name: str, computed) -> None:
        if not isinstance(computed, torch.Tensor):
            raise TargetError(f"{name}: its point computes a {type(computed).__name__}, not one tensor")
        widths[name] = int(computed.shape[-1])

    with observe(model, record):
        side.off_forward(min(8, max_tokens))
    return widths


def _writing_capture(worker):
    state = internals.get_state(worker.model_runner)
    return state if getattr(state, "writes", False) else None  # a capture state (any runner's) that writes


def finish_capture(worker) -> dict | None:
    """``llm.collective_rpc("fxreplace_finish_capture")`` (the plugin's worker method): close
    the store (last shard, index) and return the counts. Until then the store is complete
    whenever the engine idles."""
    state = _writing_capture(worker)
    if state is None:
        return None
    state.close()
    return state.counts()
