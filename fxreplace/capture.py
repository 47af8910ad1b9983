"""Reference capture: greedy generation on the reference model, recording the targets.

The targets are resolved and located exactly as :func:`fxreplace.instrument` does
(for MoE routers: the logits node inside the router, not the returned tuple), by
instrumenting the model for the duration of the capture and observing what each
injection point computes. The model is restored afterwards.

Prompts are token ids, text, or chat conversations (lists of ``{"role", "content"}``
messages); text goes through the checkpoint's own tokenizer (its chat template for
conversations), and the text is recorded beside the ids (``metadata["prompt_texts"]``).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

import torch

from .components import resolve_components
from .dtypes import dtype_name
from .devices import input_device
from .errors import PromptError
from .instrument import InstrumentedModel, instrument, observe, uninstrument
from .loading import SetupError
from .models import architecture
from .reference import Reference, load_reference
from .store import StoreWriter
from .targets import TargetError, TargetLike, resolve_targets

#: One prompt: token ids (a list or a 1-D tensor), a text, or a chat conversation.
Prompt = Union[Sequence[int], torch.Tensor, str, Sequence[Mapping[str, Any]]]


@torch.no_grad()
def capture_reference(
    model: torch.nn.Module,
    prompts: Sequence[Prompt],
    targets: Iterable[TargetLike],
    max_new_tokens: int,
    *,
    tokenizer=None,
    chat: bool = False,
    components: Mapping[str, TargetLike] | None = None,
    progress: bool = True,
    out: str | os.PathLike | None = None,
    shard_bytes: int = 64 << 20,
    metadata: Mapping[str, Any] | None = None,
) -> Reference:
    """Greedy-generate ``max_new_tokens`` per prompt and record, per prompt:
    each target's value in the step-wise capture format (step 0 = prefill
    ``[1, L, E]``, then ``[1, 1, E]`` per decode step), the logits of every
    generated step, and the generated tokens.

    ``prompts`` may mix token ids, texts and conversations; texts need ``tokenizer``
    (the checkpoint's, e.g. ``AutoTokenizer.from_pretrained(checkpoint)``), and
    ``chat=True`` sends each plain text as one user message through its chat template
    (see :func:`tokenize_prompts`).

    ``components`` (``{kind: Target}``, e.g. a family's ``components``) are recorded
    too, ``[T, H]`` rows per layer and kind, for :func:`fxreplace.blame`; the
    metadata's ``"components"`` names each one's kind and layer.

    ``out``: a new or empty directory the prompts stream into as they complete (a
    :class:`~fxreplace.store.StoreWriter`, ``shard_bytes`` per shard, ``index.json``
    rewritten at each shard), so memory holds one shard whatever the number of prompts (about
    twice over while it is written: the default keeps that beside the model's weights small);
    a capture killed midway leaves the completed shards loadable and the writer's marker
    saying the store is unfinished (:func:`fxreplace.store.unfinished`). The reference
    returned is then the store memory-mapped from ``out``. Without ``out`` it is built in
    memory. ``metadata``: keys recorded beside the ones derived from the model (e.g.
    ``source_model``).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    token_ids, texts = tokenize_prompts(prompts, tokenizer, chat=chat)
    prompts = check_prompts(token_ids, model.config.vocab_size)
    owned = not isinstance(model, InstrumentedModel)
    targets, found = _with_components(model, list(targets), components, owned)
    if owned:
        instrument(model, targets)
    try:
        names = [t.capture_name for t in model._fxreplace.targets]
        info = _metadata(model, names, max_new_tokens, texts, found)
        info.update(metadata or {})
        generated = _generate(model, names, prompts, max_new_tokens)
        return _collect(generated, prompts, info, out, shard_bytes, progress)
    finally:
        if owned:
            uninstrument(model)


def _with_components(model, targets: list, components, owned: bool) -> tuple[list, list]:
    """``targets`` and the components' targets they lack (the components resolved beside them)."""
    if not components:
        return targets, []
    if not owned:
        raise ValueError("capture_reference(components=...) instruments the model itself: pass the plain model")
    found = resolve_components(model, components)
    already = {t.module_name for t in resolve_targets(model, targets)}
    return targets + [c.target for c in found if c.module_name not in already], found


def _collect(generated, prompts, info: dict, out, shard_bytes: int, progress: bool) -> Reference:
    """The prompts' captures as they are generated: in memory, or streamed into the store at ``out``."""
    from tqdm.auto import tqdm  # the hf extra; fxreplace.models imports this module without it

    generated = tqdm(generated, total=len(prompts), desc="capture", disable=not progress)
    if out is None:
        captures, tokens, logits = (list(column) for column in zip(*generated))
        return Reference.from_parts(captures, prompts, tokens, logits, info)
    with StoreWriter(out, shard_bytes=shard_bytes, metadata=info) as writer:
        for prompt, (captured, tokens, logits) in zip(prompts, generated):
            writer.add(prompt, captured, extras=Reference.extras(tokens, logits))
    return load_reference(out)


class _Enough(Exception):
    """Raised at an injection point to end a forward whose remaining layers nobody reads."""


@torch.no_grad()
def capture_forced(model: torch.nn.Module, sequences: Sequence[Sequence[int]], targets: Iterable[TargetLike], *,
                   read_from: Sequence[int] | None = None, until: Callable[[list[str]], bool] | None = None,
                   tokens_per_forward: int = 8192):
    """What ``targets`` compute over known token sequences (e.g. each prompt followed by the
    reference's tokens): teacher-forced, a batch of sequences per forward (right-padded, up to
    ``tokens_per_forward`` slots), no generation. Yields, per sequence in order,
    ``({capture name: rows [len, E]}, picks)``, ``picks`` the model's greedy token after each
    position from ``read_from[i]`` on (only those positions' vocabulary is computed), for checking
    that the model reproduces the tokens that follow. ``until``: called with the capture names
    computed so far in a forward, in order, at each one; when it returns True the forward ends
    there (the layers after it, often most of the model, are not run): the rows hold the names
    computed and ``picks`` is None. ``model``: a plain model, instrumented for the duration."""
    sequences = [list(map(int, s)) for s in sequences]
    read_from = [len(s) - 1 for s in sequences] if read_from is None else list(read_from)
    instrument(model, list(targets))
    try:
        device = input_device(model)
        start = 0
        while start < len(sequences):
            end = start + 1
            while end < len(sequences) and (end + 1 - start) * max(map(len, sequences[start : end + 1])) <= tokens_per_forward:
                end += 1
            batch = sequences[start:end]
            width = max(map(len, batch))
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for r, s in enumerate(batch):
                ids[r, : len(s)], mask[r, : len(s)] = torch.tensor(s), 1
            # causal attention: right padding never reaches a real position; the vocabulary only where read
            first = min(read_from[start:end])
            seen: dict[str, torch.Tensor] = {}

            def record(name: str, computed: torch.Tensor) -> None:
                if not isinstance(computed, torch.Tensor):
                    raise TargetError(f"{name}: its point computes a {type(computed).__name__}, not one tensor")
                seen[name] = computed.detach().reshape(len(batch), width, computed.shape[-1]).cpu()
                if until is not None and until(list(seen)):
                    raise _Enough

            picks = None
            try:
                with observe(model, record):
                    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False,
                                   logits_to_keep=torch.arange(first, width, device=device)).logits
                picks = logits.argmax(-1).cpu()
            except _Enough:
                pass
            for r, s in enumerate(batch):
                lo = read_from[start + r] - first
                yield ({n: rows[r, : len(s)].clone() for n, rows in seen.items()},
                       None if picks is None else picks[r, lo : len(s) - first].tolist())
            start = end
    finally:
        uninstrument(model)


def _generate(model, names: list[str], prompts: list[list[int]], max_new_tokens: int):
    """Per prompt, as it completes: ``({capture name: [steps]}, generated tokens, logits [steps, vocab])``."""
    device = input_device(model)
    for prompt in prompts:
        steps: dict[str, list[torch.Tensor]] = {n: [] for n in names}

        def record(name: str, computed: torch.Tensor) -> None:
            if not isinstance(computed, torch.Tensor):
                raise TargetError(f"{name}: its point computes a {type(computed).__name__}, not one tensor; "
                                  "capture the reference at the logits (e.g. the unfused model's router)")
            steps[name].append(computed.detach().reshape(1, -1, computed.shape[-1]).cpu().clone())

        generated, step_logits = [], []
        with observe(model, record):
            out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
            for step in range(max_new_tokens):
                last = out.logits[0, -1]
                step_logits.append(last.float().cpu())
                generated.append(int(last.argmax()))
                if step + 1 == max_new_tokens:
                    break
                out = model(input_ids=torch.tensor([[generated[-1]]], device=device),
                            past_key_values=out.past_key_values, use_cache=True)
        yield steps, generated, torch.stack(step_logits)


def _metadata(model, names: list[str], max_new_tokens: int, texts: list, found: list) -> dict:
    config = model.config
    metadata = {
        "source_model": getattr(config, "name_or_path", "") or "",
        "architecture": architecture(config, type(model).__name__),
        "model_type": getattr(config, "model_type", ""),
        "vocab_size": config.vocab_size,
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),  # another count: another model
        "dtype": dtype_name(next(model.parameters()).dtype),
        "targets": names,
        "max_new_tokens": max_new_tokens,
        "prompt_texts": texts,
    }
    if found:
        metadata["components"] = {c.capture_name: {"kind": c.kind, "layer": c.layer} for c in found}
    return metadata


def tokenize_prompts(prompts: Sequence[Prompt], tokenizer=None, *, chat: bool = False
                     ) -> tuple[list, list[str | None]]:
    """Each prompt as token ids, and its text (None for a prompt given as ids).

    A text is tokenized as the tokenizer does by default (its special tokens added); a
    conversation, or a text when ``chat``, is rendered with the tokenizer's chat template
    (with the generation prompt) and the rendered text is what gets recorded.
    A ValueError names the first prompt that cannot be turned into ids.
    """
    ids, texts = [], []
    for i, prompt in enumerate(prompts):
        conversation = _conversation(prompt)
        if isinstance(prompt, str) and chat:
            conversation = [{"role": "user", "content": prompt}]
        if conversation is None and not isinstance(prompt, str):
            ids.append(prompt)
            texts.append(None)
            continue
        if tokenizer is None:
            raise ValueError(f"prompt {i} is text but no tokenizer was given: pass the checkpoint's tokenizer "
                             "(AutoTokenizer.from_pretrained(checkpoint)) or token id lists")
        if conversation is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"prompt {i} is a chat conversation but the tokenizer has no chat template: "
                                 "give plain text or token ids")
            text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
            ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template wrote them
        else:
            text = prompt
            ids.append(tokenizer(text)["input_ids"])
        texts.append(text)
    return ids, texts


