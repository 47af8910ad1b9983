"""Per-step logit comparison between a reference and a target model."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

MATCHED, WITHIN_TOLERANCE, DIVERGED = "matched", "within_tolerance", "diverged"


@dataclass(frozen=True)
class Tolerances:
    """When a step counts as matched / within tolerance / diverged.

    Errors are absolute differences of log-probabilities over the reference's top-k
    tokens. A step is *diverged* when the top-1 token differs or any error exceeds
    its tolerance, *matched* when the top-1 agrees and the top-5 error is at most
    ``match_atol`` (numerically the same model), and *within tolerance* otherwise.
    Defaults suit a bf16 target against an fp32 reference.
    """

    match_atol: float = 1e-4
    top5_atol: float = 0.1
    top50_atol: float = 0.5
    kl_max: float = 0.05

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepMetrics:
    top1_agree: bool
    reference_token: int
    target_token: int
    top5_error: float
    top50_error: float
    kl: float
    nan: bool
    status: str


def compare_logits(reference: torch.Tensor, target: torch.Tensor, tol: Tolerances = Tolerances()) -> StepMetrics:
    """Compare one step's ``[vocab]`` logits (any float dtype; computed in fp64)."""
    if reference.shape != target.shape:
        raise ValueError(f"reference logits {tuple(reference.shape)} and target logits {tuple(target.shape)} differ in shape "
                         "(is the reference from another model?)")
    ref = torch.log_softmax(reference.double(), -1)
    tgt = torch.log_softmax(target.double(), -1)
    ref_token, tgt_token = int(reference.argmax()), int(target.argmax())
    nan = bool(torch.isnan(target).any())
    if nan:
        return StepMetrics(False, ref_token, -1, float("nan"), float("nan"), float("nan"), True, DIVERGED)
    order = ref.argsort(descending=True)
    top5 = float((ref[order[:5]] - tgt[order[:5]]).abs().max())
    top50 = float((ref[order[:50]] - tgt[order[:50]]).abs().max())
    kl = float((ref.exp() * (ref - tgt)).sum().clamp(min=0))
    agree = ref_token == tgt_token
    if not agree or top5 > tol.top5_atol or top50 > tol.top50_atol or kl > tol.kl_max:
        status = DIVERGED
    elif top5 <= tol.match_atol:
        status = MATCHED
    else:
        status = WITHIN_TOLERANCE
    return StepMetrics(agree, ref_token, tgt_token, top5, top50, kl, False, status)


def topk_agreement(reference: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, whether the sets of the top-k indices agree (the experts a router picks)."""
    ref = reference.float().topk(k, dim=-1).indices.sort(-1).values
    tgt = target.float().topk(k, dim=-1).indices.sort(-1).values
    return (ref == tgt).all(-1)
