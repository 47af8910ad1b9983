"""The engine: its scheduler's steps run through the Hugging Face model with a KV cache, each
forward handed the replacement context of its batch.

What fxreplace needs is in ``BatchEngine.forward``: the step's layout (the requests in row
order, the tokens each computes, the padding after them, every slot's position) goes to
``replacer.build``, whose context the instrumented model takes as ``replacements=``. The model
sees the batch as ``[rows, width]``; the context numbers its slots row after row, as the model's
targets see their rows.
"""

from __future__ import annotations

import itertools

import torch
from transformers import DynamicCache

from fxreplace import TensorReplacer
from fxreplace.context import PerRequest
from fxreplace.engines.protocol import Engine, Generation

from .scheduler import PREFILL, Request, Scheduler, Step


class BatchEngine(Engine):
    """Greedy generation in batches of up to ``max_batch`` requests (a prefill step, then decode steps)."""

    def __init__(self, model, replacer: TensorReplacer, components=(), dtype: str = "float32", max_batch: int = 2):
        self.model, self.replacer, self.components, self.dtype = model, replacer, list(components), dtype
        self.vocab_size = model.config.vocab_size
        self.max_batch = max_batch
        self._ids = itertools.count()

    def generate(self, prompts, max_new_tokens: int, replace=True) -> list[Generation]:
        """``replace``: True (every target), False (none), the capture names to replace, or one
        such selection per prompt (a ``PerRequest``); requests that replace the same captures share
        a batch."""
        selections = replace if isinstance(replace, PerRequest) else [replace] * len(prompts)
        requests = [Request(f"batch-{next(self._ids)}", list(map(int, prompt)), max_new_tokens,
                            selection if isinstance(selection, bool) else frozenset(selection) or False)
                    for prompt, selection in zip(prompts, selections)]
        scheduler = Scheduler(self.max_batch)
        for request in requests:
            scheduler.add(request)
            if request.replace is not False:  # matched to its reference prompt by its tokens
                self.replacer.register_request(request.req_id, request.prompt)
        try:
            cache = mask = None
            while (step := scheduler.step()) is not None:
                if step.kind == PREFILL:  # a new wave: a new cache
                    cache, mask = DynamicCache(), torch.zeros(len(step.requests), 0, dtype=torch.long)
                mask = self.forward(step, cache, mask)
        finally:
            for request in requests:
                self.replacer.release_request(request.req_id)
        return [Generation(r.req_id, r.prompt, r.tokens, r.logits) for r in requests]

    def forward(self, step: Step, cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
        """Run one step, append each request's next token and its logits; returns the attention mask
        of every cache column so far (padding columns 0)."""
        rows = len(step.requests)
        input_ids = torch.zeros(rows, step.width, dtype=torch.long)
        positions = torch.zeros(rows, step.width, dtype=torch.long)  # padding slots: position 0
        new_mask = torch.zeros(rows, step.width, dtype=torch.long)
        for row, request in enumerate(step.requests):
            n, start = step.tokens(row), step.position(row)
            input_ids[row, :n] = torch.tensor(request.prompt if step.kind == PREFILL else request.tokens[-1:])
            positions[row, :n] = torch.arange(start, start + n)
            new_mask[row, :n] = 1
        mask = torch.cat([mask, new_mask], dim=1)
        with torch.no_grad():
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                             use_cache=True, replacements=self.context(step, positions.flatten()))
        for row, request in enumerate(step.requests):
            logits = out.logits[row, step.tokens(row) - 1].float()  # the row's last computed token
            request.logits.append(logits)
            request.tokens.append(int(logits.argmax()))
        return mask

    def context(self, step: Step, positions: torch.Tensor):
        """The replacement context of the step's ``rows * width`` slots: request ``r`` computes its
        tokens in the first slots of row ``r``, its padding fills the rest (replacement off there)."""
        replace = step.requests[0].replace  # one selection per wave (the scheduler's rule)
        if replace is False:
            return None
        counts = [step.tokens(row) for row in range(len(step.requests))]
        return self.replacer.build([r.req_id for r in step.requests], counts, positions,
                                   padding=[step.width - n for n in counts],
                                   names=None if replace is True else replace)
