"""What fxreplace needs from an engine.

Validation and blame drive any engine through :class:`Engine`, a base class: ``generate(prompts,
max_new_tokens, replace) -> [Generation]`` and optional capabilities with defaults (the embedded
runner, vLLM, an engine of your own: see :mod:`fxreplace.engines`).

A serving engine's model runner is seen through :class:`RunnerSide`, so one replacement state
and one row recording serve every runner (vLLM's GPU/CPU runner in
:mod:`fxreplace.engines.vllm.runners`, vllm-neuron's in :mod:`fxreplace.engines.vllm.neuron`).
A runner side tells fxreplace

* the module to instrument (the original model, under any compile wrapper), its Hugging Face
  config and device, and the rows of its largest forward (``max_tokens``);
* its replacement and capture classes, which say whether replacement rows are *bound*: static
  buffers bound to the model before it compiles and filled in place before each forward (vLLM's
  compiled and CUDA-graph runners), or *per-step inputs*: a context handed to each compiled call
  (Neuron's bucketed graphs);
* the requests each scheduler step ends and starts (:class:`StepRequests`), and each
  forward's :class:`StepLayout`: the requests in slot order, the tokens each computes,
  the padding and the position of every slot;

and installs the per-step hooks of :class:`StepHooks` where its runner steps. Everything
else (request registration, the build of the step's context, the recording of observed
rows by request and position) is the same code for every runner.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Protocol, Sequence

import torch

from ..replacer.requests import StepLayout  # re-exported: a runner side reads the seam's names here


@dataclass
class Generation:
    """One request's greedy continuation and the logits that chose each token."""

    req_id: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # one [vocab] per generated token
    # what each target computed (before replacement), per position: {capture name: {position: [E]}}
    observed: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    @property
    def logits_tensor(self) -> torch.Tensor:
        return torch.stack(self.logits)


class Engine(abc.ABC):
    """What validation and blame drive: greedy generation, with replacement on, off or for the
    named captures only. Subclass it and implement :meth:`generate` (abstract: an engine without
    it cannot be made); every other member is an
    optional capability whose default here says what an engine without it does, so callers read
    it as an attribute (override a default as a class attribute, an instance attribute or a
    property)."""

    #: blame's candidates: the components (:class:`~fxreplace.components.Component`) it can replace
    #: (none: it cannot be blamed)
    components: Sequence = ()
    #: the vocabulary its logits span, checked against the reference's (None: not checked)
    vocab_size: int | None = None
    #: what it runs the model in (a torch dtype or its name): the noise floor the reference stored
    #: for it scales blame's verdict (None: no stored floor applies)
    dtype: torch.dtype | str | None = None
    #: each request of one ``generate`` call may replace its own selection (``replace=PerRequest(...)``):
    #: blame then measures a round's hypotheses side by side in one call instead of one call each
    per_request_selection: bool = False
    #: ``generate`` takes ``forced=`` (each prompt's reference tokens to feed instead of its own),
    #: so validation runs every step after a divergence in the call that found it
    teacher_forcing: bool = False
    #: the graphs it compiled, which ``fxreplace validate`` reports (None: it does not count them)
    graphs_compiled: int | None = None
    #: the model it runs is transformers' code for the checkpoint, which ``fxreplace repro write`` exports, so a
    #: repro of a blamed module runs the code blamed (False: its own code, as vLLM's: no repro of the checkpoint runs it)
    transformers_code: bool = False

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 replace: bool | Collection[str]) -> list[Generation]:
        """One :class:`Generation` per prompt: ``max_new_tokens`` greedy tokens and the logits that
        chose each, ``replace`` True (every target replaced), False (none) or the capture names."""

    def covers(self, components: Sequence) -> Mapping[str, object]:
        """What replacing each of ``components`` spans in its model, by capture name
        (:func:`fxreplace.covers.component_covers`, run where the model lives): blame's verdict names those
        modules and a class several kinds' spans run. The default knows none: the verdict names kinds only."""
        return {}

    def close(self) -> None:
        """Release what it holds (processes, memory); the default holds nothing."""


