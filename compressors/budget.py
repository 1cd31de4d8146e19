"""KV budget over a run (docs/SPEC.md §5.1): schedules by weight version and difficulty tiers, and along a
trajectory (budget_schedule length; Sparrow, arXiv 2606.08446 §3.2).

The decoder's KV layout (`kv_dims`: layers, KV heads, head_dim from a transformers config), which the engines,
the learner and the preflight read the same way.

Pure functions of the config and plain numbers or numpy arrays of them (no torch, no I/O), shared by the rollout
actors (which apply the budget per batch; the SGLang backend per request row, `length_budgets`) and the learner
(which logs it and, with `budget_control: mismatch`, moves it: learner/budget_control.py).
"""
from __future__ import annotations

import math

import numpy as np

TIER_NAMES = ("hard", "medium", "easy")
"""Tier names in the order of `CompressorConfig.tier_scales`; a prompt never sampled before is `new`."""
NEW_TIER = "new"


def _round(x: float) -> int:
    """Round half up (not Python's banker's rounding), so hand-computed values match."""
    return int(math.floor(x + 0.5))


def scheduled_budget(cfg, version: int, total_steps: int) -> int:
    """The base budget, tokens, for rollouts sampled with weight `version` (progressive shrinking, docs/SPEC.md §5.1).

    cfg: CompressorConfig (budget_schedule, kv_budget, kv_budget_final, budget_schedule_steps).
    total_steps: the run's train.steps, used when cfg.budget_schedule_steps is 0.
    With b0 = kv_budget, b1 = kv_budget_final (0: b0), S = budget_schedule_steps or total_steps and
    p = min(max(version / S, 0), 1):
        constant: b0;   linear: b0 + (b1 - b0) p;   cosine: b1 + (b0 - b1) (1 + cos(pi p)) / 2,
    rounded half up to an int. Raises ValueError for an unknown schedule or S < 1.
    """
    b0 = cfg.kv_budget
    b1 = cfg.kv_budget_final or b0
    if cfg.budget_schedule in ("constant", "length"):   # length: the start budget; it grows within the trajectory
        return b0
    steps = cfg.budget_schedule_steps or total_steps
    if steps < 1:
        raise ValueError(f"budget schedule over {steps} steps: expected >= 1 (compressor.budget_schedule_steps "
                         "or train.steps)")
    p = min(max(version / steps, 0.0), 1.0)
    if cfg.budget_schedule == "linear":
        return _round(b0 + (b1 - b0) * p)
    if cfg.budget_schedule == "cosine":
        return _round(b1 + (b0 - b1) * (1 + math.cos(math.pi * p)) / 2)
    raise ValueError(f"compressor.budget_schedule={cfg.budget_schedule!r} is unknown")


def length_budget(cfg, start: int, generated: int) -> int:
    """Budget, tokens, of a sequence that has generated `generated` tokens under budget_schedule length (Sparrow
    §3.2: a budget that grows with the trajectory so the mismatch tail does not): min(kv_budget_final,
    start + budget_growth x generated), rounded half up; `start` (the batch's budget, normally kv_budget) itself
    for any other schedule. The torch engine compacts to this budget at every compression (one value of
    `length_budgets`, so both engines compute it the same way)."""
    if cfg.budget_schedule != "length":
        return start
    return int(length_budgets(cfg, np.array([start]), np.array([generated]))[0])


def length_budgets(cfg, start: np.ndarray, generated: np.ndarray) -> np.ndarray:
    """`length_budget` of many sequences at once: start int [n] (each sequence's start budget, tokens), generated
    int [n] (tokens each has generated) -> int64 [n] budgets, tokens: min(max(kv_budget_final, start), start +
    budget_growth x generated rounded half up) under budget_schedule length, `start` (as int64) otherwise. The
    SGLang backend reads it from its host mirror's start budgets and step counts
    (actors/engines/sglang/triton_backend.py `_budget_now`); `length_budget` is one value of it, so the two engines
    round the same way (float64, half up, as `_round`)."""
    start = np.asarray(start, dtype=np.int64)
    if cfg.budget_schedule != "length":
        return start.copy()
    grown = np.floor(start + cfg.budget_growth * np.asarray(generated, dtype=np.int64) + 0.5).astype(np.int64)
    return np.minimum(np.maximum(cfg.kv_budget_final, start), grown)


def tier_of(cfg, confidence: float | None) -> str:
    """Difficulty tier of a prompt from its confidence in [0, 1] (None: never sampled -> "new"): "hard" below
    tier_thresholds[0], "medium" up to tier_thresholds[1] inclusive, "easy" above (docs/SPEC.md §5.1: 768 below
    0.5, 512 up to 0.8, 256 above)."""
    if confidence is None:
        return NEW_TIER
    low, high = cfg.tier_thresholds
    if confidence < low:
        return "hard"
    return "medium" if confidence <= high else "easy"


def tier_budget(cfg, base: int, tier: str) -> int:
    """Budget of `tier` when the base (scheduled or controlled) budget is `base`: round(base * scale), the scale
    of the tier in cfg.tier_scales (hard, medium, easy; "new" uses medium's); `base` itself with tiers off."""
    if cfg.budget_tiers == "off":
        return base
    scale = cfg.tier_scales[TIER_NAMES.index("medium" if tier == NEW_TIER else tier)]
    return _round(base * scale)


def budget_range(cfg) -> tuple[int, int]:
    """(smallest, largest) budget the run can use, tokens: base budgets over the schedule or the controller's
    bounds, times the smallest / largest tier scale (tiers on). Preflight sizes memory with the largest."""
    if cfg.budget_control == "mismatch":
        bases = [cfg.kv_budget_min or cfg.kv_budget, cfg.kv_budget_max or cfg.kv_budget]
    elif cfg.budget_schedule != "constant":   # linear / cosine over versions; length within a trajectory
        bases = [cfg.kv_budget, cfg.kv_budget_final or cfg.kv_budget]
    else:
        bases = [cfg.kv_budget]
    if cfg.budget_tiers == "off":
        return min(bases), max(bases)
    return _round(min(bases) * min(cfg.tier_scales)), _round(max(bases) * max(cfg.tier_scales))


def kv_dims(config) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a decoder's K/V from its transformers config: num_hidden_layers;
    num_key_value_heads, or num_attention_heads where the config has none (no grouped-query attention); head_dim, or
    hidden_size // num_attention_heads where the config has none or None (Llama before head_dim was a field). The
    one reading of these fields for the engines' caches, the learner's hint layout and the preflight's sizes."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim
