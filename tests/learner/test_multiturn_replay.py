"""Eviction replay of multi-turn episodes (docs/SPEC.md §2.4): the torch engine keeps each episode's compressed cache
across turns and its record covers the whole episode (observations included, actors/envs/episode.py). Through the wire
format and the learner's collate and replayed forward (learner.policy_target=sparse) the log-probs of every
sampled token of every turn equal the engine's logp_sparse (fp32, to 1e-4), and records broken the ways a
multi-turn re-basing could break them are seen. The shipped tiny Llama in fp32; a real environment (LedgerEnv,
below) that answers every turn, so each episode runs 4 turns over a budget it exceeds several times."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engines.base import SamplingParams
from actors.engines.torch_engine import TorchEngine
from actors.envs.env import EnvConfig, EnvPool
from actors.envs.episode import run_episodes
from actors.envs.turns import ChatTemplate
from actors.tasks.data import Prompt
from broker.schema import SampleRecord, TrajectoryGroup, decode_group, encode_group
from compressors import CompressorConfig
from deploy.model_cache import TINY_LLAMA, resolve_model
from learner.config import LearnerConfig
from learner.learner import Learner
from learner.replay import EVICTION_NEVER
from tests.actors.engines.kept_caches import held_episodes

TURNS, BUDGET, INTERVAL = 4, 16, 5
ITEMS = [Prompt("p0", "alpha", "1"), Prompt("p1", "beta gamma", "2")]


class LedgerEnv:
    """Answers every turn with two entries of a ledger ("K4 = 38; K5 = 45") as a tool message, never done: an
    episode runs until actors.env.max_turns."""

    def reset(self, item):
        self.turn = 0
        return [{"role": "user", "content": f"Read the ledger {item.question} entry by entry."}]

    def step(self, action):
        self.turn += 1
        t = 2 * self.turn
        entries = f"K{t} = {10 + 7 * t}; K{t + 1} = {17 + 7 * t}"
        return [{"role": "tool", "content": entries}], 0.0, False, {"tool_call": True}


@pytest.fixture(scope="module")
def tiny_llama():
    path = resolve_model(TINY_LLAMA)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def episode_groups(model, tok, method: str, selection: str = "per_head",
                   kv_dtype: str = "model") -> list[TrajectoryGroup]:
    """2 items x 2 episodes of LedgerEnv through the torch engine's kept caches (kv_budget 16; episodes of ~150
    tokens), as the rollout actor publishes them (SampleRecord with trainable, eviction_steps and rounding_hints, the
    cache's kv_quant), off the wire; `kv_dtype`: compressor.kv_dtype (per token and KV head scales)."""
    cfg = CompressorConfig(method=method, kv_budget=BUDGET, window=4, interval=INTERVAL, selection=selection,
                           kv_dtype=kv_dtype)
    engine = TorchEngine(model, tok, cfg, record_evictions=True)
    pool = EnvPool(EnvConfig(factory=f"{__name__}:LedgerEnv", step_timeout_s=0, max_turns=TURNS,
                             max_total_tokens=200, max_obs_tokens=16))
    try:
        batch = run_episodes(engine.generate, pool, ChatTemplate.build(tok), ITEMS,
                             SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=11, ignore_eos=True),
                             release=engine.release_episodes)
    finally:
        pool.shutdown()
    assert held_episodes(engine) == [] and all(s.turns == TURNS for samples in batch for s in samples)
    groups = []
    for i, samples in enumerate(batch):
        records = [SampleRecord(np.asarray(s.prompt_ids, np.int32), np.asarray(s.response_ids, np.int32),
                                s.logp_sparse, s.finish_reason, s.reward, s.kv_retained_tokens, s.kv_peak_bytes,
                                trainable=s.trainable, eviction_steps=s.eviction_steps,
                                rounding_hints=s.rounding_hints) for s in samples]
        group = TrajectoryGroup(run_id="r", group_id=f"g{i}", prompt_id=f"p{i}", weight_version=0, temperature=1.0,
                                compressor=method, kv_budget=BUDGET, samples=records, kv_quant=cfg.kv_quant().name)
        groups.append(decode_group(encode_group(group)))
    return groups


