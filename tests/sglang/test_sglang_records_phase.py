"""Eviction records from the `sparse_rl_kv` backend under both `compressor.phase` values (CPU lane; its own module
because each test starts its own engine, and SGLang's shutdown kills every engine of the process): the join batch
(five prompts, the fifth joining mid-decode at an engine step that is not a multiple of interval) gives each row the
record TorchEngine gives it under the same rule (test_sglang_records.py: `canonical`, `assert_records_equal`)."""
import os

import pytest

pytest.importorskip("sglang.srt", reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh")

from actors.engines.base import SamplingParams
from actors.engines.sglang.engine import KV_STATS_ENV, SGLangEngine
from actors.engines.sglang.triton_backend import SELF_CHECK_ENV
from compressors import CompressorConfig
from compressors.config import PHASES
from tests.sglang.test_sglang_records import assert_records_equal, generate_each_recorded, torch_engine
from tests.sglang.test_sglang_triton import KWARGS
from tests.sglang.tiny import JOIN_MAX_NEW, join_prompts

pytestmark = pytest.mark.sglang
FIRST = 4
"""Requests admitted at the join batch's first prefill (max_running_requests=4); the fifth joins mid-decode."""


@pytest.mark.parametrize("phase", PHASES)
def test_records_under_both_phases_equal_torch_engine(phase, tiny_qwen2_dir, tmp_path):
    """The join batch on a fresh engine under `compressor.phase` request | aligned (the fifth request joining at an
    engine step that is not a multiple of interval): records equal TorchEngine's, the fifth request's from engine
    decode step `joined_at` (tests/sglang/test_sglang_triton_phase.py)."""
    cc = CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8, phase=phase)
    os.environ[KV_STATS_ENV], os.environ[SELF_CHECK_ENV] = str(tmp_path / "stats.json"), "1"
    eng = SGLangEngine(str(tiny_qwen2_dir), compressor_cfg=cc, timeout_s=600, record_evictions=True, **KWARGS)
    try:
        got = generate_each_recorded(eng, join_prompts(), JOIN_MAX_NEW)
        joined_at = eng.kv_pool_stats()["last_extend_decode_step"]
    finally:
        eng.shutdown()
        del os.environ[KV_STATS_ENV], os.environ[SELF_CHECK_ENV]
    assert 0 < joined_at and joined_at % cc.interval
    ref, prompts, want = torch_engine(tiny_qwen2_dir, cc), join_prompts(), []
    for index, start in ((range(FIRST), 0), (range(FIRST, len(prompts)), joined_at)):
        ref.decode_steps = start
        params = SamplingParams(temperature=0, max_new_tokens=max(JOIN_MAX_NEW[i] for i in index), ignore_eos=True)
        want += [g[0] for g in ref.generate([prompts[i] for i in index], params)]
    assert assert_records_equal(got, want, shapes=False)["at_decode"] > 0
