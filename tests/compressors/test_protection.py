"""Protection, every method (sinks, protect_prompt, protect_values): hand-made cases, every expected kept set derived
in the comments, with H2O's attention mass as the score so that the ranking is the given numbers."""
from __future__ import annotations

import pytest
import torch

from compressors import CompressorConfig, SelectContext, build_compressor


def h2o(**kw):
    return build_compressor(CompressorConfig(method="h2o", window=1, h2o_recent=2, **kw))


def test_protect_prompt_last_n_keeps_the_prompts_boundary():
    # seq 12, budget 7, recent 2 (slots 10, 11); prompt = positions 0..4, last:2 protects positions 3 and 4 (mass 0).
    # The other 3 slots: the largest masses among 0, 1, 2, 5..9: 0.9 (0), 0.8 (2), 0.7 (5).
    mass = torch.tensor([[[0.9, 0.1, 0.8, 0.0, 0.0, 0.7, 0.2, 0.6, 0.3, 0.5, 0.0, 0.0]]])
    ctx = SelectContext(attn_mass=mass, positions=torch.arange(12)[None], prompt_len=torch.tensor([5]))
    keys = torch.randn(1, 1, 12, 4)
    kept = h2o(kv_budget=7, protect_prompt="last:2").select(keys, None, None, ctx)
    assert kept.tolist() == [[[0, 2, 3, 4, 5, 10, 11]]]
    # unprotected: the 5 largest masses, 0 .9, 2 .8, 5 .7, 7 .6, 9 .5
    assert h2o(kv_budget=7).select(keys, None, None, ctx).tolist() == [[[0, 2, 5, 7, 9, 10, 11]]]
    # all: positions 0..4 (5 slots) + recent 2 = the budget
    kept = h2o(kv_budget=8, protect_prompt="all").select(keys, None, None, ctx)
    assert kept.tolist() == [[[0, 1, 2, 3, 4, 5, 10, 11]]]


def test_protect_values_keeps_the_largest_value_norms_before_the_window():
    # seq 10, budget 5, recent 2 (8, 9). Value norms: slot 6 has 5, slot 9 has 10 (in the window: not counted),
    # the others 1. protect_values 1 keeps 6; the other 2 slots: the largest masses 0 (.9), 1 (.8).
    values = torch.zeros(1, 1, 10, 2)
    values[..., 0] = 1.0
    values[0, 0, 6, 0], values[0, 0, 9, 0] = 5.0, 10.0
    mass = torch.tensor([[[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.0, 0.3, 0.0, 0.0]]])
    c = h2o(kv_budget=5, protect_values=1)
    assert c.needs == {"attn_mass", "values"}
    idx = c.select(torch.randn(1, 1, 10, 2), None, None, SelectContext(attn_mass=mass, values=values))
    assert idx.tolist() == [[[0, 1, 6, 8, 9]]]


def test_sinks_protect_the_first_valid_slots_for_any_method():
    # seq 10, budget 6, recent 2, sinks 2. Row 0: sinks 0, 1 (mass 0); then the 2 largest masses of 2..7: 7, 6.
    # Row 1 has 3 left pads: its sinks are slots 3, 4; then the largest masses of 5..7: 7, 6.
    mass = torch.tensor([[0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.0, 0.0]]).expand(2, 1, 10).clone()
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :3] = False
    idx = h2o(kv_budget=6, sinks=2).select(torch.randn(2, 1, 10, 2), None, valid, SelectContext(attn_mass=mass))
    assert idx.tolist() == [[[0, 1, 6, 7, 8, 9]], [[3, 4, 6, 7, 8, 9]]]
    assert CompressorConfig(method="rkv").sink_tokens == 0 and CompressorConfig(method="streamingllm").sink_tokens == 4


def test_a_prompt_longer_than_the_budget_keeps_window_then_sinks_then_the_best_prompt_tokens():
    # protect_prompt all, sinks 1, budget 6, recent 2: prompt = positions 0..8, generated 9..11 (recent: 10, 11).
    # Protected: sink 0, prompt 1..8: 9 slots for the 4 left beside the window. The budget wins: the sink (mass 0),
    # then the 3 prompt tokens of largest mass, 4 (.9), 7 (.8), 2 (.5). Slot 9, generated before the window, goes
    # although its mass (1.0) is the largest.
    mass = torch.tensor([[[0.0, 0.1, 0.5, 0.2, 0.9, 0.3, 0.05, 0.8, 0.4, 1.0, 0.0, 0.0]]])
    ctx = SelectContext(attn_mass=mass, positions=torch.arange(12)[None], prompt_len=torch.tensor([9]))
    c = h2o(kv_budget=6, sinks=1, protect_prompt="all")
    keep = c.select(torch.randn(1, 1, 12, 2), None, None, ctx)
    assert keep.tolist() == [[[0, 2, 4, 7, 10, 11]]]
    # 4 of the 6 kept slots are protected (sink 0; prompt 2, 4, 7); the window is not protection
    assert c.protected_share(keep, torch.ones(1, 12, dtype=torch.bool), ctx).tolist() == [pytest.approx(4 / 6)]


def test_protection_runs_with_every_method():
    # random with the whole prompt protected: positions 0..3 kept, then 2 random of 4..9, window 10, 11
    c = build_compressor(CompressorConfig(method="random", kv_budget=8, window=2, protect_prompt="all"))
    ctx = SelectContext(positions=torch.arange(12)[None], prompt_len=torch.tensor([4]), seed=torch.tensor([5]),
                        event=torch.tensor([12]))
    idx = c.select(torch.randn(1, 2, 12, 2), None, None, ctx)
    for h in range(2):
        row = idx[0, h].tolist()
        assert row[:4] == [0, 1, 2, 3] and row[-2:] == [10, 11] and all(4 <= j < 10 for j in row[4:6])
    for method in ("rkv", "snapkv", "streamingllm"):
        c = build_compressor(CompressorConfig(method=method, kv_budget=8, window=2, protect_prompt="last:3",
                                              protect_values=1, sinks=1))
        idx = c.select(torch.randn(1, 2, 12, 2), torch.randn(1, 4, 2, 2), None,
                       SelectContext(values=torch.randn(1, 2, 12, 2), positions=torch.arange(12)[None],
                                     prompt_len=torch.tensor([6])))
        assert all({0, 3, 4, 5, 10, 11} <= set(idx[0, h].tolist()) for h in range(2)), method
