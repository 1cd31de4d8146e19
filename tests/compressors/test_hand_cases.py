"""Small hand-made cases per method; every expected kept set is derived in the comments (SPEC §5)."""
from __future__ import annotations

import math

import torch

from compressor_reference import keep as reference_keep
from compressors import CompressorConfig, SelectContext, accumulate_attention, build_compressor, gather_kv


def kept(idx: torch.Tensor) -> list:
    return idx.tolist()


def test_streamingllm_keeps_sinks_and_recent_after_left_padding():
    # seq 10, budget 6, window 2, sinks 2. Row 0 unpadded: sinks 0,1 + most recent 4 -> 6,7,8,9.
    # Row 1 has 3 left pads: its sinks are its first valid slots 3,4; recent 6..9.
    c = build_compressor(CompressorConfig(method="streamingllm", kv_budget=6, window=2, sinks=2))
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :3] = False
    idx = c.select(torch.randn(2, 1, 10, 4), None, valid)
    assert kept(idx) == [[[0, 1, 6, 7, 8, 9]], [[3, 4, 6, 7, 8, 9]]]


def test_h2o_accumulates_mass_and_keeps_heavy_hitters_plus_recent():
    # 1 KV head, 2 query heads. Step 1 (prefill, q=2) over 3 slots, step 2 (decode, q=1) over 4 slots.
    p1 = torch.tensor([[[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]],
                        [[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]]]])          # [1, 2, 2, 3]
    p2 = torch.tensor([[[[0.1, 0.2, 0.3, 0.4]], [[0.4, 0.3, 0.2, 0.1]]]])  # [1, 2, 1, 4]
    mass = accumulate_attention(torch.zeros(1, 1, 0), p1)
    # slot 0: 1 + .5 + 1 + .2 = 2.7; slot 1: .5 + .3 = .8; slot 2: .5
    assert torch.allclose(mass, torch.tensor([[[2.7, 0.8, 0.5]]]))
    mass = accumulate_attention(mass, p2)
    # new slot 3 appended at 0; every slot gains .1 + .4 = .5 (slot 0), .5, .5, .5
    assert torch.allclose(mass, torch.tensor([[[3.2, 1.3, 1.0, 0.5]]]))

    # seq 10, budget 6, recent 3 (>= window 2): keep 7,8,9 and the top 3 masses among slots 0..6.
    c = build_compressor(CompressorConfig(method="h2o", kv_budget=6, window=2, h2o_recent=3))
    attn_mass = torch.tensor([[[0.5, 0.1, 0.9, 0.2, 0.7, 0.05, 0.3, 0.0, 0.0, 0.0]]])
    # top 3 of 0..6: 0.9 (2), 0.7 (4), 0.5 (0)
    ctx = SelectContext(attn_mass=attn_mass)
    assert kept(c.select(torch.randn(1, 1, 10, 4), None, None, ctx)) == [[[0, 2, 4, 7, 8, 9]]]
    # the mass travels with the kept slots
    carried = gather_kv(attn_mass, c.select(torch.randn(1, 1, 10, 4), None, None, ctx))
    assert torch.equal(carried, torch.tensor([[[0.5, 0.9, 0.7, 0.0, 0.0, 0.0]]]))


def test_accumulate_attention_groups_query_heads_like_repeat_kv():
    # 4 query heads on 2 KV heads: query heads 0, 1 belong to KV head 0 and 2, 3 to KV head 1
    # (transformers' repeat_kv layout). One decode query over 2 slots.
    probs = torch.tensor([[[[1.0, 0.0]], [[0.5, 0.5]], [[0.0, 1.0]], [[0.25, 0.75]]]])  # [1, 4, 1, 2]
    mass = accumulate_attention(torch.zeros(1, 2, 0), probs)
    assert torch.equal(mass, torch.tensor([[[1.5, 0.5], [0.25, 1.75]]]))


def snap_keys(xs, d=2):
    """Candidate keys [x, 0] followed by two window keys [0, 1]: logits of the query [1, 0] are x/sqrt(d)."""
    k = torch.zeros(1, 1, len(xs) + 2, d)
    k[0, 0, :len(xs), 0] = torch.tensor(xs)
    k[0, 0, len(xs):, 1] = 1.0
    return k


def test_snapkv_keeps_most_attended_candidates():
    # budget 4, window 2 -> 2 of the 6 candidates. Softmax is monotone in the logit, so with kernel 1
    # the two largest x (3 at slot 1, 2 at slot 3) are kept.
    c = build_compressor(CompressorConfig(method="snapkv", kv_budget=4, window=2, pool_kernel=1))
    q = torch.tensor([[[[1.0, 0.0]]]])
    assert kept(c.select(snap_keys([0, 3, 1, 2, -1, 0.5]), q, None)) == [[[1, 3, 6, 7]]]


def test_snapkv_max_pool_spreads_peaks_and_ties_go_to_recent():
    # kernel 3: pooled = [p1, p1, p1, p3, p3, p5] (p1 > p3 > p5 > ...). The top 2 are three-way tied at p1
    # (slots 0, 1, 2): ties go to the more recent slots 2 and 1.
    c = build_compressor(CompressorConfig(method="snapkv", kv_budget=4, window=2, pool_kernel=3))
    q = torch.tensor([[[[1.0, 0.0]]]])
    assert kept(c.select(snap_keys([0, 3, 1, 2, -1, 0.5]), q, None)) == [[[1, 2, 6, 7]]]


