"""One scoring function per eviction policy (docs/SPEC.md §5). Pure float32 torch, no model code.

Every function returns a score per cache slot, `[batch, kv_heads, seq]` float32: higher = more worth
keeping. Slots that the caller always keeps (the last `window` / `h2o_recent` slots) get a score too,
but `Compressor.select` overrides it; padding is masked there as well, so a score only needs to be
meaningful among the valid candidate slots.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_NEG = torch.finfo(torch.float32).min  # a finite "-inf": a row of only masked logits softmaxes to uniform, not NaN
_BLOCK_ELEMENTS = 1 << 24  # entries of one block of the R-KV similarity matrix (64 MiB of float32)


def window_importance(keys: torch.Tensor, queries: torch.Tensor, valid: torch.Tensor, pool_kernel: int) -> torch.Tensor:
    """SnapKV / R-KV importance of each candidate key, as R-KV's `compute_attention_scores` + `_compute_scores`.

    logits = q·kᵀ/sqrt(head_dim) of the last w queries over the candidate keys; GQA: max of the logits over
    the query heads of a group (R-KV reference, max before the softmax); softmax over the valid candidate
    keys; mean over the w queries; 1-D max-pool (kernel `pool_kernel`, stride 1, same padding).

    keys: [batch, kv_heads, n, head_dim] candidate keys (the cache without its last `window` slots).
    queries: [batch, q_heads, w, head_dim], q_heads a multiple of kv_heads. valid: bool [batch, kv_heads, n].
    Returns float32 [batch, kv_heads, n]; each row sums to <= 1 before pooling.
    """
    batch, kv_heads, n, head_dim = keys.shape
    q_heads, w = queries.shape[1], queries.shape[2]
    group = q_heads // kv_heads
    q = queries.float().reshape(batch, kv_heads, group * w, head_dim)  # one matmul per KV head, no broadcast copy
    logits = torch.matmul(q, keys.float().transpose(-1, -2)).view(batch, kv_heads, group, w, n)
    logits = logits.amax(dim=2) / math.sqrt(head_dim)  # [batch, kv_heads, w, n]
    logits = logits.masked_fill(~valid[:, :, None, :], _NEG)
    importance = logits.softmax(dim=-1).mean(dim=-2)
    return F.max_pool1d(importance, kernel_size=pool_kernel, stride=1, padding=pool_kernel // 2)


def key_redundancy(keys: torch.Tensor, valid: torch.Tensor, similarity_threshold: float) -> torch.Tensor:
    """R-KV redundancy of every key (R-KV `cal_similarity`, retain_direction "last").

    Cosine similarity between the keys of each KV head (eps 1e-8 on the norm), diagonal zeroed, pairs with
    an invalid slot zeroed; in each row the most recent key with similarity > `similarity_threshold` is
    zeroed (kept as the representative of its near-duplicates); per-key mean over the valid rows; softmax
    over the valid keys. Rows without any similar key zero nothing (the reference zeroes column 0 there).

    keys: [batch, kv_heads, seq, head_dim]; valid: bool [batch, kv_heads, seq]; similarity_threshold >= 0.
    Returns float32 [batch, kv_heads, seq] (sums to 1 over the valid keys; higher = more redundant).
    Cost O(seq^2 * head_dim) per KV head; the similarity matrix is built in row blocks of at most 2^24
    float32 entries (64 MiB, plus a uint8 copy), so a long prompt does not need [batch, kv_heads, seq, seq].
    """
    seq = keys.shape[2]
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8) * valid[..., None]  # an invalid key is similar to nothing
    # Per row i: the most recent key j != i with similarity > threshold, and that similarity (zeroed below).
    # Rows are similarities against the keys in reverse order (column c = key seq-1-c), so that the first
    # similar key found in a row is the most recent one; row blocks bound the transient memory.
    k_rev_t = k.flip(2).transpose(-1, -2)
    rows_per_block = max(1, _BLOCK_ELEMENTS // (k.shape[0] * k.shape[1] * seq))
    firsts, zeroeds = [], []
    for r0 in range(0, seq, rows_per_block):
        rows = torch.arange(r0, min(seq, r0 + rows_per_block), device=keys.device)
        sim_rev = torch.matmul(k[:, :, r0:r0 + rows_per_block], k_rev_t)  # [batch, kv_heads, rows, seq]
        sim_rev[..., rows - r0, seq - 1 - rows] = 0.0  # the diagonal
        # max over a row returns the first maximum; it is 1 iff the row has a similar key
        has_similar, first = (sim_rev > similarity_threshold).view(torch.uint8).max(dim=-1, keepdim=True)
        firsts.append(first.squeeze(-1))
        zeroeds.append((sim_rev.gather(-1, first) * has_similar).squeeze(-1))
    first, zeroed = torch.cat(firsts, dim=-1), torch.cat(zeroeds, dim=-1)
    # Column sums of the similarity matrix: k_j . sum_i k_i, minus the diagonal, minus the zeroed entries.
    column = torch.matmul(k, k.sum(dim=2).unsqueeze(-1)).squeeze(-1) - (k * k).sum(dim=-1)
    column = column.scatter_add(-1, seq - 1 - first, -zeroed)
    redundancy = column / valid.sum(dim=-1, keepdim=True).clamp(min=1).to(column.dtype)
    return redundancy.masked_fill(~valid, _NEG).softmax(dim=-1)


def rkv_scores(keys, queries, valid, window, pool_kernel, similarity_threshold, rkv_lambda) -> torch.Tensor:
    """R-KV (arXiv 2505.24133, reference `rkv/compression/r1_kv.py`): score = lambda * importance -
    (1 - lambda) * redundancy over the candidates (all slots but the last `window`); redundancy is computed
    over all slots and then cut to the candidates, as the reference does. Shapes as `window_importance`
    with the full cache: keys [batch, kv_heads, seq, head_dim], valid [batch, kv_heads, seq].
    Returns float32 [batch, kv_heads, seq]; the last `window` entries are 0."""
    n = keys.shape[2] - window
    importance = window_importance(keys[:, :, :n], queries, valid[:, :, :n], pool_kernel)
    redundancy = key_redundancy(keys, valid, similarity_threshold)[:, :, :n]
    return F.pad(rkv_lambda * importance - (1.0 - rkv_lambda) * redundancy, (0, window))


def snapkv_scores(keys, queries, valid, window, pool_kernel) -> torch.Tensor:
    """SnapKV (arXiv 2404.14469), decode-time form: the pooled window importance alone over the candidates
    (all slots but the last `window`). Returns float32 [batch, kv_heads, seq]; the last `window` entries are 0."""
    n = keys.shape[2] - window
    return F.pad(window_importance(keys[:, :, :n], queries, valid[:, :, :n], pool_kernel), (0, window))


def streamingllm_scores(valid: torch.Tensor) -> torch.Tensor:
    """StreamingLLM (arXiv 2309.17453 §3.2): every slot scores its slot index (more recent = higher); its
    attention sinks are `Compressor.select`'s SINK class (compressor.sinks, 4 by default for this method).
    valid: bool [batch, kv_heads, seq]. Returns float32 [batch, kv_heads, seq]."""
    seq = valid.shape[-1]
    return torch.arange(seq, dtype=torch.float32, device=valid.device).expand(valid.shape)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit values held in int64 [0, 2^32): xor-shift / multiply rounds (the multipliers are odd
    and < 2^31, so no product leaves int64 and every step is exact on any device)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def random_hash(seed: torch.Tensor, layer: int, positions: torch.Tensor, event: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash of (sample seed, layer, KV head, token position, event) that `random_scores` ranks by, in
    integer device ops (no host sync): h = mix(seed_lo ^ C), mix(h ^ seed_hi), mix(h ^ layer), mix(h ^ head),
    mix(h ^ position), mix(h ^ event), with mix = `_mix32`, C = 0x165667B1, seed_lo / seed_hi the low / high 32 bits
    of the int64 seed (two's complement), position and event taken mod 2^32.

    seed, event: int64 [batch]; positions: int64 [batch, kv_heads, seq] (the head is the index along dim 1).
    Returns int64 [batch, kv_heads, seq] in [0, 2^32)."""
    heads = positions.shape[1]
    h = _mix32((seed & _M32) ^ 0x165667B1)
    h = _mix32(h ^ ((seed >> 32) & _M32))
    h = _mix32(h ^ (layer & _M32))
    h = _mix32(h[:, None] ^ torch.arange(heads, device=positions.device))              # [batch, kv_heads]
    h = _mix32(h[..., None] ^ (positions & _M32))                                       # [batch, kv_heads, seq]
    return _mix32(h ^ (event & _M32)[:, None, None])


def random_scores(seed: torch.Tensor, layer: int, positions: torch.Tensor, event: torch.Tensor) -> torch.Tensor:
    """Random eviction (Random Attention, arXiv 2609.03430 §3: uniform per layer and KV head): every slot scores
    `random_hash` of its sample's seed, the layer, its KV head, its true position and the event, as float64 (exact
    for 32-bit values), so the kept candidates are a uniform random subset, reproducible from these inputs alone
    (the same on every engine). Shapes as `random_hash`; returns float64 [batch, kv_heads, seq]."""
    return random_hash(seed.long(), layer, positions.long(), event.long()).double()
