"""Properties of every policy over random inputs (hypothesis): budget, window, padding, sharing, determinism."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compressor_reference import keep as reference_keep
from compressors import CompressorConfig, SelectContext, accumulate_attention, build_compressor

torch.set_num_threads(1)
SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def cases(draw, methods=("rkv", "snapkv", "h2o", "streamingllm", "random"), protection=True):
    """A config plus random keys, queries, left-padded validity and a SelectContext (H2O attention mass, values,
    positions, prompt lengths, seeds, event, layer); with `protection` some configs protect sinks, the prompt
    (all / last:n) or value norms."""
    method = draw(st.sampled_from(methods))
    window = draw(st.integers(1, 3))
    kv_budget = draw(st.integers(window + 2, 10))
    recent = draw(st.integers(window, kv_budget - 1)) if method == "h2o" else window   # the slots always kept
    room = kv_budget - recent - (method != "streamingllm")   # protected + recent < kv_budget (streamingllm: <=)
    sinks = draw(st.integers(0, room))
    values = draw(st.integers(0, room - sinks)) if protection and method != "streamingllm" else 0
    last = kv_budget - recent - 1 - sinks - values
    prompt = draw(st.sampled_from(["off", "all"] + ([f"last:{last}"] if last > 0 else []))) if protection else "off"
    cfg = CompressorConfig(
        method=method, kv_budget=kv_budget, window=window, h2o_recent=recent if method == "h2o" else 64,
        sinks=sinks, protect_values=values, protect_prompt=prompt,
        pool_kernel=draw(st.sampled_from([1, 3, 7])),
        selection=draw(st.sampled_from(["per_head", "shared"])))
    batch, kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    seq = kv_budget + draw(st.integers(1, 10))
    pads = [draw(st.integers(0, seq - 1)) for _ in range(batch)]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    head_dim = 8
    keys = torch.randn(batch, kv_heads, seq, head_dim, generator=g)
    w = draw(st.integers(1, window))  # the engine may hold fewer than `window` queries (short prompt)
    queries = torch.randn(batch, kv_heads * group, w, head_dim, generator=g)
    valid = torch.arange(seq)[None, :] >= torch.tensor(pads)[:, None]          # left padding
    probs = torch.rand(batch, kv_heads * group, seq, seq, generator=g).masked_fill(~valid[:, None, None, :], 0)
    positions = (torch.arange(seq)[None, :] - torch.tensor(pads)[:, None]).clamp(min=0)
    ctx = SelectContext(values=torch.randn(batch, kv_heads, seq, head_dim, generator=g),
                        attn_mass=accumulate_attention(torch.zeros(batch, kv_heads, 0), probs), positions=positions,
                        prompt_len=torch.tensor([draw(st.integers(0, seq - p)) for p in pads]),
                        seed=torch.randint(-2**62, 2**62, (batch,), generator=g), event=positions[:, -1] + 1,
                        layer=draw(st.integers(0, 40)))
    return cfg, keys, queries, valid, ctx


def select(cfg, keys, queries, valid, ctx):
    return build_compressor(cfg).select(keys, queries, valid, ctx)


def sliced(ctx, b, pad):
    """Row b of a SelectContext, without its first `pad` slots."""
    return SelectContext(values=ctx.values[b:b + 1, :, pad:], attn_mass=ctx.attn_mass[b:b + 1, :, pad:],
                         positions=ctx.positions[b:b + 1, pad:], prompt_len=ctx.prompt_len[b:b + 1],
                         seed=ctx.seed[b:b + 1], event=ctx.event[b:b + 1], layer=ctx.layer)


def numpy_ctx(ctx):
    return {"values": ctx.values.double().numpy(), "positions": ctx.positions.numpy(),
            "prompt_len": ctx.prompt_len.numpy(), "seed": ctx.seed.tolist(), "event": ctx.event.tolist(),
            "layer": ctx.layer}


@SETTINGS
@given(cases())
def test_budget_sorted_window_and_determinism(case):
    cfg, keys, queries, valid, ctx = case
    idx = select(*case)
    batch, kv_heads, seq, _ = keys.shape
    assert idx.shape == (batch, kv_heads, cfg.kv_budget) and idx.dtype == torch.int64
    assert bool((idx[..., 1:] > idx[..., :-1]).all()), "strictly ascending, no slot twice"
    assert 0 <= int(idx.min()) and int(idx.max()) < seq
    protected = cfg.h2o_recent if cfg.method == "h2o" else cfg.window
    assert torch.equal(idx[..., -protected:], torch.arange(seq - protected, seq).expand(batch, kv_heads, protected))
    assert torch.equal(idx, select(*case))
    if cfg.selection == "shared":
        assert bool((idx == idx[:, :1]).all())


@SETTINGS
@given(cases())
def test_padding_is_never_kept_in_place_of_a_real_token(case):
    cfg, keys, queries, valid, ctx = case
    idx = select(*case)
    n_valid = valid.sum(-1)  # left padding: the valid slots of a row are its last n_valid
    kept_valid = torch.gather(valid[:, None, :].expand(-1, keys.shape[1], -1), 2, idx).sum(-1)
    assert torch.equal(kept_valid, n_valid.clamp(max=cfg.kv_budget)[:, None].expand_as(kept_valid))


@SETTINGS
@given(cases(methods=("streamingllm",), protection=False))
def test_streamingllm_keeps_exactly_sinks_and_most_recent(case):
    cfg, keys, queries, valid, ctx = case
    idx = select(*case)
    seq = keys.shape[2]
    for b in range(keys.shape[0]):
        n_valid = int(valid[b].sum())
        if n_valid < cfg.kv_budget:
            continue  # covered by the padding property: all real tokens kept
        first = seq - n_valid
        expected = list(range(first, first + cfg.sinks)) + list(range(seq - (cfg.kv_budget - cfg.sinks), seq))
        for h in range(keys.shape[1]):
            assert idx[b, h].tolist() == expected


@SETTINGS
@given(cases())
def test_left_padded_batch_equals_each_sequence_alone(case):
    cfg, keys, queries, valid, ctx = case
    idx = select(*case)
    for b in range(keys.shape[0]):
        pad = int((~valid[b]).sum())
        if keys.shape[2] - pad <= cfg.kv_budget:
            continue  # alone it would not be compressed at all
        alone = select(cfg, keys[b:b + 1, :, pad:], queries[b:b + 1], None, sliced(ctx, b, pad))
        assert torch.equal(idx[b:b + 1], alone + pad)


@SETTINGS
@given(cases())
def test_matches_numpy_reference(case):
    cfg, keys, queries, valid, ctx = case
    kv_heads = keys.shape[1]
    expected, margins = reference_keep(cfg.method, keys.double().numpy(), queries.double().numpy(),
                                       valid[:, None].expand(-1, kv_heads, -1).numpy(), cfg,
                                       ctx.attn_mass.double().numpy(), numpy_ctx(ctx))
    idx = select(*case)
    for b, rows in enumerate(expected):
        for h, row in enumerate(rows):
            if not 0 < margins[b][h] < 1e-5:  # skip float near-ties between float32 and float64
                assert idx[b, h].tolist() == row, (b, h)


@SETTINGS
@given(cases(methods=("rkv", "snapkv")))
def test_scoring_runs_in_float32_for_low_precision_caches(case):
    cfg, keys, queries, valid, ctx = case
    k16, q16 = keys.bfloat16(), queries.bfloat16()
    assert torch.equal(select(cfg, k16, q16, valid, ctx), select(cfg, k16.float(), q16.float(), valid, ctx))


def test_random_holes_padding_only_fills_short_rows():
    # validity with holes anywhere (empty slots) and per-head masks: a kept invalid slot outside the window
    # means every valid slot of that row was kept.
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        for method in ("rkv", "snapkv", "h2o", "streamingllm"):
            cfg = CompressorConfig(method=method, kv_budget=6, window=2, h2o_recent=3, sinks=1)
            keys = torch.randn(2, 2, 11, 4, generator=g)
            valid = torch.rand(2, 2, 11, generator=g) > 0.4
            mass = torch.rand(2, 2, 11, generator=g)
            idx = select(cfg, keys, torch.randn(2, 4, 2, 4, generator=g), valid, SelectContext(attn_mass=mass))
            protected = 3 if method == "h2o" else 2
            for b in range(2):
                for h in range(2):
                    kept = set(idx[b, h].tolist())
                    cands = range(11 - protected)
                    if any(not valid[b, h, j] for j in kept if j in cands):
                        assert all(j in kept for j in cands if valid[b, h, j]), (trial, method, b, h)
                    assert np.array_equal(sorted(kept), idx[b, h].tolist())


def test_rkv_similarity_row_blocks_match_reference(monkeypatch):
    # Force the R-KV similarity matrix into blocks of a few rows (the default block is 2^24 entries).
    from compressors import scores
    g = torch.Generator().manual_seed(1)
    for block in (1, 2 * 3 * 13, 2 * 3 * 17 * 5):  # rows per block = block // (batch 2 x heads 3 x seq): 1, 1, 5-6
        monkeypatch.setattr(scores, "_BLOCK_ELEMENTS", block)
        for seq in (13, 17):
            cfg = CompressorConfig(method="rkv", kv_budget=8, window=2, similarity_threshold=0.3)
            keys = torch.randn(2, 3, seq, 4, generator=g)
            queries = torch.randn(2, 6, 2, 4, generator=g)
            valid = torch.arange(seq)[None, :] >= torch.tensor([0, 4])[:, None]
            expected, margins = reference_keep("rkv", keys.double().numpy(), queries.double().numpy(),
                                               valid[:, None].expand(-1, 3, -1).numpy(), cfg)
            idx = select(cfg, keys, queries, valid, None)
            for b, rows in enumerate(expected):
                for h, row in enumerate(rows):
                    if not 0 < margins[b][h] < 1e-5:
                        assert idx[b, h].tolist() == row, (block, seq, b, h)
