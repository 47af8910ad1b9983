"""A per-slot reference implementation of the context rules.

Written the straightforward way the existing tool does it (Python loops over
slots and capture names, reading the step-wise captures directly), so tests can check
the vectorised :class:`~fxreplace.TensorReplacer` against it and benchmarks can
measure what vectorising buys.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch


def reference_row(steps: Sequence[torch.Tensor] | torch.Tensor, position: int) -> torch.Tensor | None:
    """Row for ``position`` read straight from step-wise (or flat) captures; None past the end."""
    if isinstance(steps, torch.Tensor):
        return steps[position] if 0 <= position < steps.shape[0] else None
    prompt_len = steps[0].shape[1]
    if 0 <= position < prompt_len:
        return steps[0][0, position]
    step = position - prompt_len + 1
    if position < 0 or step >= len(steps):
        return None
    return steps[step][0, -1]


def slot_owners(
    num_slots: int,
    num_requests: int,
    *,
    positions: Sequence[int] | None = None,
    is_prefill: bool | None = None,
    tokens_per_req: int = 1,
    num_scheduled_tokens: Sequence[int] | None = None,
) -> list[int | None]:
    """Request index owning each slot (None = padding), one slot at a time."""
    owners: list[int | None] = []
    if num_scheduled_tokens is not None:
        for i, count in enumerate(num_scheduled_tokens):
            owners += [i] * count
    elif is_prefill:
        owners.append(0)
        for s in range(1, num_slots):
            if positions[s] != positions[s - 1] + 1:
                break
            owners.append(0)
    else:
        for s in range(num_slots):
            r = s // tokens_per_req
            if r >= num_requests:
                break
            owners.append(r)
    return owners + [None] * (num_slots - len(owners))


def build_context_loop(
    captures: Sequence[Mapping[str, Sequence[torch.Tensor]]] | Mapping[int, Mapping[str, torch.Tensor]],
    request_prompts: Sequence[int | None],
    positions: Sequence[int],
    owners: Sequence[int | None],
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Fill ``{capture_name: [slots, E]}`` and the mask slot by slot.

    ``request_prompts[i]`` is the prompt index of request ``i`` (None = unknown).
    """
    first = next(iter(captures.values() if isinstance(captures, Mapping) else captures))
    out = {}
    for name, steps in first.items():
        feat = steps if isinstance(steps, torch.Tensor) else steps[0]
        out[name] = torch.zeros(len(positions), feat.shape[-1], dtype=feat.dtype)
    mask = torch.zeros(len(positions), dtype=torch.bool)
    for s, (owner, pos) in enumerate(zip(owners, positions)):
        if owner is None or request_prompts[owner] is None:
            continue
        prompt = captures[request_prompts[owner]]
        for name in out:
            row = reference_row(prompt[name], int(pos))
            if row is None:
                break
            out[name][s] = row
            mask[s] = True
    return out, mask
