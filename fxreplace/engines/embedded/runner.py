"""A small static-shape generation engine, laid out the way compiled engines lay out batches.

Why it exists: the context builder must be exercised with the layouts real
engines produce, not with hand-written positions. So this runner

- prefills one request at a time, padded to the smallest fitting prefill bucket (or, with
  ``batched_prefill``, every request of a wave in one ``[batch, bucket]`` forward, as
  static-batch engines do);
- decodes all running requests in one forward, padded to a batch bucket, with
  ``tokens_per_req = 1 + k`` slots per request when speculating ``k`` n-gram drafts;
- gives every request a fresh id, registers it with the replacer, and builds
  every forward's :class:`~fxreplace.ReplacementContext` from its own scheduler
  metadata (request ids, positions), passed to the model as ``replacements=``.

Shapes are static per bucket (a static KV cache of ``max_len`` per batch bucket, a
4-D attention mask instead of variable cache lengths), so a compiled model builds
one graph per bucket and never recompiles when replacement is switched on or off.

KV layout: requests of a decode wave share one write index ``W`` in the batch
cache (each request's prefill is copied right-aligned to ``W``); which cache
slots a row may attend to is tracked in ``valid`` and encoded in the mask, so
rejected speculative drafts simply stay masked.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

import torch
from transformers import StaticCache

from ...devices import input_device
from ...dtypes import as_dtype
from ...guards import guard_filter
from ...instrument import InstrumentedModel, observe
from ...unchanged import check_unchanged
from ...config import ReplacementConfig
from ...context import PerRequest
from ..protocol import Engine, Generation
from ...replacer import TensorReplacer


@dataclass
class RunnerConfig:
    prefill_buckets: Sequence[int] = (16, 32, 64, 128)
    batch_buckets: Sequence[int] = (1, 2, 4, 8)
    max_len: int = 256  # KV cache length per request
    speculative_tokens: int = 0  # n-gram drafts verified per decode step (k); tokens_per_req = 1 + k
    ngram: int = 2  # the proposer matches the last `ngram` tokens
    # prefill a wave's requests in one forward (rows padded to the decode batch bucket): a batch of
    # copies of the same prompts (blame's hypotheses side by side) then costs one prefill, not one each
    batched_prefill: bool = False
    # teacher forcing inside a wave: a validation hands each request the reference's tokens and the
    # decode steps read them instead of the request's own picks, so a divergence costs no re-run
    # (a new request and its prefill); every step's logits still come from the reference's prefix
    teacher_forcing: bool = False

    def __post_init__(self):
        """Checked when made: a bucket past ``max_len`` failed as a shape error at its first prefill."""
        for field_name in ("prefill_buckets", "batch_buckets"):
            buckets = getattr(self, field_name)
            if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
                raise ValueError(f"RunnerConfig.{field_name} must be positive ints, got {buckets!r}")
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len < 1:
            raise ValueError(f"RunnerConfig.max_len must be a positive int, got {self.max_len!r}")
        if max(self.prefill_buckets) > self.max_len:
            raise ValueError(f"RunnerConfig.prefill_buckets {tuple(self.prefill_buckets)} hold a bucket longer than "
                             f"max_len {self.max_len} (the KV cache's length); hint: raise max_len or drop the bucket")


def _selected(ctx, replace, tokens_per_req: int):
    """``ctx`` replaced at the names ``replace`` selects: for a :class:`~fxreplace.context.PerRequest`
    selection each request's own (request ``i`` owns slots ``i * tokens_per_req`` on; the rest is padding)."""
    if not isinstance(replace, PerRequest):
        return ctx.select(replace)
    rows = {}
    for name in set().union(*replace):
        owned = torch.tensor([name in s for s in replace]).repeat_interleave(tokens_per_req)
        rows[name] = torch.zeros(ctx.num_tokens, dtype=torch.bool)
        rows[name][: owned.shape[0]] = owned
    return ctx.select(rows)


def smallest_bucket(buckets: Sequence[int], n: int, what: str) -> int:
    fitting = [b for b in sorted(buckets) if b >= n]
    if not fitting:
        raise ValueError(f"{what} of {n} exceeds the largest bucket {max(buckets)} (buckets: {sorted(buckets)})")
    return fitting[0]


