"""Decode-time KV eviction under a fixed budget (docs/SPEC.md §5): which cache slots to keep, and how.

The engine owns the cache. Every `cfg.interval` decode steps (and after a prefill longer than the budget),
for each layer whose cache holds more than `cfg.kv_budget` slots, it calls

    keep_idx = compressor.select(keys, queries, valid, ctx)      # [batch, kv_heads, kv_budget]
    keys, values, valid, ... = (gather_kv(t, keep_idx) for t in (keys, values, valid, ...))

with `ctx` a `SelectContext` holding what `compressor.needs` names (values, attention mass, positions, prompt
lengths, seeds, the event, the layer). `gather_kv` is the one eviction mechanism every policy shares. With
`cfg.selection == "shared"` the engine calls `select` on layer 0 only and gathers every layer with those indices.
For H2O the engine also calls `accumulate_attention` after every forward of every layer. `cfg.method == "full"`
never evicts: the engine should not call `select` at all (if it does, every slot is returned).
"""
from __future__ import annotations

import dataclasses

import torch

from compressors import scores
from compressors.config import CompressorConfig

WINDOW, SINK, PROTECTED, CANDIDATE = 3, 2, 1, 0
"""Keep classes of a slot, highest kept first; within a class the method's score decides (ties: more recent)."""


@dataclasses.dataclass(frozen=True)
class SelectContext:
    """What `Compressor.select` reads besides keys, queries and validity; each field is needed only by the
    settings `Compressor.needs` names (None otherwise). Shapes as `select`'s keys: [batch, kv_heads, seq, ...].

    values: [batch, kv_heads, seq, head_dim], any float dtype (protect_values).
    attn_mass: float [batch, kv_heads, seq], H2O's accumulated attention (`accumulate_attention`; h2o).
    positions: int64 [batch, seq] or [batch, kv_heads, seq], each slot's true token position (0 = the first
        prompt token; padding: any) (random, protect_prompt).
    prompt_len: int64 [batch], tokens of each row's prompt (a multi-turn episode's first), positions
        [0, prompt_len) (protect_prompt).
    seed: int64 [batch], each sample's seed (random); event: int64 [batch], the event's index in the row: its
        length at the event, tokens (the true position of its newest token + 1), distinct for each event of a row
        and known to every engine without counting (random).
    layer: the layer's index (random).
    """
    values: torch.Tensor | None = None
    attn_mass: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    prompt_len: torch.Tensor | None = None
    seed: torch.Tensor | None = None
    event: torch.Tensor | None = None
    layer: int = 0


