"""An episode's compressed cache kept across its turns on SGLang (docs/sglang.md, "The compressed cache across turns on
SGLang"): SGLang's streaming session keeps each episode's request row between turns, a turn prefills only its new ids
(the last sampled token, the observation) at their true positions on that row, the observation is protected until the
turn's first compression event, and the episode's eviction record covers every turn.

Two lookup-shaped episodes of 8 turns on the lane's tiny Qwen2 (word ids: a 14-id question, then per turn a 10-id tool
answer with its boundary and header ids), greedy, R-KV per head at budgets 16 (the run's) and 20 (carried in each
turn's request id), window 4, interval 8, compressor.protect_observation on and off, and random with protect_prompt
last:6 and protect_values 2 (each turn seeded anew: the seed a continued row gets at its prefill), every decode step
through the backend's self-check (NoHostSync). Turns alternate 12 tokens (a compression at step 8, mid-turn) and 9 (the
compression due at step 8 = T - 1, in the turn's last forward, runs when the row parks). Against TorchEngine's kept
episodes on the same calls: the same token ids, logp_sparse (2e-5), kv_retained_tokens, protected shares (1e-6) and
eviction records, entry for entry, at every turn; the learner's replay of the SGLang episodes gives their logp_sparse
to 1e-4 (the same weights: max_staleness 0), a record one step late is seen; the pool's measured peak stays within
the preflight's per-episode bound (actors.engines.kv_memory.episode_kv_peak_bytes_per_sequence, bench/multiturn_kv.py's
shape), and closing the sessions gives every slot back."""
import copy
import dataclasses
import os
import types

import numpy as np
import pytest
import torch

pytest.importorskip("sglang.srt", reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh")
from transformers import AutoTokenizer, Qwen2ForCausalLM

from actors.engines.base import SamplingParams
from actors.engines.kv_memory import ModelShape, episode_kv_peak_bytes_per_sequence
from actors.engines.sglang.engine import KV_STATS_ENV, SGLangEngine
from actors.engines.sglang.triton_backend import SELF_CHECK_ENV
from actors.engines.torch_engine import TorchEngine
from broker.schema import SampleRecord, TrajectoryGroup, decode_group, encode_group
from compressors import CompressorConfig, SelectContext, build_compressor
from learner.config import LearnerConfig
from learner.learner import Learner
from tests.sglang.test_sglang_event_memory import bare_backend
from tests.sglang.test_sglang_triton import KWARGS

pytestmark = pytest.mark.sglang
torch.set_num_threads(1)
NEVER = 65535
PROMPT_LEN, OBS_LEN, EPISODES = 14, 10, 2
TURN_TOKENS = (12, 9, 12, 9, 12, 9, 12, 9)
"""Tokens sampled per turn (8 turns): 12 -> compressed at step 8 mid-turn; 9 -> the compression due at step 8 = T - 1
runs when the row parks (the torch engine runs it in the turn's last forward)."""
CFG = CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8)
UNPROTECTED = CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8, protect_observation=False)
RANDOM = CompressorConfig(method="random", kv_budget=16, window=4, interval=8, protect_prompt="last:6",
                          protect_values=2)
"""Random with the question's last 6 ids protected at every turn (positions [8, 14) of the episode's first prompt) and
the 2 largest value norms before the window (per layer and KV head) at every event: the window and those 8 leave
random 4 (budget 16) or 8 (budget 20) slots to choose, so one engine covers both."""
TURN_SEEDS = [7 + 3 * k for k in range(len(TURN_TOKENS))]
"""SamplingParams.seed of each turn under random (greedy: it changes no token, only the compressor's seeds): a new
one per turn, so a row that kept an earlier turn's seed would be seen. Each call's requests get the torch engine's
row seeds of that call (`compressor_seeds`: budget 16's batch seed, budget 20's seed + 1)."""
KEYS = [f"episode-{e}" for e in range(EPISODES)]
BUDGETS = [16, 20]
"""Each episode's KV budget (`kv_budgets`): the run's, and one carried in the request id of every turn."""