def _forced_reads(forced: Sequence[int], done: int, width: int) -> list[int]:
    """The ``width`` tokens a forced request reads after ``done`` steps (its last one repeated past the end)."""
    reads = list(forced[done - 1 : done - 1 + width])
    if not reads:
        raise ValueError(f"forced holds {len(forced)} tokens; a step after {done} needs token {done - 1}")
    return reads + [reads[-1]] * (width - len(reads))


def _step_mask(valid: torch.Tensor, write: int, width: int) -> torch.Tensor:
    """A decode step's ``[batch, 1, width, max_len]`` mask: the cache slots filled (``valid``) and, at the
    shared write index, the step's own ``width`` tokens causally."""
    step_mask = valid.clone()
    step_mask[:, write : write + width] = True
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask4d = step_mask[:, None, None, :].repeat(1, 1, width, 1)
    mask4d[:, 0, :, write : write + width] = causal
    return mask4d


def _attention_layout(config) -> tuple[int | None, object]:
    """The sliding window of a model with sliding-window layers (None without), and the config its
    caches are built from. Every cache layer holds ``max_len`` slots: the runner's slots are its own
    layout (a shared write index, rejected drafts left in place), which a window-sized ring buffer
    cannot hold, so the window is applied through the mask of the sliding layers instead."""
    text = config.get_text_config(decoder=True)
    types = list(getattr(text, "layer_types", None) or [])
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"the runner runs full and sliding-window attention layers; this model's config has "
                         f"layer types {unknown}")
    if "sliding_attention" not in types:
        return None, config
    full = copy.deepcopy(text)
    full.layer_types = ["full_attention"] * len(types)
    return text.sliding_window, full


