"""SPEC §2 correction on hand-made 3 x 4 tensors; expected values worked out by hand below."""
import math

import numpy as np
import pytest
import torch

from learner.correction import sparse_correction

# xi = pi_old / pi_sparse chosen per token; 0 marks padding.
XI = [
    [1.0, 1.2, 0.8, 0.0],   # kept; nothing masked
    [1.0, 5e-5, 1.0, 1.0],  # one token below eps = 1e-4 -> whole sequence vetoed
    [2.0, 0.4, 1.0, 0.0],   # not vetoed; 2.0 > 1.5 and 0.4 < 0.5 are token-masked; 2.0 truncated to 1.5
]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]]


def make_inputs():
    mask = torch.tensor(MASK, dtype=torch.bool)
    logp_sparse = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.7, -1.1, -2.2, -0.3], [-1.5, -0.9, -0.4, -9.0]],
                               dtype=torch.float64)
    log_xi = torch.tensor([[math.log(x) if x > 0 else 0.0 for x in row] for row in XI], dtype=torch.float64)
    logp_old = logp_sparse + log_xi
    logp_old[0, 3] = -50.0  # padding values must not matter
    return logp_old, logp_sparse, mask


def test_veto_token_mask_and_weights():
    logp_old, logp_sparse, mask = make_inputs()
    weights, loss_mask, m = sparse_correction(logp_old, logp_sparse, mask)

    assert loss_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 1, 0]]
    # min(xi, 1.5) over the 10 valid tokens: 1+1.2+0.8 + 1+5e-5+1+1 + 1.5+0.4+1 = 8.90005
    mean_w = 8.90005 / 10
    expected_w = [[1.0, 1.2, 0.8, 0.0], [1.0, 5e-5, 1.0, 1.0], [1.5, 0.4, 1.0, 0.0]]
    np.testing.assert_allclose(weights.numpy(), np.array(expected_w) / mean_w, rtol=1e-5)
    assert not weights.requires_grad

    assert m["rejection_rate"] == pytest.approx(1 / 3)
    assert m["token_mask_fraction"] == pytest.approx(3 / 10)   # 5e-5, 2.0, 0.4
    assert m["truncate_fraction"] == pytest.approx(1 / 10)     # 2.0
    assert m["catastrophic_token_fraction"] == pytest.approx(1 / 10)
    k3 = [[x - math.log(x) - 1 for x, v in zip(row, mrow) if v] for row, mrow in zip(XI, MASK)]
    assert m["mismatch_kl"] == pytest.approx(np.mean([np.mean(r) for r in k3]), rel=1e-6)
    k1 = [[-math.log(x) for x, v in zip(row, mrow) if v] for row, mrow in zip(XI, MASK)]
    assert m["mismatch_kl_k1"] == pytest.approx(np.mean([np.mean(r) for r in k1]), rel=1e-6)


def test_token_mask_off_keeps_out_of_bounds_tokens():
    logp_old, logp_sparse, mask = make_inputs()
    _, loss_mask, m = sparse_correction(logp_old, logp_sparse, mask, token_mask=False)
    assert loss_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 0]]
    assert m["token_mask_fraction"] == 0.0


def test_geometric_rejection_is_two_sided():
    logp_old, logp_sparse, mask = make_inputs()
    # geometric means: (0.96)^(1/3) = 0.9865, (5e-5)^(1/4) = 0.0841, (0.8)^(1/3) = 0.9283
    _, loss_mask, m = sparse_correction(logp_old, logp_sparse, mask, rejection="geometric",
                                        geo_bounds=(0.95, 1.05), token_mask=False)
    assert loss_mask.sum(1).tolist() == [3, 0, 0]
    assert m["rejection_rate"] == pytest.approx(2 / 3)
    # a sequence far above 1 is rejected by the geometric bounds but never by the one-sided veto
    big = torch.tensor([[math.log(100.0), 0.0]])
    zero = torch.zeros(1, 2)
    one = torch.ones(1, 2, dtype=torch.bool)
    assert sparse_correction(big, zero, one, rejection="geometric")[2]["rejection_rate"] == 1.0
    assert sparse_correction(big, zero, one, rejection="veto", token_mask=False)[1].tolist() == [[1, 1]]


def test_no_rejection_and_log_clamp():
    logp_old = torch.tensor([[30.0, 0.0]])
    logp_sparse = torch.zeros(1, 2)
    _, loss_mask, m = sparse_correction(logp_old, logp_sparse, torch.ones(1, 2), rejection="none",
                                        token_mask=False)
    assert loss_mask.tolist() == [[1, 1]]
    assert m["xi_max"] == pytest.approx(math.exp(20.0), rel=1e-5)  # log xi clamped to 20
    assert m["rejection_rate"] == 0.0


def test_metrics_only_and_off_change_nothing():
    logp_old, logp_sparse, mask = make_inputs()
    for mode in ("metrics_only", "off"):
        weights, loss_mask, m = sparse_correction(logp_old, logp_sparse, mask, correction=mode)
        assert loss_mask.tolist() == [[float(v) for v in row] for row in MASK]
        assert weights.tolist() == loss_mask.tolist()
    assert sparse_correction(logp_old, logp_sparse, mask, correction="metrics_only")[2]["rejection_rate"] == \
        pytest.approx(1 / 3)


def test_bad_input_names_the_tensors():
    with pytest.raises(ValueError, match="logp_sparse"):
        sparse_correction(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="rejection"):
        sparse_correction(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), rejection="max")


def test_ratio_tail_quantiles_by_hand():
    """Valid xi = 0.5, 1, 2, 4 (one padding slot ignored). Sorted xi: 0.5 1 2 4; linear interpolation at
    position q * (n - 1): p50 at 1.5 -> 1.5, p5 at 0.15 -> 0.5 + 0.15 * 0.5 = 0.575, p1 at 0.03 -> 0.515.
    min(xi, 1/xi) = 0.5 1 0.5 0.25, sorted 0.25 0.5 0.5 1: p50 -> 0.5, p5 -> 0.25 + 0.15 * 0.25 = 0.2875,
    p1 -> 0.25 + 0.03 * 0.25 = 0.2575."""
    xi = torch.tensor([[0.5, 1.0, 2.0], [4.0, 7.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    logp_sparse = torch.zeros(2, 3)
    _, _, m = sparse_correction(torch.log(xi), logp_sparse, mask, correction="metrics_only")
    expected = {"xi_p50": 1.5, "xi_p5": 0.575, "xi_p1": 0.515,
                "xi_sym_p50": 0.5, "xi_sym_p5": 0.2875, "xi_sym_p1": 0.2575}
    for name, value in expected.items():
        assert m[name] == pytest.approx(value, abs=1e-6), name


def test_unnormalised_weights_are_the_truncated_ratios():
    logp_old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    logp_sparse = torch.log(torch.tensor([[0.25, 0.8, 0.9]]))      # xi = 2, 0.25, 1 -> min(xi, 1.5) = 1.5, 0.25, 1
    mask = torch.tensor([[True, True, False]])                       # the third token is padding
    raw, _, m = sparse_correction(logp_old, logp_sparse, mask, token_mask=False, normalize=False)
    torch.testing.assert_close(raw, torch.tensor([[1.5, 0.25, 0.0]]))
    weights, _, _ = sparse_correction(logp_old, logp_sparse, mask, token_mask=False)
    assert m["tis_weight_mean"] == pytest.approx(0.875)              # (1.5 + 0.25) / 2
    torch.testing.assert_close(weights, torch.tensor([[1.5, 0.25, 0.0]]) / 0.875)