def lookup_episode(e: int) -> tuple[list[int], list[list[int]]]:
    """(question ids, the tool's answers after turns 1..7) of episode e, as word ids of the tiny tokenizer (w255 is
    EOS): each answer is boundary ids (251, 252), 'K = V; ...' entries (random ids), then header ids (253, 254)."""
    rng = np.random.default_rng(100 + e)
    prompt = [1, 2] + rng.integers(3, 250, PROMPT_LEN - 2).tolist()
    answers = [[251, 252] + rng.integers(3, 250, OBS_LEN - 4).tolist() + [253, 254] for _ in TURN_TOKENS[1:]]
    return prompt, answers


def play(engine, after_turn=None, seeds=None) -> list[list]:
    """The episodes through `engine`'s kept caches: per turn one call with every episode's new ids
    (`episodes=KEYS`), turn k with SamplingParams.seed `seeds[k]` (None: unseeded). Returns per turn the Samples of the
    episodes; `after_turn()` runs after each turn."""
    episodes = [lookup_episode(e) for e in range(EPISODES)]
    turns = []
    for k, tokens in enumerate(TURN_TOKENS):
        new = [prompt if k == 0 else answers[k - 1] for prompt, answers in episodes]
        params = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True,
                                seed=None if seeds is None else seeds[k])
        out = engine.generate(new, params, kv_budgets=BUDGETS, episodes=KEYS)
        turns.append([s for (s,) in out])
        if after_turn is not None:
            after_turn()
    return turns


@pytest.fixture(scope="module", params=[CFG, UNPROTECTED, RANDOM],
                ids=["protect_on", "protect_off", "random-protect_prompt_last6-protect_values_2"])
def played(request, tiny_qwen2_dir, tmp_path_factory):
    """(SGLang's turns, TorchEngine's turns, the pool's peak used slots after each turn, the probe's stats after the
    sessions were closed, the compressor config): R-KV with compressor.protect_observation on (the default) and off,
    random with protect_prompt last:6 and protect_values 2 (protect_observation on, each turn seeded: TURN_SEEDS)."""
    cfg = request.param
    seeds = TURN_SEEDS if cfg.method == "random" else None
    os.environ[KV_STATS_ENV] = str(tmp_path_factory.mktemp("kv") / "stats.json")
    os.environ[SELF_CHECK_ENV] = "1"
    eng = SGLangEngine(str(tiny_qwen2_dir), compressor_cfg=cfg, timeout_s=900, record_evictions=True, **KWARGS)
    try:
        peaks = []
        got = play(eng, lambda: peaks.append(eng.kv_pool_stats()["peak_used_slots"]), seeds)
        assert eng.release_episodes(KEYS) == EPISODES and not eng._sessions
        eng.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True))
        probe = eng.kv_pool_stats()
        assert not os.listdir(eng.records_dir)                      # every turn's record read and deleted
    finally:
        eng.shutdown()
        os.environ.pop(KV_STATS_ENV, None)
        os.environ.pop(SELF_CHECK_ENV, None)
    model = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
    ref = TorchEngine(model, AutoTokenizer.from_pretrained(tiny_qwen2_dir), cfg, record_evictions=True)
    want = play(ref, seeds=seeds)
    ref.release_episodes(KEYS)
    return got, want, peaks, probe, cfg


def heads(record: np.ndarray) -> np.ndarray:
    """A record uint16 [layers, 1 or 2, tokens] as int64 [layers, 2, tokens] (a collapsed head broadcast)."""
    return np.broadcast_to(record, (record.shape[0], 2, record.shape[2])).astype(np.int64)


