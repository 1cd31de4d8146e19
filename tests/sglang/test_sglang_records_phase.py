"""Eviction records from the `sparse_rl_kv` backend under both `compressor.phase` values (CPU lane; its own module
because each test starts its own engine, and SGLang's shutdown kills every engine of the process): the join batch
(five prompts, the fifth joining mid-decode at an engine step that is not a multiple of interval) gives each row the
record TorchEngine gives it under the same rule (test_sglang_records.py: `canonical`, `assert_records_equal`), for
R-KV under both phases and, under aligned (test_sglang_records.py covers them under request), random with
protect_values 3 (each request's seed the torch engine's row seed in its reference call) and R-KV with protect_prompt
all."""
import dataclasses
import os

import pytest

pytest.importorskip("sglang.srt", reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh")

from actors.engines.base import SamplingParams, row_seeds
from actors.engines.sglang.engine import KV_STATS_ENV, SGLangEngine
from actors.engines.sglang.triton_backend import SELF_CHECK_ENV
from compressors import CompressorConfig
from tests.sglang.test_sglang_records import SEED, assert_records_equal, generate_each_recorded, torch_engine
from tests.sglang.test_sglang_triton import KWARGS
from tests.sglang.tiny import JOIN_MAX_NEW, join_prompts

pytestmark = pytest.mark.sglang
FIRST = 4
"""Requests admitted at the join batch's first prefill (max_running_requests=4); the fifth joins mid-decode."""
RKV = CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8)
CASES = {"rkv-request": RKV, "rkv-aligned": dataclasses.replace(RKV, phase="aligned"),
         "random-protect_values_3-aligned": dataclasses.replace(RKV, method="random", protect_values=3,
                                                                phase="aligned"),
         "rkv-protect_prompt_all-aligned": dataclasses.replace(RKV, protect_prompt="all", phase="aligned")}


def torch_join(model_dir, cc: CompressorConfig, joined_at: int, seed: int | None) -> list:
    """TorchEngine's Samples of the join batch as SGLang runs it: the first FIRST prompts in one call from engine decode
    step 0, the fifth in a second call from step `joined_at` (sampling seed `seed`, then `seed` + 1, when not None)."""
    ref, prompts, want = torch_engine(model_dir, cc), join_prompts(), []
    for k, (index, start) in enumerate(((range(FIRST), 0), (range(FIRST, len(prompts)), joined_at))):
        ref.decode_steps = start
        params = SamplingParams(temperature=0, max_new_tokens=max(JOIN_MAX_NEW[i] for i in index), ignore_eos=True,
                                seed=None if seed is None else seed + k)
        want += [g[0] for g in ref.generate([prompts[i] for i in index], params)]
    return want


@pytest.mark.parametrize("case", CASES)
def test_records_under_both_phases_equal_torch_engine(case, tiny_qwen2_dir, tmp_path):
    """The join batch on a fresh engine under `compressor.phase` request | aligned (the fifth request joining at an
    engine step that is not a multiple of interval): records equal TorchEngine's, the fifth request's from engine
    decode step `joined_at` (tests/sglang/test_sglang_triton_phase.py). Random: each request carries the seed its
    row has in TorchEngine's calls (`row_seeds`: SEED for the first four, SEED + 1 for the fifth); the controls,
    TorchEngine with other seeds (random) and TorchEngine without the protection (protect_prompt, protect_values:
    each dropped on the torch side alone), give other records."""
    cc = CASES[case]
    seed = SEED if cc.method == "random" else None
    seeds = None if seed is None else row_seeds(seed, FIRST) + row_seeds(seed + 1, len(JOIN_MAX_NEW) - FIRST)
    os.environ[KV_STATS_ENV], os.environ[SELF_CHECK_ENV] = str(tmp_path / "stats.json"), "1"
    eng = SGLangEngine(str(tiny_qwen2_dir), compressor_cfg=cc, timeout_s=600, record_evictions=True, **KWARGS)
    try:
        got = generate_each_recorded(eng, join_prompts(), JOIN_MAX_NEW, seeds)
        joined_at = eng.kv_pool_stats()["last_extend_decode_step"]
    finally:
        eng.shutdown()
        del os.environ[KV_STATS_ENV], os.environ[SELF_CHECK_ENV]
    assert 0 < joined_at and joined_at % cc.interval
    seen = assert_records_equal(got, torch_join(tiny_qwen2_dir, cc, joined_at, seed), shapes=False)
    print(f"{case}: records equal, {seen}, joined at decode step {joined_at}")
    assert seen["at_decode"] > 0
    controls = ([("seed + 2", cc, seed + 2)] if seed is not None else []) + \
        [(f"{name} off", dataclasses.replace(cc, **{name: off}), seed)
         for name, off in (("protect_prompt", "off"), ("protect_values", 0)) if getattr(cc, name) != off]
    for name, other_cc, other_seed in controls:
        with pytest.raises(AssertionError, match="differ") as control:
            assert_records_equal(got, torch_join(tiny_qwen2_dir, other_cc, joined_at, other_seed), shapes=False)
        print(f"control ({name}): {str(control.value).splitlines()[0]}")