@contextmanager
def _quiet_tracing():
    """transformers' MoE dispatch calls lru_cache'd version checks that Dynamo warns about while it
    traces: harmless, and nothing a user can act on (the warning prints file lines that read like
    a traceback)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
        yield


def takes_logits_to_keep(model) -> bool:
    """Whether ``model``'s forward (through wrappers passing ``**kwargs`` on, such as an instrumented
    model's) takes ``logits_to_keep``, as HF causal LMs do: then a prefill computes the vocabulary
    only at the positions it reads."""
    for cls in type(model).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is None:
            continue
        params = inspect.signature(forward).parameters
        if "logits_to_keep" in params:
            return True
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return False
    return False


def propose_ngram(history: Sequence[int], n: int, k: int) -> list[int]:
    """k draft tokens: what followed the most recent earlier occurrence of the last n tokens.

    Falls back to repeating the last token, so every request always has k drafts
    (a fixed tokens_per_req keeps shapes static).
    """
    if len(history) > n:
        tail = list(history[-n:])
        for start in range(len(history) - n - 1, -1, -1):
            if list(history[start : start + n]) == tail:
                follow = list(history[start + n : start + n + k])
                return follow + [history[-1]] * (k - len(follow))
    return [history[-1]] * k


class Runner(Engine):
    """Greedy generation over an HF causal LM (instrumented or not) with engine-style batches.

    ``model`` is called as ``model(input_ids=, position_ids=, attention_mask=4-D,
    past_key_values=StaticCache, use_cache=True[, replacements=ctx])``; pass the
    instrumented (and compiled) model, and its plain HF config as ``config``.
    ``replacer``: a TensorReplacer, or the :class:`~fxreplace.ReplacementConfig`
    to build one from. ``observed``: the instrumented model whose targets' computed values are
    recorded per request and position (for router agreement). ``compile``: a
    torch.compile backend (e.g. "inductor") to compile ``model`` with, counting
    the graphs it builds in ``graphs_compiled`` (one per bucket is expected).
    """

    #: each request of one call may replace its own selection (``replace=PerRequest(...)``)
    per_request_selection = True

    def __init__(self, model: Callable, config, replacer: TensorReplacer | ReplacementConfig | None = None,
                 runner_config: RunnerConfig | None = None,
                 dtype: torch.dtype | str = torch.float32, device: torch.device | str | None = None,
                 observed: torch.nn.Module | None = None,
                 compile: str | None = None):
        dtype = as_dtype(dtype, "Runner's dtype")
        weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), None) if isinstance(
            model, torch.nn.Module) else None
        if weights is not None and weights != dtype:  # else a dtype mismatch deep in the KV cache's index_copy_
            raise ValueError(f"the model's weights are {weights} but Runner's dtype (its KV cache's) is {dtype}; "
                             f"hint: Runner(..., dtype={weights})")
        self.graphs_compiled = 0
        self.compiled = compile is not None
        self._keeps_logits = takes_logits_to_keep(model)
        self._eager = model if isinstance(model, torch.nn.Module) else None  # probed for its cache's shapes
        # an instrumented model proves on the first prompt that, with nothing replaced, it is the model given
        self._unproven = isinstance(model, InstrumentedModel)
        self._kv_shapes: list[tuple[int, int, int]] | None = None
        if compile is not None:
            backend = torch._dynamo.lookup_backend(compile)  # no public lookup; the wrapper counts its graphs

            def counting_backend(gm, example_inputs):
                self.graphs_compiled += 1
                return backend(gm, example_inputs)

            # fxreplace's own module-level guards dropped: per step, Dynamo checks the model's and the inputs'
            model = torch.compile(model, backend=counting_backend, options={"guard_filter_fn": guard_filter})
        self.model = model
        self.observed = observed
        self.config = config
        self.replacer = TensorReplacer.from_config(replacer) if isinstance(replacer, ReplacementConfig) else replacer
        self.cfg = runner_config or RunnerConfig()
        self.dtype = dtype
        # where the model's inputs, caches and contexts go: by default where the model is
        self.device = torch.device(device) if device is not None else (
            input_device(self._eager) if self._eager is not None else torch.device("cpu"))
        self._caches: dict[tuple[str, int], StaticCache] = {}
        self._window, self._cache_config = _attention_layout(config)
        self._ids = itertools.count()
        self.forwards = 0

    # ------------------------------------------------------------------ public

    @property
    def teacher_forcing(self) -> bool:
        """Whether a validation should hand ``generate`` the reference's tokens (``forced=``)."""
        return self.cfg.teacher_forcing

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, replace: bool | Collection[str] = True,
                 prompt_hints: Sequence[int | None] | None = None,
                 forced: Sequence[Sequence[int]] | None = None) -> list[Generation]:
        """Greedy continuation of each prompt; ``replace=False`` runs the same graphs with an all-off mask.

        ``replace`` may also name the capture names to replace (the others stay off, in the
        same graphs: see :meth:`ReplacementContext.select`), or be a
        :class:`~fxreplace.context.PerRequest` selection for each prompt. ``prompt_hints[i]``
        registers request i with an explicit reference prompt index. ``forced[i]``: the tokens
        request i reads after each step instead of its own picks (teacher forcing); its
        ``tokens`` are still its own picks (what each step's logits choose).
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if forced is not None and len(forced) != len(prompts):
            raise ValueError(f"forced holds {len(forced)} continuations for {len(prompts)} prompts")
        if isinstance(replace, PerRequest):
            if len(replace) != len(prompts):
                raise ValueError(f"replace holds {len(replace)} selections for {len(prompts)} prompts")
        elif isinstance(replace, str) or not isinstance(replace, Collection):
            replace = bool(replace)
        if replace is not False and self.replacer is None:
            raise ValueError("replace=True needs a Runner built with a replacer")
        if self._unproven and prompts:
            check_unchanged(self._eager, torch.tensor([list(map(int, prompts[0]))], device=self.device))
            self._unproven = False
        hints = list(prompt_hints) if prompt_hints is not None else [None] * len(prompts)
        wave = max(self.cfg.batch_buckets)
        results = []
        for start in range(0, len(prompts), wave):
            chunk = [list(map(int, p)) for p in prompts[start : start + wave]]
            selection = PerRequest(replace[start : start + wave]) if isinstance(replace, PerRequest) else replace
            feed = None if forced is None else [list(map(int, f)) for f in forced[start : start + wave]]
            results += self._run_wave(chunk, hints[start : start + wave], max_new_tokens, selection, feed)
        return results

    # ------------------------------------------------------------------ internals

    def _run_wave(self, prompts, hints, max_new_tokens, replace, forced=None) -> list[Generation]:
        gens = [Generation(f"req-{next(self._ids)}", p) for p in prompts]
        if replace is not False:
            for g, hint in zip(gens, hints):
                self.replacer.register_request(g.req_id, g.prompt, prompt_idx=hint)
        try:
            k = self.cfg.speculative_tokens
            width = 1 + k
            batch = smallest_bucket(self.cfg.batch_buckets, len(gens), "a decode batch")
            write = max(len(g.prompt) for g in gens)  # shared write index W
            self._check_room(write, max_new_tokens, width)
            cache = self._cache("decode", batch)
            valid = torch.zeros(batch, self.cfg.max_len, dtype=torch.bool)
            held = torch.zeros(batch, self.cfg.max_len, dtype=torch.long)  # the position each cache slot holds
            if self.cfg.batched_prefill:
                self._prefill(gens, replace, cache, write, valid, held, rows=batch)
            else:
                for row, g in enumerate(gens):
                    self._prefill([g], replace[row] if isinstance(replace, PerRequest) else replace, cache, write, valid,
                                  held, first_row=row)
            positions = torch.tensor([len(g.prompt) for g in gens] + [0] * (batch - len(gens)))
            while any(len(g.tokens) < max_new_tokens for g in gens):
                # what each request reads: its last pick and k drafts, or (forced) the next k + 1 forced tokens
                reads = ([[g.tokens[-1]] + propose_ngram(g.prompt + g.tokens, self.cfg.ngram, k) for g in gens]
                         if forced is None else [_forced_reads(f, len(g.tokens), width) for f, g in zip(forced, gens)])
                inputs = torch.zeros(batch, width, dtype=torch.long)
                inputs[: len(gens)] = torch.tensor(reads)
                slot_pos = positions[:, None] + torch.arange(width)
                mask4d = _step_mask(valid, write, width)
                held[:, write : write + width] = slot_pos
                with self._context([g.req_id for g in gens], slot_pos.flatten(), False, width, replace) as ctx:
                    logits, seen = self._forward(inputs, slot_pos, mask4d, cache, write, ctx, held=held)
                # the host reads each step once for all requests (a wave holds a blame round's copies); the
                # rows kept are the requests' only, not the padding's
                picks, kept = logits.argmax(-1).tolist(), logits[: len(gens)].to("cpu", torch.float32, copy=True)
                for row, g in enumerate(gens):
                    chosen = picks[row]
                    accepted = k if forced is not None else 0  # forced reads are the reference's: all kept
                    while accepted < k and reads[row][accepted + 1] == chosen[accepted]:
                        accepted += 1
                    for name, values in seen.items():  # the inputs of accepted slots are real tokens
                        rows = values[row * width : row * width + accepted + 1]
                        g.observed.setdefault(name, {}).update(zip(slot_pos[row, : accepted + 1].tolist(), rows))
                    for j in range(accepted + 1):
                        if len(g.tokens) < max_new_tokens:
                            g.tokens.append(chosen[j])
                            g.logits.append(kept[row, j])
                    valid[row, write : write + accepted + 1] = True
                    positions[row] += accepted + 1
                write += width
            return gens
        finally:
            if replace is not False:
                for g in gens:
                    self.replacer.release_request(g.req_id)

    def _check_room(self, write: int, max_new_tokens: int, width: int) -> None:
        """Refuse a wave whose longest prompt and steps of ``width`` tokens overrun the cache."""
        needed = write + max_new_tokens * width
        if needed > self.cfg.max_len:
            raise ValueError(f"max_len {self.cfg.max_len} is too small: the longest prompt ({write}) plus "
                             f"{max_new_tokens} steps of {width} tokens needs {needed}")

    def _prefill(self, gens: list[Generation], replace, batch_cache: StaticCache, write: int, valid: torch.Tensor,
                 held: torch.Tensor, first_row: int = 0, rows: int = 1):
        """The prompts of ``gens`` in one ``[rows, bucket]`` forward (padding rows after them); request
        ``r``'s cache goes to row ``first_row + r`` of the batch cache. One request: the Neuron-style
        prefill layout; several (``batched_prefill``): decode-style, slot ``s`` of request ``s // bucket``."""
        bucket = smallest_bucket(self.cfg.prefill_buckets, max(len(g.prompt) for g in gens), "a prompt")
        cache = self._cache("prefill", bucket) if rows == 1 else self._cache("batched prefill", rows)
        inputs = torch.zeros(rows, bucket, dtype=torch.long)
        positions = torch.zeros(rows, bucket, dtype=torch.long)  # padding slots repeat position 0: not a continuation
        for r, g in enumerate(gens):
            inputs[r, : len(g.prompt)] = torch.tensor(g.prompt)
            positions[r, : len(g.prompt)] = torch.arange(len(g.prompt))
        mask4d = torch.zeros(rows, 1, bucket, self.cfg.max_len, dtype=torch.bool)
        mask4d[:, 0, :, :bucket] = torch.ones(bucket, bucket, dtype=torch.bool).tril()
        req_ids = [g.req_id for g in gens]
        # only each row's last position is read: the model computes the vocabulary there alone (row r's at
        # index r of a [rows]-long logits_to_keep, a static shape) unless that is no smaller than the bucket
        last = [len(g.prompt) - 1 for g in gens] + [0] * (rows - len(gens))
        keep = torch.tensor(last) if self._keeps_logits and rows < bucket else None
        prefill_held = torch.zeros(rows, self.cfg.max_len, dtype=torch.long)
        prefill_held[:, :bucket] = positions
        with (self._context(req_ids, positions[0], True, 1, replace) if rows == 1
              else self._context(req_ids, positions.flatten(), False, bucket, replace)) as ctx:
            logits, seen = self._forward(inputs, positions, mask4d, cache, 0, ctx, keep=keep, held=prefill_held)
        for r, g in enumerate(gens):
            n = len(g.prompt)
            for name, values in seen.items():
                g.observed.setdefault(name, {}).update(zip(range(n), values[r * bucket : r * bucket + n]))
            row = logits[r, r if keep is not None else n - 1]
            g.tokens.append(int(row.argmax()))
            g.logits.append(row.to("cpu", torch.float32, copy=True))
        # each prompt right-aligned to W in its row of the batch cache, all rows in one gather per layer:
        # slot j reads prompt position j - (W - n); the slots before the prompt read position 0 and stay
        # masked off (not valid)
        lengths = torch.tensor([len(g.prompt) for g in gens])
        source = (torch.arange(write) - write + lengths[:, None]).clamp(min=0)  # [requests, W]
        mine = slice(first_row, first_row + len(gens))
        held[mine, :write] = source
        source = source.to(self.device)
        for src, dst in zip(cache.layers, batch_cache.layers):
            for held_by_src, held_by_dst in ((src.keys, dst.keys), (src.values, dst.values)):  # widths may differ
                index = source[:, None, :, None].expand(-1, held_by_src.shape[1], -1, held_by_src.shape[3])
                held_by_dst[mine, :, :write] = held_by_src[: len(gens)].gather(2, index)
        slot = torch.arange(valid.shape[1])
        valid[mine] = (slot >= write - lengths[:, None]) & (slot < write)

    @contextmanager
    def _context(self, req_ids, positions, is_prefill, tokens_per_req, replace):
        """The context of one forward (None without a replacer), for the ``with`` block that runs
        it; a built context goes back to the replacer after it, so the next forward's build writes
        into its buffers instead of allocating."""
        if self.replacer is None:
            yield None
            return
        # the rows of the names replaced only, unless compiled: graphs take every name's tensor as an input,
        # so a context of other names would build other graphs
        names = (None if self.compiled or replace is True else () if replace is False
                 else set().union(*replace) if isinstance(replace, PerRequest) else replace)
        if replace is False:
            yield self.replacer.warmup_context(positions.shape[0], device=self.device, names=names)
            return
        ctx = self.replacer.build_context(req_ids, positions, is_prefill, device=self.device, tokens_per_req=tokens_per_req,
                                          names=names)
        try:
            yield ctx if replace is True else _selected(ctx, replace, tokens_per_req)
        finally:
            self.replacer.release(ctx)

    def _forward(self, inputs, positions, mask_bool, cache: StaticCache, write: int, ctx, keep=None, held=None):
        """Logits ``[batch, slots, vocab]`` (``[batch, len(keep), vocab]``: only the slots ``keep`` indexes) and
        the observed target values ``{name: [batch*slots, E]}``. ``held``: the position in each cache slot
        (``[batch, max_len]``), from which a model with sliding-window layers gets their mask."""
        for layer in cache.layers:
            layer.cumulative_length.fill_(write)
        mask = self._additive(mask_bool)
        if self._window is not None:  # HF models take a mask per layer type, built by the caller
            recent = positions[:, None, :, None] - held[:, None, None, :] < self._window
            mask = {"full_attention": mask, "sliding_attention": self._additive(mask_bool & recent)}
        kwargs = dict(
            input_ids=inputs.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
        )
        if ctx is not None:
            kwargs["replacements"] = ctx
        if keep is not None:
            kwargs["logits_to_keep"] = keep.to(self.device)
        self.forwards += 1
        seen: dict[str, torch.Tensor] = {}
        with torch.no_grad(), (observe(self.observed, seen.__setitem__) if self.observed is not None else nullcontext()), \
                (_quiet_tracing() if self.compiled else nullcontext()):
            logits = self.model(**kwargs).logits
        # router agreement compares logits: points that compute (weights, ids) pairs have none to offer
        return logits, {name: value.reshape(-1, value.shape[-1]).float().cpu() for name, value in seen.items()
                        if isinstance(value, torch.Tensor)}

    def _additive(self, mask_bool: torch.Tensor) -> torch.Tensor:
        """A bool mask as the additive one attention takes, on the model's device."""
        mask = torch.zeros(mask_bool.shape, dtype=self.dtype).masked_fill(~mask_bool, torch.finfo(self.dtype).min)
        return mask.to(self.device)

    def _cache(self, kind: str, size: int) -> StaticCache:
        """One static cache per (kind, bucket): reused so compiled graphs see the same objects."""
        key = (kind, size)
        if key not in self._caches and not self.compiled:
            # eager: nothing reuses a cache's object, so one per kind at a time (the others' memory returns)
            for other in [k for k in self._caches if k[0] == kind]:
                del self._caches[other]
        if key not in self._caches:
            cache = StaticCache(config=self._cache_config, max_cache_len=self.cfg.max_len)
            batch = 1 if kind == "prefill" else size
            for layer, (heads, key_dim, value_dim) in zip(cache.layers, self._layer_shapes()):
                # made before any forward (a compiled graph must not allocate its cache), each layer as the model fills it
                layer.lazy_initialization(torch.zeros(batch, heads, 0, key_dim, dtype=self.dtype, device=self.device),
                                          torch.zeros(batch, heads, 0, value_dim, dtype=self.dtype, device=self.device))
            self._caches[key] = cache
        return self._caches[key]

    def _layer_shapes(self) -> list[tuple[int, int, int]]:
        """Per cache layer (heads, key width, value width): what one token's forward of the model
        writes (a latent-attention model such as DeepSeek-V3 caches one compressed head of another
        width for keys than for values); from the config for a model that is not a module."""
        if self._kv_shapes is None:
            text = self.config.get_text_config(decoder=True)
            if self._eager is None:
                head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
                self._kv_shapes = [(text.num_key_value_heads, head_dim, head_dim)] * text.num_hidden_layers
            else:
                probe = StaticCache(config=self._cache_config, max_cache_len=1)
                # the decoder alone: no vocabulary computed, no replacement armed, no hook of the whole model called
                decoder = self._eager.get_decoder() if hasattr(self._eager, "get_decoder") else self._eager
                with torch.no_grad():
                    decoder(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device), past_key_values=probe,
                            use_cache=True)
                self._kv_shapes = [(layer.num_heads, layer.k_head_dim, layer.v_head_dim) for layer in probe.layers]
        return self._kv_shapes
