"""An engine of your own: the example of docs/extending.md, run through validate and blame by
tests/test_engines.py.

"recompute" runs the Hugging Face model eagerly and, at every step, the whole sequence again (no KV
cache): slow, and plain enough to read in one sitting. Each request's replacement is the context
the replacer builds for its positions, handed to the instrumented model as ``replacements=``.
A real engine would keep its own scheduler, cache and compiled graphs; what fxreplace needs from
it is an ``Engine`` (``fxreplace.engines.protocol``) with ``generate(prompts, max_new_tokens,
replace)`` and, for blame, the components it replaces; the other capabilities keep their defaults.
"""

from __future__ import annotations

import itertools

import torch

from fxreplace import TensorReplacer, instrument
from fxreplace.components import default_components, resolve_components
from fxreplace.context import PerRequest
from fxreplace.dtypes import as_dtype
from fxreplace.engines.protocol import Engine, Generation
from fxreplace.engines.registry import EngineRun, EngineSpec, Opened, register_engine
from fxreplace.loading import check_vocab, default_targets, load_model


class RecomputeEngine(Engine):
    """Greedy generation, one request at a time, the whole sequence recomputed every step."""

    #: each prompt of one call may replace its own captures, so blame runs a round's hypotheses in one call
    per_request_selection = True

    def __init__(self, model, replacer: TensorReplacer, components=(), dtype: str = "float32"):
        self.model, self.replacer, self.components, self.dtype = model, replacer, list(components), dtype
        self.vocab_size = model.config.vocab_size
        self._ids = itertools.count()

    def generate(self, prompts, max_new_tokens: int, replace=True) -> list[Generation]:
        """``replace``: True (every target), False (none), the capture names to replace, or one
        such selection per prompt (a ``PerRequest``: blame tests several side by side)."""
        selections = replace if isinstance(replace, PerRequest) else [replace] * len(prompts)
        return [self._one(list(map(int, prompt)), max_new_tokens, selection)
                for prompt, selection in zip(prompts, selections)]

    def _one(self, prompt: list[int], max_new_tokens: int, replace) -> Generation:
        gen = Generation(f"recompute-{next(self._ids)}", prompt)
        names = None if replace is True else frozenset(replace or ())  # None: every capture
        if names is None or names:  # matched to its reference prompt by its tokens
            self.replacer.register_request(gen.req_id, prompt)
        try:
            tokens = list(prompt)
            for _ in range(max_new_tokens):
                context = None
                if names is None or names:
                    context = self.replacer.build_context([gen.req_id], list(range(len(tokens))), is_prefill=True,
                                                          names=names)
                with torch.no_grad():
                    logits = self.model(input_ids=torch.tensor([tokens]), replacements=context).logits[0, -1]
                gen.logits.append(logits.float())
                gen.tokens.append(int(logits.argmax()))
                tokens.append(gen.tokens[-1])
        finally:
            self.replacer.release_request(gen.req_id)
        return gen


def open_validation(run: EngineRun) -> Opened:
    """The target with its family's targets (or ``run.targets``) instrumented."""
    model = load_model(run.model, as_dtype(run.dtype), device=run.device)
    check_vocab(run.reference, run.model, model.config.vocab_size)
    targets = run.targets or default_targets(model)
    instrument(model, targets)
    engine = RecomputeEngine(model, TensorReplacer(run.reference.store), dtype=run.dtype)
    return Opened(engine, f"target: {run.model} in {run.dtype}, recomputed every step",
                  getattr(model.config, "num_experts_per_tok", None), list(targets))


def open_blame(run: EngineRun) -> Opened:
    """The target with the components asked for (``run.components``), else those the reference
    recorded, else its family's, instrumented."""
    model = load_model(run.model, as_dtype(run.dtype), device=run.device)
    check_vocab(run.reference, run.model, model.config.vocab_size)
    components = resolve_components(model, run.components or default_components(run.reference, model))
    instrument(model, [c.target for c in components])
    return Opened(RecomputeEngine(model, TensorReplacer(run.reference.store), components, dtype=run.dtype))


ENGINE = register_engine(EngineSpec(
    name="recompute",
    summary="the HF model, eager, the whole sequence recomputed every step (an example engine)",
    open_validation=open_validation,
    open_blame=open_blame,
))
