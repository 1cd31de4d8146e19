"""Opt-in SGLang CPU lane (docs/sglang.md): run with the lane's venv, built by scripts/setup_sglang_cpu.sh:
    .venv-sglang/bin/python -m pytest tests/sglang -m sglang -q
SGLang's CPU engine must be selected before sglang is imported."""
import os

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")     # SGLang's Triton kernels run on CPU tensors (numpy interpreter)
try:
    import sglang.srt  # noqa: F401  (the real package: this folder is importable as a namespace "sglang" too)
    HAVE_SGLANG = True
except ImportError:
    HAVE_SGLANG = False


def pytest_collection_modifyitems(config, items):
    """Without SGLang (any venv but the lane's) the lane's tests are skipped, not errors."""
    if HAVE_SGLANG:
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh"))

CPU_ENGINE_KWARGS = dict(device="cpu", dtype="float32", max_total_tokens=4096, mem_fraction_static=0.5,
                         random_seed=0, disable_cuda_graph=True, disable_overlap_schedule=True)
"""sglang.Engine settings of the lane: fp32 on CPU, small KV pool (max_total_tokens caps it), eager. On the
CPU SGLang sizes the pool as available - pre_load * (1 - mem_fraction_static) of *system* memory, so a small
fraction fails the start whenever other processes grow by more than that margin while the weights load."""


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """A 2-layer random Qwen2 + word-level tokenizer (tests/sglang/tiny.py), built once per session."""
    from tests.sglang.tiny import make_tiny_qwen2

    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))
