"""An episode's KV cache kept across turns in the torch engine (docs/SPEC.md §2.4): a turn prefills only the ids since
the episode's last sampled token into the kept cache (compressed or dense) at their true positions. Checked against a
teacher-forced forward over the whole episode that hides exactly the keys the episode's eviction record says were
evicted (test_torch_engine.py's reference, extended to episodes), the observation's protection, the peak-KV bound
over turns (measured bytes), dense continuation against the re-prefill, and release."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engines.base import SamplingParams
from actors.engines.kv_memory import ModelShape, episode_kv_peak_bytes_per_sequence
from actors.engines.torch_engine import TorchEngine
from actors.envs.env import EnvConfig, EnvPool
from actors.envs.episode import run_episodes
from actors.envs.turns import ChatTemplate
from actors.tasks.data import Prompt
from compressors import CompressorConfig
from deploy.model_cache import TINY_LLAMA, resolve_model
from test_torch_engine import VOCAB, tiny_model, tiny_tokenizer
from tests.actors.engines.kept_caches import held_episodes

NEVER = np.iinfo(np.uint16).max


def play(engine, prompt, observations, params, key="ep"):
    """One episode through the engine's continuation: the prompt, then one turn after each observation (ids).
    Returns (prompt_len, response ids, [(response index of the turn's first sampled id, prefilled ids, Sample)])."""
    response, turns = [], []
    for k, new in enumerate([prompt] + observations):
        if k:
            response += new
        (s,), = engine.generate([new], params, episodes=[key])
        prefilled = len(new) + (1 if k else 0)                       # the last sampled id goes in with them
        turns.append((len(response), prefilled, s))
        response += s.response_ids
    return len(prompt), response, turns


def episode_masks(record: np.ndarray, prompt_len: int, length: int, kv_heads: int = 2) -> list[torch.Tensor]:
    """Per layer [1, Hkv, L, L] bool from an episode's eviction_steps uint16 [layers, heads 1 or Hkv, L]: query q
    sees key k iff k <= q and q < prompt_len + steps[k] (never: 65535), or k == q (learner/replay.py's rule)."""
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    steps = torch.from_numpy(record.astype(np.int64))
    evicted = torch.where(steps == NEVER, torch.iinfo(torch.long).max, steps + prompt_len)     # [layers, H, L]
    evicted = evicted.expand(evicted.shape[0], kv_heads, length)
    return [(((k <= q)[None] & (q[None] < e[:, None, :])) | (k == q)[None])[None] for e in evicted]


def teacher_forced(model, ids: list[int], prompt_len: int, masks=None) -> torch.Tensor:
    """float64 [T, vocab] log_softmax of a forward over the whole episode at the positions predicting its response;
    `masks`: the per-layer visibility (None: dense)."""
    model.set_attn_implementation("evicted_mask_reference")
    if masks is None:
        L = len(ids)
        masks = ([torch.ones(1, model.config.num_key_value_heads, L, L, dtype=torch.bool).tril()]
                 * len(model.model.layers))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), layer_masks=masks).logits[0].double()
    model.set_attn_implementation("sdpa")
    return logits.log_softmax(-1)[prompt_len - 1:-1]


def sampled_logp(turns) -> tuple[np.ndarray, np.ndarray]:
    """(response indices of the sampled ids, their logp_sparse float64), over every turn."""
    index = np.concatenate([np.arange(a, a + len(s.response_ids)) for a, _, s in turns])
    return index, np.concatenate([s.logp_sparse for _, _, s in turns]).astype(np.float64)


OBS = [[int(x) for x in torch.randint(1, VOCAB, (9,), generator=torch.Generator().manual_seed(k))] for k in range(4)]
PROMPT = [100, 3, 44, 21, 19, 18, 60, 61, 62, 63, 64, 65, 66, 67]


@pytest.mark.parametrize("method,selection", [("rkv", "per_head"), ("h2o", "per_head"), ("snapkv", "per_head"),
                                              ("rkv", "shared"), ("random", "per_head")])
def test_log_probs_across_turns_equal_a_forward_that_hides_the_evicted_keys(method, selection):
    """4 turns, budget 12 < the episode: every generated token's logp_sparse equals a teacher-forced forward over
    the whole episode under its eviction record (fp64, to 1e-5), the dense forward differs (eviction mattered), a
    turn's prefill compresses the older cache (some keys evicted at a turn's first sampled id), and no prefilled
    id (observation, its template tokens, the last sampled id) is evicted before the turn's interval-th token."""
    model = tiny_model("llama", layers=3, dtype=torch.float64)
    cfg = CompressorConfig(method=method, kv_budget=12, window=4, interval=5, selection=selection,
                           h2o_recent=4 if method == "h2o" else 64,     # random: the episode's token positions
                           protect_prompt="last:2" if method == "random" else "off")
    engine = TorchEngine(model, tiny_tokenizer(), cfg, record_evictions=True)
    P, response, turns = play(engine, PROMPT, OBS[:3], SamplingParams(temperature=1.0, max_new_tokens=13, seed=5))
    record = turns[-1][2].eviction_steps
    L = P + len(response)
    assert record.shape[2] == L and record.shape[0] == 3
    index, got = sampled_logp(turns)
    ids = torch.tensor(response)[index]
    ref = teacher_forced(model, PROMPT + response, P, episode_masks(record, P, L))[index, ids].numpy()
    dense = teacher_forced(model, PROMPT + response, P)[index, ids].numpy()
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    assert np.abs(got - dense).max() > 1e-2, "eviction did not change any log-prob: the check would see nothing"
    at_prefill = 0
    for a, m, s in turns[1:]:
        keys = record[:, :, P + a - m:P + a]                                  # the ids this turn prefilled
        assert (keys >= a + min(cfg.interval, len(s.response_ids))).all(), (a, keys.min())
        at_prefill += int((record[:, :, :P + a - m] == a).sum())             # older keys dropped at this prefill
    assert at_prefill > 0, "no turn compressed its older cache at its prefill"


def test_peak_kv_is_bounded_over_turns_while_dense_grows():
    """6 turns of 12 tokens after observations of 10: the sparse episode's measured peak KV bytes at every turn
    stay under kv_budget + interval + the longest prefill (observation + the last sampled id) slots (+ one layer's
    prefill), as actors.engines.kv_memory predicts, and its kept cache between turns under kv_budget + interval slots;
    the dense one grows every turn past that bound."""
    model = tiny_model("llama", layers=2)
    shape = ModelShape(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)
    obs = [[(7 * k + j) % VOCAB + 1 for j in range(10)] for k in range(5)]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1, ignore_eos=True)
    cfg = CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8)
    sparse = TorchEngine(model, tiny_tokenizer(), cfg)
    dense = TorchEngine(model, tiny_tokenizer(), CompressorConfig(method="full"))
    kept = []
    peaks = {}
    for name, engine in (("sparse", sparse), ("dense", dense)):
        peaks[name] = []
        for _k, new in enumerate([PROMPT] + obs):
            (s,), = engine.generate([new], params, episodes=["e"])
            peaks[name].append(s.kv_peak_bytes)
            if name == "sparse":
                kept.append(engine.episode_kv_bytes("e"))
    total = 6 * 12 + 5 * 10
    bound = episode_kv_peak_bytes_per_sequence(shape, len(PROMPT), 12, total, 11, 16, 8, compress=True)
    assert bound == shape.bytes_per_token * (16 + 8 + 11) + shape.bytes_per_token // shape.layers * 16   # chunk 16 > 11
    assert max(peaks["sparse"]) <= bound and max(kept) <= shape.bytes_per_token * (16 + 8)
    assert all(b > a for a, b in zip(peaks["dense"], peaks["dense"][1:])), peaks["dense"]
    assert peaks["dense"][-1] > bound and peaks["dense"][-1] <= episode_kv_peak_bytes_per_sequence(
        shape, len(PROMPT), 12, total, 11, 16, 8, compress=False)
    assert max(peaks["sparse"][1:]) == max(peaks["sparse"][2:]), "the sparse peak still grows after turn 2"


