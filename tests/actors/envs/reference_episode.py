"""One episode, start to end, sequentially: the reference the batched rollout loop (actors/envs/episode.py,
`run_episodes`) is checked against (tests/actors/envs/test_episode.py), and the driver of the environment tests
(tests/actors/envs/test_env.py). It makes the calls a rollout loop makes per live episode, one at a time."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from actors.envs.env import EnvPool
from actors.envs.turns import ChatTemplate, Rollout


@dataclass
class Episode:
    """One finished episode: `prompt_ids` (list[int], the reset's messages rendered), `rollout` (actors.envs.turns.
    Rollout: `.ids`, `.trainable`, one 0/1 per id), `reward` (float, EnvConfig.reward; 0 on failure), `turns`
    (sampled turns), `finish`: done | max_turns | max_total_tokens | error | timeout | lost."""
    key: str
    prompt_ids: list
    rollout: Rollout
    reward: float
    turns: int
    finish: str


Generate = Callable[[list, int], Sequence[int]]
"""generate(ids: list[int], max_new_tokens: int) -> the sampled ids (ending with the template's end-of-turn id when
the turn ended by itself)."""


def run_episode(pool: EnvPool, template: ChatTemplate, key: str, item, generate: Generate,
                max_new_tokens: int) -> Episode:
    """Run episode `key` of `item` to its end: reset, then up to `max_turns` times generate a turn (at most
    min(max_new_tokens, tokens left of max_total_tokens)), step the environment with its text, append the
    observation; close. Sequential and one episode at a time: the reference for a batched rollout loop, which
    makes the same calls per live episode. Raises what `generate` raises; never what the environment does."""
    cfg = pool.cfg
    rollout = Rollout(template, cfg.max_total_tokens, cfg.max_obs_tokens, cfg.obs_truncation)
    first = pool.reset(key, item)
    prompt = [] if first.failure else template.prompt_ids(first.messages)
    turns, finish = 0, first.failure
    while not finish:
        rollout.add_sampled(generate(prompt + rollout.ids, min(max_new_tokens, rollout.remaining)))
        turns += 1
        text = template.tokenizer.decode(rollout.turns[-1].ids, skip_special_tokens=True)
        step = pool.step(key, text)
        finish = step.failure or ("done" if step.done else "max_turns" if turns >= cfg.max_turns else "")
        if not finish and rollout.add_observation(step.messages) is None:
            finish = "max_total_tokens"
    reward = pool.episode_reward(key)
    pool.close(key)
    return Episode(key, prompt, rollout, reward, turns, finish)
