"""Closed-loop KV budget (SPEC §5.1): keep a tail statistic of the sparse/dense mismatch at or above a target.

Sparrow (arXiv 2606.08446, §3.1-3.2) found that the tail of the per-token acceptance rate
alpha_t = sum_x min(p_dense(x), q_sparse(x)), not its mean, predicts collapse, and keeps its 5th percentile
>= 0.86. This controller applies that as a feedback loop on the KV budget: after every learner step it reads one
statistic of the step (`budget_metric`): accept_upper_p5 by default when the actors send top-k log-probs (the
p5 of alpha_t's upper bound, learner/acceptance.py: measured within +0.06 of the exact p5 where the lower bound's
sat up to 0.72 below it, docs/SPEC.md §4; it errs toward less budget), else a quantile of the sampled token's
ratio xi (learner/correction.py `ratio_tail`: xi_pK or xi_sym_pK; a one-sample statistic on another scale than
Sparrow's 0.86, kept for runs without top-k), and

- raises the budget by `step` tokens (up to `budget_max`) as soon as one step's statistic is below `target`
  (grow at once: a step below target is a step that missed; with accept_upper_p5 it also proves the exact p5
  missed);
- lowers it by `step` (down to `budget_min`) only when (a) the budget has been in place for at least
  wait(lower budget) steps, none below target, and (b) the mean of the statistic over the last `window` steps at
  this budget is at or above `target + hysteresis`; otherwise holds.

Why a window mean. Each step's p5 rests on a few hundred to a few thousand tokens (a few dozen in the tail), so
it moves by several hundredths from batch to batch at one budget (+-0.07 in bench/kv_budget.py, docs/results.md
§7). The old rule lowered after `patience` steps in a row at or above target + hysteresis: two lucky steps were
enough, and one step in the dead band [target, target + hysteresis) started the count again. The mean over the
last `window` steps at the current budget (only those: steps at another budget are another measurement)
estimates the budget's expected per-step p5, which is what "the target is met on a step" depends on; the
hysteresis is the margin that keeps single steps above target around that mean. Steps are averaged, not their
tokens pooled: the controller sees the scalar the learner logs (a pooled quantile would need every rank's
per-token values on rank 0).

Why a memory per budget (exponential back-off, as TCP does for retransmissions). Lowering from b to b' = b - step
is a probe of b'. wait(b') = `patience` x 2^k(b') steps (k capped at 4: 16 x patience), where k(b') counts the
steps at b' that missed the target since b' last held: a budget the controller left because it missed, on the
way up as much as after a probe, is tried again only after ever longer stays at the budget above. b' holds when
it has run `patience` steps in a row at or above target (k(b') back to 0). A probe is thus judged over
`patience` steps, not one: a probe that meets the target once and misses on its second step counts as failed.
So a budget sitting just above the point where the tail breaks costs a missed step only every 2, 4, 8, ...
x patience steps, and the climb from a low start does not end in an immediate probe back down to the budget it
just left. The asymmetry (raise at once, lower slowly) errs on the side of a dense-like rollout.

Pure python: the learner worker publishes `budget` in Redis (broker.streams.publish_kv_budget).
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


MAX_BACKOFF = 4
"""wait(b) = patience x 2^min(misses, MAX_BACKOFF): at most 16 x patience steps before a budget is tried again."""


class BudgetController:
    """Budget feedback on a tail statistic of the mismatch (module docstring).

    budget: start budget, tokens, in [budget_min, budget_max]. metric: name of the statistic (e.g. accept_upper_p5),
    used in the reasons. target: in (0, 1]. hysteresis >= 0: the margin above target the window mean needs before
    a lowering. patience >= 1: steps at a budget before lowering from it (doubled per recorded miss of the budget
    below) and steps in a row at or above target that clear a budget's misses. step >= 0 tokens (0: an eighth of
    budget_max - budget_min, at least 1). window >= 1: steps at the current budget averaged for a lowering.
    Raises ValueError naming the argument for a value out of range.
    """

    def __init__(self, budget: int, budget_min: int, budget_max: int, *, metric: str = "xi_sym_p5",
                 target: float = 0.86, hysteresis: float = 0.03, patience: int = 2, step: int = 0, window: int = 4):
        if not 1 <= budget_min <= budget <= budget_max:
            raise ValueError(f"budget={budget}, budget_min={budget_min}, budget_max={budget_max}: expected "
                             "1 <= budget_min <= budget <= budget_max")
        if not 0 < target <= 1 or hysteresis < 0 or patience < 1 or step < 0 or window < 1:
            raise ValueError(f"target={target} (0 < target <= 1), hysteresis={hysteresis} (>= 0), patience={patience} "
                             f"(>= 1), step={step} (>= 0, 0 = auto), window={window} (>= 1): out of range")
        self.budget, self.budget_min, self.budget_max = budget, budget_min, budget_max
        self.metric, self.target, self.hysteresis, self.patience = metric, target, hysteresis, patience
        self.step = step or max(1, (budget_max - budget_min) // 8)
        self.window = window
        self.recent: list[float] = []  # the statistic of the last `window` steps at the current budget
        self.steps_here = 0             # steps at the current budget since it was set, none below target
        self.misses: dict[int, int] = {}  # budget -> steps there below target since it last held (back-off)

    @classmethod
    def from_config(cls, cfg) -> "BudgetController":
        """From a CompressorConfig with budget_control 'mismatch' (kv_budget, kv_budget_min/max, budget_*)."""
        return cls(cfg.kv_budget, cfg.kv_budget_min, cfg.kv_budget_max, metric=cfg.budget_metric or "xi_sym_p5",
                   target=cfg.budget_target, hysteresis=cfg.budget_hysteresis, patience=cfg.budget_patience,
                   step=cfg.budget_step, window=cfg.budget_window)

    def wait(self, budget: int) -> int:
        """Steps at the budget above `budget` before the controller lowers to it: patience x 2^(its misses)."""
        return self.patience * 2 ** min(self.misses.get(budget, 0), MAX_BACKOFF)

    def state(self) -> dict:
        """What a checkpoint keeps so that a resumed run continues the same control: the budget, the window of
        recent values at it, the steps there and each budget's recorded misses (JSON-safe: budgets as strings)."""
        return {"budget": self.budget, "recent": list(self.recent), "steps_here": self.steps_here,
                "misses": {str(b): k for b, k in self.misses.items()}}

    def restore(self, state: dict) -> None:
        """Continue from `state()` (the budget clipped into this controller's bounds; a budget moved by the clip
        starts a fresh window). A state written before the window and the per-budget misses (keys budget, calm,
        wait, probing) restores its budget and starts with an empty window and no recorded misses."""
        budget = min(self.budget_max, max(self.budget_min, int(state["budget"])))
        fresh = budget != int(state["budget"]) or "steps_here" not in state
        self.budget = budget
        self.recent = [] if fresh else [float(v) for v in state["recent"]][-self.window:]
        self.steps_here = 0 if fresh else int(state["steps_here"])
        self.misses = {int(b): int(k) for b, k in state.get("misses", {}).items()}

    def _move(self, new: int) -> None:
        self.budget, self.recent, self.steps_here = new, [], 0

    def update(self, value: float) -> BudgetChange:
        """One learner step's measured statistic -> the decision (the new budget is also `self.budget`).
        A NaN (no valid token in the step) holds and starts the window at this budget again."""
        old, m, t = self.budget, value, self.target
        if m is None or math.isnan(m):
            self.recent, self.steps_here = [], 0
            return BudgetChange(old, old, float("nan"), f"{self.metric} not measured: hold")
        if m < t:
            self.misses[old] = self.misses.get(old, 0) + 1
            self._move(min(self.budget_max, old + self.step))
            what = (f"raise {old} -> {self.budget}; {old} tried again after {self.wait(old)} steps above it"
                    if self.budget != old else f"at kv_budget_max={old}: hold")
            return BudgetChange(old, self.budget, m, f"{self.metric}={m:.4f} < target {t:g}: {what}")
        self.recent = (self.recent + [m])[-self.window:]
        self.steps_here += 1
        if self.steps_here == self.patience and self.misses.get(old):
            self.misses[old] = 0  # the budget held `patience` steps in a row: its misses are forgiven
        mean, bar = sum(self.recent) / len(self.recent), t + self.hysteresis
        lower = max(self.budget_min, old - self.step)
        head = f"{self.metric}={m:.4f}, mean of {len(self.recent)} at {old}: {mean:.4f}"
        if lower == old:
            return BudgetChange(old, old, m, f"{head}: at kv_budget_min={old}: hold")
        if self.steps_here < self.wait(lower):
            return BudgetChange(old, old, m, f"{head}; {self.steps_here} of {self.wait(lower)} steps before "
                                             f"trying {lower}: hold")
        if mean < bar:
            return BudgetChange(old, old, m, f"{head} < {bar:g}: hold")
        n = self.steps_here
        self._move(lower)
        return BudgetChange(old, lower, m, f"{head} >= {bar:g} after {n} steps: lower {old} -> {lower}")
