"""Method random (Random Attention, arXiv 2609.03430 §3): the hash against a Python-int reference of its formula,
hand-made kept sets, reproducibility, and a uniformity check with a fixed seed."""
from __future__ import annotations

import pytest
import torch

from compressor_reference import random_hash as reference_hash
from compressors import CompressorConfig, SelectContext, build_compressor
from compressors.scores import random_hash

torch.set_num_threads(1)


def ctx_of(seed, event, seq, layer=0, batch=1):
    """Positions 0..seq-1 for every row; seed and event per row (ints or lists)."""
    seed, event = ([x] * batch if isinstance(x, int) else x for x in (seed, event))
    return SelectContext(positions=torch.arange(seq).expand(batch, seq), seed=torch.tensor(seed),
                         event=torch.tensor(event), layer=layer)


def test_hash_equals_the_python_reference_of_its_formula():
    # int64 seeds of both signs and past 32 bits, positions and events past 2^32 (taken mod 2^32), 3 heads
    seeds = torch.tensor([0, 1, -5, 2**62 + 12345, -(2**40)])
    positions = torch.tensor([[0, 1, 7, 2**32 + 3, 2**40 + 7]]).expand(5, 3, 5)
    events = torch.tensor([1, 2**33, 9, 123456, 0])
    got = random_hash(seeds, 27, positions, events)
    assert got.dtype == torch.int64 and int(got.min()) >= 0 and int(got.max()) < 2**32
    for b in range(5):
        for h in range(3):
            for j in range(5):
                assert int(got[b, h, j]) == reference_hash(int(seeds[b]), 27, h, int(positions[b, h, j]),
                                                           int(events[b])), (b, h, j)
    # two values pinned: another engine's hash of these inputs must give these numbers
    assert reference_hash(1, 0, 0, 0, 1) == 2134961712
    assert reference_hash(-5, 27, 3, 2**40 + 7, 123456) == 1592655099


def test_random_keeps_the_window_and_the_highest_hashes():
    # seq 10, budget 5, window 2: slots 8, 9 always; of slots 0..7 the 3 with the largest hash of
    # (seed 11, layer 2, head h, position j, event 10), computed here with the reference.
    c = build_compressor(CompressorConfig(method="random", kv_budget=5, window=2))
    idx = c.select(torch.randn(1, 2, 10, 4), None, None, ctx_of(11, 10, 10, layer=2))
    for h in range(2):
        ranked = sorted(range(8), key=lambda j: reference_hash(11, 2, h, j, 10), reverse=True)
        assert idx[0, h].tolist() == sorted(ranked[:3]) + [8, 9]


def test_random_is_reproducible_and_changes_with_seed_event_layer_and_head():
    c = build_compressor(CompressorConfig(method="random", kv_budget=12, window=2))
    keys = torch.randn(1, 4, 60, 4)
    base = c.select(keys, None, None, ctx_of(3, 60, 60))
    assert torch.equal(base, c.select(torch.randn(1, 4, 60, 4), None, None, ctx_of(3, 60, 60)))  # keys unused
    for other in (ctx_of(4, 60, 60), ctx_of(3, 61, 60), ctx_of(3, 60, 60, layer=1)):
        assert not torch.equal(base, c.select(keys, None, None, other))
    assert len({tuple(base[0, h].tolist()) for h in range(4)}) == 4       # each KV head its own draw
    shared = build_compressor(CompressorConfig(method="random", kv_budget=12, window=2, selection="shared"))
    idx = shared.select(keys, None, None, ctx_of(3, 60, 60))
    assert bool((idx == idx[:, :1]).all())


def test_random_is_uniform_over_the_candidates():
    # 4000 rows (seeds 0..3999), 40 candidates, 10 kept each: every candidate position is kept 1000 times in
    # expectation. Pearson's chi-square over the 40 positions (39 degrees of freedom) has mean 39 and sd 8.8
    # (a little less: 10 of 40 drawn without replacement); its 1e-6 upper quantile is about 92.
    # The fixed seeds make the value exact on any CPU; the bound only guards against a biased hash.
    rows, cand, take, window = 4000, 40, 10, 2
    c = build_compressor(CompressorConfig(method="random", kv_budget=take + window, window=window))
    idx = c.select(torch.zeros(rows, 1, cand + window, 1), None, None,
                   ctx_of(list(range(rows)), 500, cand + window, batch=rows))
    counts = torch.bincount(idx[:, 0, :take].flatten(), minlength=cand).double()
    expected = rows * take / cand
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 92, chi2
    # no preference for recent or old positions: the kept positions' mean is the candidates' mean, 19.5
    assert abs(float(idx[:, 0, :take].double().mean()) - 19.5) < 0.3
    # two heads draw independently: overlap of two 10-of-40 draws has mean 10 * 10 / 40 = 2.5
    two = c.select(torch.zeros(rows, 2, cand + window, 1), None, None,
                   ctx_of(list(range(rows)), 500, cand + window, batch=rows))
    overlap = (two[:, 0, :take, None] == two[:, 1, None, :take]).sum((-1, -2)).double().mean()
    assert abs(float(overlap) - 2.5) < 0.1


def test_random_needs_its_context_fields():
    c = build_compressor(CompressorConfig(method="random", kv_budget=4, window=1))
    assert c.needs == {"positions", "seed", "event"}
    with pytest.raises(ValueError, match=r"ctx\.event must be \[1\] for compressor\.method='random'"):
        c.select(torch.randn(1, 1, 6, 2), None, None, SelectContext(positions=torch.arange(6)[None],
                                                                    seed=torch.tensor([1])))
