"""The SGLang sparse backend's eviction-record buffers (actors/engines/sglang/records.py, `EvictionRecorder`; plain
torch, no SGLang) grow with the requests live at once and the longest one compressed, and are given back when no
request is live (the end of a generate call): a long request does not hold its width into the next call."""
from __future__ import annotations

import os

import numpy as np

from actors.engines.sglang.records import EvictionRecorder

LAYERS, KV_HEADS, BUDGET = 2, 2, 4


def test_record_buffers_grow_while_requests_live_and_are_given_back_when_none_is(tmp_path):
    rec = EvictionRecorder(LAYERS, KV_HEADS, BUDGET, "cpu", str(tmp_path))
    empty = rec.bytes
    rec.enter([3, 5], ["a", "b"], [BUDGET, BUDGET])
    rec.fit(600)                                                     # a long request: 3 x 256 columns
    long = 2 * LAYERS * KV_HEADS * (4 * BUDGET + 2 * (768 + 1))      # kv_memory.record_bytes_per_request x 2
    assert rec.width == 768 and rec.bytes == long
    rec.take(3, 600)
    assert rec.bytes == long and rec.width == 768                    # one request still live: nothing moves
    rec.take(5, 600)
    assert rec.bytes == empty and rec.width == 0 and not rec.slot and not rec.free   # none live: given back
    rec.enter([7], ["c"], [BUDGET])                                  # the next call: one short request
    rec.fit(10)
    assert rec.width == 256 and rec.bytes == LAYERS * KV_HEADS * (4 * BUDGET + 2 * (256 + 1))
    rec.take(7, 10)
    got = np.load(os.path.join(tmp_path, "c.npy"))
    assert got.shape == (LAYERS, KV_HEADS, 10) and (got == 65535).all()   # never evicted: nothing recorded
    assert np.load(os.path.join(tmp_path, "a.npy")).shape == (LAYERS, KV_HEADS, 600)


def test_an_episodes_record_spans_its_turns(tmp_path):
    """An episode's row (docs/sglang.md, "The compressed cache across turns"): `snapshot` writes the record so far as
    the finished turn's request's and keeps the slot, `resume` carries it to the next turn's request id, a compression
    in that turn adds to the same record, and `drop` (the session closed) gives the slot and the buffers back without
    a file. Hand-made compressions: 8 tokens, positions 2 and 5 evicted at step 3 in turn 1; after 6 more tokens,
    the packed 7 and the appended 8, 9, 11, 12, 13 evicted at step 11 in turn 2."""
    import torch

    rec = EvictionRecorder(1, 1, BUDGET, "cpu", str(tmp_path))
    rec.enter([4], ["turn-1"], [BUDGET])
    t = lambda a, dtype=torch.int64: torch.tensor(a, dtype=dtype)      # noqa: E731
    rec.fit(8)
    slot = t(rec.slots_of(np.array([4])))
    pos = np.arange(2, 8)[None]                                       # live [2, 8): 6 candidates -> keep 4
    mapped, rel = EvictionRecorder.host_index(pos, np.array([2]), 0)
    origin = rec.origins(0, slot, t(pos), t(mapped, torch.bool), t(rel))
    rec.record(0, slot, origin, t(np.ones((1, 6)), torch.bool), t([[[1, 2, 4, 5]]]), t([3]))   # keeps 3, 4, 6, 7
    rec.snapshot(4, 8, "turn-1")
    first = np.load(os.path.join(tmp_path, "turn-1.npy"))
    assert first[0, 0].tolist() == [65535, 65535, 3, 65535, 65535, 3, 65535, 65535] and 4 in rec.slot
    rec.resume([4], ["turn-2"])
    rec.fit(14)
    pos = np.arange(4, 14)[None]                                      # start 4: packed 3, 4, 6, 7 at [4, 8)
    mapped, rel = EvictionRecorder.host_index(pos, np.array([4]), BUDGET)
    origin = rec.origins(0, slot, t(pos), t(mapped, torch.bool), t(rel))
    assert origin[0, 0].tolist() == [3, 4, 6, 7, 8, 9, 10, 11, 12, 13]
    keep = t([[[0, 1, 2, 6]]])                                        # 3, 4, 6, 10 kept; 7, 8, 9, 11, 12, 13 go
    rec.record(0, slot, origin, t(np.ones((1, 10)), torch.bool), keep, t([11]))
    rec.snapshot(4, 14, "turn-2")
    second = np.load(os.path.join(tmp_path, "turn-2.npy"))[0, 0].tolist()
    assert second == [65535, 65535, 3, 65535, 65535, 3, 65535, 11, 11, 11, 65535, 11, 11, 11]
    rec.resume([4], ["turn-3"])                                       # a third turn's request, then the close
    rec.drop(4)
    assert sorted(os.listdir(tmp_path)) == ["turn-1.npy", "turn-2.npy"] and not rec.slot and rec.width == 0


