"""KV budget over a run (docs/SPEC.md §5.1): schedules, tiers, the budget range and the config checks. Expected values
are worked out by hand in the comments, not with the code under test."""
import types

import pytest

from compressors import CompressorConfig
from compressors.budget import budget_range, kv_dims, length_budget, scheduled_budget, tier_budget, tier_of


def test_constant_schedule_is_kv_budget_at_every_version():
    cfg = CompressorConfig(kv_budget=512, kv_budget_final=256)         # final ignored by constant
    assert [scheduled_budget(cfg, v, 8) for v in (0, 3, 8, 20)] == [512, 512, 512, 512]


def test_linear_schedule():
    cfg = CompressorConfig(kv_budget=512, kv_budget_final=256, budget_schedule="linear")
    # 512 + (256 - 512) * v / 8: v=0 512, v=2 448, v=3 416, v=8 256; v=10 past the end stays 256
    assert [scheduled_budget(cfg, v, 8) for v in (0, 2, 3, 8, 10)] == [512, 448, 416, 256, 256]
    cfg.budget_schedule_steps = 4                                        # its own length beats train.steps
    assert scheduled_budget(cfg, 2, 8) == 384                            # 512 - 256 * 2/4
    grow = CompressorConfig(kv_budget=100, kv_budget_final=201, budget_schedule="linear")
    assert scheduled_budget(grow, 1, 2) == 151                           # 100 + 101 / 2 = 150.5, rounded half up


def test_cosine_schedule():
    cfg = CompressorConfig(kv_budget=512, kv_budget_final=256, budget_schedule="cosine")
    # 256 + 256 (1 + cos(pi v/8)) / 2: v=2 cos(pi/4)=0.70711 -> 256 + 218.51 = 474.51 -> 475;
    # v=4 cos(pi/2)=0 -> 384; v=6 cos(3pi/4)=-0.70711 -> 256 + 37.49 = 293.49 -> 293
    assert [scheduled_budget(cfg, v, 8) for v in (0, 2, 4, 6, 8)] == [512, 475, 384, 293, 256]


def test_length_schedule_grows_along_the_trajectory_up_to_its_cap():
    cfg = CompressorConfig(kv_budget=48, kv_budget_final=120, budget_schedule="length", budget_growth=0.5)
    # 48 + 0.5 t: t=0 48, t=1 48.5 -> 49, t=10 53, t=100 98, t=144 120, t=1000 capped at 120
    assert [length_budget(cfg, 48, t) for t in (0, 1, 10, 100, 144, 1000)] == [48, 49, 53, 98, 120, 120]
    assert [scheduled_budget(cfg, v, 8) for v in (0, 5)] == [48, 48]    # by version: the start budget
    assert budget_range(cfg) == (48, 120)                               # preflight sizes with the cap
    assert length_budget(CompressorConfig(kv_budget=48), 48, 500) == 48  # other schedules: the start budget


def test_tiers_follow_the_confidence_rule():
    cfg = CompressorConfig(kv_budget=512, budget_tiers="confidence")   # thresholds 0.5 / 0.8, scales 1.5 / 1 / 0.5
    assert [tier_of(cfg, c) for c in (0.0, 0.49, 0.5, 0.8, 0.81, 1.0, None)] == \
        ["hard", "hard", "medium", "medium", "easy", "easy", "new"]
    # docs/SPEC.md §5.1, difficulty tiers: 768 below 0.5, 512 up to 0.8, 256 above; never sampled: the medium budget
    assert [tier_budget(cfg, 512, t) for t in ("hard", "medium", "easy", "new")] == [768, 512, 256, 512]
    assert [tier_budget(cfg, 33, t) for t in ("hard", "easy")] == [50, 17]   # 49.5 -> 50, 16.5 -> 17
    off = CompressorConfig(kv_budget=512)
    assert tier_budget(off, 300, "easy") == 300                        # tiers off: the base budget


