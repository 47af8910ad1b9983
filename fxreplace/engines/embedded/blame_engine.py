"""The embedded engine as :func:`fxreplace.blame` drives it: the target model in this process,
instrumented at its components and run by a teacher-forced runner sized for the search's rounds
(:func:`blame_runner`). In this process blame can also watch what each component computes and
swap the tensors it replaces as components are captured from the clean model on demand."""

from __future__ import annotations

import copy
from typing import Mapping, Sequence

import torch
from torch import nn

from ...covers import component_covers
from ...components import LAYER, Component, ComponentError, default_components, resolve_components
from ...instrument import instrument, uninstrument
from ...models import architecture
from ...replacer import TensorReplacer
from ...targets import TargetLike
from ..protocol import Engine
from .runner import Runner, RunnerConfig


class BlameRunner(Engine):
    """An engine over ``target`` (a Hugging Face causal LM) for :func:`fxreplace.blame`:
    ``generate(prompts, n, replace=<capture names>)``, teacher-forced.

    ``components``: ``{kind: Target}`` to search (None: those the reference recorded, else the
    family's); ``dtype``: the target's (converted in a copy when it has another); ``compile``: the
    torch.compile backend. :meth:`resolve` picks the components on the model, :meth:`open` instruments
    them and builds the runner once the search's prompts are known, :meth:`close` restores a
    target that was used itself."""

    #: each request of one batch may replace its own selection (hypotheses side by side)
    per_request_selection = True
    teacher_forcing = True
    transformers_code = True  # the target itself: what `fxreplace repro write` exports

    def __init__(self, target: nn.Module, *, components: Mapping[str, TargetLike] | None = None,
                 dtype: torch.dtype | None = None, compile: str | None = None):
        self.target, self.wanted, self.compile = target, components, compile
        self.torch_dtype = dtype or next(target.parameters()).dtype
        self.vocab_size = target.config.vocab_size
        self.architecture = architecture(target.config, type(target).__name__)
        self.layer_types = getattr(target.config, "layer_types", None)  # names the layers a systematic fault holds
        self.model: nn.Module | None = None
        self.same = False  # the model searched is the target itself (it had the dtype)
        self.components: list[Component] = []
        self.runner: Runner | None = None
        self.instrumented = False

    def resolve(self, reference, clean=None) -> list[Component]:
        """The components searched, on the model in the target's dtype: the target itself when it
        already has it (a copy would hold the weights twice), else a converted copy."""
        self.same = self.torch_dtype == next(self.target.parameters()).dtype and self.target is not clean
        self.model = self.target if self.same else copy.deepcopy(self.target).to(self.torch_dtype)
        components = self.wanted if self.wanted is not None else default_components(reference, self.model)
        self.components = resolve_components(self.model, components)
        if not self.components:
            raise ComponentError(f"the components {dict(components or {})} match no module of the target")
        return self.components

    def covers(self, components: Sequence[Component]) -> dict:
        """What replacing each component spans (:func:`~fxreplace.covers.component_covers`): the resolved model
        runs two tokens, before :meth:`open` instruments it."""
        return component_covers(self.model, list(components))

    def open(self, store, reference, prompts: Sequence[int], probes: int) -> None:
        """Instrument the components and build the runner of a search over ``prompts`` replacing from ``store``."""
        instrument(self.model, [c.target for c in self.components])
        self.instrumented = True
        self.runner = blame_runner(self.model, self.target.config, store, reference, prompts, self.components,
                                   probes=probes, compile=self.compile)

    def generate(self, prompts, max_new_tokens: int, replace, forced=None) -> list:
        return self.runner.generate(prompts, max_new_tokens, replace=replace, forced=forced)

    def observe(self, prompts, max_new_tokens: int) -> list:
        """One pass observing what every component computes (nothing replaced)."""
        self.runner.observed = self.model
        try:
            return self.runner.generate(prompts, max_new_tokens, replace=False)
        finally:
            self.runner.observed = None

    def use_store(self, store) -> None:
        """Replace from ``store`` from now on (it holds components captured since)."""
        self.runner.replacer = TensorReplacer(store)

    @property
    def batch_rows(self) -> int:
        """The requests one batch runs."""
        return max(self.runner.cfg.batch_buckets)

    def close(self) -> None:
        """Restore a target that was instrumented itself."""
        if self.instrumented and self.model is self.target:
            uninstrument(self.model)
        self.instrumented = False


#: the most requests the embedded runner decodes in one batch (a blame round beyond it runs in several)
MAX_BATCH = 64


def blame_runner(model: nn.Module, config, store, reference, prompts: Sequence[int], components: Sequence[Component], *,
                 probes: int, compile: str | None = None):
    """The embedded runner :func:`blame` searches with (``model`` instrumented at ``components``):
    a decode bucket holding a round (every hypothesis's copy of the prompts side by side; eagerly
    also one holding the prompts once), prefilled in one forward and teacher-forced inside its
    decode steps: a diverging copy is not re-run, so the prefill bucket holds the longest prompt
    and the cache its generated tokens."""

    def pow2(n: int) -> int:
        return 1 << (n - 1).bit_length()

    prompt = max(len(reference.prompt_tokens(p)) for p in prompts)
    generated = max(reference.num_generated(p) for p in prompts)
    kinds = len({c.kind for c in components if c.kind != LAYER})
    wave = len(prompts) * (max(probes, kinds) + 1)
    # eagerly a bucket costs nothing (the runner keeps one cache at a time), so a round runs in a batch of
    # exactly its copies (a multiple of the prompts, unpadded; the powers of two hold what a round larger
    # than one batch leaves over) and a wider round (a deciding round carrying its layers' kinds) still
    # runs in one batch of up to MAX_BATCH; compiled, each bucket is graphs to compile, so one holds every round
    powers = {1 << k for k in range(MAX_BATCH.bit_length())}
    copies = set(range(len(prompts), MAX_BATCH + 1, len(prompts)))
    buckets = (min(wave, MAX_BATCH),) if compile else tuple(sorted(powers | copies))
    return Runner(model, config, replacer=TensorReplacer(store),
                  runner_config=RunnerConfig(prefill_buckets=(pow2(prompt),), batch_buckets=buckets,
                                                max_len=pow2(prompt + generated), batched_prefill=True,
                                                teacher_forcing=True),
                  dtype=next(model.parameters()).dtype, compile=compile)
