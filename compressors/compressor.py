"""Decode-time KV eviction under a fixed budget (docs/SPEC.md §5): which cache slots to keep, and how.

The engine owns the cache. Every `cfg.interval` decode steps (and after a prefill longer than the budget),
for each layer whose cache holds more than `cfg.kv_budget` slots, it calls

    keep_idx = compressor.select(keys, queries, valid, attn_mass)      # [batch, kv_heads, kv_budget]
    keys, values, valid, attn_mass = (gather_kv(t, keep_idx) for t in (keys, values, valid, attn_mass))

`gather_kv` is the one eviction mechanism every policy shares. With `cfg.selection == "shared"` the
engine calls `select` on layer 0 only and gathers every layer with those indices. For H2O the engine also
calls `accumulate_attention` after every forward of every layer. `cfg.method == "full"` never evicts: the
engine should not call `select` at all (if it does, every slot is returned).
"""
from __future__ import annotations

import torch

from compressors import scores
from compressors.config import CompressorConfig


class Compressor:
    """A validated `CompressorConfig` plus the selection rule shared by every method.

    Kept set of one (sequence, KV head) row, per SPEC §5: the last `cfg.window` slots (H2O: the last
    `cfg.h2o_recent`) always, plus the best-scoring other slots up to `cfg.kv_budget`. Invalid slots
    (padding, empty) are only kept when the row has fewer valid slots than `kv_budget`. Ties go to the more
    recent slot. Scoring runs in float32 whatever the cache dtype.
    """

    def __init__(self, cfg: CompressorConfig):
        cfg.validate()
        self.cfg = cfg
        self.needs_attention_mass = cfg.method == "h2o"
        """True when `select` needs `attn_mass` (kept up to date with `accumulate_attention`)."""

    def select(self, keys: torch.Tensor, queries: torch.Tensor, valid: torch.Tensor | None,
               attn_mass: torch.Tensor | None = None) -> torch.Tensor:
        """Choose the cache slots to keep.

        keys: [batch, kv_heads, seq, head_dim], after RoPE, slots in time order (oldest first), any float dtype.
        queries: [batch, q_heads, w, head_dim], the last w (1 <= w <= cfg.window) queries of this layer after
            RoPE; q_heads must be a multiple of kv_heads. Used by rkv and snapkv only.
        valid: bool [batch, seq] or [batch, kv_heads, seq]; False = padding / empty slot; None = all valid.
        attn_mass: float [batch, kv_heads, seq], accumulated attention (see `accumulate_attention`);
            required iff `needs_attention_mass` (h2o).
        Returns int64 [batch, kv_heads, kv_budget] slot indices, ascending in every row (for `full`:
            [batch, kv_heads, seq], every slot). With selection "shared" all kv_heads rows are equal (scores
            averaged over the heads; a slot counts as valid only if it is valid in every head).
        Raises ValueError naming the argument on a wrong shape or dtype, q_heads not divisible by kv_heads,
            a missing attn_mass, or seq <= kv_budget (nothing to evict: do not call).
        """
        cfg = self.cfg
        if keys.dim() != 4:
            raise ValueError(f"keys must be [batch, kv_heads, seq, head_dim], got shape {tuple(keys.shape)}")
        batch, kv_heads, seq, head_dim = keys.shape
        if cfg.method == "full":
            return torch.arange(seq, device=keys.device).expand(batch, kv_heads, seq)
        if seq <= cfg.kv_budget:
            raise ValueError(f"keys hold seq={seq} slots <= compressor.kv_budget={cfg.kv_budget}: nothing to evict")
        if valid is None:
            valid = torch.ones(batch, kv_heads, seq, dtype=torch.bool, device=keys.device)
        if valid.dtype != torch.bool:
            raise ValueError(f"valid must be a bool tensor, got {valid.dtype}")
        if valid.dim() == 2:
            valid = valid[:, None, :]
        if valid.dim() != 3 or valid.shape[0] != batch or valid.shape[2] != seq or valid.shape[1] not in (1, kv_heads):
            raise ValueError(f"valid must be [batch={batch}, seq={seq}] or [batch, kv_heads={kv_heads}, seq], "
                             f"got shape {tuple(valid.shape)}")
        valid = valid.expand(batch, kv_heads, seq)

        if cfg.method in ("rkv", "snapkv"):
            if queries is None or queries.dim() != 4:
                raise ValueError("queries must be [batch, q_heads, w, head_dim], got "
                                 f"{None if queries is None else tuple(queries.shape)}")
            if queries.shape[0] != batch or queries.shape[3] != head_dim:
                raise ValueError(f"queries shape {tuple(queries.shape)} does not match keys shape "
                                 f"{tuple(keys.shape)} in batch or head_dim")
            if queries.shape[1] % kv_heads != 0:
                raise ValueError(f"queries q_heads={queries.shape[1]} is not a multiple of keys kv_heads={kv_heads}")
            if not 1 <= queries.shape[2] <= cfg.window:
                raise ValueError(f"queries hold w={queries.shape[2]} queries; expected 1 <= w <= "
                                 f"compressor.window={cfg.window}")
        if cfg.method == "rkv":
            score = scores.rkv_scores(keys, queries, valid, cfg.window, cfg.pool_kernel,
                                      cfg.similarity_threshold, cfg.rkv_lambda)
        elif cfg.method == "snapkv":
            score = scores.snapkv_scores(keys, queries, valid, cfg.window, cfg.pool_kernel)
        elif cfg.method == "h2o":
            if attn_mass is None or tuple(attn_mass.shape) != (batch, kv_heads, seq):
                raise ValueError(f"attn_mass must be [batch={batch}, kv_heads={kv_heads}, seq={seq}] for h2o, got "
                                 f"{None if attn_mass is None else tuple(attn_mass.shape)}")
            score = attn_mass.float()
        else:  # streamingllm
            score = scores.streamingllm_scores(valid, cfg.sinks)

        if cfg.selection == "shared":
            score = score.mean(dim=1, keepdim=True)
            valid = valid.all(dim=1, keepdim=True)
        protected = cfg.h2o_recent if cfg.method == "h2o" else cfg.window
        score = score.masked_fill(~valid, float("-inf"))
        score[..., seq - protected:] = float("inf")
        # Stable sort of the reversed row: among equal scores the more recent slot comes first.
        order = torch.sort(score.flip(-1), dim=-1, descending=True, stable=True).indices[..., :cfg.kv_budget]
        keep_idx = (seq - 1 - order).sort(dim=-1).values
        return keep_idx.expand(batch, kv_heads, cfg.kv_budget)