def prefills(trainable: np.ndarray) -> list[tuple[int, int]]:
    """(first, a) per turn after the first, response indices: the turn prefilled ids [first, a) (its previous
    turn's last sampled id, the template boundary, the observation, the next assistant header) and sampled from
    a on. trainable uint8 [T]: its runs of 1 are the sampled turns."""
    t = np.concatenate([[0], np.asarray(trainable, dtype=np.int8), [0]])
    starts, ends = np.flatnonzero(np.diff(t) == 1), np.flatnonzero(np.diff(t) == -1)
    return [(int(end) - 1, int(a)) for end, a in zip(ends, starts[1:])]


def replayed(learner, groups) -> tuple:
    """The learner's replayed and dense log-probs, logp_sparse and the trainable mask of the collated groups,
    [S, T] each (one no-grad _replay_forward, the path of logp_old)."""
    batch = learner.collate(groups)
    with torch.no_grad():
        r = learner._replay_forward(batch, torch.arange(batch.input_ids.shape[0]), grad=False)
    return r["logp"], r["logp_dense"], batch.logp_sparse, batch.response_mask


def gap(a, b, mask) -> float:
    return float((a - b).abs()[mask].max())


def learner_of(model, **overrides) -> Learner:
    return Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, kl_coef=0.0, policy_target="sparse",
                                                       micro_batch_size=4, **overrides))


@pytest.mark.parametrize("method,selection", [("rkv", "per_head"), ("snapkv", "per_head"), ("rkv", "shared")])
def test_replay_of_multi_turn_episodes_equals_logp_sparse(tiny_llama, method, selection):
    """Every sampled token of every turn: replayed logp = logp_sparse to 1e-4, dense differs by > 1e-2; the
    records hold what makes episodes differ from single turns (keys dropped at a later turn's prefill,
    observation keys evicted, none before its turn's interval-th token); a record with the observation keys'
    evictions one token early, with the prefill's evictions hidden from the prefill's own queries, or with the
    protection ignored (the observation evicted at its turn's first sampled id) is seen (> 1e-4)."""
    model, tok = tiny_llama
    groups = episode_groups(model, tok, method, selection)
    learner = learner_of(model)
    logp, dense, sparse, mask = replayed(learner, groups)
    print(f"{method}/{selection}: replay {gap(logp, sparse, mask):.2e}, dense {gap(dense, sparse, mask):.2e}")
    assert gap(logp, sparse, mask) <= 1e-4
    assert gap(dense, sparse, mask) > 1e-2, "nothing evicted mattered: the check would not see a wrong record"
    check_cross_turn_evictions(groups, selection)
    for name, edit in BROKEN.items():
        bad = copy.deepcopy(groups)
        for g in bad:
            for s in g.samples:
                s.eviction_steps = edit(s.eviction_steps.copy(), len(s.prompt_ids), s.trainable)
        got, _, _, _ = replayed(learner, bad)
        print(f"  broken record ({name}): replay {gap(got, sparse, mask):.2e}")
        assert gap(got, sparse, mask) > 1e-4, name


def check_cross_turn_evictions(groups, selection):
    at_prefill = obs_evicted = 0
    for s in (s for g in groups for s in g.samples):
        rec, P = s.eviction_steps.astype(np.int64), len(s.prompt_ids)
        assert rec.shape[1] == (1 if selection == "shared" else 2) and rec.shape[2] == P + len(s.response_ids)
        turns = prefills(s.trainable)
        assert len(turns) == TURNS - 1
        for first, a in turns:
            obs = slice(P + first, P + a)
            assert (rec[:, :, obs] >= a + INTERVAL).all()       # protected until the turn's interval-th token
            at_prefill += int((rec[:, :, :P + first] == a).sum())
            obs_evicted += int((rec[:, :, obs] != EVICTION_NEVER).sum())
    assert at_prefill > 0 and obs_evicted > 0, (at_prefill, obs_evicted)


def _obs_early(rec, P, trainable):
    """Every evicted key of an environment/template token: one token earlier."""
    env = np.concatenate([np.zeros(P, bool), np.asarray(trainable) == 0])
    hit = env[None, None, :] & (rec != EVICTION_NEVER)
    rec[hit] -= 1
    return rec


def _prefill_hidden(rec, P, trainable):
    """Keys dropped at a turn's prefill marked as dropped before it (at its last sampled id's index): the
    observation's queries lose what they saw."""
    for first, a in prefills(trainable):
        rec[rec == a] = first
    return rec


def _unprotected(rec, P, trainable):
    """The prefilled ids evicted at the turn's interval-th token marked as evicted at its first sampled id."""
    for first, a in prefills(trainable):
        block = rec[:, :, P + first:P + a]
        block[block == a + INTERVAL] = a
    return rec


