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
