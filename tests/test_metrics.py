"""compare_steps at scale: chunked, in the reference's top-k, equal to the whole-vocabulary original."""

import math

import torch

from fxreplace.metrics import (COMPARE_CHUNK_ROWS, DIVERGED, MATCHED, WITHIN_TOLERANCE, StepMetrics, Tolerances,
                               compare_steps)


def _original_compare_steps(reference, target, tol):
    """compare_steps as it was before chunking: every row at once in fp64, the vocabulary argsorted."""
    ref = torch.log_softmax(reference.double(), -1)
    tgt = torch.log_softmax(target.double(), -1)
    ref_tokens, tgt_tokens = reference.argmax(-1).tolist(), target.argmax(-1).tolist()
    nans = torch.isnan(target).any(-1).tolist()
    order = ref.argsort(dim=-1, descending=True)[:, :50]
    errors = (ref.gather(-1, order) - tgt.gather(-1, order)).abs()
    top5s, top50s = errors[:, :5].amax(-1).tolist(), errors.amax(-1).tolist()
    kls = (ref.exp() * (ref - tgt)).sum(-1).clamp(min=0).tolist()
    out = []
    for ref_token, tgt_token, nan, top5, top50, kl in zip(ref_tokens, tgt_tokens, nans, top5s, top50s, kls):
        if nan:
            out.append(StepMetrics(False, ref_token, -1, float("nan"), float("nan"), float("nan"), True, DIVERGED))
            continue
        agree = ref_token == tgt_token
        if not agree or top5 > tol.top5_atol or top50 > tol.top50_atol or kl > tol.kl_max:
            status = DIVERGED
        elif top5 <= tol.match_atol:
            status = MATCHED
        else:
            status = WITHIN_TOLERANCE
        out.append(StepMetrics(agree, ref_token, tgt_token, top5, top50, kl, False, status))
    return out


def test_compare_steps_equals_the_whole_vocabulary_original_on_random_logits():
    torch.manual_seed(0)
    rows, vocab = 3 * COMPARE_CHUNK_ROWS + 5, 3000  # chunks and a partial one
    reference = torch.randn(rows, vocab) * 3
    # every status: identical rows (matched), small noise (within tolerance), large noise (diverged), NaN
    scale = torch.tensor([0.0, 1e-3, 3e-2, 1.0])[torch.arange(rows) % 4]
    target = reference + scale[:, None] * torch.randn(rows, vocab)
    target[7, 11] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        ref, tgt = reference.to(dtype), target.to(dtype)
        got, want = compare_steps(ref, tgt, Tolerances()), _original_compare_steps(ref, tgt, Tolerances())
        assert [s.status for s in got] == [s.status for s in want]
        assert {s.status for s in got} == {MATCHED, WITHIN_TOLERANCE, DIVERGED}
        for g, w in zip(got, want):
            assert (g.top1_agree, g.reference_token, g.target_token, g.nan) == (w.top1_agree, w.reference_token,
                                                                                  w.target_token, w.nan)
            for field in ("top5_error", "top50_error", "kl"):
                a, b = getattr(g, field), getattr(w, field)
                assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15), (field, a, b)


def test_compare_steps_on_a_vocabulary_smaller_than_the_top_50():
    torch.manual_seed(1)
    reference, target = torch.randn(4, 20), torch.randn(4, 20)
    assert compare_steps(reference, target) == _original_compare_steps(reference, target, Tolerances())
