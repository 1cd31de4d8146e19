"""A learner step's metrics (SPEC §4) besides the correction's: the loss metrics summed over its micro-batches in
their order (`LossTotals`), the batch's own (`step_metrics`), the correction's per difficulty tier (`tier_metrics`)."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from broker.schema import TrajectoryGroup
from learner.batching import LossInputs
from learner.config import LearnerConfig
from learner.correction import sparse_correction
from learner.distributed import all_reduce


class LossTotals:
    """The micro-batches' loss metrics of one step, added in micro-batch order: pg_loss, kl_loss (and with
    `distill` distill_kl), sums reported per optimizer step; clip_fraction, ppo_kl, ratio_mean, reported as means
    over the micro-batches; with `gap` (a replaying step that recomputed logp_old), `train_gap`, the largest
    `train_gap` of the first optimizer step's micro-batches (padding slots included), from 0.0."""

    def __init__(self, distill: bool, gap: bool):
        self.sums = {"pg_loss": 0.0, "kl_loss": 0.0}
        if distill:
            self.sums["distill_kl"] = 0.0
        self.means = {"clip_fraction": 0.0, "ppo_kl": 0.0, "ratio_mean": 0.0}
        self.micro_steps: float = 0
        self.train_gap: float | None = 0.0 if gap else None

    def add(self, m: dict[str, float], padding: bool) -> None:
        """Add one micro-batch's metrics (Learner._micro_batch); a padding slot's count only for `train_gap`."""
        if "train_gap" in m:
            self.train_gap = max(self.train_gap, m["train_gap"])
        if padding:
            return
        for k in self.sums:
            self.sums[k] += m.get(k, 0.0)
        for k in self.means:
            self.means[k] += m[k]
        self.micro_steps += 1

    def all_reduce(self, all_reduce: Callable[[torch.Tensor], torch.Tensor], device) -> None:
        """The totals of every rank's share (`all_reduce`: a sum over the learner ranks), in place."""
        names, n = [*self.sums, *self.means], len(self.sums)
        totals = all_reduce(torch.tensor([*self.sums.values(), *self.means.values(), self.micro_steps],
                                         dtype=torch.float64, device=device)).tolist()
        self.sums = dict(zip(names[:n], totals[:n]))
        self.means = dict(zip(names[n:], totals[n:-1]))
        self.micro_steps = totals[-1]

    def metrics(self, optimizer_steps: int) -> dict[str, float]:
        """The sums per optimizer step, then the means over the micro-batches."""
        out = {k: v / optimizer_steps for k, v in self.sums.items()}
        out.update({k: v / max(self.micro_steps, 1) for k, v in self.means.items()})
        return out


def step_metrics(groups: list[TrajectoryGroup], staleness: list[int], t: LossInputs, totals: LossTotals,
                 optimizer_steps: int, grad_norms: list[float], fused: bool, ranks: int,
                 elapsed: float) -> dict[str, float]:
    """A step's loss metrics (`totals`) and the batch's own: entropy of pi_old, grad_norm (mean over the optimizer
    steps), staleness, reward, response length, truncation, the KV cache's, the learner's throughput."""
    validf = t.mask.float()
    response_len = t.batch.response_mask.sum(1).float()
    metrics = totals.metrics(optimizer_steps)
    truncated = [s.finish_reason == "length" for g in groups for s in g.samples]
    kv_ratio = [s.kv_retained_tokens / max(1, len(s.prompt_ids) + len(s.response_ids))
                for g in groups for s in g.samples]
    metrics.update({
        "entropy": ((t.entropy * validf).sum() / validf.sum().clamp(min=1)).item(),
        "grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
        "optimizer_steps": optimizer_steps,
        "staleness_mean": float(np.mean(staleness)),
        "staleness_max": float(np.max(staleness)),
        "reward_mean": t.batch.reward.mean().item(),
        "response_length_mean": response_len.mean().item(),
        "response_truncated_fraction": float(np.mean(truncated)),
        "kv_retained_ratio": float(np.mean(kv_ratio)),
        "kv_protected_fraction": float(np.mean([s.kv_protected_fraction for g in groups for s in g.samples])),
        "kv_peak_bytes_mean": float(np.mean([s.kv_peak_bytes for g in groups for s in g.samples])),
        "kv_budget": float(np.mean([g.kv_budget for g in groups])),
        "num_sequences": t.batch.size,
        "learner_ranks": ranks,
        "logp_old_fused": float(fused),
        "learner_step_s": elapsed,
        "learner_tokens_per_s": t.batch.seq_len.sum().item() / elapsed,
    })
    return metrics


def tier_metrics(groups: list[TrajectoryGroup], cfg: LearnerConfig, logp_old: torch.Tensor, logp_sparse: torch.Tensor,
                 mask: torch.Tensor) -> dict[str, float]:
    """Per difficulty tier (groups' budget_tier, SPEC §5.1): tier/<name>/rejection_rate and
    tier/<name>/xi_sym_p5, the correction's metrics over that tier's sequences only; {} with tiers off."""
    tiers = sorted({g.budget_tier for g in groups} - {""})
    if not tiers or cfg.correction == "off":
        return {}
    row_tier = [g.budget_tier for g in groups for _ in g.samples]
    out = {}
    for tier in tiers:
        rows = torch.tensor([i for i, t in enumerate(row_tier) if t == tier], device=logp_old.device)
        _, _, m = sparse_correction(logp_old[rows], logp_sparse[rows], mask[rows], correction="metrics_only",
                                    rejection=cfg.rejection, eps=cfg.eps, geo_bounds=cfg.geo_bounds)
        out[f"tier/{tier}/rejection_rate"] = m["rejection_rate"]
        out[f"tier/{tier}/xi_sym_p5"] = m["xi_sym_p5"]
    return out


def train_gap_metrics(metrics: dict, train_gap: float | None, ranks: int, device) -> dict[str, float]:
    """replay_logp_train_max_abs (max |trained forward's logp - logp_sparse| over staleness-0 tokens, first
    optimizer step, the maximum over the `ranks` learner ranks; the fused step's training forward is logp_old's)
    and replay_logp_max_abs, the larger of it and metrics' replay_logp_old_max_abs: what must stay <= 1e-4 in fp32
    at max_staleness 0 (SPEC §4)."""
    old = metrics["replay_logp_old_max_abs"]
    if train_gap is None:
        train = old
    else:
        gap = torch.tensor([train_gap], dtype=torch.float64, device=device)
        train = float(all_reduce(gap, ranks, torch.distributed.ReduceOp.MAX))
        if math.isnan(old):
            train = float("nan")
    worst = float("nan") if math.isnan(old) or math.isnan(train) else max(old, train)
    return {"replay_logp_train_max_abs": train, "replay_logp_max_abs": worst}
