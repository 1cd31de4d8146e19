"""The `sparse_rl_kv` backend (SGLang's own Triton kernels, actors/engines/sglang/triton_backend.py) on CPU through
Triton's interpreter (TRITON_INTERPRET=1, set in conftest): same tokens and logp_sparse as the torch reference
backend and as TorchEngine under the same evictions, evicted slots freed, per-request budgets, and the
graph-replay metadata path checked every step (no host sync, persistent buffers, equal to the eager path)."""
import os

import pytest
import torch

pytest.importorskip("sglang.srt", reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh")
from transformers import AutoTokenizer, Qwen2ForCausalLM

from actors.engines.base import SamplingParams
from actors.engines.sglang.engine import KV_STATS_ENV, TORCH_SPARSE_BACKEND, SGLangEngine
from actors.engines.sglang.triton_backend import SELF_CHECK_ENV
from actors.engines.torch_engine import TorchEngine
from compressors import CompressorConfig
from tests.sglang.conftest import CPU_ENGINE_KWARGS
from tests.sglang.tiny import (
    JOIN_MAX_NEW,
    assert_prefixes_equal,
    generate_each,
    join_prompts,
    max_logp_shift,
    torch_references,
)

pytestmark = pytest.mark.sglang
torch.set_num_threads(1)
PROMPT_LEN, NEW = 20, 40
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(PROMPT_LEN)] for i in range(2)]
PARAMS = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)
KWARGS = dict(CPU_ENGINE_KWARGS, max_running_requests=4, cuda_graph_bs_decode=[1, 2, 4, 8])
"""cuda_graph_bs_decode: the head of SGLang 0.5.23's GPU decode capture buckets (generate_decode_cuda_graph_batch_sizes:
1, 2, 4, 8, 12, 16, ...); on the CPU SGLang otherwise captures every size up to 16, so no batch would be padded."""


@pytest.fixture(scope="module", params=[
    CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8),
    CompressorConfig(method="snapkv", kv_budget=16, window=4, interval=8, selection="shared"),
], ids=["rkv-per_head", "snapkv-shared"])
def compressor(request):
    return request.param


@pytest.fixture(scope="module")
def torch_backend_samples(compressor, tiny_qwen2_dir):
    """The reference backend's samples, from an engine shut down before the Triton engine starts (SGLang's
    shutdown kills every child of this process, the other engine's scheduler too)."""
    ref_eng = SGLangEngine(str(tiny_qwen2_dir), compressor_cfg=compressor, timeout_s=600,
                           sparse_backend=TORCH_SPARSE_BACKEND, **CPU_ENGINE_KWARGS)
    try:
        return [g[0] for g in ref_eng.generate(PROMPTS, PARAMS)]
    finally:
        ref_eng.shutdown()


@pytest.fixture(scope="module")
def triton_engine(compressor, torch_backend_samples, tiny_qwen2_dir, tmp_path_factory):
    stats = tmp_path_factory.mktemp("kv") / "stats.json"
    os.environ[KV_STATS_ENV], os.environ[SELF_CHECK_ENV] = str(stats), "1"
    eng = SGLangEngine(str(tiny_qwen2_dir), compressor_cfg=compressor, timeout_s=600, **KWARGS)
    yield eng, compressor
    eng.shutdown()
    del os.environ[KV_STATS_ENV], os.environ[SELF_CHECK_ENV]


def test_triton_backend_equals_torch_backend_and_torch_engine(triton_engine, torch_backend_samples, tiny_qwen2_dir):
    eng, cc = triton_engine
    got = [g[0] for g in eng.generate(PROMPTS, PARAMS)]
    stats = eng.kv_pool_stats()
    assert stats["self_checks"] == stats["decode_steps"] > 0      # every decode step went through the replay path
    want, dense = torch_references(tiny_qwen2_dir, cc, PROMPTS, PARAMS)
    for g, w, o in zip(got, want, torch_backend_samples):
        assert g.response_ids == w.response_ids == o.response_ids
        assert torch.allclose(torch.from_numpy(g.logp_sparse), torch.from_numpy(w.logp_sparse), atol=2e-5)
        assert torch.allclose(torch.from_numpy(g.logp_sparse), torch.from_numpy(o.logp_sparse), atol=2e-5)
        assert g.kv_retained_tokens == w.kv_retained_tokens
    assert max_logp_shift(got, dense, NEW) > 1e-3   # eviction changed the distribution: the equalities are not trivial


def test_triton_backend_frees_evicted_slots(triton_engine):
    eng, cc = triton_engine
    eng.generate(PROMPTS, PARAMS)
    stats = eng.kv_pool_stats()
    assert stats["used_at_last_extend"] == 2 * PROMPT_LEN             # previous calls' slots all came back once
    # compression runs between steps: a row holds budget + interval tokens plus the next token's slot at most
    assert stats["peak_used_slots"] <= 2 * (cc.kv_budget + cc.interval + 1)
    assert stats["freed_slots"] >= 2 * (PROMPT_LEN + NEW - 1 - (cc.kv_budget + cc.interval))
    assert stats["max_live_by_budget"] == {str(cc.kv_budget): cc.kv_budget + cc.interval}