def _conversation(prompt) -> list | None:
    """``prompt`` as a list of chat messages, or None when it is not one."""
    if isinstance(prompt, (str, torch.Tensor)) or not isinstance(prompt, Sequence) or not prompt:
        return None
    if not all(isinstance(m, Mapping) for m in prompt):
        return None
    return list(prompt)


def checked_prompts(ids: list, vocab_size: int, source: str) -> list[list[int]]:
    """:func:`check_prompts` for prompts a user gave: a :class:`~fxreplace.loading.SetupError`
    names ``source`` (the prompts file) and how to fix what is wrong."""
    try:
        return check_prompts(ids, vocab_size)
    except PromptError as e:
        raise SetupError(f"{source}: {e}", e.hint) from None


def check_prompts(prompt_token_ids: Sequence, vocab_size: int) -> list[list[int]]:
    """Token id lists (or tensors) as plain lists; a :class:`PromptError` names the first bad prompt.
    A prompt given twice is refused here, before a model runs: a request with its tokens
    could only ever be matched to one of them."""
    prompts, first_seen = [], {}
    for i, prompt in enumerate(prompt_token_ids):
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not ids:
            raise PromptError(f"prompt {i} is empty", "give every prompt at least one token")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise PromptError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}",
                              f"this model's token ids are below its vocab_size ({vocab_size}): give ids of its "
                              "tokenizer, or the prompt as text")
        seen = first_seen.setdefault(tuple(ids), i)
        if seen != i:
            raise PromptError(f"prompt {i} has the same token ids as prompt {seen}: a request with these tokens could "
                              "only ever get one of them", "give each prompt once")
        prompts.append(ids)
    if not prompts:
        raise PromptError("no prompts to capture", "give at least one prompt")
    return prompts
