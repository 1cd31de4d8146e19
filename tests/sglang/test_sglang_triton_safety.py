"""Graph safety of the `sparse_rl_kv` replay-path metadata, checked without a GPU, and the start-time refusals.

The runtime half (every decode step of the CPU-lane engine runs the replay path under `NoHostSync`, into the
same persistent buffers, equal to the eager path) is `test_sglang_triton.py` (SPARSE_RL_KV_SELF_CHECK=1);
here: the static half (no host-sync call in the source of the replay-path functions), the guard itself, and
every setting SGLangEngine refuses before SGLang starts."""
import ast
import inspect
import textwrap

import pytest
import torch

pytest.importorskip("sglang.srt", reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh")

from actors import sglang_triton_backend as backend
from actors.sglang_engine import SPARSE_REQUIRED, SGLangEngine, check_sparse_settings
from compressors import CompressorConfig

pytestmark = pytest.mark.sglang
SYNC_METHODS = {"item", "tolist", "cpu", "numpy"}
SYNC_BUILTINS = {"int", "float", "bool"}
REPLAY_PATH = [backend.SparseTritonAttnBackend._live_kv_indices, backend.SparseTritonAttnBackend._update_decode_kv_buffers,
               backend.SparseTritonAttnBackend.forward_decode]


def host_syncs(source: str) -> list[str]:
    """Calls in `source` that read a device value on the host: .item/.tolist/.cpu/.numpy, int/float/bool(...)."""
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in SYNC_METHODS:
                found.append(f".{f.attr}()")
            elif isinstance(f, ast.Name) and f.id in SYNC_BUILTINS:
                found.append(f"{f.id}()")
    return found


@pytest.mark.parametrize("fn", REPLAY_PATH, ids=lambda f: f.__name__)
def test_replay_path_source_has_no_host_sync(fn):
    assert host_syncs(inspect.getsource(fn)) == []


def test_host_sync_detector_catches_a_sync():           # the control: the check above can fail
    bad = "def f(self, x):\n    n = int(x.max())\n    return x[:n].tolist()\n"
    assert host_syncs(bad) == ["int()", ".tolist()"]


@pytest.mark.parametrize("read", [lambda t: t.item(), lambda t: t.tolist(), lambda t: int(t), lambda t: bool(t),
                                  lambda t: float(t), lambda t: t.cpu(), lambda t: [0, 1, 2][t]],
                         ids=["item", "tolist", "int", "bool", "float", "cpu", "index"])
def test_no_host_sync_guard_raises_on_every_read(read):
    t = torch.tensor(1)
    assert read(t) is not None                             # fine outside the guard
    with pytest.raises(backend.HostSyncError), backend.NoHostSync():
        read(t)


def test_no_host_sync_guard_lets_device_ops_through():
    start, seq = torch.tensor([0, 3, 5]), torch.tensor([4, 9, 6])
    indptr = torch.zeros(4, dtype=torch.int32)
    with backend.NoHostSync():
        live = seq - start
        indptr[1:] = torch.cumsum(live, dim=0)
    assert indptr.tolist() == [0, 4, 10, 11]


SPARSE = CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8)


@pytest.mark.parametrize("setting,value", [
    ("kv_cache_dtype", "fp8_e4m3"), ("page_size", 16), ("disable_radix_cache", False), ("chunked_prefill_size", 8192),
    ("tp_size", 2), ("pp_size", 2), ("dp_size", 2), ("disable_overlap_schedule", False), ("enable_mixed_chunk", True),
    ("speculative_algorithm", "EAGLE"), ("attention_backend", "flashinfer"),
    # graphs (issue 38 item 4): a piecewise (breakable) or full prefill graph, a breakable decode graph, torch.compile
    ("cuda_graph_backend_prefill", "breakable"), ("cuda_graph_backend_prefill", "full"),
    ("cuda_graph_backend_decode", "breakable"), ("debug_cuda_graph", True), ("enable_torch_compile", True),
    ("cuda_graph_config", {"prefill": {"backend": "breakable"}}), ("cuda_graph_config", {"decode": {"backend": "breakable"}}),
])
def test_sparse_engine_refuses_setting_at_start(setting, value):
    with pytest.raises(ValueError, match=rf"\b{setting}="):
        SGLangEngine("/nonexistent-model", compressor_cfg=SPARSE, **{setting: value})   # refused before SGLang starts


