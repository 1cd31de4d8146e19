"""The length schedule (`compressor.budget_schedule: length`, Sparrow, arXiv 2606.08446 §3.2) on the `sparse_rl_kv`
backend (actors/engines/sglang/triton_backend.py `_budget_now`): each request's budget grows with its own decode step
count, read from the backend's host mirror, and each compression event makes one call per distinct budget among its
due rows (`compress_pending`, stats `compression_groups` / `compression_calls`).

On the lane's greedy case (tests/sglang/test_sglang_triton.py: 2 prompts x 40 tokens, window 4, interval 8), start
budgets 12 and 16 growing by 0.5 a token up to 26: the same tokens and `logp_sparse` as TorchEngine with the same
config and `kv_budgets`, the same `kv_retained_tokens` (33 for both; a constant budget would leave 19 and 23), and
the same eviction records entry for entry (`assert_records_equal`, what the learner replays), every decode step
through the self-check (NoHostSync over the compression and the record writes); for R-KV and random with
protect_values 2 (seeded: each request the torch engine's row seed; the controls, another seed and the torch engine
without protect_values, give other records or tokens)."""
import dataclasses
import os

import numpy as np
import pytest
import torch

pytest.importorskip("sglang.srt", reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh")

from actors.engines.sglang.engine import KV_STATS_ENV, SGLangEngine
from actors.engines.sglang.triton_backend import SELF_CHECK_ENV
from compressors import CompressorConfig
from compressors.budget import length_budget
from tests.sglang.test_sglang_event_memory import bare_backend
from tests.sglang.test_sglang_records import SEED, assert_records_equal, seeded, torch_engine, with_records
from tests.sglang.test_sglang_triton import KWARGS, PARAMS, PROMPTS

pytestmark = pytest.mark.sglang
torch.set_num_threads(1)
LENGTH = CompressorConfig(method="rkv", kv_budget=12, window=4, interval=8, budget_schedule="length",
                          budget_growth=0.5, kv_budget_final=26)
RANDOM = dataclasses.replace(LENGTH, method="random", protect_values=2)
"""Random with the 2 largest value norms before the window protected at every event (per layer and KV head): the
window and those 2 leave random 6 slots at the start budget 12, 20 at the cap 26."""
BUDGETS = [12, 16]
COUNTED = ("compression_events", "compression_groups", "compression_calls", "compressions", "decode_steps",
           "self_checks")
NEW_STEPS = PARAMS.max_new_tokens - 1
"""Decode forwards of one call: the first of the 40 response tokens comes from the prefill."""


def test_an_event_makes_one_call_per_distinct_budget_now():
    """A bare backend (no SGLang engine, tests/sglang/test_sglang_event_memory.py): four rows due at once with start
    budgets 12, 12, 16, 16 at step counts 8, 16, 8, 24 are compressed to 16, 20, 20, 26 (the cap) in one event of
    3 calls, one per distinct budget now; under a constant schedule the same rows make 2 calls (12, 16)."""
    lens, constant = [30, 30, 30, 30], CompressorConfig(method="rkv", kv_budget=12, window=4, interval=8)
    for cfg, want, calls in ((LENGTH, [16, 20, 20, 26], 3), (constant, [12, 12, 16, 16], 2)):
        b = bare_backend(cfg, lens, kv_heads=2, q_heads=4, head_dim=16, dtype=torch.float32)
        rows = np.arange(1, 5)
        b.budget[rows], b.steps[rows] = [12, 12, 16, 16], [8, 16, 8, 24]
        assert b._budget_now(rows).tolist() == want
        assert want == [length_budget(cfg, s, t) for s, t in zip([12, 12, 16, 16], [8, 16, 8, 24])]
        b.compress_pending()
        assert (b.stats["compression_events"], b.stats["compression_groups"], b.stats["compression_calls"]) == \
            (1, calls, calls)
        assert b.start[rows].tolist() == [n - k for n, k in zip(lens, want)] and b.kept[rows].tolist() == want


@pytest.fixture(scope="module", params=[LENGTH, RANDOM], ids=["rkv", "random-protect_values_2"])
def growing(request, tiny_qwen2_dir, tmp_path_factory):
    """(A recording `sparse_rl_kv` engine under the length schedule, every decode step through the self-check; its
    compressor config): R-KV, and random with protect_values 2."""
    os.environ[KV_STATS_ENV] = str(tmp_path_factory.mktemp("kv") / "stats.json")
    os.environ[SELF_CHECK_ENV] = "1"
    eng = SGLangEngine(str(tiny_qwen2_dir), compressor_cfg=request.param, timeout_s=600, record_evictions=True,
                       **KWARGS)
    yield eng, request.param
    eng.shutdown()
    os.environ.pop(KV_STATS_ENV, None)
    os.environ.pop(SELF_CHECK_ENV, None)


def generate_counted(eng, params, kv_budgets):
    """(first sample per prompt, the backend's counters this call added: `COUNTED`, the stats after it)."""
    before = eng.kv_pool_stats() or {}
    got = [g[0] for g in eng.generate(PROMPTS, params, kv_budgets=kv_budgets)]
    stats = eng.kv_pool_stats()
    return got, {k: stats[k] - before.get(k, 0) for k in COUNTED}, stats


def assert_equal_torch_engine(got, want, protects: bool) -> dict:
    """Tokens, logp_sparse (2e-5), kv_retained_tokens, the protected share at the last compression
    (`kv_protected_fraction`, 1e-6; with `protects` > 0 on every sample, else 0) and eviction records of each
    SGLang Sample equal TorchEngine's; returns the records' counts (`assert_records_equal`)."""
    for g, w in zip(got, want):
        assert g.response_ids == w.response_ids
        assert torch.allclose(torch.from_numpy(g.logp_sparse), torch.from_numpy(w.logp_sparse), atol=2e-5)
        assert g.kv_retained_tokens == w.kv_retained_tokens
    shares = [(g.kv_protected_fraction, w.kv_protected_fraction) for g, w in zip(got, want)]
    assert [g for g, _ in shares] == pytest.approx([w for _, w in shares], abs=1e-6), shares
    assert all(w > 0 for _, w in shares) if protects else all(w == 0 for _, w in shares), shares
    return assert_records_equal(with_records(got), want)


def test_length_schedule_with_per_request_budgets_equals_torch_engine(growing, tiny_qwen2_dir):
    """Start budgets 12 and 16: the prefill and steps 8, 16, 24 compress the two rows to two different budgets (12 /
    16, 16 / 20, 20 / 24, 24 / 26: 2 calls each), step 32 to one (26 / 26, both at the cap: 1 call), so 5 events in
    9 calls; each row's live KV never exceeds kv_budget_final + interval. Random (seeded, SEED: the torch engine's
    row seeds, budget 16's batch with SEED + 1): the controls, TorchEngine with another seed and TorchEngine without
    protect_values (dropped on the torch side alone), give other records or tokens."""
    eng, cc = growing
    params = seeded(PARAMS, cc)
    got, counted, stats = generate_counted(eng, params, BUDGETS)
    assert counted == {"compression_events": 5, "compression_groups": 9, "compression_calls": 9, "compressions": 10,
                       "decode_steps": NEW_STEPS, "self_checks": NEW_STEPS}, counted
    want = [g[0] for g in torch_engine(tiny_qwen2_dir, cc).generate(PROMPTS, params, kv_budgets=BUDGETS)]
    seen = assert_equal_torch_engine(got, want, cc.protects)
    print(f"{cc.method} protect_values={cc.protect_values}: samples and records equal, {seen}, protected shares "
          f"{[round(g.kv_protected_fraction, 4) for g in got]}")
    assert seen["at_decode"] > 0, seen
    assert [g.kv_retained_tokens for g in got] == [33, 33]          # constant budgets 12 / 16 would leave 19 / 23
    assert max(stats["max_live_by_budget"].values()) <= LENGTH.kv_budget_final + LENGTH.interval
    assert not os.listdir(eng.records_dir)
    controls = ([("seed + 2", cc, dataclasses.replace(params, seed=SEED + 2))] if cc.method == "random" else []) + \
        ([("protect_values off", dataclasses.replace(cc, protect_values=0), params)] if cc.protect_values else [])
    for name, other_cc, other_params in controls:
        other = [g[0] for g in torch_engine(tiny_qwen2_dir, other_cc).generate(PROMPTS, other_params,
                                                                               kv_budgets=BUDGETS)]
        with pytest.raises(AssertionError, match="differ") as control:
            assert_records_equal(with_records(got), other)
        print(f"control ({name}): {str(control.value).splitlines()[0]}")


def test_length_schedule_at_the_run_budget_equals_torch_engine(growing, tiny_qwen2_dir):
    """No kv_budgets (SGLang's own request ids, the run's start budget 12 for both rows): one budget per event, so
    5 events in 5 calls, and the same samples and records as TorchEngine."""
    eng, cc = growing
    params = seeded(PARAMS, cc)
    got, counted, _ = generate_counted(eng, params, None)
    assert counted == {"compression_events": 5, "compression_groups": 5, "compression_calls": 5, "compressions": 10,
                       "decode_steps": NEW_STEPS, "self_checks": NEW_STEPS}, counted
    want = [g[0] for g in torch_engine(tiny_qwen2_dir, cc).generate(PROMPTS, params)]
    assert assert_equal_torch_engine(got, want, cc.protects)["at_decode"] > 0
    assert [g.kv_retained_tokens for g in got] == [33, 33]
