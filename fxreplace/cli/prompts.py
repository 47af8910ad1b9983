"""The prompts file of ``fxreplace capture``: parsed and checked before any model loads, text
through the checkpoint's own tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from ..capture import tokenize_prompts
from ..loading import load_tokenizer
from .args import UsageError


def read_prompts(path: str) -> list:
    """The prompts file, parsed before any model loads: a JSON list whose items are texts,
    token id lists, ``{"prompt": text or ids}`` or ``{"messages": [...]}`` (a chat), or the
    same items one per line (JSONL)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"cannot read prompts file {path}: {e}") from None
    try:
        data = json.loads(text)
        items = [(f"item {i}", item) for i, item in enumerate(data)] if isinstance(data, list) else None
    except json.JSONDecodeError:
        items = None
    if items is None:  # JSONL: one prompt per line
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append((f"line {n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise UsageError(f"{path} line {n} is not JSON: {e}", PROMPTS_HINT) from None
    if not items:
        raise UsageError(f"{path} holds no prompts", PROMPTS_HINT)
    return [_prompt(path, where, item) for where, item in items]


PROMPTS_HINT = ('a JSON list of texts or token id lists, or JSONL lines {"prompt": "..."} or '
                '{"messages": [{"role": "user", "content": "..."}]}')


def _prompt(path: str, where: str, item):
    if isinstance(item, dict):
        if "messages" in item and isinstance(item["messages"], list):
            return item["messages"]
        if "prompt" not in item:
            raise UsageError(f"{path} {where}: a dict with neither 'prompt' nor 'messages' (it has {sorted(item)[:4]})",
                             PROMPTS_HINT)
        item = item["prompt"]
    if isinstance(item, str) or (isinstance(item, list) and item and all(_is_token_id(t) for t in item)):
        return item
    raise UsageError(f"{path} {where}: {_not_a_prompt(item)}", PROMPTS_HINT)


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _not_a_prompt(item) -> str:
    """What is wrong with an item that is not a prompt, in the user's terms."""
    if isinstance(item, int) and not isinstance(item, bool):
        return (f"{item!r} is a number, not a prompt: a file of one prompt of token ids is a list of lists "
                "([[1, 2, 3]], not [1, 2, 3])")
    if isinstance(item, list):
        if not item:
            return "an empty prompt"
        bad = next(t for t in item if not _is_token_id(t))
        what = ("a float" if isinstance(bad, float) else "negative" if isinstance(bad, int) and not isinstance(bad, bool)
                else f"a {type(bad).__name__}")
        return f"token id {bad!r} is {what}; token ids are non-negative integers"
    return f"a {type(item).__name__} ({str(item)[:40]}), not a text or a list of token ids"


def tokenize_args(prompts: list, model_spec: str, path: str, chat: bool = False) -> tuple[list, list]:
    """Token ids and texts of parsed prompts, text through the checkpoint's tokenizer
    (loaded before the model, so a missing one fails fast)."""
    texts_given = chat or any(not (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompts)
    tokenizer = load_tokenizer(model_spec, required_by=f"text prompts in {path}") if texts_given else None
    try:
        return tokenize_prompts(prompts, tokenizer, chat=chat)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None