def check_engine(engine, what: str) -> Engine:
    """``engine`` when it is an :class:`Engine`, else a TypeError naming ``what`` it is."""
    if not isinstance(engine, Engine):
        raise TypeError(f"{what} must be an fxreplace.engines.protocol.Engine (subclass it: generate() and the "
                        f"capabilities it has), got {type(engine).__name__}")
    return engine


@dataclass(slots=True)
class NewRequest:
    """A request a scheduler step starts: ``prompt`` its token ids (None: prompt embeddings, nothing
    to match), ``replace`` True (every capture), False (served untouched) or the capture names it
    selects."""

    req_id: str
    prompt: Sequence[int] | None
    replace: bool | Sequence[str] = True


@dataclass(slots=True)
class StepRequests:
    """The requests one scheduler step ends (``finished``, their ids) and starts (``new``)."""

    finished: Collection[str] = ()
    new: list[NewRequest] = field(default_factory=list)


@dataclass
class StepHooks:
    """Callbacks a runner side installs where its runner steps (any may be None):

    * ``begin_step(step)``: before each scheduler step (``step``: the scheduler's output);
    * ``before_forward(step, positions)`` right before each forward of a step, ``positions``
      the forward's host or device positions; for a per-step-input runner it returns the
      context the compiled call receives;
    * ``off_forward(num_tokens)`` before a forward outside a step (warm-ups, dummy and profile
      runs, graph capture); a per-step-input runner gets the all-off context it returns;
    * ``after_forward(step, positions)`` after each forward of a step, even when it raised;
    * ``end_step(output)`` after each step; ``after_sample(output)`` after a separate sampling.
    """

    begin_step: Callable | None = None
    before_forward: Callable | None = None
    off_forward: Callable | None = None
    after_forward: Callable | None = None
    end_step: Callable | None = None
    after_sample: Callable | None = None


class RunnerSide(Protocol):
    """What fxreplace reads and hooks in one engine's model runner."""

    runner: Any  # the engine's model runner object
    model: torch.nn.Module  # the module fxreplace instruments (under any compile wrapper)
    hf_config: Any  # the model's Hugging Face config (family and default targets)
    device: torch.device  # where the model runs
    max_tokens: int  # slots of the largest forward
    model_code: str  # whose model code it runs ("vllm", "vllm-neuron"): messages, and the key of a family's sites there

    def replacement_class(self, select_captures: bool) -> type:
        """The replacement state of this runner, built as ``cls(side, replacement_config)``
        (``select_captures``: each request may select the captures that replace it)."""

    def capture_class(self) -> type:
        """The capture state of this runner, built as ``cls(side, capture_config)``."""

    def split_by_stage(self, targets: list) -> tuple[list, list]:
        """``targets`` as (this pipeline stage's, other stages')."""

    def requests(self, step) -> StepRequests:
        """The requests the scheduler's ``step`` ends and starts (read from its own output)."""

    def layout(self, step, positions) -> StepLayout:
        """The layout of the forward of ``step`` whose positions are ``positions``."""

    def install(self, hooks: StepHooks) -> None:
        """Install the per-step hooks on this runner instance."""

    def off_forward(self, num_tokens: int) -> None:
        """Run the model once eagerly on ``num_tokens`` dummy tokens, replacement off (the start-up
        check of a bound runner; a runner whose device runs no eager forward has none)."""


@dataclass
class RecordedRows:
    """Rows observed in one forward, by request: ``spans[i] = (first slot, tokens, first position)``
    of request ``req_ids[i]``; the rows themselves stay in the observation buffer until copied."""

    req_ids: list[str]
    spans: list[tuple[int, int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, layout: StepLayout) -> "RecordedRows":
        """Where each request's computed rows lie in a forward of ``layout`` (padding skipped)."""
        positions = layout.positions
        spans = [(start, count, int(positions[start]) if count else 0)
                 for start, count in zip(layout.starts(), layout.counts)]
        return cls(list(layout.req_ids), spans)