@pytest.fixture(scope="module")
def tiny_llama():
    path = resolve_model(TINY_LLAMA)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval(), AutoTokenizer.from_pretrained(path)


ITEMS = [Prompt("p0", "alpha", "1"), Prompt("p1", "beta beta", "2")]


@pytest.fixture(scope="module")
def pool():
    """One environment worker for the module (ScriptedEnv's answers name its pid: the same in every run here)."""
    pool = EnvPool(EnvConfig(factory="scripted_envs:ScriptedEnv", max_turns=3, max_total_tokens=60, max_obs_tokens=8))
    yield pool
    pool.shutdown()


def episodes(engine, pool, template, params, release: bool):
    batch = run_episodes(engine.generate, pool, template, ITEMS, params,
                         release=engine.release_episodes if release else None)
    return [s for samples in batch for s in samples]


def test_dense_continuation_equals_the_re_prefill(tiny_llama, pool):
    """The shipped tiny Llama (fp64) through run_episodes with a real environment: greedy, the kept-cache episodes
    have the re-prefilled ones' ids and log-probs (to 1e-5); sampled, every trainable token's logp_sparse equals a
    forward over the whole episode (to 1e-5), and nothing stays held."""
    model, tok = tiny_llama
    engine = TorchEngine(model, tok, CompressorConfig(method="full"))
    template = ChatTemplate.build(tok)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, n=2)
    kept, again = episodes(engine, pool, template, greedy, True), episodes(engine, pool, template, greedy, False)
    assert held_episodes(engine) == []
    for a, b in zip(kept, again):
        assert a.response_ids == b.response_ids and a.turns == b.turns >= 2 and a.obs_tokens > 0
        np.testing.assert_allclose(a.logp_sparse, b.logp_sparse, atol=1e-5, rtol=0)
    checked = 0
    for s in episodes(engine, pool, template, SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=3), True):
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].double()
        P, ids = len(s.prompt_ids), torch.tensor(s.response_ids)
        ref = logits[P - 1:-1].log_softmax(-1)[torch.arange(len(ids)), ids].numpy()
        sampled = s.trainable == 1
        np.testing.assert_allclose(s.logp_sparse[sampled], ref[sampled], atol=1e-5, rtol=0)
        checked += int(sampled.sum())
    assert checked > 20 and held_episodes(engine) == []