class Compressor:
    """A validated `CompressorConfig` plus the selection rule shared by every method.

    Kept set of one (sequence, KV head) row, per SPEC §5: by class, then by the method's score. The last
    `cfg.window` slots (H2O: the last `cfg.h2o_recent`) always; then the sinks (the first `cfg.sink_tokens` valid
    slots); then the protected slots (protect_prompt, protect_values); then the other slots, best score first, up to
    `cfg.kv_budget`. When a class does not fit (a prompt longer than the budget under protect_prompt all) the
    budget wins: the slots of that class the method scores highest are kept. Invalid slots (padding, empty) are
    only kept when the row has fewer valid slots than `kv_budget`. Ties go to the more recent slot. Scoring runs
    in float32 whatever the cache dtype (random: float64, exact 32-bit hashes).
    """

    def __init__(self, cfg: CompressorConfig):
        cfg.validate()
        self.cfg = cfg
        self.needs_attention_mass = cfg.method == "h2o"
        """True when `select` needs `ctx.attn_mass` (kept up to date with `accumulate_attention`)."""
        needs = {"attn_mass"} if self.needs_attention_mass else set()
        if cfg.method == "random":
            needs |= {"seed", "event"}
        if cfg.protect_prompt != "off":
            needs.add("prompt_len")
        if cfg.reads_positions:
            needs.add("positions")
        if cfg.protect_values > 0:
            needs.add("values")
        self.needs = frozenset(needs)
        """The `SelectContext` fields `select` reads (besides layer)."""

    def select(self, keys: torch.Tensor, queries: torch.Tensor | None, valid: torch.Tensor | None,
               ctx: SelectContext | None = None) -> torch.Tensor:
        """Choose the cache slots to keep.

        keys: [batch, kv_heads, seq, head_dim], after RoPE, slots in time order (oldest first), any float dtype.
        queries: [batch, q_heads, w, head_dim], the last w (1 <= w <= cfg.window) queries of this layer after
            RoPE; q_heads must be a multiple of kv_heads. Used by rkv and snapkv only.
        valid: bool [batch, seq] or [batch, kv_heads, seq]; False = padding / empty slot; None = all valid.
        ctx: the `SelectContext` fields `self.needs` names (None: none needed).
        Returns int64 [batch, kv_heads, kv_budget] slot indices, ascending in every row (for `full`:
            [batch, kv_heads, seq], every slot). With selection "shared" all kv_heads rows are equal (scores
            averaged over the heads; a slot counts as valid only if it is valid in every head).
        Raises ValueError naming the argument on a wrong shape or dtype, q_heads not divisible by kv_heads,
            a needed ctx field missing or of the wrong shape, or seq <= kv_budget (nothing to evict: do not call).
        """
        cfg = self.cfg
        if keys.dim() != 4:
            raise ValueError(f"keys must be [batch, kv_heads, seq, head_dim], got shape {tuple(keys.shape)}")
        batch, kv_heads, seq, _ = keys.shape
        if cfg.method == "full":
            return torch.arange(seq, device=keys.device).expand(batch, kv_heads, seq)
        if seq <= cfg.kv_budget:
            raise ValueError(f"keys hold seq={seq} slots <= compressor.kv_budget={cfg.kv_budget}: nothing to evict")
        valid = self._valid(keys, valid)
        ctx = self._context(keys, ctx)
        score = self._scores(keys, queries, valid, ctx)
        if cfg.selection == "shared":
            score = score.mean(dim=1, keepdim=True)
            valid = valid.all(dim=1, keepdim=True)
        recent = cfg.h2o_recent if cfg.method == "h2o" else cfg.window
        score = score.masked_fill(~valid, float("-inf"))
        score[..., seq - recent:] = float("inf")
        # Stable sort of the reversed row: among equal scores the more recent slot comes first.
        order = torch.sort(score.flip(-1), dim=-1, descending=True, stable=True).indices
        if cfg.protects:   # then by class, stably: the score order stays within each class
            rank = self.classes(valid, ctx).flip(-1).gather(-1, order)
            order = order.gather(-1, torch.sort(rank, dim=-1, descending=True, stable=True).indices)
        keep_idx = (seq - 1 - order[..., :cfg.kv_budget]).sort(dim=-1).values
        return keep_idx.expand(batch, kv_heads, cfg.kv_budget)

    def classes(self, valid: torch.Tensor, ctx: SelectContext) -> torch.Tensor:
        """The keep class of every slot, int8 [batch, 1 or kv_heads, seq] (valid's heads): WINDOW for the last
        window (h2o: h2o_recent) slots, SINK for the first `sink_tokens` valid ones, PROTECTED for the valid
        slots of the protected prompt part (positions in [prompt_len - n, prompt_len), all: [0, prompt_len)) and
        the protect_values largest value norms among the valid slots before the window, CANDIDATE otherwise.
        valid: bool [batch, heads, seq] (selection shared: heads 1, valid in every head); ctx as `select`'s."""
        cfg, seq = self.cfg, valid.shape[-1]
        recent = cfg.h2o_recent if cfg.method == "h2o" else cfg.window
        protected = torch.zeros_like(valid)           # masks and torch.where only: no host sync on any device
        kind, n = cfg.prompt_protection()
        if kind != "off":
            pos = ctx.positions[:, :valid.shape[1]] if ctx.positions.dim() == 3 else ctx.positions[:, None]
            plen = ctx.prompt_len[:, None, None]
            first = plen - n if kind == "last" else torch.zeros_like(plen)
            protected = protected | (valid & (pos < plen) & (pos >= first))
        if cfg.protect_values > 0:
            norm = ctx.values.float().norm(dim=-1)
            norm = norm.mean(dim=1, keepdim=True) if valid.shape[1] == 1 else norm
            candidate = valid.clone()
            candidate[..., seq - recent:] = False
            order = torch.sort(norm.masked_fill(~candidate, float("-inf")).flip(-1), dim=-1, descending=True,
                               stable=True).indices[..., :cfg.protect_values]
            protected = protected | (torch.zeros_like(valid).scatter_(-1, seq - 1 - order, True) & candidate)
        sink = valid & (valid.cumsum(dim=-1) <= cfg.sink_tokens)
        cls = torch.where(sink, SINK, torch.where(protected, PROTECTED, CANDIDATE)).to(torch.int8)
        cls[..., seq - recent:] = WINDOW
        return cls

    def protected_share(self, keep: torch.Tensor, valid: torch.Tensor, ctx: SelectContext) -> torch.Tensor:
        """The share of the kept valid slots that protection held (class SINK or PROTECTED, not the window), per
        row, mean over the KV heads, float32 [batch] (what MLflow's kv/protected_fraction averages).
        keep: int64 [batch, kv_heads, k] from `select` with these valid (bool [batch, (kv_heads,) seq]) and ctx."""
        batch, kv_heads = keep.shape[:2]
        valid = (valid if valid.dim() == 3 else valid[:, None]).expand(batch, kv_heads, valid.shape[-1])
        rows = valid.all(dim=1, keepdim=True) if self.cfg.selection == "shared" else valid
        held = self.classes(rows, ctx).expand(batch, kv_heads, -1).gather(-1, keep)
        kept_valid = valid.gather(-1, keep)
        protected = ((held == SINK) | (held == PROTECTED)) & kept_valid
        return (protected.sum(-1).float() / kept_valid.sum(-1).clamp(min=1)).mean(-1)

    def _valid(self, keys: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """valid checked and expanded to bool [batch, kv_heads, seq] (None: all valid)."""
        batch, kv_heads, seq, _ = keys.shape
        if valid is None:
            valid = torch.ones(batch, kv_heads, seq, dtype=torch.bool, device=keys.device)
        if valid.dtype != torch.bool:
            raise ValueError(f"valid must be a bool tensor, got {valid.dtype}")
        if valid.dim() == 2:
            valid = valid[:, None, :]
        if valid.dim() != 3 or valid.shape[0] != batch or valid.shape[2] != seq or valid.shape[1] not in (1, kv_heads):
            raise ValueError(f"valid must be [batch={batch}, seq={seq}] or [batch, kv_heads={kv_heads}, seq], "
                             f"got shape {tuple(valid.shape)}")
        return valid.expand(batch, kv_heads, seq)

    def _context(self, keys: torch.Tensor, ctx: SelectContext | None) -> SelectContext:
        """ctx with every field `needs` names present and of its shape; raises ValueError naming the field."""
        ctx = ctx or SelectContext()
        batch, kv_heads, seq, head_dim = keys.shape
        shapes = {"values": [(batch, kv_heads, seq, head_dim)], "attn_mass": [(batch, kv_heads, seq)],
                  "positions": [(batch, seq), (batch, kv_heads, seq)], "prompt_len": [(batch,)],
                  "seed": [(batch,)], "event": [(batch,)]}
        for name in sorted(self.needs):
            t = getattr(ctx, name)
            if t is None or tuple(t.shape) not in shapes[name]:
                raise ValueError(f"ctx.{name} must be {' or '.join(str(list(s)) for s in shapes[name])} for "
                                 f"compressor.method={self.cfg.method!r} (protect_prompt={self.cfg.protect_prompt!r}, "
                                 f"protect_values={self.cfg.protect_values}), got "
                                 f"{None if t is None else tuple(t.shape)}")
        return ctx

    def _scores(self, keys, queries, valid, ctx: SelectContext) -> torch.Tensor:
        """The method's score of every slot, [batch, kv_heads, seq] (higher = keep; see compressors/scores.py)."""
        cfg = self.cfg
        if cfg.method in ("rkv", "snapkv"):
            _check_queries(keys, queries, cfg.window)
        if cfg.method == "rkv":
            return scores.rkv_scores(keys, queries, valid, cfg.window, cfg.pool_kernel, cfg.similarity_threshold,
                                     cfg.rkv_lambda)
        if cfg.method == "snapkv":
            return scores.snapkv_scores(keys, queries, valid, cfg.window, cfg.pool_kernel)
        if cfg.method == "h2o":
            return ctx.attn_mass.float()
        if cfg.method == "random":
            positions = ctx.positions if ctx.positions.dim() == 3 else ctx.positions[:, None]
            return scores.random_scores(ctx.seed, ctx.layer, positions.expand(valid.shape), ctx.event)
        return scores.streamingllm_scores(valid)


def _check_queries(keys: torch.Tensor, queries: torch.Tensor | None, window: int) -> None:
    """ValueError naming queries unless [batch, q_heads, 1..window, head_dim] with q_heads a multiple of keys'."""
    batch, kv_heads, _, head_dim = keys.shape
    if queries is None or queries.dim() != 4:
        raise ValueError("queries must be [batch, q_heads, w, head_dim], got "
                         f"{None if queries is None else tuple(queries.shape)}")
    if queries.shape[0] != batch or queries.shape[3] != head_dim:
        raise ValueError(f"queries shape {tuple(queries.shape)} does not match keys shape "
                         f"{tuple(keys.shape)} in batch or head_dim")
    if queries.shape[1] % kv_heads != 0:
        raise ValueError(f"queries q_heads={queries.shape[1]} is not a multiple of keys kv_heads={kv_heads}")
    if not 1 <= queries.shape[2] <= window:
        raise ValueError(f"queries hold w={queries.shape[2]} queries; expected 1 <= w <= "
                         f"compressor.window={window}")


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