BROKEN = {"observation keys one token early": _obs_early, "prefill evictions hidden from the prefill": _prefill_hidden,
          "protection ignored": _unprotected}


def test_a_replaying_step_on_multi_turn_episodes_is_exact(tiny_llama):
    """learner.step on the episodes (policy_target=sparse): replay_logp_max_abs <= 1e-4 from both forwards
    (logp_old and the differentiated one), over the trainable tokens only, and the dense gap > 1e-2."""
    model, tok = tiny_llama
    m = learner_of(model).step(episode_groups(model, tok, "rkv"), [0, 0])
    print({k: m[k] for k in ("replay_logp_old_max_abs", "replay_logp_train_max_abs", "replay_dense_gap_max")})
    assert m["replay_logp_max_abs"] <= 1e-4 and m["replay_logp_train_max_abs"] <= 1e-4
    assert m["replay_dense_gap_max"] > 1e-2


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int4"])
def test_replay_of_quantized_multi_turn_episodes_equals_logp_sparse(kv_dtype):
    """A quantized kept cache across turns (compressor.kv_dtype; docs/kv_cache.md "Quantized KV"): the episode's
    stored codes are reloaded at each turn's prefill and the learner replays the quantize-dequantize along the whole
    episode's record. fp64 model, so that the engine's and the learner's K/V round to the same codes (at fp32 a
    value within rounding of a code boundary can flip: tests/learner/test_replay_kv_quant.py): every sampled token
    of every turn replays logp_sparse to 1e-6; the same replay without the qdq is off by more than 1e-3 (measured
    6.1e-3 fp8_e4m3, 1.8e-2 int4), and the dense forward by more than 1e-2."""
    path = resolve_model(TINY_LLAMA)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    groups = episode_groups(model, AutoTokenizer.from_pretrained(path), "rkv", kv_dtype=kv_dtype)
    learner = learner_of(model)
    batch = learner.collate(groups)
    assert batch.kv_quant == f"{kv_dtype}/token_head"
    rows = torch.arange(batch.size)
    with torch.no_grad():
        got = {quant: learner._at_response(learner.log_probs(learner.engine, batch, rows, replay=True, quant=quant),
                                           batch, rows) for quant in (True, False)}
    logp, dense, sparse, mask = replayed(learner, groups)
    print(f"{kv_dtype}: replay {gap(got[True], sparse, mask):.2e}, without qdq {gap(got[False], sparse, mask):.2e}, "
          f"dense {gap(dense, sparse, mask):.2e}")
    assert gap(got[True], sparse, mask) <= 1e-6 and gap(logp, sparse, mask) <= 1e-6
    assert gap(got[False], sparse, mask) > 1e-3, "the quantization did not matter: a missing qdq would not be seen"
    assert gap(dense, sparse, mask) > 1e-2


def test_fp32_quantized_multi_turn_episodes_replay_with_every_turns_rounding_hints():
    """fp32 model, a bf16 kept cache across 4 turns: the episode's sample carries the rounding hints of every turn's
    writes (the earlier turns' kept with the cache and re-based, as its eviction record: docs/kv_cache.md "Rounding
    hints"), over its whole token range, first prompt and every later turn; with them the replay of every sampled
    token of every turn equals logp_sparse to 2e-5 (no code flips; fp32 rounding of the logits only)."""
    from compressors.kv_quant import unpack_hints

    path = resolve_model(TINY_LLAMA)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    groups = episode_groups(model, AutoTokenizer.from_pretrained(path), "rkv", kv_dtype="bf16")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for s in (s for g in groups for s in g.samples):
        tokens = len(s.prompt_ids) + len(s.response_ids)
        index, _ = unpack_hints(torch.from_numpy(s.rounding_hints))
        hinted = set(((index // head_dim) % tokens).tolist())               # token index of each hint
        turns = [(0, len(s.prompt_ids))] + [(len(s.prompt_ids) + a, len(s.prompt_ids) + b) for a, b in
                                             prefills(s.trainable)]
        assert all(any(a <= t < b for t in hinted) for a, b in turns), "a turn's writes carry no hint"
    learner = learner_of(model)
    logp, _, sparse, mask = replayed(learner, groups)
    print(f"bf16 fp32 episodes: replay {gap(logp, sparse, mask):.2e}")
    assert gap(logp, sparse, mask) <= 2e-5
