"""The batched multi-turn loop (actors/envs/episode.py) on the real torch engine (the shipped tiny Llama with SmolLM2's
chat template) and real environment workers: it makes the calls of the one-episode reference
(tests/actors/envs/reference_episode.py), its dense log-probs are a teacher-forced forward over the whole episode, and
environment tokens are marked untrainable with log-prob 0."""
from __future__ import annotations

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
from compressors import CompressorConfig
from deploy.model_cache import TINY_LLAMA, resolve_model
from tests.actors.envs.reference_episode import run_episode


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    path = resolve_model(TINY_LLAMA)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return TorchEngine(model, AutoTokenizer.from_pretrained(path), CompressorConfig(method="full"))


@pytest.fixture
def pool():
    pool = EnvPool(EnvConfig(factory="scripted_envs:ScriptedEnv", max_turns=3, max_total_tokens=60, max_obs_tokens=8))
    yield pool
    pool.shutdown()


ITEMS = [Prompt("p0", "alpha", "1"), Prompt("p1", "beta beta", "2")]


def test_the_batch_makes_the_reference_calls(engine, pool):
    """Greedy: every episode of the batch has the ids, mask, reward and turn count of the same episode run
    alone through run_episode (which calls the engine one turn at a time)."""
    template = ChatTemplate.build(engine.tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, n=2)
    batch = run_episodes(engine.generate, pool, template, ITEMS, params)
    for item, samples in zip(ITEMS, batch):
        alone = run_episode(pool, template, f"ref-{item.prompt_id}", item, lambda ids, m: engine.generate(
            [ids], SamplingParams(temperature=0.0, max_new_tokens=m))[0][0].response_ids, 12)
        for s in samples:
            assert s.prompt_ids == alone.prompt_ids and s.response_ids == alone.rollout.ids
            assert s.trainable.tolist() == alone.rollout.trainable
            assert s.reward == alone.reward and s.turns == alone.turns and s.finish == alone.finish
    s = batch[0][0]
    assert s.turns >= 2 and s.obs_tokens > 0 and len(s.turn_kv_bytes) == s.turns


def test_dense_log_probs_are_a_forward_over_the_whole_episode(engine, pool):
    """Sampled (temperature 1): at every trainable token logp_sparse equals log_softmax of the model's own forward
    over prompt + response (the turn's re-prefill is exact dense); 0 at the environment's tokens, which decode to
    the tool's answers."""
    template = ChatTemplate.build(engine.tokenizer)
    batch = run_episodes(engine.generate, pool, template, ITEMS, SamplingParams(temperature=1.0, max_new_tokens=10,
                                                                                n=2, seed=3))
    checked = 0
    for s in (s for samples in batch for s in samples):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = engine.model(ids).logits[0].float()
        P = len(s.prompt_ids)
        ref = torch.log_softmax(logits[P - 1:-1], -1).gather(1, ids[0, P:, None]).squeeze(1).numpy()
        sampled = s.trainable == 1
        np.testing.assert_allclose(s.logp_sparse[sampled], ref[sampled], atol=1e-4)
        assert (s.logp_sparse[~sampled] == 0).all() and s.obs_tokens == int((~sampled).sum())
        observed = engine.tokenizer.decode(np.asarray(s.response_ids)[~sampled])
        assert "tool" in observed and f" {1} " in observed, observed   # "<pid> <turn> <action>" of turn 1
        checked += int(sampled.sum())
    assert checked > 20


def test_a_failing_environment_ends_only_its_episode(engine):
    """ScriptedEnv's reset of the question "bad-reset" returns a dict (not a list): every episode of that item
    fails at reset and ends with reward 0, finish "error", the item's own prompt ids and no response, counted once
    per episode."""
    pool = EnvPool(EnvConfig(factory="scripted_envs:ScriptedEnv"))
    try:
        item = Prompt("p", "bad-reset", "1", prompt_ids=[1, 2, 3])
        (samples,) = run_episodes(engine.generate, pool, ChatTemplate.build(engine.tokenizer), [item],
                                  SamplingParams(temperature=1.0, max_new_tokens=4, n=3))
    finally:
        pool.shutdown()
    assert [(s.finish, s.reward, s.prompt_ids, s.response_ids) for s in samples] == [("error", 0.0, [1, 2, 3], [])] * 3
    assert pool.counts["errors"] == 3
