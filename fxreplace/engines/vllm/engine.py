"""A vLLM engine behind fxreplace's validation engine protocol
(``generate(prompts, max_new_tokens, replace) -> [Generation]``), used by
``fxreplace validate --engine vllm``.

One engine serves both modes. The plugin is configured with the reference;
``replace=False`` requests carry ``extra_args={"fxreplace": "off"}``, which the
plugin honours per request; with ``select_captures=True`` in the config,
``replace=<capture names>`` replaces only those (``{"fxreplace": {"captures": [...]}}``).
Each mode (each selection) gets its own ``cache_salt`` so the prefix cache never
hands KV computed with one replacement to a request with another, while retries of
one mode still reuse their cached prefixes.

Logits: vLLM returns log-probabilities, not logits, and only the top ``k``
tokens of each step. Validation compares log-softmaxed values, so log-probs stand
in for logits exactly. By default ``k = -1`` (the whole vocabulary: exact
metrics, but one Python object per vocabulary entry per step, slow for 100k+
vocabularies). With a smaller ``k`` the tokens outside the top ``k`` get the
smallest returned log-prob: top-1 and top-5/top-50 errors stay exact while the
reference's top-50 lies inside the target's top-k; KL is then approximate.
``Generation.observed`` stays empty (router agreement is not measured).
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
from pathlib import Path
from typing import Callable, Collection, Sequence

import torch

from ...components import components_in
from ...config import ReplacementConfig
from ...context import PerRequest
from ...covers import components_to_data, covers_from_data
from ...models import architecture, get_family
from ...reference import load_reference
from ..protocol import Engine, Generation
from . import internals, shm
from .sites import MODEL_CODE
from .startup import engine_start

OFF = {"fxreplace": "off"}


class VllmEngine(Engine):
    """``VllmEngine(model_dir, replacement, dtype="float32", logprobs=-1, **llm_kwargs)``.

    ``replacement``: the plugin's :class:`~fxreplace.ReplacementConfig` (e.g.
    ``ReplacementConfig(tensors_path=reference_dir)``). ``interrupted``: what a Ctrl-C during the start
    says last (:func:`~fxreplace.engines.vllm.startup.engine_start`). ``llm_kwargs`` go to
    ``vllm.LLM`` (e.g. ``enforce_eager``, ``max_model_len``).
    """

    def __init__(self, model: str, replacement: ReplacementConfig, *, dtype: str = "float32", logprobs: int = -1,
                 interrupted: Callable[[], None] | None = None, **llm_kwargs):
        from vllm import LLM  # vLLM loads when an engine starts, not with fxreplace

        self.logprobs = logprobs
        llm_kwargs.setdefault("max_logprobs", logprobs)
        llm_kwargs.setdefault("seed", 0)
        self._shm = shm.Cleanup()
        try:
            with engine_start(interrupted):
                self.llm = LLM(model=model, dtype=dtype, additional_config={"fxreplace": replacement}, **llm_kwargs)
        except BaseException:
            self._shm.after_teardown()  # what a failed start left
            raise
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self._ids = itertools.count()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 replace: bool | Collection[str] | PerRequest) -> list[Generation]:
        """``replace``: True (every target), False (none), the capture names to replace, or a
        :class:`~fxreplace.context.PerRequest` selection per prompt (one batch serves them all)."""
        from vllm import SamplingParams  # vLLM loads when an engine starts, not with fxreplace

        selections = replace if isinstance(replace, PerRequest) else [replace] * len(prompts)
        params, salts = [], []
        for selection in selections:
            extra, salt = _request_selection(selection)
            params.append(SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True,
                                         logprobs=self.logprobs, extra_args=extra))
            salts.append(salt)
        inputs = [{"prompt_token_ids": list(p), "cache_salt": salt} for p, salt in zip(prompts, salts)]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        gens = []
        for prompt, out, salt in zip(prompts, outs, salts):
            completion = out.outputs[0]
            gens.append(Generation(req_id=f"{out.request_id}:{salt}", prompt=list(prompt),
                                   tokens=list(completion.token_ids),
                                   logits=[self._dense(step) for step in completion.logprobs]))
        return gens

    def _dense(self, step: dict) -> torch.Tensor:
        """``{token: Logprob}`` of one step -> ``[vocab]`` log-probs (missing: the smallest returned)."""
        ids = torch.tensor(list(step), dtype=torch.long)
        values = torch.tensor([v.logprob for v in step.values()], dtype=torch.float32)
        dense = torch.full((self.vocab_size,), float(values.min()), dtype=torch.float32)
        dense[ids] = values
        return dense

    def close(self) -> None:
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        self.llm = None
        self._shm.after_teardown()


class VllmBlameEngine(Engine):
    """:func:`fxreplace.blame` through vLLM: ``generate(prompts, n, replace=<capture names>)``.

    One engine serves the whole search: its plugin instruments every component, with
    ``select_captures=True``, and each pass's requests select the captures they replace
    (a pass replacing nothing is served with replacement off). Components come from the
    reference (``metadata["components"]``: capture name, kind, layer) and the family's
    vLLM sites (engines/vllm/sites.py: vLLM's module and injection point per kind; ``*`` = layer).
    ``engine``: that :class:`VllmEngine`.
    """

    def __init__(self, model: str, reference_dir: str, *, dtype: str = "float32", vllm_components=None, **llm_kwargs):
        reference = load_reference(reference_dir)
        if vllm_components is None:
            vllm_components = _family_vllm_components(model)
        self.components = components_in(reference, reference_dir, vllm_components, "vLLM")
        replacement = ReplacementConfig(tensors_path=str(reference_dir), targets=[c.target for c in self.components],
                                        select_captures=True)
        self.engine: VllmEngine | None = VllmEngine(model, replacement, dtype=dtype, **llm_kwargs)

    #: each request of one batch may replace its own selection (hypotheses side by side)
    per_request_selection = True

    def generate(self, prompts, max_new_tokens: int, replace) -> list[Generation]:
        return self.engine.generate(prompts, max_new_tokens, replace=replace)

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def covers(self, components) -> dict:
        """What replacing each component spans in vLLM's model, read in its workers (one eager dummy forward
        each): the same covers from every worker (tensor-parallel ranks hold the same modules), else none (the
        stages of a pipeline each hold some layers: a verdict names kinds only)."""
        answers = self.engine.llm.collective_rpc(internals.COVERS_METHOD, args=(components_to_data(list(components)),))
        found = [data for data in answers if data]
        if not found or any(data != found[0] for data in found[1:]):
            return {}
        return covers_from_data(found[0])

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            gc.collect()
            from vllm.distributed import cleanup_dist_env_and_memory  # vLLM loads with its engine, not with fxreplace

            cleanup_dist_env_and_memory()


def _request_selection(replace: bool | Collection[str]) -> tuple[dict | None, str]:
    """A request's ``extra_args`` and ``cache_salt`` for one selection (an empty one: off)."""
    if not isinstance(replace, bool) and not replace:
        replace = False
    if isinstance(replace, bool):
        return (None, "fxreplace-on") if replace else (dict(OFF), "fxreplace-off")
    names = sorted(replace)
    return {"fxreplace": {"captures": names}}, "fxreplace-" + hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def _family_vllm_components(model_dir: str) -> dict:
    arch = architecture(json.loads((Path(model_dir) / "config.json").read_text()), "?")
    family = get_family(arch)
    components = family.components_for(MODEL_CODE)
    if not components:
        raise ValueError(f"the {arch} family declares no components in vLLM's model code; pass "
                         "vllm_components={kind: Target}")
    return components