def test_positions_only_recorder_keeps_the_origin_map_and_writes_nothing(tmp_path):
    """directory None (a compressor that reads true positions, recording nothing): `record` keeps the kept keys'
    original indices in `origin`, `fit` adds no step columns, `take` writes no file; its bytes are
    kv_memory.record_bytes_per_request with tokens 0."""
    import torch

    from actors.engines.kv_memory import record_bytes_per_request

    rec = EvictionRecorder(LAYERS, KV_HEADS, BUDGET, "cpu", None)
    rec.enter([3], ["a"], [BUDGET])
    rec.fit(600)
    assert rec.width == 0 and rec.bytes == record_bytes_per_request(LAYERS, KV_HEADS, BUDGET, 0)
    pos = torch.arange(8)[None]                                                  # one row, 8 live keys
    slots = torch.tensor(rec.slots_of([3]))
    keep = torch.tensor([[[1, 2, 5, 7], [0, 3, 4, 6]]])                          # [1, Hkv, B] per head
    for li in range(LAYERS):
        origin = rec.origins(li, slots, pos, torch.zeros(1, 8, dtype=torch.bool), torch.zeros(1, 8, dtype=torch.long))
        rec.record(li, slots, origin, torch.ones(1, 8, dtype=torch.bool), keep, torch.zeros(1, dtype=torch.long))
    mapped, rel = EvictionRecorder.host_index(np.arange(4, 12)[None], np.array([4]), BUDGET)   # packed at [4, 8)
    again = rec.origins(1, slots, torch.arange(4, 12)[None], torch.from_numpy(mapped), torch.from_numpy(rel))
    assert again[0].tolist() == [[1, 2, 5, 7, 8, 9, 10, 11], [0, 3, 4, 6, 8, 9, 10, 11]]   # true positions per head
    rec.take(3, 600)
    assert not os.listdir(tmp_path) and rec.bytes == 0                          # none live: given back


def test_compressor_seeds_are_the_torch_engines_row_seeds():
    """actors.engines.base.compressor_seeds (the SGLang engine's request seeds) = the seeds TorchEngine gives the same
    rows (`_row_seeds` per batch; one batch per distinct budget, ascending, batch k of several at seed + k)."""
    from actors.engines.base import compressor_seeds, row_seeds

    assert row_seeds(5, 3) == [5 * 1000003, 5 * 1000003 + 1, 5 * 1000003 + 2]
    assert row_seeds(2**62, 1) == [(2**62 * 1000003) % 2**63]
    budgets, n = [20, 12, 20], 2
    # budget 12 (k = 0): prompt 1's two rows; budget 20 (k = 1): prompts 0 and 2, four rows, in prompt order
    want = [*row_seeds(8, 4)[:2], *row_seeds(7, 2), *row_seeds(8, 4)[2:]]
    assert compressor_seeds(7, budgets, n, None) == want
    assert compressor_seeds(7, [16, 16], 1, None) == row_seeds(7, 2)          # one budget: the seed itself
    draws = iter([100, 200])
    assert compressor_seeds(None, budgets, n, lambda: next(draws))[2:4] == row_seeds(100, 2)
