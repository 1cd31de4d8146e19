"""Eviction records from the `sparse_rl_kv` backend (actors/engines/sglang/records.py) on the CPU lane: on the greedy
cases where the backend is token-identical to TorchEngine (tests/sglang/test_sglang_triton.py, _phase.py), each
Sample's `eviction_steps` equals TorchEngine's (`record_evictions=True`), for R-KV, SnapKV, StreamingLLM and random,
R-KV with protect_prompt all (the 20-token prompts do not fit budget 16 with the window: the budget wins) and with
protect_values, per-head and shared selection, per-request budgets, rows joining mid-decode, and both
`compressor.phase` values; every decode step runs the self-check, so the record writes run under the backend's
host-sync guard (NoHostSync), and so does the compression's select (random's hash, the protection classes) wherever
the self-check runs it. Random's seeds: a seeded call (SEED), each request's the torch engine's row seed
(`actors.engines.base.compressor_seeds`, carried in the request id), per-request budgets in one batch per budget
with seed SEED + k, as TorchEngine.generate.

One difference is structural, not a tie: a compression due in the forward that produces a response's last token.
TorchEngine runs it and records its step, T - 1 for a T-token response; SGLang frees the request's row before the
compression would run (records.py). No query of the sample sees the difference (the last log-prob comes from the
query at P + T - 2, which sees a key while P + T - 2 < P + steps), so `canonical` sets steps >= T - 1 to never on
both sides before comparing; the same rule covers a SGLang row compared with a prefix of a longer TorchEngine row.
No other difference is allowed (no near-tie was needed: the records are equal entry for entry)."""
import dataclasses
import os

import numpy as np
import pytest
import torch

pytest.importorskip("sglang.srt", reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh")
from transformers import AutoTokenizer, Qwen2ForCausalLM

from actors.engines.base import SamplingParams, compressor_seeds
from actors.engines.sglang.engine import KV_STATS_ENV, SGLangEngine, sglang_request
from actors.engines.sglang.triton_backend import SELF_CHECK_ENV
from actors.engines.torch_engine import TorchEngine
from compressors import CompressorConfig
from tests.sglang.test_sglang_triton import KWARGS, PARAMS, PROMPTS
from tests.sglang.tiny import JOIN_MAX_NEW, join_prompts

pytestmark = pytest.mark.sglang
torch.set_num_threads(1)
NEVER = 65535
KV_HEADS = 2


def canonical(steps: np.ndarray, tokens: int, response_len: int) -> np.ndarray:
    """A record uint16 [layers, 1 or KV_HEADS, >= tokens] cut to `tokens` columns, heads broadcast to KV_HEADS, steps
    >= response_len - 1 set to never (module docstring: evicted after the last query that counts)."""
    s = np.broadcast_to(steps[:, :, :tokens], (steps.shape[0], KV_HEADS, tokens)).astype(np.int64)
    return np.where(s >= response_len - 1, NEVER, s)


def assert_records_equal(got: list, want: list, shapes: bool = True) -> dict:
    """Each SGLang (prompt ids, response ids, record) equals its TorchEngine Sample's record (`canonical`, over the
    SGLang row's tokens); with `shapes` (rows of equal length) the heads dimension is equal too. Returns counts:
    evicted entries compared, those at a decode step (> 0), and the TorchEngine entries at step T - 1 set to never."""
    seen = {"evicted": 0, "at_decode": 0, "last_step": 0}
    for i, ((prompt, response, rec), w) in enumerate(zip(got, want)):
        tokens, T = len(prompt) + len(response), len(response)
        assert response == w.response_ids[:T], f"row {i}: response ids differ"
        assert rec.dtype == np.uint16 and rec.shape[0] == w.eviction_steps.shape[0] and rec.shape[2] == tokens
        if shapes:
            assert rec.shape == w.eviction_steps.shape, (i, rec.shape, w.eviction_steps.shape)
        a, b = canonical(rec, tokens, T), canonical(w.eviction_steps, tokens, T)
        bad = np.argwhere(a != b)
        assert not len(bad), f"row {i}: {len(bad)} entries differ, first (layer, head, token) {bad[:5].tolist()}: " \
                             f"sglang {a[tuple(bad[0])]} torch {b[tuple(bad[0])]}"
        seen["evicted"] += int((a != NEVER).sum())
        seen["at_decode"] += int(((a != NEVER) & (a > 0)).sum())
        raw = np.broadcast_to(w.eviction_steps[:, :, :tokens], a.shape)
        seen["last_step"] += int(((raw != NEVER) & (raw >= T - 1)).sum())
    return seen


def test_recorder_follows_packed_suffixes_without_host_sync(tmp_path):
    """EvictionRecorder alone (no engine): two rows, budgets 4 and 6 (`origin` grows for the second), through a
    prefill compression and decode compressions with random kept sets per (layer, head), left-padded as the backend
    groups rows, against a list model of each (layer, head)'s live original tokens; the device half under
    NoHostSync; the record's width grows past its first step; `take` writes each row's record (uint16, never =
    65535) and gives the slot back; the last one's leaving gives the buffers back."""
    from actors.engines.sglang.records import EvictionRecorder, int16_bits
    from actors.engines.sglang.triton_backend import NoHostSync

    rng = np.random.default_rng(0)
    layers, rows, budgets = 2, [3, 5], {3: 4, 5: 6}
    rec = EvictionRecorder(layers, KV_HEADS, 4, "cpu", str(tmp_path))
    rec.enter([3], ["a"], [4])
    rec.enter([5], ["b"], [6])
    live = {(r, li, h): list(range(n)) for r, n in ((3, 7), (5, 9)) for li in range(layers) for h in range(KV_HEADS)}
    want = {r: np.full((layers, KV_HEADS, 1000), NEVER) for r in rows}
    length, start, steps = {3: 7, 5: 9}, {3: 0, 5: 0}, {3: 0, 5: 0}
    for _ in range(4):
        length_a = np.array([length[r] for r in rows])
        start_a = np.array([start[r] for r in rows])
        n = int((length_a - start_a).max())
        pos = length_a[:, None] - n + np.arange(n)[None, :]
        valid = pos >= start_a[:, None]
        rec.fit(int(length_a.max()))
        for i, r in enumerate(rows):                               # one group per budget, as the backend
            b = budgets[r]
            t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64))  # noqa: E731
            mapped, rel = EvictionRecorder.host_index(pos[i:i + 1], start_a[i:i + 1], b)
            keep = np.stack([np.sort(rng.choice(np.flatnonzero(valid[i]), b, replace=False))
                             for _ in range(KV_HEADS)])[None]      # [1, Hkv, b] positions kept
            with NoHostSync():
                for li in range(layers):
                    origin = rec.origins(li, t(rec.slots_of([r])), t(np.maximum(pos[i:i + 1], 0)), t(mapped).bool(),
                                         t(rel))
                    rec.record(li, t(rec.slots_of([r])), origin, t(valid[i:i + 1]).bool(), t(keep),
                               t(int16_bits([steps[r]])))
            for li in range(layers):
                for h in range(KV_HEADS):
                    kept_pos = set(pos[i, keep[0, h]].tolist())
                    tokens = live[(r, li, h)]
                    for p, tok in zip(range(start[r], length[r]), tokens):
                        if p not in kept_pos:
                            want[r][li, h, tok] = steps[r]
                    live[(r, li, h)] = [tok for p, tok in zip(range(start[r], length[r]), tokens) if p in kept_pos]
            start[r] = length[r] - b
        for r in rows:                                             # decode: 100 + r tokens appended, then due again
            for key in live:
                if key[0] == r:
                    live[key] += list(range(length[r], length[r] + 100 + r))
            length[r] += 100 + r
            steps[r] += 100 + r
    assert rec.width == 512 and rec.origin.shape[3] == 6             # grown: 2 x 256 columns, the larger budget
    for r in rows:
        rec.take(r, length[r])
        got = np.load(os.path.join(tmp_path, f"{'a' if r == 3 else 'b'}.npy"))
        assert got.dtype == np.uint16 and got.shape == (layers, KV_HEADS, length[r])
        assert np.array_equal(got, want[r][:, :, :length[r]]), r
        assert ((got > 0) & (got < NEVER)).any()
    assert not rec.slot and not rec.free and rec.bytes == 0 and rec.width == 0   # none live: buffers given back