def assert_turns_equal(got: list, want: list) -> None:
    """Every turn of both episodes: token ids, logp_sparse (2e-5), kv_retained_tokens, the whole episode's eviction
    record so far, entry for entry, and the turn's protected share at its last compression (`kv_protected_fraction`,
    1e-6) of SGLang's turns `got` equal TorchEngine's `want`."""
    for k, (g_turn, w_turn) in enumerate(zip(got, want)):
        for e, (g, w) in enumerate(zip(g_turn, w_turn)):
            assert g.response_ids == w.response_ids, f"turn {k} episode {e}: response ids differ"
            np.testing.assert_allclose(g.logp_sparse, w.logp_sparse, atol=2e-5, rtol=0, err_msg=f"turn {k} ep {e}")
            assert g.kv_retained_tokens == w.kv_retained_tokens, (k, e, g.kv_retained_tokens, w.kv_retained_tokens)
            a, b = heads(g.eviction_steps), heads(w.eviction_steps)
            assert a.shape == b.shape, (k, e, g.eviction_steps.shape, w.eviction_steps.shape)
            bad = np.argwhere(a != b)
            assert not len(bad), f"turn {k} episode {e}: {len(bad)} record entries differ, first (layer, head, " \
                                 f"token) {bad[:5].tolist()}: sglang {a[tuple(bad[0])]} torch {b[tuple(bad[0])]}"
            assert abs(g.kv_protected_fraction - w.kv_protected_fraction) <= 1e-6, \
                f"turn {k} episode {e}: protected shares differ: sglang {g.kv_protected_fraction} torch " \
                f"{w.kv_protected_fraction}"


def test_episodes_equal_the_torch_engines_turn_by_turn(played, tiny_qwen2_dir):
    """`assert_turns_equal` (no entry differs: the compression due in a turn's last forward runs when the row parks);
    the records hold what makes episodes differ from single turns: keys dropped at a later turn's prefill, keys
    evicted at decode steps, and no prefilled id of a turn evicted before its first compression event
    (compressor.protect_observation; without it, a prefilled id evicted at its own prefill). Random with
    protect_prompt and protect_values, the controls: TorchEngine's episodes with the first turn's seed at every turn (a
    row keeping its first seed), without protect_prompt, and without protect_values (each dropped on the torch side
    alone), differ."""
    got, want, _, _, cfg = played
    assert_turns_equal(got, want)
    shares = [s.kv_protected_fraction for turn in got for s in turn]
    assert all(x > 0 for x in shares) if cfg.protects else not any(shares), shares   # every turn compresses
    if cfg.method == "random":
        model = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
        for name, other, seeds in (("turn 0's seed at every turn", cfg, TURN_SEEDS[:1] * len(TURN_TOKENS)),
                                   ("protect_prompt off", dataclasses.replace(cfg, protect_prompt="off"), TURN_SEEDS),
                                   ("protect_values off", dataclasses.replace(cfg, protect_values=0), TURN_SEEDS)):
            ref = TorchEngine(model, AutoTokenizer.from_pretrained(tiny_qwen2_dir), other, record_evictions=True)
            with pytest.raises(AssertionError, match="differ|Not equal") as control:
                assert_turns_equal(got, play(ref, seeds=seeds))
            print(f"control ({name}): {' '.join(str(control.value).strip().splitlines()[:2])[:200]}")
    at_prefill = at_decode = unprotected = 0
    for e in range(EPISODES):
        record = heads(got[-1][e].eviction_steps)
        start = 0                                                    # episode index of the turn's first prefilled id
        for k, tokens in enumerate(TURN_TOKENS):
            prefilled = PROMPT_LEN if k == 0 else OBS_LEN + 1        # a later turn: the last sampled id + the answer
            first = start + prefilled                                # the turn's first sampled token's index
            if k:
                keys = record[:, :, start:first]
                if cfg.protect_observation:
                    assert (keys >= first - PROMPT_LEN + min(cfg.interval, tokens - 1)).all(), (e, k, keys.min())
                else:
                    unprotected += int((keys == first - PROMPT_LEN).sum())
                at_prefill += int((record[:, :, :start] == first - PROMPT_LEN).sum())
            at_decode += int(((record > first - PROMPT_LEN) & (record < first - PROMPT_LEN + tokens)).sum())
            start = first + tokens - 1
    assert at_prefill > 0 and at_decode > 0 and (unprotected > 0) != cfg.protect_observation, \
        (at_prefill, at_decode, unprotected)


