"""Acceptance-rate bounds (learner/acceptance.py, Sparrow §3.1 eq. 2) against exact full-vocabulary values
computed here by hand and with numpy."""
import math

import numpy as np
import pytest
import torch

from learner.acceptance import acceptance_bounds, acceptance_metrics


def topk_of_q(q: np.ndarray, p: np.ndarray, k: int):
    """log q and log p at the k most likely tokens of q (the actors' top-k), as float64 tensors [..., k]."""
    order = np.argsort(-q, axis=-1, kind="stable")[..., :k]
    with np.errstate(divide="ignore"):            # a probability of exactly 0 is log 0 = -inf: exp gives it back
        return (torch.from_numpy(np.log(np.take_along_axis(q, order, -1))),
                torch.from_numpy(np.log(np.take_along_axis(p, order, -1))))


def test_hand_made_distributions():
    # q (sparse) = [0.6, 0.3, 0.1], p (dense) = [0.2, 0.5, 0.3]: alpha = 0.2 + 0.3 + 0.1 = 0.6
    q, p = np.array([0.6, 0.3, 0.1]), np.array([0.2, 0.5, 0.3])
    expected = {  # K: (lower, upper, 1 - q(topK))
        3: (0.6, 0.6, 0.0),          # the whole vocabulary: exact
        2: (0.5, 0.6, 0.1),          # {0, 1}: 0.2 + 0.3; outside q 0.1, p 0.3
        1: (0.2, 0.6, 0.4),          # {0}: 0.2; outside q 0.4, p 0.8
    }
    for k, (lo, up, out) in expected.items():
        lower, upper, outside = acceptance_bounds(*topk_of_q(q, p, k))
        assert math.isclose(lower.item(), lo, abs_tol=1e-6), k
        assert math.isclose(upper.item(), up, abs_tol=1e-6), k
        assert math.isclose(outside.item(), out, abs_tol=1e-6), k
    # identical distributions accept everything; disjoint ones nothing
    lower, upper, _ = acceptance_bounds(*topk_of_q(q, q, 3))
    assert math.isclose(lower.item(), 1.0, abs_tol=1e-6) and math.isclose(upper.item(), 1.0, abs_tol=1e-6)
    lower, upper, _ = acceptance_bounds(*topk_of_q(np.array([1 - 2e-9, 1e-9, 1e-9]),
                                                   np.array([1e-9, 1e-9, 1 - 2e-9]), 3))
    assert lower.item() < 1e-6 and upper.item() < 1e-6


@pytest.mark.parametrize("concentration", [0.05, 1.0])
def test_bounds_contain_the_exact_full_vocabulary_value(concentration):
    """Random pairs over a 64-token vocabulary (peaked and flat): exact alpha = sum_x min(p, q) over the whole
    vocabulary (numpy); top-k = the vocabulary gives it, every smaller k brackets it, and the bounds tighten as
    k grows (lower rises, upper falls)."""
    rng = np.random.default_rng(0)
    q = rng.dirichlet([concentration] * 64, size=(5, 7))
    p = 0.7 * q + 0.3 * rng.dirichlet([concentration] * 64, size=(5, 7))   # related, not equal
    exact = np.minimum(p, q).sum(-1)
    lower, upper, outside = acceptance_bounds(*topk_of_q(q, p, 64))
    assert np.allclose(lower.numpy(), exact, atol=1e-6) and np.allclose(upper.numpy(), exact, atol=1e-6)
    assert np.allclose(outside.numpy(), 0, atol=1e-6)
    last_lower, last_upper = np.zeros_like(exact), np.ones_like(exact)
    for k in (1, 2, 5, 20, 40):
        lower, upper, _ = (t.double().numpy() for t in acceptance_bounds(*topk_of_q(q, p, k)))
        assert (lower <= exact + 1e-6).all() and (exact <= upper + 1e-6).all(), k
        assert (lower >= last_lower - 1e-6).all() and (upper <= last_upper + 1e-6).all(), k
        last_lower, last_upper = lower, upper
        if k == 5:
            assert (lower < exact - 1e-3).any() and (upper > exact + 1e-3).any(), "no gap: the check would see nothing"


def test_metrics_over_valid_tokens_only():
    """accept_* are taken over mask-valid tokens: quantiles of the lower bound (torch.quantile, linear), the
    upper bound's mean and p5, the mean mass outside the top k."""
    # 2 sequences x 3 positions, K = 2 over a 3-token vocabulary; lower bound of position t is 0.1 * (t + 1) etc.
    q = np.array([0.5, 0.3, 0.2])
    rows = []
    for a in (0.1, 0.2, 0.3, 0.4, 0.5, 0.9):     # p = [a, 0.3, 0.7 - a]: lower (top-2 of q) = a + 0.3 when a <= 0.5
        rows.append(np.array([a, 0.3, 0.7 - a]))
    p = np.stack(rows).reshape(2, 3, 3)
    logq, logp = topk_of_q(np.broadcast_to(q, p.shape).copy(), p, 2)
    mask = torch.tensor([[True, True, True], [True, True, False]])          # the a = 0.9 token is padding
    m = acceptance_metrics(logq, logp, mask)
    lower = torch.tensor([0.4, 0.5, 0.6, 0.7, 0.8], dtype=torch.float64)
    assert math.isclose(m["accept_mean"], 0.6, abs_tol=1e-6)
    assert math.isclose(m["accept_p5"], torch.quantile(lower, 0.05).item(), abs_tol=1e-6)   # 0.42
    assert math.isclose(m["accept_p1"], 0.404, abs_tol=1e-6)
    assert math.isclose(m["accept_p50"], 0.6, abs_tol=1e-6)
    # outside the top 2: q 0.2, p 0.7 - a -> upper = lower + min(0.2, 0.7 - a) = lower + 0.2 (a <= 0.5)
    assert math.isclose(m["accept_upper_mean"], 0.8, abs_tol=1e-6)
    assert math.isclose(m["accept_upper_p5"], 0.62, abs_tol=1e-6)
    assert math.isclose(m["accept_topk_mass_outside"], 0.2, abs_tol=1e-6)
    empty = acceptance_metrics(logq, logp, torch.zeros(2, 3, dtype=torch.bool))
    assert all(math.isnan(v) for v in empty.values())
    with pytest.raises(ValueError, match="one shape"):
        acceptance_bounds(logq, logp[..., :1])
