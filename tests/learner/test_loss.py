"""SPEC §3 loss on hand-made tensors against a loop-by-loop numpy reference written from the formulas."""
import math

import numpy as np
import pytest
import torch

from learner.correction import sparse_correction
from learner.loss import grpo_advantages, grpo_loss


def reference_loss(logp, logp_old, adv, mask, w, n, logp_ref=None, beta=0.0, lo=0.2, hi=0.2):
    """SPEC §3 written with explicit loops over sequences and tokens."""
    pg, kl = 0.0, 0.0
    for i in range(len(logp)):
        m_sum = max(1.0, sum(mask[i]))
        seq_pg, seq_kl = 0.0, 0.0
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            r = math.exp(logp[i][t] - logp_old[i][t])
            seq_pg += w[i][t] * max(-r * adv[i], -min(max(r, 1 - lo), 1 + hi) * adv[i])
            if beta:
                d = logp_ref[i][t] - logp[i][t]
                seq_kl += min(max(math.exp(d) - d - 1, -10), 10)
        pg += seq_pg / m_sum
        kl += seq_kl / m_sum
    return pg / n + beta * kl / n, pg / n, kl / n


def test_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735; group 1: std 0 -> advantage 0
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    np.testing.assert_allclose(grpo_advantages(rewards, groups).numpy(), [a, -a, -a, a, 0, 0, 0, 0], rtol=1e-6)


def test_advantages_without_std_by_hand():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.95, 0.2, 0.6])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    # group 0: mean 0.9875 -> 0.0125 x 3, -0.0375 (GRPO's std 0.025 would make them 0.5 and -1.5); group 1: mean 0.4
    np.testing.assert_allclose(grpo_advantages(rewards, groups, norm_by_std=False).numpy(),
                               [0.0125, 0.0125, 0.0125, -0.0375, -0.2, 0.2], rtol=1e-5)
    np.testing.assert_allclose(grpo_advantages(rewards, groups).numpy()[:4], [0.5, 0.5, 0.5, -1.5], rtol=1e-4)


LOGP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.8], [-0.9, -0.1, -1.5]]
LOGP_OLD = [[-1.1, -0.9, -2.0], [-0.3, -0.6, -1.0], [-0.2, -0.1, -1.4]]
LOGP_REF = [[-1.3, -0.4, -2.5], [-0.2, -1.0, -0.8], [-0.9, -0.3, -1.0]]
ADV = [1.0, -0.5, 2.0]
MASK = [[1, 1, 1], [1, 1, 0], [0, 0, 0]]   # the third sequence is rejected but still counts in N
W = [[1.1, 0.9, 1.0], [1.2, 0.8, 1.0], [1.0, 1.0, 1.0]]


def test_clipped_loss_with_kl_matches_reference():
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    logp = t(LOGP).requires_grad_()
    loss, m = grpo_loss(logp, t(LOGP_OLD), t(ADV), t(MASK), t(W), num_seqs=3, logp_ref=t(LOGP_REF), kl_coef=0.1)
    ref, ref_pg, ref_kl = reference_loss(LOGP, LOGP_OLD, ADV, MASK, W, 3, LOGP_REF, 0.1)
    assert loss.item() == pytest.approx(ref, rel=1e-9)
    assert m["pg_loss"] == pytest.approx(ref_pg, rel=1e-9)
    assert m["kl_loss"] == pytest.approx(ref_kl, rel=1e-9)
    # ratios on the 5 masked tokens: e^0.1, e^0.4 (clipped), 1, 1, e^-0.6 (clipped)
    assert m["clip_fraction"] == pytest.approx(2 / 5)
    loss.backward()
    assert logp.grad[2].abs().sum() == 0           # rejected sequence: no gradient
    logp.grad = None
    grpo_loss(logp, t(LOGP_OLD), t(ADV), t(MASK), t(W), num_seqs=3)[0].backward()
    assert logp.grad[0, 1] == 0                    # clipped with A > 0 and r > 1 + eps: no pg gradient
    assert logp.grad[0, 0] != 0


def test_token_mean_by_hand():
    # the 5 loss tokens' w * L_clip, worked out by hand: sequence 0 (A = 1): r = e^0.1 -> -1.1 * e^0.1, r = e^0.4
    # clipped to 1.2 -> -0.9 * 1.2, r = 1 -> -1; sequence 1 (A = -0.5): r = 1 -> 1.2 * 0.5, r = e^-0.6 clipped
    # to 0.8 (the max picks it) -> 0.8 * 0.5 * 0.8; sequence 2 rejected
    seq0 = -1.1 * math.exp(0.1) - 0.9 * 1.2 - 1.0
    seq1 = 1.2 * 0.5 + 0.8 * 0.5 * 0.8
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    token_mean, m = grpo_loss(t(LOGP), t(LOGP_OLD), t(ADV), t(MASK), t(W), num_seqs=3, num_tokens=9)
    assert token_mean.item() == pytest.approx((seq0 + seq1) / 9, rel=1e-12)     # 9 response tokens, 3 rejected
    assert m["pg_loss"] == pytest.approx((seq0 + seq1) / 9, rel=1e-12)
    seq_mean, _ = grpo_loss(t(LOGP), t(LOGP_OLD), t(ADV), t(MASK), t(W), num_seqs=3)
    assert seq_mean.item() == pytest.approx((seq0 / 3 + seq1 / 2) / 3, rel=1e-12)
    with pytest.raises(ValueError, match="num_tokens"):
        grpo_loss(t(LOGP), t(LOGP_OLD), t(ADV), t(MASK), t(W), num_seqs=3, num_tokens=0)


def test_sparse_rl_equals_plain_grpo_when_sampler_matches_dense():
    rng = np.random.default_rng(0)
    logp_old = -rng.uniform(0.1, 3.0, size=(4, 5))
    logp = logp_old + rng.normal(0, 0.3, size=(4, 5))
    mask = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    adv = grpo_advantages(rewards, torch.zeros(4, dtype=torch.long))
    weights, loss_mask, m = sparse_correction(torch.tensor(logp_old), torch.tensor(logp_old), torch.tensor(mask))
    assert m["rejection_rate"] == 0 and m["mismatch_kl"] == 0
    loss, _ = grpo_loss(torch.tensor(logp), torch.tensor(logp_old), adv.double(), loss_mask.double(),
                        weights.double(), num_seqs=4)
    ones = np.ones((4, 5))
    plain, _, _ = reference_loss(logp.tolist(), logp_old.tolist(), adv.tolist(), mask, ones.tolist(), 4)
    assert loss.item() == pytest.approx(plain, rel=1e-6)


def test_kl_needs_reference():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="logp_ref"):
        grpo_loss(z, z, torch.zeros(1), z, z, num_seqs=1, kl_coef=0.1)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(z, z, torch.zeros(2), z, z, num_seqs=1)


def test_zero_variance_is_all_rewards_equal():
    from learner.loss import zero_variance
    assert zero_variance([1.0, 1.0, 1.0]) and zero_variance([0.0, 0.0]) and zero_variance([0.5])
    assert not zero_variance([0.0, 1.0]) and not zero_variance([0.25, 0.25, 0.2500001])
