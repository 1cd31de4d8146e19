"""The transient memory of one compression call of the `sparse_rl_kv` backend (docs/sglang.md), measured: the CPU
allocator's peak during `_compress_group` (torch.profiler, profile_memory) stays under its computed bound
(actors.engines.kv_memory.compression_event_bytes), and an event over `event_bytes_cap` is split into calls that
each stay under it, with the same result as one call. The backend's compression runs here on a bare instance (its K/V
buffers, request table and query ring built by hand; no SGLang engine), so the shapes can be those of a real model."""
import copy
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("sglang.srt", reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh")

from actors.engines.kv_memory import SIMILARITY_BLOCK, compression_event_bytes
from actors.engines.sglang.triton_backend import SparseTritonAttnBackend
from compressors import CompressorConfig
from compressors.scores import _BLOCK_ELEMENTS

_spec = importlib.util.spec_from_file_location("bench_compressors",
                                               Path(__file__).parents[2] / "bench" / "compressors.py")
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
peak_bytes = _bench.allocator_peak_bytes   # the CPU allocator's peak while fn() runs (torch.profiler memory events)

pytestmark = pytest.mark.sglang


class Pool:
    """The two methods and the head count of SGLang's MHATokenToKVPool that the compression uses."""

    def __init__(self, k, v):
        self.k, self.v, self.head_num, self.start_layer = k, v, k[0].shape[1], 0

    def get_key_buffer(self, layer):
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


class Allocator:
    def __init__(self):
        self.freed = []

    def free(self, slots):
        self.freed.append(slots.clone())


def bare_backend(cfg, lens, kv_heads, q_heads, head_dim, dtype, layers=2, seed=0):
    """A SparseTritonAttnBackend without SGLang: request rows 1..len(lens) holding lens[i] tokens in consecutive
    slots of random K/V buffers [slots, kv_heads, head_dim] x layers, random query rings (none where the method
    reads no queries), every row due."""
    gen = torch.Generator().manual_seed(seed)
    b = SparseTritonAttnBackend.__new__(SparseTritonAttnBackend)
    rows, slots = len(lens) + 1, int(sum(lens)) + 1
    b.cfg, b._compressors, b.device, b.start_layer, b.num_layers = cfg, {}, "cpu", 0, layers
    b.kv_pool = Pool(*[[torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(layers)]
                       for _ in "kv"])
    b.num_head, b.head_dim, b.kv_dtype_bytes = q_heads, head_dim, torch.empty(0, dtype=dtype).element_size()
    b.req_to_token = torch.zeros(rows, max(lens) + 1, dtype=torch.int32)
    b.qwin = torch.randn(layers, rows, cfg.window, q_heads, head_dim, generator=gen).to(dtype) \
        if cfg.reads_queries else None                   # as the backend: no ring for streamingllm
    b.start_dev = torch.zeros(rows, dtype=torch.int64)
    b._init_mirror(rows)                                    # the backend's host mirror, every row empty
    b.allocator, b.event_bytes_cap, b.pending = Allocator(), 1 << 30, set(range(1, rows))
    b.stats = {k: 0 for k in ("freed_slots", "compressions", "compression_events", "compression_calls",
                              "compression_groups", "event_bytes_bound")}
    b.self_check, b.recorder = False, None
    b.protected = torch.zeros(rows, dtype=torch.float32) if cfg.protects else None   # as the backend's __init__
    b.protected_dir = None                                  # no PROTECTED_ENV: a parked row's share is not handed on
    first = 1
    for r, n in enumerate(lens, start=1):
        b.req_to_token[r, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    b.seq_len[1:] = lens
    return b


CASES = [  # method (or the compressor's fields), selection, rows, longest live, budget, window, KV heads, query heads,
    # head_dim, dtype
    ("rkv", "per_head", 1, 40, 16, 4, 2, 4, 16, torch.float32),
    ("rkv", "shared", 5, 200, 100, 16, 4, 4, 32, torch.float32),
    ("snapkv", "per_head", 3, 300, 64, 8, 2, 12, 64, torch.bfloat16),
    ("streamingllm", "per_head", 3, 300, 64, 8, 2, 12, 64, torch.bfloat16),
    ("rkv", "per_head", 48, 640, 512, 8, 2, 12, 128, torch.bfloat16),    # Qwen2.5-1.5B heads; 2 similarity blocks
    ("random", "per_head", 1, 40, 16, 4, 2, 4, 16, torch.float32),
    ("random", "per_head", 3, 300, 64, 8, 2, 12, 64, torch.bfloat16),
    ({"method": "rkv", "protect_prompt": "all"}, "per_head", 3, 300, 64, 8, 2, 12, 64, torch.bfloat16),
    ({"method": "streamingllm", "protect_values": 4}, "per_head", 3, 300, 64, 8, 2, 12, 64, torch.bfloat16),
    ({"method": "random", "protect_values": 4, "protect_prompt": "last:4", "sinks": 2}, "shared", 5, 200, 100, 16, 4,
     4, 32, torch.float32),
]


def case_id(case) -> str:
    fields = case[0] if isinstance(case[0], dict) else {"method": case[0]}
    return "-".join(str(v) for v in fields.values()) + f"-{case[1]}-g{case[2]}-n{case[3]}"


@pytest.mark.parametrize("record", [False, True], ids=["plain", "recording"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_one_call_stays_under_its_computed_bound(case, record, tmp_path):
    """With `record` the backend keeps eviction records (actors/engines/sglang/records.py; its persistent buffers are
    allocated before the call, as they are by the rows' prefill and an earlier compression); without, a compressor
    that reads true positions (random, protect_prompt) has the recorder's positions alone, as in the backend. Random
    and protection run with each row's prompt a third of it (protect_prompt: part of the candidates)."""
    from actors.engines.sglang.records import EvictionRecorder

    fields, selection, g, n, budget, w, hkv, hq, d, dtype = case
    fields = fields if isinstance(fields, dict) else {"method": fields}
    torch.set_num_threads(1)
    cfg = CompressorConfig(kv_budget=budget, window=w, interval=128, selection=selection, **fields)
    lens = np.random.RandomState(0).randint(budget + 1, n + 1, size=g)
    lens[0] = n
    b = bare_backend(cfg, lens, hkv, hq, d, dtype)
    rows = np.arange(1, g + 1)
    b.first_prompt[rows], b.seed[rows] = lens // 3, rows * 1000003
    if record or cfg.reads_positions:
        b.recorder = EvictionRecorder(b.num_layers, hkv, budget, "cpu", str(tmp_path) if record else None)
        b.recorder.enter(rows.tolist(), [f"r{r}" for r in rows], [budget] * g)
        b.recorder.fit(n)
    measured = peak_bytes(lambda: b._compress_group(rows, budget))
    bound = compression_event_bytes(g, n, budget, w, hq, hkv, d, b.kv_dtype_bytes, cfg.method, b.recorder is not None,
                                    cfg.protects, cfg.protect_values > 0)
    assert measured <= bound, f"measured {measured:,} B > bound {bound:,} B"
    assert (b.start[rows] == lens - budget).all()                      # it did compress every row


def test_an_event_over_the_cap_is_split_into_calls_under_it_with_the_same_result():
    cfg = CompressorConfig(method="rkv", kv_budget=64, window=8, interval=16)
    torch.set_num_threads(1)
    lens = np.random.RandomState(1).randint(65, 301, size=12)
    lens[5] = 300
    whole = bare_backend(cfg, lens, 2, 12, 64, torch.bfloat16)
    split = copy.deepcopy(whole)
    four = compression_event_bytes(4, 300, 64, 8, 12, 2, 64, 2, "rkv")
    split.event_bytes_cap = four                                         # 4 rows per call: 3 calls of 4 rows
    measured = peak_bytes(split.compress_pending)
    whole.compress_pending()
    assert (whole.stats["compression_calls"], split.stats["compression_calls"]) == (1, 3)
    assert split.stats["event_bytes_bound"] == four < whole.stats["event_bytes_bound"]
    evicted = int((lens - 64).sum())
    # the calls' slots freed so far, and their concatenation for the allocator, are held beside a call
    assert measured <= four + 2 * 8 * evicted, f"{measured:,} B"
    for name in ("req_to_token", "start_dev"):
        assert torch.equal(getattr(whole, name), getattr(split, name)), name
    for layer in range(whole.num_layers):
        assert torch.equal(whole.kv_pool.k[layer], split.kv_pool.k[layer])
        assert torch.equal(whole.kv_pool.v[layer], split.kv_pool.v[layer])
    assert torch.equal(whole.allocator.freed[0].sort().values, split.allocator.freed[0].sort().values)


def test_the_similarity_block_is_the_compressors():
    assert SIMILARITY_BLOCK == _BLOCK_ELEMENTS