def test_sparse_episodes_carry_the_whole_episode_record(tiny_llama, pool):
    """run_episodes on a sparse engine that records evictions: each episode's record covers its prompt and every
    response token (observations included) and reproduces its logp_sparse under a teacher-forced forward."""
    model, tok = tiny_llama
    engine = TorchEngine(model, tok, CompressorConfig(method="rkv", kv_budget=24, window=4, interval=6),
                         record_evictions=True)
    samples = episodes(engine, pool, ChatTemplate.build(tok), SamplingParams(temperature=1.0, max_new_tokens=10, n=2,
                                                                       seed=4), True)
    evicted = 0
    for s in samples:
        P, L = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)
        assert s.eviction_steps.shape[2] == L
        ids = torch.tensor(s.response_ids)
        ref = teacher_forced(model, s.prompt_ids + s.response_ids, P, episode_masks(s.eviction_steps, P, L))
        ref = ref[torch.arange(len(ids)), ids].numpy()
        sampled = s.trainable == 1
        np.testing.assert_allclose(s.logp_sparse[sampled], ref[sampled], atol=1e-5, rtol=0)
        evicted += int((s.eviction_steps != NEVER).sum())
    assert evicted > 0 and held_episodes(engine) == []


def test_release_frees_the_kept_state():
    """A kept episode is held until released; a weight load refuses while one is held; a released key starts a
    new episode (its prompt is the whole context: the record covers only it)."""
    engine = TorchEngine(tiny_model("llama"), tiny_tokenizer(), CompressorConfig(method="rkv", kv_budget=12, window=4,
                                                                              interval=5), record_evictions=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=0)
    engine.generate([PROMPT, PROMPT[:5]], params, episodes=["a", "b"])
    engine.generate([OBS[0]], params, episodes=["a"])
    assert sorted(held_episodes(engine)) == ["a", "b"] and engine.episode_kv_bytes("a") > 0
    with pytest.raises(ValueError, match="release_episodes"):
        engine.load_weights(engine.model.state_dict().items(), version=1)
    assert engine.release_episodes(["a", "zz"]) == 1 and held_episodes(engine) == ["b"]
    with pytest.raises(KeyError):
        engine.episode_kv_bytes("a")
    (s,), = engine.generate([OBS[0]], params, episodes=["a"])
    assert s.eviction_steps.shape[2] == len(OBS[0]) + 6                  # a new episode: only this prompt
    assert engine.release_episodes(held_episodes(engine)) == 2 and held_episodes(engine) == []
    engine.load_weights(engine.model.state_dict().items(), version=1)
    with pytest.raises(ValueError, match="episodes"):
        engine.generate([PROMPT], SamplingParams(n=2), episodes=["a"])
