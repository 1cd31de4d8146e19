"""Eviction replay (docs/SPEC.md §2.4): the learner's teacher-forced forward hides, per layer and KV head, exactly
the keys the rollout's compressor had evicted, so its log-probs are the compressed sampler's (pi_sparse) and the
GRPO ratio is on-policy for the policy that generated (MoE RL's routing replay, for KV eviction).

The record travels with each sample (`SampleRecord.eviction_steps`, broker/schema.py): uint16 [layers, heads,
P + T] over the sample's own tokens (prompt, then response), the number of response tokens generated when that
key was evicted (`EVICTION_NEVER` = never; heads = the model's KV heads, or 1 when every head kept the same set).
In the learner's right-padded layout the query at position q (0-based over prompt + response) sees key k iff
k <= q and q < P + eviction_steps[k] (and always itself), which is the engine's "query column < eviction
column" (actors/engines/torch_engine.py) re-based to the sample.

`replay_attention` is registered with transformers' AttentionInterface as "sparse_rl_replay": with the keyword
`replay_evicted_at` (int32 [B, layers, heads, L], local query index of each key's eviction) it builds each
layer's mask from that O(layers x heads x L) record: on the CPU a boolean [B, H, L, L] for SDPA (the reference
path), on CUDA a FlexAttention block mask (compiled; bench/replay_gpu_check.py checks it against SDPA); without the
keyword it is transformers' SDPA attention, so one model serves the dense and the replayed forward. With the keyword
`replay_kv_quant` (compressors.kv_quant.KVQuant, the sampler's compressor.kv_dtype / kv_scale) it first
quantize-dequantizes the layer's K and V (after RoPE, at every position, with the engine's own function
`straight_through`: identity backward), the values the sampler's queries read from its quantized cache
(docs/kv_cache.md "Quantized KV"); with `replay_rounding_hints` as well (`collate_hints`: the samples'
`rounding_hints`), the sampler's own codes at the elements where its rounding was within noise of a code boundary,
so a recomputation's rounding noise flips no code (docs/kv_cache.md "Rounding hints").
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from compressors.kv_quant import straight_through, unpack_hints

EVICTION_NEVER = np.iinfo(np.uint16).max
"""eviction_steps value of a key no query of the sample lost."""
NEVER_INDEX = np.iinfo(np.int32).max
"""replay_evicted_at value of a key never evicted."""
ATTN_IMPLEMENTATION = "sparse_rl_replay"


def replay_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs):
    """transformers attention function: query [B, Hq, L, D], key/value [B, Hkv, L, D] (L = the full sequence:
    the learner's forward has no KV cache). With `replay_evicted_at` in kwargs, attention under the eviction
    record of layer `module.layer_idx` (GQA: query head h reads KV head h // (Hq / Hkv)): FlexAttention on CUDA,
    SDPA with a boolean mask elsewhere (`replay_backend` sdpa | flex forces one); else SDPA as transformers does
    it. With `replay_kv_quant` (a KVQuant) key and value are read through `straight_through` first, with the
    layer's `replay_rounding_hints` (`collate_hints`) when given. Returns (attn_output [B, L, Hq, D], None)."""
    evicted_at = kwargs.pop("replay_evicted_at", None)
    backend = kwargs.pop("replay_backend", "auto")   # auto | sdpa | flex (bench/replay_gpu_check.py compares them)
    quant = kwargs.pop("replay_kv_quant", None)
    hints = kwargs.pop("replay_rounding_hints", None)
    if quant is not None:   # the sampler's stored precision (its codes where hinted): forward qdq, backward identity
        key, value = (straight_through(x, quant, layer_hints(hints, module.layer_idx, kv, x))
                      for kv, x in enumerate((key, value)))
    if evicted_at is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    flex = backend == "flex" or (backend == "auto" and query.is_cuda and _flex() is not None)
    if flex:   # the block-sparse path: the dense mask never materialises
        return flex_replay_attention(query, key, value, evicted_at[:, module.layer_idx], scaling), None
    return sdpa_replay_attention(query, key, value, evicted_at[:, module.layer_idx], scaling), None


def sdpa_replay_attention(query, key, value, evicted_at: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """The reference path (CPU): SDPA with the layer's boolean mask [B, H, L, L] from `evicted_at` int32
    [B, heads, L] (heads 1 or Hkv). query [B, Hq, L, D], key/value [B, Hkv, L, D]; returns [B, L, Hq, D]."""
    visible = layer_visibility(evicted_at, query.shape[2])                            # [B, H, L, L]
    groups = query.shape[1] // key.shape[1]
    heads = visible.shape[1]
    if heads == 1:                                                                   # shared selection
        mask = visible
    else:
        mask = visible.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                         attn_mask=mask, dropout_p=0.0, scale=scaling)
    return out.transpose(1, 2).contiguous()


def flex_replay_attention(query, key, value, evicted_at: torch.Tensor, scaling: float | None,
                          compiled: bool | None = None) -> torch.Tensor:
    """The same attention through torch FlexAttention: mask_mod(b, h, q, kv) = (kv <= q and q < evicted_at[b, h //
    group, kv]) or kv == q, and a block mask from `create_block_mask`, so blocks whose keys were all evicted before
    their queries are skipped (the saving on long sequences). Compiled on CUDA (`compiled` None = query.is_cuda);
    eager elsewhere (a slow reference, for tests). Shapes as `sdpa_replay_attention`."""
    flex = _flex()
    B, Hq, L, _ = query.shape
    heads = evicted_at.shape[1]
    group = Hq // heads
    table = evicted_at[..., :L]

    def mask_mod(b, h, q, kv):
        return ((kv <= q) & (q < table[b, h // group, kv])) | (q == kv)

    compiled = query.is_cuda if compiled is None else compiled
    block_mask = flex.create_block_mask(mask_mod, B, Hq, L, L, device=query.device, _compile=compiled)
    attend = _compiled_flex() if compiled else flex.flex_attention
    out = attend(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=key.shape[1] != Hq)
    return out.transpose(1, 2).contiguous()


def _flex():
    """torch.nn.attention.flex_attention, or None where this torch has none."""
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    return flex_attention


_COMPILED = []


def _compiled_flex():
    """flex_attention under torch.compile (once per process): FlexAttention's fused kernel on CUDA."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_flex().flex_attention, dynamic=True))
    return _COMPILED[0]


AttentionInterface.register(ATTN_IMPLEMENTATION, replay_attention)


def layer_visibility(evicted_at: torch.Tensor, L: int) -> torch.Tensor:
    """Boolean [B, H, L, L] of one layer: query q sees key k iff k <= q and q < evicted_at[b, h, k], or k == q.
    `evicted_at`: int32 [B, H, >= L] local query index at which each key was evicted (NEVER_INDEX: never)."""
    q = torch.arange(L, device=evicted_at.device)
    causal = q[None, :] <= q[:, None]                                                  # [L(q), L(k)]
    seen = q[None, None, :, None] < evicted_at[:, :, None, :L]                          # [B, H, L, L]
    return (seen & causal) | torch.eye(L, dtype=torch.bool, device=evicted_at.device)


def collate_record(records: list[np.ndarray | None], prompt_lens: list[int], L: int, layers: int,
                   kv_heads: int) -> torch.Tensor:
    """The samples' eviction_steps (uint16 [layers, heads, P + T] each, heads 1 or kv_heads) as the forward's
    `replay_evicted_at`: int32 [S, layers, kv_heads, L], key k of sample i evicted at local query index
    P_i + eviction_steps[..., k]; NEVER_INDEX for never and for padding.

    Raises ValueError naming the sample whose record is missing or has the wrong shape."""
    out = torch.full((len(records), layers, kv_heads, L), NEVER_INDEX, dtype=torch.int32)
    for i, (rec, P) in enumerate(zip(records, prompt_lens)):
        if rec is None:
            raise ValueError(f"sample {i} has no eviction record (learner.policy_target=sparse replays one per sample)")
        if rec.ndim != 3 or rec.shape[0] != layers or rec.shape[1] not in (1, kv_heads) or rec.shape[2] > L:
            raise ValueError(f"sample {i}: eviction record of shape {tuple(rec.shape)}, expected "
                             f"[{layers}, 1 or {kv_heads}, <= {L}]")
        steps = torch.from_numpy(np.asarray(rec, dtype=np.int64))
        local = torch.where(steps == EVICTION_NEVER, NEVER_INDEX, steps + P).to(torch.int32)
        out[i, :, :, :rec.shape[2]] = local.expand(layers, kv_heads, rec.shape[2])
    return out


def collate_hints(hints: list[np.ndarray | None], seq_lens: list[int], L: int, layers: int, kv_heads: int,
                  head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The samples' rounding hints (`Sample.rounding_hints`: int64 [n_i], each an element's flat index into
    [layers, 2, kv_heads, P_i + T_i, head_dim] << 16 | its code bits; None: none) as the forward's
    `replay_rounding_hints`: (index int64 [n], ascending, flat into [layers, 2, S, kv_heads, L, head_dim] (the
    learner's right-padded layout: token t of sample i at position t); bits int64 [n]; bounds int64 [2 layers + 1]
    on the CPU: layer l's K (0) / V (1) hints are [bounds[2 l + kv], bounds[2 l + kv + 1])). seq_lens: P_i + T_i.

    Raises ValueError naming the sample with a hint outside its [layers, 2, kv_heads, P + T, head_dim]."""
    S, parts = len(hints), [(torch.zeros(0, dtype=torch.long),) * 2]
    for i, (packed, tokens) in enumerate(zip(hints, seq_lens)):
        if packed is None or not len(packed):
            continue
        index, bits = unpack_hints(torch.from_numpy(np.asarray(packed, dtype=np.int64)))
        if int(index.max()) >= layers * 2 * kv_heads * tokens * head_dim:
            raise ValueError(f"sample {i}: a rounding hint at element {int(index.max())}, outside its [{layers}, 2, "
                             f"{kv_heads}, {tokens}, {head_dim}] K/V")
        rest, element = index // head_dim, index % head_dim
        rest, token = rest // tokens, rest % tokens
        plane, head = rest // kv_heads, rest % kv_heads                       # plane = layer x 2 + (0 K, 1 V)
        parts.append(((((plane * S + i) * kv_heads + head) * L + token) * head_dim + element, bits))
    index, bits = (torch.cat(t) for t in zip(*parts))
    index, order = torch.sort(index)
    bounds = torch.searchsorted(index, torch.arange(2 * layers + 1) * (S * kv_heads * L * head_dim))
    return index, bits[order], bounds


def layer_hints(hints: tuple | None, layer: int, kv: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer `layer`'s K (kv 0) or V (kv 1) hints of a `collate_hints` table as `straight_through` takes them: (index
    int64 [m] into x [S, kv_heads, L, head_dim] in row-major order, bits int64 [m]); None without a table."""
    if hints is None:
        return None
    index, bits, bounds = hints
    plane = 2 * layer + kv
    lo, hi = int(bounds[plane]), int(bounds[plane + 1])
    return index[lo:hi] - plane * x.numel(), bits[lo:hi]


def exact_acceptance(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Sparrow's per-token acceptance rate alpha = sum_v min(p_v, q_v) (arXiv 2606.08446 §3.1) from the whole
    distributions: log_p, log_q float [..., V] (the dense and the replayed forward's log-softmax). Returns [...]
    in [0, 1], no gradient."""
    with torch.no_grad():
        return torch.minimum(log_p, log_q).exp().sum(-1)


def teacher_kl(log_p_teacher: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p_teacher || q) per position: sum_v p (log p - log q), float [...]; the gradient flows into log_q only
    (the dense teacher is a no-grad forward). Shadow Mask Distillation's dense-teacher term (arXiv 2605.06850)."""
    p = log_p_teacher.detach().exp()
    return (p * (log_p_teacher.detach() - log_q)).sum(-1)


def logp_gap(logp: torch.Tensor, logp_sparse: torch.Tensor, mask: torch.Tensor) -> float:
    """max |logp - logp_sparse| over the tokens where `mask` (bool [n, T]) holds; 0.0 when none does."""
    if not bool(mask.any()):
        return 0.0
    return float((logp.detach().float() - logp_sparse.float()).abs()[mask].max())


def replay_metrics(logp_old: torch.Tensor, logp_dense: torch.Tensor, logp_sparse: torch.Tensor, mask: torch.Tensor,
                   fresh: torch.Tensor, accept_exact: torch.Tensor, applied: dict[str, float]) -> dict[str, float]:
    """A replaying step's own metrics (SPEC §4), from tensors [S, T] over the whole step (mask bool, fresh bool
    [S]: the rows sampled with the step's weights, staleness 0):
    replay_logp_old_max_abs, max |replayed logp_old - logp_sparse| over fresh rows (the replay's exactness: a few
    1e-6 in fp32; NaN without fresh rows); replay_dense_gap_max, max |dense logp - logp_sparse| (what replay
    changes: > 1e-2 when eviction mattered); accept_exact_mean / _p5 / _min, Sparrow's sum_v min(p, q) per token
    with p dense and q replayed; and `applied`'s (the correction of the replayed xi) rejection_rate,
    token_mask_fraction, tis_weight_mean and mismatch_kl as replay_*."""
    valid = mask.bool()
    old = fresh.bool()[:, None] & valid
    alpha = accept_exact[valid].double().cpu()
    out = {"replay_logp_old_max_abs": logp_gap(logp_old, logp_sparse, old) if bool(old.any()) else float("nan"),
           "replay_dense_gap_max": logp_gap(logp_dense, logp_sparse, valid),
           "accept_exact_mean": float(alpha.mean()) if alpha.numel() else float("nan"),
           "accept_exact_p5": float(torch.quantile(alpha, 0.05)) if alpha.numel() else float("nan"),
           "accept_exact_min": float(alpha.min()) if alpha.numel() else float("nan")}
    out.update({f"replay_{k}": applied[k] for k in ("rejection_rate", "token_mask_fraction", "tis_weight_mean",
                                                    "mismatch_kl") if k in applied})
    return out
