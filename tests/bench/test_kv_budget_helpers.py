"""Pure helpers of bench/kv_budget.py on hand-made values: the exact acceptance rate against its top-K bounds,
the constant budget of the same mean as a length schedule, quantiles by position bucket."""
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from compressors import CompressorConfig

_path = Path(__file__).parents[2] / "bench" / "kv_budget.py"
_spec = importlib.util.spec_from_file_location("kv_budget", _path)
kv_budget = importlib.util.module_from_spec(_spec)
_saved = sys.path[:]
_spec.loader.exec_module(kv_budget)   # the module trims bench/ off sys.path: put it back as it was
sys.path[:] = _saved


def test_exact_vs_topk_by_hand():
    # one position, 4-token vocabulary; q (sparse) and p (dense) given out of q's order: the helper sorts by q
    q = torch.tensor([[0.1, 0.5, 0.3, 0.1]], dtype=torch.float64)
    p = torch.tensor([[0.4, 0.4, 0.1, 0.1]], dtype=torch.float64)
    # exact alpha = min: 0.1 + 0.4 + 0.1 + 0.1 = 0.7
    # K = 1 (token 1): lower 0.4, upper 0.4 + min(0.5, 0.6) = 0.9, outside 0.5
    # K = 2 (tokens 1, 2): lower 0.5, upper 0.5 + min(0.2, 0.5) = 0.7, outside 0.2
    out = kv_budget.exact_vs_topk(q.log()[None], p.log()[None], torch.ones(1, 1, dtype=torch.bool), (1, 2))
    assert out["exact_p5"] == pytest.approx(0.7) and out["exact_mean"] == pytest.approx(0.7)
    assert out["tokens"] == 1
    assert out["K1"]["lower_p5"] == pytest.approx(0.4) and out["K1"]["upper_p5"] == pytest.approx(0.9)
    assert out["K1"]["max_abs_lower"] == pytest.approx(0.3) and out["K1"]["max_abs_upper"] == pytest.approx(0.2)
    assert out["K1"]["mass_outside_mean"] == pytest.approx(0.5)
    assert out["K2"]["lower_p5"] == pytest.approx(0.5) and out["K2"]["upper_p5"] == pytest.approx(0.7)
    assert out["K2"]["max_abs_upper"] == pytest.approx(0.0, abs=1e-6) and out["K2"]["bounds_contain_exact"]


def test_exact_vs_topk_quantiles_over_valid_tokens_only():
    # 3 positions, 2-token vocabulary, the last one padding; exact alpha = 1 - |q0 - p0|: 0.9, 0.5, (0.0 padding)
    q = torch.tensor([[[0.5, 0.5], [0.75, 0.25], [1.0, 0.0]]], dtype=torch.float64)
    p = torch.tensor([[[0.4, 0.6], [0.25, 0.75], [0.0, 1.0]]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    out = kv_budget.exact_vs_topk(q.log(), p.log(), mask, (2,))
    assert out["tokens"] == 2
    assert out["exact_mean"] == pytest.approx(0.7)
    assert out["exact_p5"] == pytest.approx(0.5 + 0.05 * 0.4)           # linear interpolation between 0.5 and 0.9
    assert out["K2"]["lower_p5"] == pytest.approx(out["exact_p5"])      # K = vocabulary: exact


def test_equal_mean_budget_of_a_length_schedule():
    """The constant budget with the schedule's mean over the tokens actually generated: start 48, +0.5 a token,
    capped at 52. A 4-token response has budgets 48, 49 (48.5 rounded half up), 49, 50; a 10-token one adds 50, 51,
    51, 52, 52, 52. Mean over the 14 tokens = (196 + 4 * 52 + ... ) / 14, computed below by hand."""
    cfg = CompressorConfig(kv_budget=48, budget_schedule="length", budget_growth=0.5, kv_budget_final=52)
    budgets = [48, 49, 49, 50] + [48, 49, 49, 50, 50, 51, 51, 52, 52, 52]
    assert kv_budget.equal_mean_budget(cfg, 48, [4, 10]) == round(sum(budgets) / len(budgets))   # 50.0 -> 50
    assert kv_budget.equal_mean_budget(cfg, 48, [1]) == 48
    assert kv_budget.equal_mean_budget(CompressorConfig(kv_budget=48), 48, [7, 3]) == 48          # constant schedule
    with pytest.raises(ValueError, match="no generated token"):
        kv_budget.equal_mean_budget(cfg, 48, [0, 0])


def test_bucket_p5():
    values = torch.arange(60, dtype=torch.float64).reshape(1, 60) / 100      # position t has value t / 100
    mask = torch.ones(1, 60, dtype=torch.bool)
    mask[0, 50:] = False
    out = kv_budget.bucket_p5(values, mask, 25)
    # bucket 0-25: 25 values 0.00..0.24, p5 = 0.05 * 24 / 100 = 0.012; 25-50: 0.25..0.49 -> 0.262; 50-75: all padding
    assert out == {"0-25": pytest.approx(0.012), "25-50": pytest.approx(0.262)}
    assert math.isclose(kv_budget.spread(out), 0.25)
