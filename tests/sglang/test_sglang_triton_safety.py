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

from actors.engines.sglang import triton_backend as backend
from actors.engines.sglang.engine import SPARSE_REQUIRED, SGLangEngine, check_sparse_settings
from compressors import CompressorConfig

pytestmark = pytest.mark.sglang
SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "nonzero", "argwhere", "masked_select"}
SYNC_BUILTINS = {"int", "float", "bool"}
HOST_DATA = {"from_numpy", "tensor", "as_tensor"}      # torch.<f>(host data): a host-to-device copy on a GPU
REPLAY_PATH = [backend.SparseTritonAttnBackend._live_kv_indices,
               backend.SparseTritonAttnBackend._update_decode_kv_buffers,
               backend.SparseTritonAttnBackend.forward_decode, backend.SparseTritonAttnBackend._write_ring]


def host_syncs(source: str) -> list[str]:
    """What in `source` makes the host wait for the device: .item/.tolist/.cpu/.numpy/.nonzero/.argwhere/
    .masked_select(), int/float/bool(...), .to("cpu") / .to(device="cpu"), torch.from_numpy/tensor/as_tensor
    (host data copied to the device), indexing with a comparison or its negation (a boolean mask)."""
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in SYNC_METHODS:
                found.append(f".{f.attr}()")
            elif isinstance(f, ast.Name) and f.id in SYNC_BUILTINS:
                found.append(f"{f.id}()")
            elif isinstance(f, ast.Attribute) and f.attr == "to" and any(
                    isinstance(a, ast.Constant) and a.value == "cpu" for a in
                    list(node.args) + [k.value for k in node.keywords if k.arg == "device"]):
                found.append('.to("cpu")')
            elif (isinstance(f, ast.Attribute) and f.attr in HOST_DATA and isinstance(f.value, ast.Name)
                  and f.value.id == "torch"):
                found.append(f"torch.{f.attr}()")
        elif isinstance(node, ast.Subscript):
            index = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if any(isinstance(i, ast.Compare)
                   or (isinstance(i, ast.UnaryOp) and isinstance(i.op, (ast.Invert, ast.Not)))
                   for i in index):
                found.append("boolean-mask [...]")
    return found


@pytest.mark.parametrize("fn", REPLAY_PATH, ids=lambda f: f.__name__)
def test_replay_path_source_has_no_host_sync(fn):
    assert host_syncs(inspect.getsource(fn)) == []


@pytest.mark.parametrize("fn", [backend.SparseTritonAttnBackend.compress_pending,
                                backend.SparseTritonAttnBackend._compress_group], ids=lambda f: f.__name__)
def test_compression_source_reads_nothing_back_and_copies_once(fn):
    """The between-steps compression (docs/sglang.md, "What runs where"): no host sync on a device tensor and no per-row
    loop; its host-to-device copies go through `_to_device` (one pinned, non-blocking copy per group)."""
    source = inspect.getsource(fn)
    assert host_syncs(source) == []
    assert "for r" not in source and ".to(" not in source


def test_compression_device_half_source_has_no_host_sync():
    """The compression's device half and what it runs for random and protection (the seed / event / position hash,
    the origin map, the protected share): no host sync in their source. They also run under NoHostSync wherever the
    lane's self-check compresses (tests/sglang/test_sglang_records.py, random and protection cases),
    Compressor.select and its classes too (whose source the scan cannot take: float("-inf") reads as float())."""
    from actors.engines.sglang.records import EvictionRecorder
    from compressors import scores
    from compressors.compressor import Compressor

    for fn in (backend.SparseTritonAttnBackend._compress_device, EvictionRecorder.origins, EvictionRecorder.record,
               scores.random_hash, scores.random_scores, scores._mix32, Compressor.protected_share):
        assert host_syncs(inspect.getsource(fn)) == [], fn.__qualname__