def test_sparse_engine_turns_the_prefill_graph_off():
    """SGLang 0.5.23 defaults to a breakable (piecewise) prefill CUDA graph on CUDA: sparse mode sets it off
    (the CPU lane's default is off already, so this is the only place the GPU default is checked)."""
    from actors.sglang_engine import sparse_engine_kwargs

    for name in ("sparse_rl_kv", "sparse_rl_kv_torch"):
        kw = sparse_engine_kwargs(name)
        assert kw["cuda_graph_backend_prefill"] == "disabled" and kw["enable_torch_compile"] is False, kw
    check_sparse_settings({"cuda_graph_backend_decode": "full", "cuda_graph_config": {"decode": {"backend": "full"}}})


def test_scheduler_side_graph_check_refuses_sglangs_gpu_default():
    """The backend's own check in the scheduler, on SGLang's resolved CudaGraphConfig: its CUDA default
    (breakable prefill) is refused, what sparse_engine_kwargs() resolves to is accepted."""
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig

    gpu_default = CudaGraphConfig(prefill=PhaseConfig(backend="breakable"))
    with pytest.raises(ValueError, match="cuda_graph_backend_prefill='breakable'"):
        backend.check_graph_settings(gpu_default, False)
    with pytest.raises(ValueError, match="cuda_graph_backend_decode='breakable'"):
        backend.check_graph_settings(CudaGraphConfig(decode=PhaseConfig(backend="breakable"),
                                                     prefill=PhaseConfig(backend="disabled")), False)
    ours = CudaGraphConfig(prefill=PhaseConfig(backend="disabled"))
    with pytest.raises(ValueError, match="enable_torch_compile=True"):
        backend.check_graph_settings(ours, True)
    backend.check_graph_settings(ours, False)


def test_sparse_engine_refuses_budget_schedule_length():
    """budget_schedule=length grows the budget along a trajectory (torch engine only); the SGLang engine would
    read kv_budget as a constant: refused at start, naming the setting (deploy/config.py refuses it in a config)."""
    import dataclasses

    grow = dataclasses.replace(SPARSE, budget_schedule="length", kv_budget_final=32, budget_growth=0.5)
    grow.validate()                                                   # a valid setting, for the torch engine
    with pytest.raises(ValueError, match="compressor.budget_schedule='length'"):
        SGLangEngine("/nonexistent-model", compressor_cfg=grow)


def test_refusals_cover_every_required_setting():
    assert {"kv_cache_dtype", "page_size", "disable_radix_cache", "chunked_prefill_size", "tp_size",
            "disable_overlap_schedule"} <= set(SPARSE_REQUIRED)
    check_sparse_settings({"dtype": "float32", "kv_cache_dtype": "float32", "chunked_prefill_size": None})  # accepted


@pytest.mark.parametrize("env,value,named", [
    ("SGLANG_PLUGINS", "other_plugin", "SGLANG_PLUGINS"), ("SGLANG_USE_HND_KVCACHE", "1", "SGLANG_USE_HND_KVCACHE"),
    ("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "true", "SGLANG_ENABLE_METADATA_GLUE_GRAPH"),
])
def test_sparse_engine_refuses_environment(monkeypatch, env, value, named):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=named):
        SGLangEngine("/nonexistent-model", compressor_cfg=SPARSE)
    if env == "SGLANG_PLUGINS":
        monkeypatch.setenv(env, "other_plugin, sparse_rl_kv")
        check_sparse_settings({})                             # listed: accepted


def test_deterministic_inference_accepts_the_backend():
    from sglang.srt.arg_groups.choices import DETERMINISTIC_ATTENTION_BACKEND_CHOICES

    from actors.sglang_engine import SPARSE_BACKEND, register_sglang_plugin

    register_sglang_plugin()
    assert SPARSE_BACKEND in DETERMINISTIC_ATTENTION_BACKEND_CHOICES
