"""Shared helpers for the graph-pass tests: tiny models and an independent
reference that overrides router logits without fxreplace."""

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fxreplace.context import ReplacementContext

TOKENS = 8


class OverrideLinear(TorchFunctionMode):
    """Replaces the result of ``F.linear`` calls whose weight is one of the
    given router weights: ``where(mask, replacement, logits)``. Independent of
    fxreplace's graph rewriting, so it is a fair reference."""

    def __init__(self, weights_to_replacement: dict, mask: torch.Tensor):
        super().__init__()
        self.by_ptr = {w.data_ptr(): r for w, r in weights_to_replacement.items()}
        self.mask = mask

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (F.linear, torch._C._nn.linear) and args[1].data_ptr() in self.by_ptr:
            replacement = self.by_ptr[args[1].data_ptr()]
            out = torch.where(self.mask.unsqueeze(-1), replacement.to(out.dtype), out.reshape(-1, out.shape[-1]))
        return out


@contextlib.contextmanager
def override_outputs(model, replacements: dict, mask: torch.Tensor, index=None):
    """Reference for output points: forward hooks replacing module outputs."""
    handles = []
    for name, replacement in replacements.items():
        def hook(module, args, output, replacement=replacement):
            value = output if index is None else output[index]
            flat = value.reshape(-1, value.shape[-1])
            new = torch.where(mask.unsqueeze(-1), replacement, flat).reshape(value.shape)
            return new if index is None else (*output[:index], new, *output[index + 1:])
        handles.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def random_context(names, num_experts, tokens=TOKENS, seed=0, scale=3.0, mask=None):
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(tokens, num_experts, generator=gen) * scale for n in names}
    if mask is None:
        mask = torch.rand(tokens, generator=gen) > 0.3
    return ReplacementContext(tensors, mask)


def contiguous_context(names, num_experts, tokens=TOKENS, seed=0):
    """random_context's values, each name in a group of its own (``from_storage``), so every
    tensor is contiguous: what an eager bound feed hands on without a copy. A hand-made context
    packs its names into one position-major group per width, like the replacer's."""
    ctx = random_context(names, num_experts, tokens, seed)
    return ReplacementContext.from_storage(tuple(ctx[n][:, None].clone() for n in names), ctx.mask,
                                           {n: (g, 0) for g, n in enumerate(names)})


def off_context(names, num_experts, tokens=TOKENS):
    return ReplacementContext({n: torch.zeros(tokens, num_experts) for n in names},
                              torch.zeros(tokens, dtype=torch.bool))


def input_ids(tokens=TOKENS, seed=0):
    return torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(seed))