def torch_engine(model_dir, cc):
    model = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    return TorchEngine(model, AutoTokenizer.from_pretrained(model_dir), cc, record_evictions=True)


def with_records(samples) -> list:
    return [(s.prompt_ids, s.response_ids, s.eviction_steps) for s in samples]


@pytest.fixture(scope="module", params=[
    CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8),
    CompressorConfig(method="snapkv", kv_budget=16, window=4, interval=8, selection="shared"),
    CompressorConfig(method="streamingllm", kv_budget=16, window=4, interval=8),
    CompressorConfig(method="random", kv_budget=16, window=4, interval=8),
    CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8, protect_prompt="all"),
    CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8, protect_values=3),
], ids=["rkv-per_head", "snapkv-shared", "streamingllm-per_head", "random-per_head", "rkv-protect_prompt_all",
        "rkv-protect_values_3"])
def recording(request, tiny_qwen2_dir, tmp_path_factory):
    """A recording `sparse_rl_kv` engine, every decode step through the self-check (NoHostSync)."""
    cc = request.param
    os.environ[KV_STATS_ENV] = str(tmp_path_factory.mktemp("kv") / "stats.json")
    os.environ[SELF_CHECK_ENV] = "1"
    eng = SGLangEngine(str(tiny_qwen2_dir), compressor_cfg=cc, timeout_s=600, record_evictions=True, **KWARGS)
    yield eng, cc
    eng.shutdown()
    os.environ.pop(KV_STATS_ENV, None)
    os.environ.pop(SELF_CHECK_ENV, None)


SEED = 7
"""SamplingParams.seed of the calls whose compressor reads seeds (random): greedy, so it changes no token."""


