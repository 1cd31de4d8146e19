"""Retraction in sparse mode (docs/sglang.md, "Limits, exactly"). When SGLang's decode runs out of KV it retracts
requests: their KV is freed and they are later re-prefilled from prompt + response so far, so the sparse backend
compresses them from scratch and their logp_sparse no longer follows the compression schedule (nor the torch engine's).
No SGLang 0.5.23 setting prevents retraction, so `SGLangEngine.generate` refuses a batch in which a request was
retracted (`meta_info["num_retractions"]`), naming the settings that make it less likely. SGLang's own test
switch `SGLANG_TEST_RETRACT=1` retracts every third decode step (read by the scheduler subprocess at import)."""
import pytest
import torch

pytest.importorskip("sglang.srt", reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh")

from actors.engines.base import SamplingParams
from actors.engines.sglang.engine import SGLangEngine
from compressors import CompressorConfig
from tests.sglang.conftest import CPU_ENGINE_KWARGS

pytestmark = pytest.mark.sglang
torch.set_num_threads(1)
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(20)] for i in range(2)]
PARAMS = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def test_sparse_engine_refuses_a_retracted_request(tiny_qwen2_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_RETRACT", "1")
    eng = SGLangEngine(str(tiny_qwen2_dir), compressor_cfg=CompressorConfig(method="rkv", kv_budget=16, window=4,
                                                                            interval=8),
                       timeout_s=600, **dict(CPU_ENGINE_KWARGS, max_running_requests=4))
    try:
        with pytest.raises(RuntimeError, match=r"retracted a request \d+ time\(s\).*max_running_requests"):
            eng.generate(PROMPTS, PARAMS)
    finally:
        eng.shutdown()
