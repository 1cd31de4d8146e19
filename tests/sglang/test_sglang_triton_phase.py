"""`compressor.phase` on the `sparse_rl_kv` backend (CPU lane): with rows that joined the running batch in another
phase, `aligned` (compression due on the engine's decode steps that are multiples of `interval`) puts the rows'
compressions into fewer events than `request` (each row's own steps), and under either phase every row's ids and
logp_sparse equal TorchEngine's under the same rule."""
import os

import pytest

pytest.importorskip("sglang.srt", reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh")
from transformers import AutoTokenizer, Qwen2ForCausalLM

from actors.engines.base import SamplingParams
from actors.engines.sglang.engine import KV_STATS_ENV, SGLangEngine
from actors.engines.sglang.triton_backend import SELF_CHECK_ENV
from actors.engines.torch_engine import TorchEngine
from compressors import CompressorConfig
from compressors.config import PHASES
from tests.sglang.test_sglang_triton import KWARGS
from tests.sglang.tiny import JOIN_MAX_NEW, assert_prefixes_equal, generate_each, join_prompts

pytestmark = pytest.mark.sglang
FIRST = 4
"""Requests admitted at the call's first prefill (max_running_requests=4); the fifth joins mid-decode."""


def run_join_batch(model_dir, cc: CompressorConfig, stats_path) -> tuple[list, dict]:
    """The join batch (tests/sglang/tiny.py) on a fresh `sparse_rl_kv` engine under `cc`, every decode step through
    the checked replay path: (outputs, the backend's stats)."""
    os.environ[KV_STATS_ENV], os.environ[SELF_CHECK_ENV] = str(stats_path), "1"
    eng = SGLangEngine(str(model_dir), compressor_cfg=cc, timeout_s=600, **KWARGS)
    try:
        assert (eng.kv_pool_stats() or {}).get("decode_steps", 0) == 0
        return generate_each(eng, join_prompts(), JOIN_MAX_NEW), eng.kv_pool_stats()
    finally:
        eng.shutdown()
        del os.environ[KV_STATS_ENV], os.environ[SELF_CHECK_ENV]


def torch_join_references(model_dir, cc: CompressorConfig, joined_at: int) -> list:
    """TorchEngine's samples for the join batch under `cc`: the first FIRST prompts in one batch from engine
    decode step 0, the fifth alone from engine decode step `joined_at` (its `decode_steps` set there: the shared
    phase it joined the SGLang batch in), each for its longest SGLang length."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    eng = TorchEngine(model, AutoTokenizer.from_pretrained(model_dir), cc)
    prompts = join_prompts()
    out = []
    for index, start in ((range(FIRST), 0), (range(FIRST, len(prompts)), joined_at)):
        eng.decode_steps = start
        params = SamplingParams(temperature=0, max_new_tokens=max(JOIN_MAX_NEW[i] for i in index), ignore_eos=True)
        out += [g[0] for g in eng.generate([prompts[i] for i in index], params)]
    return out


def test_aligned_phase_takes_fewer_compression_events_and_equals_torch_engine(tiny_qwen2_dir, tmp_path):
    events = {}
    for phase in PHASES:
        cc = CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8, phase=phase)
        got, stats = run_join_batch(tiny_qwen2_dir, cc, tmp_path / f"{phase}.json")
        joined_at = stats["last_extend_decode_step"]
        assert 0 < joined_at and joined_at % cc.interval, f"the fifth request joined at step {joined_at}: in phase"
        assert stats["self_checks"] == stats["decode_steps"] == max(JOIN_MAX_NEW) - 1
        assert_prefixes_equal(got, torch_join_references(tiny_qwen2_dir, cc, joined_at))
        events[phase] = (stats["compression_events"], stats["compressions"])
    # (events, requests compressed): the prefill of the first four and of the fifth, step 8, then request: steps
    # 16, 24, 32 for three rows and 17, 25, 33 for the fifth (joined at step 9); aligned: 16, 24, 32 for all four
    assert events == {"request": (9, 20), "aligned": (6, 20)}, events


def test_aligned_kv_retained_tokens_equal_torch_engine(tiny_qwen2_dir, tmp_path):
    """`kv_retained_tokens` of SGLangEngine.generate under phase aligned is exact: it equals TorchEngine's (the valid
    slots of its cache when the row ended) for the same run, the fifth request joining when the first four end, at
    engine step 23, not a multiple of interval 8. By hand (budget 16; 23 decode forwards): the first four (prompts
    12-30, 12 < 16 uncompressed, the others compressed at prefill) are compressed at steps 8 and 16 and end at 16 + 7
    = 23; the fifth (prompt 17, compressed at prefill) at engine steps 24, 32, 40 = its steps 1, 9, 17, ending at
    16 + 6 = 22 (its own steps 8 and 16, the request phase's, would give 23)."""
    cc = CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8, phase="aligned")
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    os.environ[KV_STATS_ENV] = str(tmp_path / "stats.json")
    eng = SGLangEngine(str(tiny_qwen2_dir), compressor_cfg=cc, timeout_s=600, **KWARGS)
    try:
        got = [g[0] for g in eng.generate(join_prompts(), params)]
        joined_at = eng.kv_pool_stats()["last_extend_decode_step"]
        assert open(eng.joins_path).read() == ""                          # read and emptied by generate
    finally:
        eng.shutdown()
        del os.environ[KV_STATS_ENV]
    assert joined_at == 23
    model = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
    ref = TorchEngine(model, AutoTokenizer.from_pretrained(tiny_qwen2_dir), cc)
    want = [g[0] for g in ref.generate(join_prompts()[:FIRST], params)]
    ref.decode_steps = joined_at
    want += [g[0] for g in ref.generate(join_prompts()[FIRST:], params)]
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    assert [s.kv_retained_tokens for s in want] == [23, 23, 23, 23, 22]
    assert [s.kv_retained_tokens for s in got] == [s.kv_retained_tokens for s in want]