def seeded(params: SamplingParams, cc: CompressorConfig) -> SamplingParams:
    """`params` with seed SEED when `cc` reads sample seeds (method random), so both engines hash the same seeds."""
    return dataclasses.replace(params, seed=SEED) if cc.method == "random" else params


def test_records_equal_torch_engine(recording, tiny_qwen2_dir):
    eng, cc = recording
    params = seeded(PARAMS, cc)
    got = [g[0] for g in eng.generate(PROMPTS, params)]
    stats = eng.kv_pool_stats()
    assert stats["self_checks"] == stats["decode_steps"] > 0 and stats["record_bytes"] > 0
    assert (stats["query_ring_bytes"] > 0) == cc.reads_queries      # StreamingLLM and random: no query ring
    want = [g[0] for g in torch_engine(tiny_qwen2_dir, cc).generate(PROMPTS, params)]
    seen = assert_records_equal(with_records(got), want)
    shares = [(s.kv_protected_fraction, w.kv_protected_fraction) for s, w in zip(got, want)]
    print(f"{cc.method} protect_prompt={cc.protect_prompt} protect_values={cc.protect_values}: records equal, "
          f"{seen}, query ring {stats['query_ring_bytes']:,} B, protected shares (sglang, torch) {shares}")
    # the share protection held at each sample's last compression (kv/protected_fraction): the torch engine's,
    # 0 on both without protection
    assert [s for s, _ in shares] == pytest.approx([w for _, w in shares], abs=1e-6), shares
    assert all(w > 0 for _, w in shares) if cc.protects else all(s == w == 0 for s, w in shares), shares
    assert seen["evicted"] > 0 and seen["at_decode"] > 0, seen
    if cc.method == "random" or cc.protect_prompt != "off" or cc.protect_values:
        # the control: TorchEngine with another seed (random) or without the protection gives another record (or
        # other tokens), so the comparison sees the seeds and the protection
        plain = dataclasses.replace(cc, protect_prompt="off", protect_values=0)
        other = ([g[0] for g in torch_engine(tiny_qwen2_dir, cc).generate(PROMPTS, dataclasses.replace(
            params, seed=SEED + 1))] if cc.method == "random" else
                 [g[0] for g in torch_engine(tiny_qwen2_dir, plain).generate(PROMPTS, params)])
        with pytest.raises(AssertionError, match="differ"):
            assert_records_equal(with_records(got), other)
    heads = {s.eviction_steps.shape[1] for s in got}        # StreamingLLM keeps the same positions in every head
    assert heads == ({1} if cc.selection == "shared" or cc.method == "streamingllm" else {KV_HEADS}), heads
    assert not os.listdir(eng.records_dir)                          # read and deleted by generate


def test_records_under_per_request_budgets_equal_torch_engine(recording, tiny_qwen2_dir):
    eng, cc = recording
    budgets, params = [12, 20], seeded(PARAMS, cc)
    got = [g[0] for g in eng.generate(PROMPTS, params, kv_budgets=budgets)]
    want = [g[0] for g in torch_engine(tiny_qwen2_dir, cc).generate(PROMPTS, params, kv_budgets=budgets)]
    assert assert_records_equal(with_records(got), want)["at_decode"] > 0


def generate_each_recorded(eng, prompts, max_new, seeds=None) -> list:
    """Greedy (ignore_eos) in one SGLang call with one max_new_tokens per request (tests/sglang/tiny.py
    generate_each), each with its eviction record: [(prompt ids, response ids, record)]; `seeds`: each request's
    compressor seed (method random), or None."""
    request = sglang_request(SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True), [0] * len(prompts),
                             None, seeds)
    for sp, m in zip(request["sampling_params"], max_new):
        sp["max_new_tokens"] = m
    outs = eng._call(eng.engine.async_generate(input_ids=[list(p) for p in prompts], return_logprob=True,
                                               **request), "generate")
    return [(list(p), list(o["output_ids"]), eng._read_record(o["meta_info"]["id"], len(p) + len(o["output_ids"])))
            for p, o in zip(prompts, outs)]


def test_records_of_rows_joining_mid_decode_equal_torch_engine(recording, tiny_qwen2_dir):
    """The join batch (five prompts of unequal lengths, the fifth joining mid-decode, phase request): each SGLang
    row's record equals TorchEngine's, all five in one batch, over the SGLang row's tokens."""
    eng, cc = recording
    prompts = join_prompts()
    params = seeded(SamplingParams(temperature=0, max_new_tokens=max(JOIN_MAX_NEW), ignore_eos=True), cc)
    seeds = compressor_seeds(SEED, [cc.kv_budget] * len(prompts), 1, None) if cc.method == "random" else None
    got = generate_each_recorded(eng, prompts, JOIN_MAX_NEW, seeds)
    want = [g[0] for g in torch_engine(tiny_qwen2_dir, cc).generate(prompts, params)]
    seen = assert_records_equal(got, want, shapes=False)
    assert seen["at_decode"] > 0 and seen["last_step"] > 0, seen    # the shorter rows cut the torch rows' records
