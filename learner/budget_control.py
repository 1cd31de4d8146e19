"""Closed-loop KV budget (issues 13, 22): keep a tail statistic of the sparse/dense mismatch at or above a target.

Sparrow (arXiv 2606.08446, §3.1-3.2) found that the tail of the per-token acceptance rate
alpha_t = sum_x min(p_dense(x), q_sparse(x)), not its mean, predicts collapse, and keeps its 5th percentile
>= 0.86. This controller applies that as a feedback loop on the KV budget: after every learner step it reads one
statistic of the step (`budget_metric`): accept_upper_p5 by default when the actors send top-k log-probs (the
p5 of alpha_t's upper bound, learner/acceptance.py: measured within +0.06 of the exact p5 where the lower bound's
sat up to 0.72 below it, docs/SPEC.md §4; it errs toward less budget), else a quantile of the sampled token's
ratio xi (learner/correction.py `ratio_tail`: xi_pK or xi_sym_pK; a one-sample statistic on another scale than
Sparrow's 0.86, kept for runs without top-k), and

- raises the budget by `step` tokens (up to `budget_max`) when the quantile is below `target`;
- lowers it by `step` (down to `budget_min`) only after `patience` steps in a row with the quantile at or
  above `target + hysteresis`; otherwise holds.

The dead band [target, target + hysteresis) and the patience make it hold instead of oscillating when the
measured quantile is noisy; the asymmetry (raise at once, lower slowly) errs on the side of a dense-like
rollout. A lowering is a probe: when the very next step misses the target (the lower budget was too low,
and the budget goes back up), the patience before the next probe doubles (up to 16x `patience`), so a
budget sitting just above the point where the tail breaks costs a missed step only every 2, 4, 8, ... x
patience steps instead of every patience + 1; a probe that holds the target resets it. Pure python: the learner worker publishes `budget` in Redis (broker.streams.publish_kv_budget).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class BudgetChange:
    """One controller decision: `old` -> `new` tokens (equal when it held) and why, in words."""
    old: int
    new: int
    metric: float
    reason: str

    @property
    def changed(self) -> bool:
        return self.new != self.old


class BudgetController:
    """Budget feedback on the ratio tail.

    budget: start budget, tokens, in [budget_min, budget_max]. metric: name of the quantile (e.g. xi_sym_p5),
    used in the reasons. target: in (0, 1]. hysteresis >= 0. patience >= 1. step >= 1 tokens.
    Raises ValueError naming the argument for a value out of range.
    """

    def __init__(self, budget: int, budget_min: int, budget_max: int, *, metric: str = "xi_sym_p5",
                 target: float = 0.86, hysteresis: float = 0.03, patience: int = 2, step: int = 0):
        if not 1 <= budget_min <= budget <= budget_max:
            raise ValueError(f"budget={budget}, budget_min={budget_min}, budget_max={budget_max}: expected "
                             "1 <= budget_min <= budget <= budget_max")
        if not 0 < target <= 1 or hysteresis < 0 or patience < 1 or step < 0:
            raise ValueError(f"target={target} (0 < target <= 1), hysteresis={hysteresis} (>= 0), patience={patience} "
                             f"(>= 1), step={step} (>= 0, 0 = auto): out of range")
        self.budget, self.budget_min, self.budget_max = budget, budget_min, budget_max
        self.metric, self.target, self.hysteresis, self.patience = metric, target, hysteresis, patience
        self.step = step or max(1, (budget_max - budget_min) // 8)
        self.calm = 0  # consecutive steps at or above target + hysteresis
        self.wait = patience  # calm steps needed before the next lowering (doubles after a failed probe)
        self.probing = False  # the last decision lowered the budget: this step tells whether that held

    @classmethod
    def from_config(cls, cfg) -> "BudgetController":
        """From a CompressorConfig with budget_control 'mismatch' (kv_budget, kv_budget_min/max, budget_*)."""
        return cls(cfg.kv_budget, cfg.kv_budget_min, cfg.kv_budget_max, metric=cfg.budget_metric or "xi_sym_p5",
                   target=cfg.budget_target, hysteresis=cfg.budget_hysteresis, patience=cfg.budget_patience,
                   step=cfg.budget_step)

    def state(self) -> dict:
        """What a checkpoint keeps so that a resumed run continues the same control: budget, calm count, the
        wait before the next lowering and whether the last decision was a probe."""
        return {"budget": self.budget, "calm": self.calm, "wait": self.wait, "probing": self.probing}

    def restore(self, state: dict) -> None:
        """Continue from `state()` (the budget clipped into this controller's bounds)."""
        self.budget = min(self.budget_max, max(self.budget_min, int(state["budget"])))
        self.calm, self.wait, self.probing = int(state["calm"]), int(state["wait"]), bool(state["probing"])

    def update(self, value: float) -> BudgetChange:
        """One learner step's measured quantile -> the decision (the new budget is also `self.budget`).
        A NaN (no valid token in the step) holds and resets the patience count."""
        old, m, t = self.budget, value, self.target
        if m is None or math.isnan(m):
            self.calm = 0
            return BudgetChange(old, old, float("nan"), f"{self.metric} not measured: hold")
        probed, self.probing = self.probing, False
        if m < t:
            self.calm = 0
            if probed:  # the budget just lowered to is too low: wait longer before probing again
                self.wait = min(2 * self.wait, 16 * self.patience)
            self.budget = min(self.budget_max, old + self.step)
            what = f"raise {old} -> {self.budget}" if self.budget != old else f"at kv_budget_max={old}: hold"
            backoff = f"; the last lowering failed, next one after {self.wait} calm steps" if probed else ""
            return BudgetChange(old, self.budget, m, f"{self.metric}={m:.4f} < target {t:g}: {what}{backoff}")
        if probed:
            self.wait = self.patience
        if m < t + self.hysteresis:
            self.calm = 0
            return BudgetChange(old, old, m, f"{self.metric}={m:.4f} in [{t:g}, {t + self.hysteresis:g}): hold")
        self.calm += 1
        if self.calm < self.wait:
            return BudgetChange(old, old, m, f"{self.metric}={m:.4f} >= {t + self.hysteresis:g} for {self.calm} of "
                                             f"{self.wait} steps: hold")
        self.calm = 0
        self.budget = max(self.budget_min, old - self.step)
        self.probing = self.budget != old
        what = f"lower {old} -> {self.budget}" if self.budget != old else f"at kv_budget_min={old}: hold"
        return BudgetChange(old, self.budget, m, f"{self.metric}={m:.4f} >= {t + self.hysteresis:g} for "
                                                 f"{self.wait} steps: {what}")