def episode_record(e: int, turns: list) -> SampleRecord:
    """Episode e of SGLang's turns as the rollout actor publishes it (actors/envs/episode.py): response = every id
    after the question (sampled turns and answers), trainable 1 on sampled ids, logp_sparse 0 on the answers, the
    last turn's record (the whole episode)."""
    prompt, answers = lookup_episode(e)
    response, trainable, logp = [], [], []
    for k, s in enumerate(turns):
        if k:
            response += answers[k - 1]
            trainable += [0] * len(answers[k - 1])
            logp += [0.0] * len(answers[k - 1])
        response += s.response_ids
        trainable += [1] * len(s.response_ids)
        logp += s.logp_sparse.tolist()
    last = turns[-1]
    assert last.eviction_steps.shape[2] == len(prompt) + len(response)
    return SampleRecord(np.asarray(prompt, np.int32), np.asarray(response, np.int32), np.asarray(logp, np.float32),
                        "length", 0.0, last.kv_retained_tokens, last.kv_peak_bytes,
                        trainable=np.asarray(trainable, np.uint8), eviction_steps=last.eviction_steps)


def replay_gaps(model, groups) -> tuple[float, float]:
    """(max |replayed logp - logp_sparse|, max |dense logp - logp_sparse|) over the sampled tokens (one no-grad
    `_replay_forward` of the learner, learner.policy_target=sparse)."""
    learner = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, kl_coef=0.0, policy_target="sparse",
                                                          micro_batch_size=2))
    batch = learner.collate(groups)
    with torch.no_grad():
        r = learner._replay_forward(batch, torch.arange(batch.input_ids.shape[0]), grad=False)
    mask = batch.response_mask.bool()
    return (float((r["logp"] - batch.logp_sparse).abs()[mask].max()),
            float((r["logp_dense"] - batch.logp_sparse).abs()[mask].max()))


def test_replay_of_sglang_episodes_equals_logp_sparse(played, tiny_qwen2_dir):
    """The SGLang episodes through the wire into the learner's replay (the same weights): every sampled token of
    every turn to 1e-4 while the dense recompute differs by > 1e-2; the control, one layer's record one step late,
    is seen (> 1e-4)."""
    got, _, _, _, cfg = played
    samples = [episode_record(e, [turn[e] for turn in got]) for e in range(EPISODES)]
    group = decode_group(encode_group(TrajectoryGroup(run_id="r", group_id="g0", prompt_id="p0", weight_version=0,
                                                      temperature=1.0, compressor=cfg.method, kv_budget=cfg.kv_budget,
                                                      samples=samples)))
    model = Qwen2ForCausalLM.from_pretrained(tiny_qwen2_dir).eval()
    replayed, dense = replay_gaps(model, [group])
    assert replayed <= 1e-4 and dense > 1e-2, (replayed, dense)
    late = copy.deepcopy(group)
    for s in late.samples:
        s.eviction_steps = s.eviction_steps.copy()
        s.eviction_steps[1] = np.where(s.eviction_steps[1] == NEVER, NEVER, s.eviction_steps[1] + 1)
    assert replay_gaps(model, [late])[0] > 1e-4


def test_peak_pool_slots_stay_within_the_per_episode_bound(played):
    """The pool's measured peak (used slots, both episodes, over all 8 turns) stays within the two episodes' bounds,
    kv_budget + interval + the longest prefill (the last sampled id + an answer) + 1 (the next token's slot) slots
    each, and so within the preflight's per-episode bytes (`episode_kv_peak_bytes_per_sequence`), while a dense
    episode ends several times larger; closing the sessions gives every slot back (the next request's prefill finds
    only its own 5 slots in use)."""
    _, _, peaks, probe, cfg = played
    longest = OBS_LEN + 1
    slots = [b + cfg.interval + longest + 1 for b in BUDGETS]
    shape = ModelShape(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)
    total = sum(TURN_TOKENS) + OBS_LEN * (len(TURN_TOKENS) - 1)
    per_episode = [episode_kv_peak_bytes_per_sequence(shape, PROMPT_LEN, max(TURN_TOKENS), total, longest, b,
                                                      cfg.interval, compress=True) for b in BUDGETS]
    assert max(peaks) <= sum(slots), (peaks, slots)
    assert max(peaks) * shape.bytes_per_token <= sum(per_episode), (peaks, per_episode)
    assert PROMPT_LEN + total > 3 * max(slots)                         # a dense episode: the whole episode's tokens
    assert probe["used_at_last_extend"] == 5, probe