def test_per_request_budgets_each_bounded_by_their_own(triton_engine, tiny_qwen2_dir):
    eng, cc = triton_engine
    if cc.selection == "shared":
        pytest.skip("one compressor config is enough for the per-request budget check")
    budgets = [12, 20]
    got = [g[0] for g in eng.generate(PROMPTS, PARAMS, kv_budgets=budgets)]
    stats = eng.kv_pool_stats()
    assert (stats["max_live_by_budget"]["12"] == 12 + cc.interval
            and stats["max_live_by_budget"]["20"] == 20 + cc.interval)
    model = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    want = [g[0] for g in TorchEngine(model, tok, cc).generate(PROMPTS, PARAMS, kv_budgets=budgets)]
    same = [g[0] for g in TorchEngine(model, tok, cc).generate(PROMPTS, PARAMS)]
    for g, w in zip(got, want):
        assert g.response_ids == w.response_ids
        assert torch.allclose(torch.from_numpy(g.logp_sparse), torch.from_numpy(w.logp_sparse), atol=2e-5)
        assert g.kv_retained_tokens == w.kv_retained_tokens
    # the budgets mattered: the budget-12 row differs from its run at the config's budget 16
    assert not torch.allclose(torch.from_numpy(got[0].logp_sparse), torch.from_numpy(same[0].logp_sparse), atol=1e-4)
    with pytest.raises(ValueError, match="kv_budgets"):
        eng.generate(PROMPTS, PARAMS, kv_budgets=[cc.window, 16])          # a budget <= window is refused


def test_padded_graph_replay_odd_batch_with_stale_lanes(triton_engine, tiny_qwen2_dir):
    """An odd batch (3 requests) through the replay metadata on SGLang 0.5.23's own padded view (its decode input
    buffers + slot registry + build_replay_fb_view, padded to a capture bucket, some padded lanes holding stale
    rows of live requests: SELF_CHECK_ENV): every step checked in the scheduler (no negative length, padded lanes
    read only slot 0 and write no live row's query ring) and the outputs still equal TorchEngine's."""
    eng, cc = triton_engine
    if cc.selection == "shared":
        pytest.skip("one compressor config is enough for the padded-lane check")
    prompts = PROMPTS + [[(11 * j + 3) % 250 + 1 for j in range(PROMPT_LEN)]]
    before = eng.kv_pool_stats() or {}
    got = [g[0] for g in eng.generate(prompts, PARAMS)]
    stats = eng.kv_pool_stats()
    steps = stats["decode_steps"] - before.get("decode_steps", 0)
    assert stats["self_checks"] - before.get("self_checks", 0) == steps > 0
    stale = stats["stale_lanes_checked"] - before.get("stale_lanes_checked", 0)
    padded = stats["padded_lanes_checked"] - before.get("padded_lanes_checked", 0)
    assert 0 < stale <= padded and padded >= steps, (stale, padded, steps)
    assert stats["graph_replays"] == 0                    # eager CPU engine: SGLang's graph runner never ran
    want, _ = torch_references(tiny_qwen2_dir, cc, prompts, PARAMS)
    for g, w in zip(got, want):
        assert g.response_ids == w.response_ids
        assert torch.allclose(torch.from_numpy(g.logp_sparse), torch.from_numpy(w.logp_sparse), atol=2e-5)


def test_rows_joining_mid_decode_with_unequal_prompts_equal_torch_engine(triton_engine, tiny_qwen2_dir):
    """Five prompts of unequal lengths (12..30: the torch engine's compression groups are left-padded, and so are
    the backend's, to other widths) and per-request max_new_tokens with max_running_requests=4: the fifth
    request joins the running batch mid-decode, after the first finished, in another phase. With phase
    `request` each row's schedule runs from its own prefill, which TorchEngine represents with all five
    prompts in one batch (it cannot admit a row mid-decode: its rows share one step counter, but under
    `request` no row's outputs depend on when it joined). Every row's ids and logp_sparse equal the prefix of
    TorchEngine's (atol 2e-5), every decode step through the checked replay path."""
    eng, cc = triton_engine
    prompts = join_prompts()
    before = eng.kv_pool_stats() or {}
    got = generate_each(eng, prompts, JOIN_MAX_NEW)
    stats = eng.kv_pool_stats()
    assert [len(ids) for ids, _ in got] == list(JOIN_MAX_NEW)
    steps = stats["decode_steps"] - before.get("decode_steps", 0)
    assert stats["self_checks"] - before.get("self_checks", 0) == steps
    # the fifth request decoded beside the others (it joined at about step 10 and ended before them): the call
    # took the longest request's steps, not the 68 of running it after them
    assert steps == max(JOIN_MAX_NEW) - 1, steps
    want, dense = torch_references(tiny_qwen2_dir, cc, prompts,
                                   SamplingParams(temperature=0, max_new_tokens=max(JOIN_MAX_NEW), ignore_eos=True))
    assert_prefixes_equal(got, want)
    assert max(float((lp - torch.from_numpy(d.logp_sparse[:len(lp)])).abs().max())
               for (_, lp), d in zip(got, dense)) > 1e-3           # eviction mattered