def test_to_device_packs_the_arrays_into_one_pinned_non_blocking_copy():
    import types

    import numpy as np

    a, b = np.arange(6).reshape(2, 3), np.array([True, False])
    x, y = backend.SparseTritonAttnBackend._to_device(types.SimpleNamespace(device="cpu"), a, b)
    assert x.tolist() == a.tolist() and y.tolist() == [1, 0] and x.dtype == y.dtype == torch.int64
    assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()          # one buffer, one copy
    source = inspect.getsource(backend.SparseTritonAttnBackend._to_device)        # the accelerator branch
    assert "pin_memory()" in source and "non_blocking=True" in source


@pytest.mark.parametrize("bad,want", [
    ("n = int(x.max())\ny = x[:n].tolist()", ["int()", ".tolist()"]),
    ('y = x.to("cpu")', ['.to("cpu")']), ('y = x.to(device="cpu")', ['.to("cpu")']), ("y = x.cpu()", [".cpu()"]),
    ("y = x.nonzero()", [".nonzero()"]), ("y = x[x != 0]", ["boolean-mask [...]"]),
    ("x[~m, 0] = 1", ["boolean-mask [...]"]), ("y = torch.from_numpy(a).to(dev)", ["torch.from_numpy()"]),
    ("y = x.masked_select(m)", [".masked_select()"]),
], ids=["int-tolist", "to-cpu", "to-device-cpu", "cpu", "nonzero", "mask-index", "mask-assign", "h2d", "masked_select"])
def test_host_sync_detector_catches_a_sync(bad, want):           # the control: the check above can fail
    assert host_syncs(f"def f(self, x, m, a, dev):\n    {bad.replace(chr(10), chr(10) + '    ')}\n") == want


@pytest.mark.parametrize("read", [lambda t: t.item(), lambda t: t.tolist(), lambda t: int(t), lambda t: bool(t),
                                  lambda t: float(t), lambda t: t.cpu(), lambda t: [0, 1, 2][t],
                                  lambda t: t.to("cpu"), lambda t: t.to(device=torch.device("cpu")),
                                  lambda t: t.nonzero(), lambda t: torch.nonzero(t), lambda t: torch.where(t > 0),
                                  lambda t: t[t > 0], lambda t: t.__setitem__(t > 0, 0),
                                  lambda t: t.masked_select(t > 0),
                                  lambda t: t.argwhere()],
                         ids=["item", "tolist", "int", "bool", "float", "cpu", "index", "to-cpu", "to-device-cpu",
                              "nonzero", "torch.nonzero", "where1", "mask-index", "mask-assign", "masked_select",
                              "argwhere"])
def test_no_host_sync_guard_raises_on_every_read(read):
    t = torch.tensor([1])
    read(t.clone())                                        # fine outside the guard
    with pytest.raises(backend.HostSyncError), backend.NoHostSync():
        read(t)


def test_no_host_sync_guard_flags_a_blocking_host_to_device_copy():
    """Only an accelerator target is a host-to-device copy: checked on the guard's rule itself (no GPU here)."""
    t = torch.ones(2)
    meta = torch.empty(2, device="meta")
    assert backend._host_sync(torch.Tensor.to, (t, "cuda"), {}) == "blocking host-to-device to()"
    assert backend._host_sync(torch.Tensor.to, (t, "cuda"), {"non_blocking": True}) is None
    assert backend._host_sync(torch.Tensor.copy_, (meta, t), {}) == "blocking copy_ between host and device"
    assert backend._host_sync(torch.Tensor.copy_, (meta, t), {"non_blocking": True}) is None


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
    # graphs: a piecewise (breakable) or full prefill graph, a breakable decode graph, torch.compile
    ("cuda_graph_backend_prefill", "breakable"), ("cuda_graph_backend_prefill", "full"),
    ("cuda_graph_backend_decode", "breakable"), ("debug_cuda_graph", True), ("enable_torch_compile", True),
    ("cuda_graph_config", {"prefill": {"backend": "breakable"}}),
    ("cuda_graph_config", {"decode": {"backend": "breakable"}}),
])
def test_sparse_engine_refuses_setting_at_start(setting, value):
    with pytest.raises(ValueError, match=rf"\b{setting}="):
        SGLangEngine("/nonexistent-model", compressor_cfg=SPARSE, **{setting: value})   # refused before SGLang starts


