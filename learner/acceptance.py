"""Per-token acceptance rate of the sparse sampler against the dense policy (Sparrow, arXiv 2606.08446, §3.1 eq. 2).

For one response position with sparse (sampler) distribution q and dense distribution p over the vocabulary V,

    alpha = E_{x ~ q}[min(1, p(x) / q(x))] = sum_{x in V} min(p(x), q(x))   (= 1 - total variation distance),

the acceptance rate of speculative decoding with q as the draft and p as the target. Sparrow keeps its 5th
percentile over tokens >= 0.86. The actors send only the K most likely tokens of q with their log-probs (Sparrow
asks its engine for the top 20), so alpha is bounded, not known: with S = topK(q),

    lower = sum_{x in S} min(p(x), q(x))
    upper = lower + min(1 - q(S), 1 - p(S))       (the mass outside S can agree at most that much)

and lower <= alpha <= upper, both exact when S is the whole vocabulary. p comes from the learner's dense recompute,
which has the full distribution at every position (pi_old, the same temperature as the sampler). With staleness
> 0 that recompute is a newer policy than the sampler's, so alpha then measures staleness and sparsity together:
measure sparsity alone with broker.max_staleness = 0.

Pure torch on tensors; no model, no I/O.
"""
from __future__ import annotations

import torch

QUANTILES = (("p1", 0.01), ("p5", 0.05), ("p50", 0.5))


def acceptance_bounds(logq_topk: torch.Tensor,
                      logp_topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bounds of the per-token acceptance rate from the top-K of q (module docstring).

    logq_topk: float [..., K], log q (sparse sampler) of its K most likely tokens at each position.
    logp_topk: float [..., K], log p (dense) of the same tokens.
    Returns float32 (lower [...], upper [...], outside [...]) with outside = 1 - q(S), the sparse mass the top-K
    leaves out (clamped to [0, 1], as are the bounds; float16 log-probs can sum a hair above 1).
    Raises ValueError when the shapes differ.
    """
    if logq_topk.shape != logp_topk.shape:
        raise ValueError(f"logq_topk {tuple(logq_topk.shape)} and logp_topk {tuple(logp_topk.shape)} "
                         "must have one shape")
    q, p = logq_topk.double().exp(), logp_topk.double().exp()
    lower = torch.minimum(p, q).sum(-1).clamp(0, 1)
    outside_q = (1 - q.sum(-1)).clamp(0, 1)
    outside_p = (1 - p.sum(-1)).clamp(0, 1)
    upper = (lower + torch.minimum(outside_q, outside_p)).clamp(0, 1)
    return lower.float(), upper.float(), outside_q.float()


def acceptance_metrics(logq_topk: torch.Tensor, logp_topk: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The step's acceptance-rate metrics over its valid response tokens (SPEC §4):

    accept_mean, accept_p1, accept_p5, accept_p50   mean and quantiles of the lower bound
    accept_upper_mean, accept_upper_p5              the upper bound's (accept_upper_p5: what the budget controller
                                                    reads by default; near the exact p5 on real batches, SPEC §4)
    accept_topk_mass_outside                        mean sparse mass outside the top K, 1 - q(topK(q))

    logq_topk / logp_topk: float [S, T, K] (module docstring); mask: bool [S, T], valid response tokens.
    Quantiles: torch.quantile, linear interpolation. NaN for every metric when no token is valid.
    """
    lower, upper, outside = acceptance_bounds(logq_topk, logp_topk)
    m = mask.to(lower.device).bool()
    lower, upper, outside = lower[m].double().cpu(), upper[m].double().cpu(), outside[m].double().cpu()
    names = ["accept_mean", *(f"accept_{k}" for k, _ in QUANTILES), "accept_upper_mean", "accept_upper_p5",
             "accept_topk_mass_outside"]
    if lower.numel() == 0:
        return {name: float("nan") for name in names}
    q = torch.tensor([v for _, v in QUANTILES] + [0.05], dtype=torch.float64)
    low_q = torch.quantile(lower, q[:-1]).tolist()
    return dict(zip(names, [lower.mean().item(), *low_q, upper.mean().item(), torch.quantile(upper, q[-1:]).item(),
                            outside.mean().item()]))
