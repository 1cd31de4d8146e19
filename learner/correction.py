"""Sparsity-aware rejection and reweighting (docs/SPEC.md §2) and the mismatch metrics of §4.

A pure function of tensors: no model, no engine, testable with hand-made numbers.
"""
from __future__ import annotations

import torch

LOG_XI_CLAMP = 20.0


TAIL_QUANTILES = (("p1", 0.01), ("p5", 0.05), ("p50", 0.5))


def ratio_tail(log_xi: torch.Tensor) -> dict[str, float]:
    """Quantiles p1, p5, p50 of xi = exp(log_xi) (`xi_pK`) and of min(xi, 1/xi) = exp(-|log_xi|) (`xi_sym_pK`)
    over a 1-D tensor of valid tokens' log xi (torch.quantile, linear interpolation); NaN when it is empty."""
    q = torch.tensor([v for _, v in TAIL_QUANTILES], dtype=torch.float64)
    if log_xi.numel() == 0:
        return {f"{name}_{k}": float("nan") for name in ("xi", "xi_sym") for k, _ in TAIL_QUANTILES}
    log_xi = log_xi.detach().double().cpu()
    out = {}
    for name, values in (("xi", log_xi.exp()), ("xi_sym", (-log_xi.abs()).exp())):
        out.update({f"{name}_{k}": float(v) for (k, _), v in zip(TAIL_QUANTILES, torch.quantile(values, q))})
    return out


def sparse_correction(
    logp_old: torch.Tensor,
    logp_sparse: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    correction: str = "on",
    rejection: str = "veto",
    eps: float = 1e-4,
    geo_bounds: tuple[float, float] = (0.5, 2.0),
    token_mask: bool = True,
    token_mask_bounds: tuple[float, float] = (0.5, 1.5),
    tis_cap: float = 1.5,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Importance weights and loss mask correcting pi_sparse -> pi_old (SPEC §2).

    Args:
        logp_old: float [num_seqs, max_resp_len], log pi_old of each response token (dense recompute).
        logp_sparse: float [num_seqs, max_resp_len], log pi_sparse recorded by the sampler.
        response_mask: bool or 0/1 [num_seqs, max_resp_len], True on real (non-padding) response tokens.
        correction: "on" | "metrics_only" (metrics computed, weights 1, mask = response_mask) |
            "off" (weights 1, mask = response_mask, only shape metrics).
        rejection: "veto" (any token with xi < eps rejects its sequence; one-sided) | "geometric" (the
            per-sequence geometric mean of xi outside geo_bounds rejects it) | "none".
        token_mask: mask tokens with xi outside token_mask_bounds.
        tis_cap: C in w = min(xi, C).
        normalize: divide the weights by their batch mean (the authors'). False returns min(xi, C) itself, for a
            caller that sees the batch in parts and applies the mean (`metrics["tis_weight_mean"]` of the whole
            batch) afterwards: the learner's single-pass step scales the gradient by it.

    Returns:
        weights: float32 [num_seqs, max_resp_len], min(xi, C) divided by its mean over all valid
            (non-padding) response tokens of the batch (not divided with normalize=False); detached; 0 on padding.
        loss_mask: float32 [num_seqs, max_resp_len], response_mask after sequence rejection and token mask.
        metrics: rejection_rate, token_mask_fraction, truncate_fraction, mismatch_kl (k3 per-sequence token
            mean, averaged over sequences), mismatch_kl_k1 (same reduction of logp_sparse - logp_old),
            catastrophic_token_fraction (xi < eps), xi_mean/xi_max, tis_weight_mean (before normalisation), and the
            tail of the per-token ratio over valid tokens (Sparrow, arXiv 2606.08446: the tail, not the mean,
            predicts collapse): xi_p1, xi_p5, xi_p50 and xi_sym_p1, xi_sym_p5, xi_sym_p50, quantiles (linear
            interpolation) of xi and of min(xi, 1/xi).

    Raises:
        ValueError: shapes differ, or an unknown option.
    """
    if not (logp_old.shape == logp_sparse.shape == response_mask.shape) or logp_old.dim() != 2:
        raise ValueError(f"logp_old {tuple(logp_old.shape)}, logp_sparse {tuple(logp_sparse.shape)} and "
                         f"response_mask {tuple(response_mask.shape)} "
                         "must share one 2-D shape [num_seqs, max_resp_len]")
    if correction not in ("on", "metrics_only", "off"):
        raise ValueError(f"correction={correction!r}: expected on | metrics_only | off")
    if rejection not in ("veto", "geometric", "none"):
        raise ValueError(f"rejection={rejection!r}: expected veto | geometric | none")

    valid = response_mask.bool()
    validf = valid.float()
    num_seqs = logp_old.shape[0]
    num_tokens = validf.sum().clamp(min=1)
    seq_len = validf.sum(1).clamp(min=1)
    ones = torch.ones_like(logp_old, dtype=torch.float32)
    if correction == "off":
        return ones * validf, validf.clone(), {"rejection_rate": 0.0}

    with torch.no_grad():
        log_xi = (logp_old.float() - logp_sparse.float()).clamp(-LOG_XI_CLAMP, LOG_XI_CLAMP) * validf
        xi = log_xi.exp()

        if rejection == "veto":
            rejected = ((xi < eps) & valid).any(1)
        elif rejection == "geometric":
            geo_mean = ((log_xi * validf).sum(1) / seq_len).exp()
            rejected = (geo_mean < geo_bounds[0]) | (geo_mean > geo_bounds[1])
        else:
            rejected = torch.zeros(num_seqs, dtype=torch.bool, device=logp_old.device)

        out_of_bounds = valid & ((xi < token_mask_bounds[0]) | (xi > token_mask_bounds[1]))
        keep = valid & ~rejected[:, None]
        if token_mask:
            keep = keep & ~out_of_bounds

        truncated = xi.clamp(max=tis_cap) * validf
        weights = truncated / (truncated.sum() / num_tokens) if normalize else truncated

        k3 = (xi - log_xi - 1) * validf
        metrics = {
            "rejection_rate": rejected.float().mean().item(),
            "token_mask_fraction": (out_of_bounds.float().sum() / num_tokens).item() if token_mask else 0.0,
            "truncate_fraction": ((xi > tis_cap) & valid).float().sum().item() / num_tokens.item(),
            "catastrophic_token_fraction": ((xi < eps) & valid).float().sum().item() / num_tokens.item(),
            "mismatch_kl": (k3.sum(1) / seq_len).mean().item(),
            "mismatch_kl_k1": ((-log_xi).sum(1) / seq_len).mean().item(),
            "xi_mean": (xi * validf).sum().item() / num_tokens.item(),
            "xi_max": xi.masked_fill(~valid, 0).max().item() if valid.any() else 0.0,
            "tis_weight_mean": (truncated.sum() / num_tokens).item(),
            **ratio_tail(log_xi[valid]),
        }
    if correction == "metrics_only":
        return ones * validf, validf.clone(), metrics
    return weights, keep.float(), metrics