def test_fp8_kv_pool_is_refused_quoting_the_try():
    """SGLang's own fp8 KV pool under the sparse backend: refused before SGLang starts, naming the setting and quoting
    in one line what the try on the CPU lane gave (contract.FP8_POOL_TRY; docs/sglang.md, "Refused at start")."""
    with pytest.raises(ValueError, match=r"^engine setting kv_cache_dtype='fp8_e4m3': .*tried on the CPU lane \(SGLang "
                                         r"0\.5\.23, TRITON_INTERPRET=1, .*CPU FP8 KV cache requires Intel AMX"):
        SGLangEngine("/nonexistent-model", compressor_cfg=SPARSE, kv_cache_dtype="fp8_e4m3")


def test_backends_refuse_compressor_settings_each_with_its_reason():
    """Both backends, in the scheduler, refuse what contract.unsupported_compressor_settings lists for them, each
    setting with its own reason in one line, before touching the runner: `sparse_rl_kv` runs random and protection,
    the torch reference backend does not."""
    from actors.engines.sglang.kv_backend import SparseKVAttnBackend

    cfg = CompressorConfig(method="random", kv_budget=16, window=4, interval=8, protect_values=2, kv_dtype="int8")
    cfg.validate()
    with pytest.raises(ValueError, match=r"^compressor\.kv_dtype=int8: the sparse backend's KV pool stores the model "
                                         r"dtype .* \(the SGLang sparse backend cannot run this yet; "):
        backend.SparseTritonAttnBackend(None, cfg)          # random and protect_values run there
    with pytest.raises(ValueError, match=r"^compressor\.method=random: the sparse_rl_kv_torch reference backend does "
                                         r"not track each request's seed .*; compressor\.protect_values=2: the "
                                         r"sparse_rl_kv_torch reference backend was never run .*; compressor\."
                                         r"kv_dtype=int8: .* \(the SGLang sparse backend cannot run this yet; "):
        SparseKVAttnBackend(None, cfg)


def test_sparse_engine_turns_the_prefill_graph_off():
    """SGLang 0.5.23 defaults to a breakable (piecewise) prefill CUDA graph on CUDA: sparse mode sets it off
    (the CPU lane's default is off already, so this is the only place the GPU default is checked)."""
    from actors.engines.sglang.engine import sparse_engine_kwargs

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


def test_torch_reference_backend_refuses_budget_schedule_length():
    """budget_schedule=length grows the budget along a trajectory: `sparse_rl_kv` follows it from each row's host
    step count (tests/sglang/test_sglang_length_schedule.py); the torch reference backend compresses every request to
    kv_budget, so it refuses it at start, naming the setting and the backend to use."""
    import dataclasses

    from actors.engines.sglang.engine import TORCH_SPARSE_BACKEND

    grow = dataclasses.replace(SPARSE, budget_schedule="length", kv_budget_final=32, budget_growth=0.5)
    grow.validate()
    with pytest.raises(ValueError, match="compressor.budget_schedule='length'.*use sparse_rl_kv"):
        SGLangEngine("/nonexistent-model", compressor_cfg=grow, sparse_backend=TORCH_SPARSE_BACKEND)


def test_torch_reference_backend_refuses_aligned_phase():
    """compressor.phase aligned is built in sparse_rl_kv only: the reference backend refuses it at start."""
    import dataclasses

    from actors.engines.sglang.engine import TORCH_SPARSE_BACKEND

    with pytest.raises(ValueError, match="compressor.phase='aligned'"):
        SGLangEngine("/nonexistent-model", compressor_cfg=dataclasses.replace(SPARSE, phase="aligned"),
                     sparse_backend=TORCH_SPARSE_BACKEND)


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

    from actors.engines.sglang.engine import SPARSE_BACKEND, register_sglang_plugin

    register_sglang_plugin()
    assert SPARSE_BACKEND in DETERMINISTIC_ATTENTION_BACKEND_CHOICES
