"""GRPO advantages and the clipped, corrected policy loss with k3 KL (docs/SPEC.md §3).

Pure functions of tensors returning `(loss, metrics)`, in the style of prime-rl's loss module.
"""
from __future__ import annotations

import torch

KL_CLAMP = 10.0


def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, norm_by_std: bool = True) -> torch.Tensor:
    """A_i = (R_i - mean_G R) / (std_G R + 1e-6), std unbiased (n - 1), over all G samples of each group
    (SPEC §3: computed before rejection and never recomputed after it); with norm_by_std=False,
    A_i = R_i - mean_G R (Dr. GRPO, Liu et al. 2025 section 3.1; verl's norm_adv_by_std_in_grpo=False).

    Args:
        rewards: float [num_seqs].
        group_index: int64 [num_seqs], the group (prompt) each sequence belongs to.
        norm_by_std: divide by the group's std (GRPO). Off, rewards [1, 1, 1, 0.95] get advantages 0.0125 x 3
            and -0.0375, not 0.5 x 3 and -1.5: a graded reward near saturation no longer steps the policy as
            hard as a pass/fail split.
    Returns:
        float32 [num_seqs]. A group of one sample gets advantage 0.
    Raises:
        ValueError: shapes differ.
    """
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must be "
                         "equal 1-D shapes [num_seqs]")
    rewards = rewards.float()
    advantages = torch.zeros_like(rewards)
    for g in group_index.unique():
        members = group_index == g
        r = rewards[members]
        if r.numel() > 1:
            advantages[members] = (r - r.mean()) / (r.std(unbiased=True) + 1e-6 if norm_by_std else 1.0)
    return advantages


def zero_variance(rewards) -> bool:
    """True when all rewards of one group (a sequence of G floats) are equal: every GRPO advantage of the
    group is then 0 and it gives no policy gradient. DAPO's dynamic sampling (verl `filter_groups` with
    metric "acc"/"score": std == 0) filters such groups out. A group of one sample is zero-variance."""
    values = [float(r) for r in rewards]
    return max(values) == min(values)


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    weights: torch.Tensor,
    *,
    num_seqs: int,
    num_tokens: float | None = None,
    logp_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    clip_eps: float = 0.2,
    clip_eps_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sparse-RL GRPO loss: L = L_pg + beta * L_kl (SPEC §3).

    L_clip_t = max(-r_t A_i, -clip(r_t, 1 - clip_eps, 1 + clip_eps_high) A_i), r_t = exp(logp - logp_old);
    L_pg = (1/N) sum_i [sum_t M_it w_t L_clip_t] / max(1, sum_t M_it) (seq-mean-token-mean, GRPO's), or, with
    `num_tokens` = T_N, L_pg = sum_i sum_t M_it w_t L_clip_t / T_N (token-mean, DAPO section 3.3); the k3 KL
    kl_t = exp(logp_ref - logp) - (logp_ref - logp) - 1, clamped to [-10, 10], reduced the same way with M
    (no importance weight).

    Args:
        logp: float [S, T] log pi_theta of the response tokens (with grad).
        logp_old: float [S, T] log pi_old (no grad).
        advantages: float [S], one per sequence (broadcast to its tokens).
        loss_mask: 0/1 float [S, T] after padding, veto and token mask (M).
        weights: float [S, T] detached importance weights w (ones without correction).
        num_seqs: N, the denominator: every sequence of the minibatch, rejected ones included; pass the
            minibatch size when a minibatch is split into micro-batches so the micro losses add up.
        num_tokens: T_N for token-mean, the response tokens of the whole minibatch (rejected sequences
            included, as in N); None for seq-mean-token-mean.
        logp_ref: float [S, T] log pi_ref, required when kl_coef > 0.
    Returns:
        (loss scalar, metrics: pg_loss, kl_loss, clip_fraction, ppo_kl, ratio_mean). Metrics are sums
        scaled by 1/num_seqs (token-mean: 1/num_tokens) like the loss (pg_loss, kl_loss) or token means over M
        (the rest).
    Raises:
        ValueError: shapes differ, kl_coef > 0 without logp_ref, or num_tokens <= 0.
    """
    if not (logp.shape == logp_old.shape == loss_mask.shape == weights.shape) or logp.dim() != 2:
        raise ValueError(f"logp {tuple(logp.shape)}, logp_old {tuple(logp_old.shape)}, loss_mask "
                         f"{tuple(loss_mask.shape)} and weights {tuple(weights.shape)} must share one shape [S, T]")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [S] = [{logp.shape[0]}]")
    if kl_coef > 0 and logp_ref is None:
        raise ValueError("kl_coef > 0 needs logp_ref")
    if num_tokens is not None and not num_tokens > 0:
        raise ValueError(f"num_tokens={num_tokens}: expected > 0 (the minibatch's response tokens)")

    mask = loss_mask.float()
    # per-sequence divisor: its own loss tokens (seq-mean-token-mean), or T_N / N (token-mean), so that
    # sum_i [...] / divisor_i / N is the same formula for both
    seq_tokens = (mask.sum(1).clamp(min=1) if num_tokens is None
                  else mask.new_full(mask.shape[:1], num_tokens / num_seqs))
    log_ratio = logp - logp_old
    ratio = log_ratio.exp()
    adv = advantages[:, None].float()
    pg_unclipped = -ratio * adv
    pg_clipped = -ratio.clamp(1 - clip_eps, 1 + clip_eps_high) * adv
    pg_token = torch.maximum(pg_unclipped, pg_clipped)
    pg_loss = ((pg_token * weights * mask).sum(1) / seq_tokens).sum() / num_seqs

    kl_loss = torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device)
    if kl_coef > 0:
        ref_log_ratio = logp_ref - logp
        kl_token = (ref_log_ratio.exp() - ref_log_ratio - 1).clamp(-KL_CLAMP, KL_CLAMP)
        kl_loss = ((kl_token * mask).sum(1) / seq_tokens).sum() / num_seqs
    loss = pg_loss + kl_coef * kl_loss

    with torch.no_grad():
        masked_tokens = mask.sum().clamp(min=1)
        clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps_high)).float()
        metrics = {
            "pg_loss": pg_loss.item(),
            "kl_loss": kl_loss.item(),
            "clip_fraction": ((clipped * mask).sum() / masked_tokens).item(),
            "ppo_kl": ((-log_ratio * mask).sum() / masked_tokens).item(),
            "ratio_mean": ((ratio * mask).sum() / masked_tokens).item(),
        }
    return loss, metrics


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, num_seqs: int, num_tokens: float | None) -> torch.Tensor:
    """A per-token loss [n, T] reduced as the policy loss is (SPEC §3): each sequence's token mean over the
    minibatch's num_seqs sequences, or, token-mean, the sum over its num_tokens response tokens."""
    maskf = mask.float()
    if num_tokens is not None:
        return (per_token * maskf).sum() / num_tokens
    return ((per_token * maskf).sum(1) / maskf.sum(1).clamp(min=1)).sum() / num_seqs