def test_gqa_takes_max_over_the_query_heads_of_a_group():
    # 2 query heads on 1 KV head, queries [1,0] and [0,1]; candidates k0=[2.5,0], k1=[0,3], k2=[1.4,1.4],
    # k3=[0,0]. Max of the logits over heads: 2.5, 3, 1.4, 0 -> keep k1, k0. (A mean over heads would give
    # 1.25, 1.5, 1.4, 0 and keep k1, k2.)
    c = build_compressor(CompressorConfig(method="snapkv", kv_budget=3, window=1, pool_kernel=1))
    k = torch.tensor([[[[2.5, 0], [0, 3], [1.4, 1.4], [0, 0], [1, 1]]]])
    q = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]])
    assert kept(c.select(k, q, None)) == [[[0, 1, 4]]]


def redundancy_case():
    """8 candidates + 2 window slots, head_dim 8, basis vectors e0..e7.

    Slots 2, 4, 5 are the same key e0 (near duplicates); slot 7 is 0.95 e0 + 2 e1 (cos with e0 = 0.43 <
    0.5: not similar); slots 0, 1, 3, 6 are e2..e5, the window slots 8, 9 are e6, e7. Two queries a*e0 with
    a = 4 sqrt(8): logits 4 for the duplicates, 3.8 for slot 7, 0 for the rest.
    """
    e = torch.eye(8)
    rows = [e[2], e[3], e[0], e[4], e[0], e[0], e[5], 0.95 * e[0] + 2 * e[1], e[6], e[7]]
    k = torch.stack(rows)[None, None]
    q = (4 * math.sqrt(8) * e[0]).expand(1, 1, 2, 8).clone()
    return k, q


def test_redundancy_makes_rkv_drop_the_oldest_duplicate_that_snapkv_keeps():
    k, q = redundancy_case()
    # SnapKV (kernel 1): importance = softmax([0,0,4,0,4,4,0,3.8]) -> duplicates .257 each, slot 7 .210:
    # keeps 2, 4, 5.
    snap = build_compressor(CompressorConfig(method="snapkv", kv_budget=5, window=2, pool_kernel=1))
    assert kept(snap.select(k, q, None)) == [[[2, 4, 5, 8, 9]]]
    # R-KV: cosine rows; row 2 and row 4 zero their most recent similar key (5), row 5 zeroes 4.
    # column sums: slot 2: 1 + 1 + .43 (row 7), slot 4: 1 + .43, slot 5: .43, slot 7: 3 x .43, others 0;
    # /10, softmax -> redundancy .120 (2), .109 (4), .098 (5), .107 (7), .094 (others).
    # score = .1 imp - .9 red: slot 5 -.063, slot 4 -.072, slot 7 -.076, slot 2 -.083, others -.084
    # -> keeps 4, 5, 7: the oldest duplicate gives way to the distinct key.
    rkv = build_compressor(CompressorConfig(method="rkv", kv_budget=5, window=2, pool_kernel=1, rkv_lambda=0.1))
    assert kept(rkv.select(k, q, None)) == [[[4, 5, 7, 8, 9]]]


def test_rkv_and_snapkv_match_numpy_reference_with_default_kernel():
    # Two sequences, 2 KV heads, 4 query heads, 12 slots, chosen integer-ish values (seeded), default kernel 7.
    g = torch.Generator().manual_seed(7)
    k = torch.randint(-3, 4, (2, 2, 12, 4), generator=g).float()
    q = torch.randint(-2, 3, (2, 4, 2, 4), generator=g).float()
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :2] = False
    for method in ("rkv", "snapkv"):
        cfg = CompressorConfig(method=method, kv_budget=7, window=2)
        expected, margins = reference_keep(method, k.double().numpy(), q.double().numpy(),
                                           valid[:, None].expand(2, 2, 12).numpy(), cfg)
        assert not any(0 < m < 1e-6 for row in margins for m in row)  # exact ties are fine, near-ties not
        assert kept(build_compressor(cfg).select(k, q, valid)) == expected


def test_full_keeps_every_slot():
    c = build_compressor(CompressorConfig(method="full", kv_budget=4, window=2))
    assert kept(c.select(torch.randn(1, 2, 6, 4), None, None)) == [[list(range(6)), list(range(6))]]


def test_gather_kv_gathers_trailing_dims():
    x = torch.arange(2 * 1 * 4 * 2).view(2, 1, 4, 2)
    idx = torch.tensor([[[0, 3]], [[1, 2]]])
    assert gather_kv(x, idx).tolist() == [[[[0, 1], [6, 7]]], [[[10, 11], [12, 13]]]]
    assert gather_kv(x[..., 0], idx).tolist() == [[[0, 6]], [[10, 12]]]


def test_shared_selection_averages_head_scores():
    # 2 KV heads, h2o, budget 4, recent 2: head 0 mass favours slot 0, head 1 slot 1; averaged:
    # slot 0 (.9 + .0)/2 = .45, slot 1 (.1 + .7)/2 = .4, slot 2 (.2 + .3)/2 = .25, slot 3 .1 -> keep 0, 1.
    c = build_compressor(CompressorConfig(method="h2o", kv_budget=4, window=1, h2o_recent=2, selection="shared"))
    mass = torch.tensor([[[0.9, 0.1, 0.2, 0.1, 0, 0], [0.0, 0.7, 0.3, 0.1, 0, 0]]])
    ctx = SelectContext(attn_mass=mass)
    assert kept(c.select(torch.randn(1, 2, 6, 4), None, None, ctx)) == [[[0, 1, 4, 5], [0, 1, 4, 5]]]
    per_head = build_compressor(CompressorConfig(method="h2o", kv_budget=4, window=1, h2o_recent=2))
    assert kept(per_head.select(torch.randn(1, 2, 6, 4), None, None, ctx)) == [[[0, 2, 4, 5], [1, 2, 4, 5]]]