def test_budget_range():
    # schedule 512 -> 256, no tiers: (256, 512)
    assert budget_range(CompressorConfig(kv_budget=512, kv_budget_final=256, budget_schedule="linear")) == (256, 512)
    # controller bounds 256..1024 with tiers 0.5 / 1.5: (128, 1536)
    cfg = CompressorConfig(kv_budget=512, budget_control="mismatch", kv_budget_min=256, kv_budget_max=1024,
                           budget_tiers="confidence")
    assert budget_range(cfg) == (128, 1536)
    assert budget_range(CompressorConfig(kv_budget=64)) == (64, 64)


@pytest.mark.parametrize("fields,named", [
    (dict(budget_schedule="step"), "compressor.budget_schedule"),
    (dict(budget_control="pid"), "compressor.budget_control"),
    (dict(budget_metric="xi_p7"), "compressor.budget_metric"),
    (dict(budget_control="mismatch"), "compressor.kv_budget_min"),
    (dict(budget_control="mismatch", kv_budget_min=100, kv_budget_max=200), "compressor.kv_budget="),
    (dict(budget_control="mismatch", kv_budget_min=32, kv_budget_max=128, budget_schedule="linear"),
     "compressor.budget_schedule"),
    (dict(budget_schedule="linear", kv_budget_final=6), "smallest budget"),       # 6 <= window 8
    (dict(budget_schedule="length", kv_budget_final=600), "compressor.budget_growth"),
    (dict(budget_schedule="length", budget_growth=0.5), "compressor.kv_budget_final"),
    (dict(budget_schedule="length", budget_growth=0.5, kv_budget_final=600, budget_tiers="confidence"),
     "compressor.budget_tiers"),
    (dict(budget_tiers="confidence", tier_scales=[1.5, 1.0, 0.1]), "smallest budget"),   # 64 * 0.1 = 6 <= 8
    (dict(budget_tiers="confidence", tier_thresholds=[0.9, 0.2]), "compressor.tier_thresholds"),
    (dict(budget_tiers="confidence", tier_scales=[1.0, 0.5]), "compressor.tier_scales"),
    (dict(budget_target=1.2), "compressor.budget_target"),
    (dict(budget_patience=0), "compressor.budget_patience"),
    (dict(budget_window=0), "compressor.budget_window"),
    (dict(method="full", budget_tiers="confidence"), "compressor.method"),
])
def test_bad_budget_settings_name_the_field(fields, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.").replace("=", "=")):
        CompressorConfig(**{"kv_budget": 64, **fields}).validate()


def test_good_budget_settings_validate():
    CompressorConfig(kv_budget=64, budget_control="mismatch", kv_budget_min=32, kv_budget_max=128,
                     budget_tiers="confidence").validate()
    CompressorConfig(kv_budget=64, kv_budget_final=16, budget_schedule="cosine").validate()


@pytest.mark.parametrize("fields, dims", [
    # SmolLM2-135M: 576 / 9 heads = 64, 3 KV heads
    (dict(num_hidden_layers=30, num_attention_heads=9, hidden_size=576, num_key_value_heads=3), (30, 3, 64)),
    # an explicit head_dim that is not hidden / heads (Qwen3-0.6B: 1024 / 16 = 64, head_dim 128) wins
    (dict(num_hidden_layers=28, num_attention_heads=16, hidden_size=1024, num_key_value_heads=8, head_dim=128),
     (28, 8, 128)),
    # head_dim None (a config that has the field unset) falls back to hidden / heads
    (dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, num_key_value_heads=2, head_dim=None),
     (2, 2, 16)),
    # no num_key_value_heads: every attention head has its own K/V
    (dict(num_hidden_layers=12, num_attention_heads=12, hidden_size=768), (12, 12, 64)),
])
def test_kv_dims_reads_layers_kv_heads_and_head_dim_of_a_config(fields, dims):
    assert kv_dims(types.SimpleNamespace(**fields)) == dims
