"""The engine's scheduler and what each of its steps hands the model runner (its scheduler output).

Requests wait in arrival order; when none is running, up to ``max_batch`` of them that replace the
same captures start together with one *prefill* step (every prompt in one forward, each row padded
to the longest prompt), then run *decode* steps (one token per request) until each has its tokens.
A real server would also admit requests while others decode; this one keeps one wave at a time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

PREFILL, DECODE = "prefill", "decode"


@dataclass
class Request:
    """One prompt being served: ``replace`` True (every capture replaced), False (none) or the
    capture names it replaces; ``tokens`` and ``logits`` grow by one per step."""

    req_id: str
    prompt: list[int]
    max_new_tokens: int
    replace: bool | frozenset
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens


@dataclass
class Step:
    """One forward's batch: ``kind`` PREFILL or DECODE, the requests in row order, and ``width``, the
    slots of each row (the longest prompt for a prefill, 1 for a decode). Row ``r`` computes
    ``tokens(r)`` tokens; the rest of its slots are padding."""

    kind: str
    requests: list[Request]
    width: int

    def tokens(self, row: int) -> int:
        request = self.requests[row]
        return len(request.prompt) if self.kind == PREFILL else 1

    def position(self, row: int) -> int:
        """The position of row ``row``'s first token."""
        request = self.requests[row]
        return 0 if self.kind == PREFILL else len(request.prompt) + len(request.tokens) - 1


class Scheduler:
    """Static batching: one wave of up to ``max_batch`` requests at a time."""

    def __init__(self, max_batch: int):
        self.max_batch = max_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def step(self) -> Step | None:
        """The next forward's batch (None: nothing left to run)."""
        self.running = [r for r in self.running if not r.done]
        if self.running:
            return Step(DECODE, self.running, 1)
        if not self.waiting:
            return None
        first = self.waiting[0].replace  # a wave shares one context: its requests replace the same captures
        while self.waiting and len(self.running) < self.max_batch and self.waiting[0].replace == first:
            self.running.append(self.waiting.popleft())
        return Step(PREFILL, self.running, max(len(r.prompt) for r in self.running))