@pytest.mark.parametrize("protect", [True, False], ids=["protected", "unprotected"])
def test_a_later_turns_prefill_compresses_the_kept_cache_only(protect):
    """A bare backend (no SGLang engine, tests/sglang/test_sglang_event_memory.py): a parked episode row holding 14
    tokens continues with 6 prefilled ids at positions [14, 20) (`_continue_rows`), budget 6. With
    protect_observation the kept cache alone is compressed: the 6 keys the compressor picks among positions [0, 14)
    (scored with the last 4 queries) are packed into [8, 14), the new ids stay in their slots at [14, 20), 8 slots are
    freed, the row's start is 8 and it holds 12 slots (`session_held_slots`). Without it the whole row is compressed
    to 6 (start 14). Then `park` runs a compression due in a turn's last forward at once."""
    cfg = CompressorConfig(method="rkv", kv_budget=6, window=4, interval=8, protect_observation=protect)
    b = bare_backend(cfg, [28], kv_heads=2, q_heads=4, head_dim=16, dtype=torch.float32)   # slots 1..28 at 0..27
    b.pending.clear()
    row = np.array([1])
    b.alive[1], b.parked[1], b.seq_len[1], b.first_prompt[1] = True, True, 14, 5
    end = 14 if protect else 20
    ks = [b.kv_pool.get_key_buffer(li)[1:end + 1].transpose(0, 1)[None].clone() for li in range(2)]   # [1, Hkv, n, D]
    vs = [b.kv_pool.get_value_buffer(li)[1:end + 1].transpose(0, 1)[None].clone() for li in range(2)]
    queries = [b.qwin[li][1][torch.arange(16, 20) % 4].transpose(0, 1)[None] for li in range(2)]
    select = build_compressor(cfg).select
    keep = [select(ks[li], queries[li], torch.ones(1, end, dtype=torch.bool), SelectContext(values=vs[li], layer=li))
            for li in range(2)]
    b._continue_rows(row, np.array([14]), np.array([6]), ["turn-2"], np.array([6]))
    assert not b.parked[1] and b.seq_len[1] == 20 and b.steps[1] == 0 and b.pending == {1}
    b.compress_pending()
    new_start = end - 6
    assert b.start[1] == new_start and b.kept[1] == 6 and b.candidates_end[1] == 0 and not b.pending
    assert b.req_to_token[1, :new_start].eq(0).all()
    assert b.req_to_token[1, end:20].tolist() == list(range(end + 1, 21))               # the new ids stay put
    assert sorted(torch.cat(b.allocator.freed).tolist()) == sorted(
        set(range(1, end + 1)) - set(b.req_to_token[1, new_start:end].tolist()))
    for li in range(2):
        slots = b.req_to_token[1, new_start:end].long()
        kept_k = b.kv_pool.get_key_buffer(li)[slots].transpose(0, 1)                    # [Hkv, 6, D]
        want = torch.gather(ks[li][0], 1, keep[li][0][..., None].expand(-1, -1, 16))
        assert torch.equal(kept_k, want), li
    kv = types.SimpleNamespace(kv_allocated_len=20, req_pool_idx=1, cache_protected_len=0)
    assert b.session_held_slots(kv) == 20 - new_start
    b.seq_len[1], b.steps[1] = 28, 8                                                    # 8 decode steps later
    b.pending.add(1)
    b.park(1, "turn-2", finished=True)                                                  # due in the last forward
    assert b.parked[1] and b.start[1] == 22 and not b.pending