def build_compressor(cfg: CompressorConfig) -> Compressor:
    """Validate `cfg` (ValueError naming the field, see `CompressorConfig.validate`) and return its Compressor."""
    return Compressor(cfg)


def accumulate_attention(attn_mass: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """H2O state update (arXiv 2306.14048), called after every forward of a layer (prefill and each decode step).

    attn_mass: float32 [batch, kv_heads, seq_old] accumulated so far; before the first forward pass
        `torch.zeros(batch, kv_heads, 0)`.
    probs: [batch, q_heads, q, seq] this forward's softmax attention probabilities over the cache slots
        (seq >= seq_old: the slots this forward appended are the last seq - seq_old; padding should carry 0).
    Returns float32 [batch, kv_heads, seq]: attn_mass with the new slots appended at 0, plus probs summed over
    the q queries and over the query heads of each KV head's group. At an eviction the engine carries it with
    `gather_kv(attn_mass, keep_idx)`, like K and V.
    Raises ValueError on wrong shapes or q_heads not a multiple of kv_heads.
    """
    if probs.dim() != 4:
        raise ValueError(f"probs must be [batch, q_heads, q, seq], got shape {tuple(probs.shape)}")
    batch, q_heads, _, seq = probs.shape
    if attn_mass.dim() != 3 or attn_mass.shape[0] != batch or attn_mass.shape[2] > seq:
        raise ValueError(f"attn_mass shape {tuple(attn_mass.shape)} does not fit probs shape {tuple(probs.shape)}: "
                         "expected [batch, kv_heads, seq_old <= seq]")
    kv_heads = attn_mass.shape[1]
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(f"probs q_heads={q_heads} is not a multiple of attn_mass kv_heads={kv_heads}")
    added = probs.float().sum(dim=2).view(batch, kv_heads, q_heads // kv_heads, seq).sum(dim=2)
    return torch.nn.functional.pad(attn_mass.float(), (0, seq - attn_mass.shape[2])) + added


def gather_kv(x: torch.Tensor, keep_idx: torch.Tensor) -> torch.Tensor:
    """The eviction itself, shared by every policy: keep the slots `keep_idx` of every row of `x`.

    x: [batch, kv_heads, seq, ...] (K or V [.., head_dim], validity, attn_mass, positions: any dtype);
    keep_idx: int64 [batch, kv_heads, k] from `Compressor.select`.
    Returns [batch, kv_heads, k, ...], a new contiguous tensor (the old cache can be freed).
    Raises ValueError if the leading dims differ or x has fewer than 3 dims.
    """
    if x.dim() < 3 or keep_idx.dim() != 3 or x.shape[:2] != keep_idx.shape[:2]:
        raise ValueError(f"gather_kv: x {tuple(x.shape)} must be [batch, kv_heads, seq, ...] and keep_idx "
                         f"{tuple(keep_idx.shape)} [batch, kv_heads, k] with the same batch and kv_heads")
    index = keep_idx.view(*keep_idx.shape, *([1] * (x.dim() - 3))).expand(*keep_idx.shape, *x.shape[3:])
    return torch.gather(x, 2, index)
