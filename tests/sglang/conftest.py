"""Opt-in SGLang CPU lane (docs/sglang.md): run with the lane's venv, built by scripts/setup_sglang_cpu.sh:
    .venv-sglang/bin/python -m pytest tests/sglang -m sglang -q
SGLang's CPU engine must be selected before sglang is imported."""
import os

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
pytest.importorskip("sglang", reason="the SGLang lane needs scripts/setup_sglang_cpu.sh's venv")

CPU_ENGINE_KWARGS = dict(device="cpu", dtype="float32", max_total_tokens=4096, mem_fraction_static=0.05,
                         random_seed=0, disable_cuda_graph=True, disable_overlap_schedule=True)
"""sglang.Engine settings of the lane: fp32 on CPU, small KV pool, eager."""


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """A 2-layer random Qwen2 + word-level tokenizer (tests/sglang/tiny.py), built once per session."""
    from tests.sglang.tiny import make_tiny_qwen2

    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))
