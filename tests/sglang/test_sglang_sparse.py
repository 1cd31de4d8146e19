"""Sparse mode inside SGLang with the torch reference backend (`sparse_rl_kv_torch`, compression inside the
step) on CPU with a tiny random Qwen2: the same prompts and compressor give the same tokens and logp_sparse as
the torch engine, eviction changes the log-probs, and the evicted KV slots go back to SGLang's allocator
(measured by the backend from the allocator itself). The default backend is tests/sglang/test_sglang_triton.py."""
import json
import os

import pytest
import torch

from actors.engines.base import SamplingParams
from actors.engines.sglang.engine import KV_STATS_ENV, TORCH_SPARSE_BACKEND, SGLangEngine
from compressors import CompressorConfig
from tests.sglang.conftest import CPU_ENGINE_KWARGS
from tests.sglang.tiny import max_logp_shift, torch_references

pytestmark = pytest.mark.sglang
torch.set_num_threads(1)
PROMPT_LEN, NEW = 20, 40
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(PROMPT_LEN)] for i in range(2)]   # equal lengths, > kv_budget
PARAMS = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=[
    CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8),
    CompressorConfig(method="snapkv", kv_budget=16, window=4, interval=8, selection="shared"),
], ids=["rkv-per_head", "snapkv-shared"])
def sparse(request, tiny_qwen2_dir, tmp_path_factory):
    stats = tmp_path_factory.mktemp("kv") / "stats.json"
    os.environ[KV_STATS_ENV] = str(stats)
    eng = SGLangEngine(str(tiny_qwen2_dir), compressor_cfg=request.param, timeout_s=120,
                       sparse_backend=TORCH_SPARSE_BACKEND, **CPU_ENGINE_KWARGS)
    yield eng, request.param
    eng.shutdown()
    del os.environ[KV_STATS_ENV]


def test_sparse_equals_torch_engine(sparse, tiny_qwen2_dir):
    eng, cc = sparse
    got = [g[0] for g in eng.generate(PROMPTS, PARAMS)]
    want, dense = torch_references(tiny_qwen2_dir, cc, PROMPTS, PARAMS)
    for g, w in zip(got, want):
        assert g.response_ids == w.response_ids
        assert torch.allclose(torch.from_numpy(g.logp_sparse), torch.from_numpy(w.logp_sparse), atol=1e-4)
        assert g.kv_retained_tokens == w.kv_retained_tokens
    assert max_logp_shift(got, dense, NEW) > 1e-3   # eviction changed the distribution: the equality is not trivial


def test_evicted_slots_are_freed(sparse):
    eng, cc = sparse
    eng.generate(PROMPTS, PARAMS)
    stats = eng.kv_pool_stats()
    # Measured at the prefill of this call: exactly the two prompts' slots are held, so the previous calls'
    # evicted slots and finished rows came back once each (no leak, no double free).
    assert stats["used_at_last_extend"] == 2 * PROMPT_LEN
    # Compression inside the step: two requests never held more than kv_budget + interval slots each (dense
    # would need PROMPT_LEN + NEW - 1; the Triton backend, compressing between steps, needs one slot more).
    assert stats["peak_used_slots"] <= 2 * (cc.kv_budget + cc.interval)
    assert stats["freed_slots"] >= 2 * (PROMPT_LEN + NEW - 1 - (cc.kv_budget + cc.interval))
    with open(os.environ[KV_STATS_ENV]) as f:
        assert json.load(f) == stats
