"""The batched multi-turn rollout loop (docs/multi-turn.md): G episodes per prompt, every live
episode's next turn sampled in one engine call, the environments stepped between turns (actors/envs/env.py), the
token stream kept exact (actors/envs/turns.py). tests/actors/envs/reference_episode.py runs one episode at a time
with the same calls: the reference the tests check this loop against.

With an engine that keeps episodes (`release` given: the torch engine's `release_episodes`, docs/results.md 9; the
SGLang engine's in sparse mode, through SGLang's streaming sessions, docs/sglang.md), each
turn passes only the ids appended since the episode's last sampled token (the template boundary, the observation, the
next assistant header): the engine prefills them into the episode's kept cache (compressed or dense) at their
true positions and decodes the turn, so a dense episode costs one prefill of its new tokens per turn and a sparse
one holds at most kv_budget + interval + its longest observation (+ 1, the last sampled token) slots whatever its
number of turns; the observation is protected from eviction until the turn's first compression event
(compressor.protect_observation). The last turn's eviction record covers the whole episode (observations
included), so the learner can replay it. Finished episodes are released at once, every episode when the loop ends
or raises.

Without it (the dense SGLang engine, whose radix cache shares the re-sent history), each turn re-prefills the
episode's history (prompt + every earlier turn, as token ids): exact (a teacher-forced forward over the same ids).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from actors.engines.base import Sample, SamplingParams
from actors.envs.env import EnvPool
from actors.envs.turns import ChatTemplate, Rollout

TURN_SEED_STRIDE = 1_000_003
"""Turn k of a batch samples with seed params.seed + k * TURN_SEED_STRIDE (+ sub-batch index)."""


@dataclass
class EpisodeSample(Sample):
    """A finished episode as one training sample: `prompt_ids` the reset's conversation rendered, `response_ids`
    every id after it (sampled turns, template boundaries, observations), `logp_sparse` float32 [T] (0 on
    environment and template tokens), `trainable` uint8 [T] (1 = sampled). `reward`: the episode's
    (EnvConfig.reward; 0 when it failed); `finish`: done | max_turns | max_total_tokens | error | timeout | lost;
    `turns`: sampled turns; `tool_calls`: steps whose info said tool_call; `obs_tokens`: response tokens that are not
    trainable; `turn_kv_bytes`: the engine's KV bytes of the trajectory at the end of each turn; `eviction_steps`
    (an engine that keeps episodes and records evictions): the whole episode's record, uint16 [layers, heads,
    P + T], else None; `rounding_hints` the same for the whole episode's rounding hints (a quantized cache)."""
    reward: float = 0.0
    finish: str = ""
    turns: int = 0
    tool_calls: int = 0
    obs_tokens: int = 0
    turn_kv_bytes: list = field(default_factory=list)


@dataclass
class _Live:
    key: str
    prompt_ids: list
    rollout: Rollout
    logps: list = field(default_factory=list)     # per turn of the rollout: float32 array (zeros on observations)
    kv_bytes: list = field(default_factory=list)
    retained: int = 0
    protected: float = 0.0
    tool_calls: int = 0
    turns: int = 0
    finish: str = ""
    sent: int = 0                                 # ids of prompt + rollout the engine has been given
    eviction_steps: object = None                 # the last turn's record (kept episodes: the whole episode)
    rounding_hints: object = None                 # the same for its rounding hints (a quantized KV cache)


def run_episodes(generate, pool: EnvPool, template: ChatTemplate, items: list, params: SamplingParams,
                 kv_budgets: list[int] | None = None, batch_key: str = "", release=None) -> list[list[EpisodeSample]]:
    """Run `params.n` episodes of every item (an actors.tasks.data.Prompt) to their ends; returns one list of n
    EpisodeSamples per item. `generate(prompts, params, kv_budgets=...)` is the engine's (RolloutEngine.generate):
    each turn calls it once per distinct (max_new_tokens, budget) with n = 1 per live episode, max_new_tokens the
    smaller of `params.max_new_tokens` and the tokens left of actors.env.max_total_tokens. `release(keys)`: the
    engine keeps episodes (TorchEngine.release_episodes, a sparse SGLangEngine's): `generate` is then called with
    `episodes=` keys and only each episode's new ids (module docstring); None: every turn re-prefills the history.
    `kv_budgets`: one per
    item, or None. `batch_key` prefixes the episode keys. Raises what `generate` raises; never what an
    environment does (its failures end that episode with reward 0, counted in `pool.counts`)."""
    try:
        return _run(generate, pool, template, items, params, kv_budgets, batch_key, release)
    finally:
        if release is not None:
            release([f"{batch_key}{i}.{g}" for i in range(len(items)) for g in range(params.n)])


def _run(generate, pool, template, items, params, kv_budgets, batch_key, release) -> list[list[EpisodeSample]]:
    cfg = pool.cfg
    live, order = [], []
    for i, item in enumerate(items):
        for g in range(params.n):
            key = f"{batch_key}{i}.{g}"
            first = pool.reset(key, item)
            ep = _Live(key, list(item.prompt_ids) if first.failure else template.prompt_ids(first.messages),
                       Rollout(template, cfg.max_total_tokens, cfg.max_obs_tokens, cfg.obs_truncation),
                       finish=first.failure)
            order.append((i, ep))
            live.append(ep)
    budget_of = {ep.key: (kv_budgets[i] if kv_budgets is not None else None) for i, ep in order}
    turn = 0
    while any(not ep.finish for ep in live):
        running = [ep for ep in live if not ep.finish]
        _sample_turn(generate, running, params, budget_of, turn, kept=release is not None)
        for ep in running:
            _step_environment(pool, template, ep)
        if release is not None:
            release([ep.key for ep in running if ep.finish])
        turn += 1
    out: list[list[EpisodeSample]] = [[] for _ in items]
    for i, ep in order:
        out[i].append(_episode_sample(ep, pool.episode_reward(ep.key)))
        pool.close(ep.key)
    return out


def _sample_turn(generate, running: list[_Live], params: SamplingParams, budget_of: dict, turn: int,
                 kept: bool) -> None:
    """One turn of every running episode: one engine call per distinct (max_new_tokens, budget); `kept`: the engine
    keeps the episodes' caches (only the ids since each one's last sampled token are sent)."""
    groups: dict[tuple, list[_Live]] = {}
    for ep in running:
        groups.setdefault((min(params.max_new_tokens, ep.rollout.remaining), budget_of[ep.key]), []).append(ep)
    for k, ((max_new, budget), eps) in enumerate(sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))):
        seed = None if params.seed is None else params.seed + turn * TURN_SEED_STRIDE + k
        sub = dataclasses.replace(params, n=1, max_new_tokens=max_new, seed=seed)
        budgets = None if budget is None else [budget] * len(eps)
        if kept:
            outs = generate([(ep.prompt_ids + ep.rollout.ids)[ep.sent:] for ep in eps], sub, kv_budgets=budgets,
                            episodes=[ep.key for ep in eps])
        else:
            outs = generate([ep.prompt_ids + ep.rollout.ids for ep in eps], sub, kv_budgets=budgets)
        for ep, (s,) in zip(eps, outs):
            ep.rollout.add_sampled(s.response_ids)
            ep.sent = len(ep.prompt_ids) + len(ep.rollout.ids)
            ep.eviction_steps = s.eviction_steps if kept else None   # a re-prefill's record is of one turn
            ep.rounding_hints = getattr(s, "rounding_hints", None) if kept else None
            ep.logps.append(np.asarray(s.logp_sparse, dtype=np.float32))
            ep.kv_bytes.append(int(s.kv_peak_bytes))
            ep.retained = int(s.kv_retained_tokens)
            ep.protected = float(s.kv_protected_fraction)
            ep.turns += 1


def _step_environment(pool: EnvPool, template: ChatTemplate, ep: _Live) -> None:
    """The environment's answer to the episode's last turn: its observation appended, or the episode's end."""
    text = template.tokenizer.decode(ep.rollout.turns[-1].ids, skip_special_tokens=True)
    step = pool.step(ep.key, text)
    ep.tool_calls += bool(step.info.get("tool_call"))
    ep.finish = step.failure or ("done" if step.done else "max_turns" if ep.turns >= pool.cfg.max_turns else "")
    if not ep.finish:
        if ep.rollout.remaining <= 0 or (obs := ep.rollout.add_observation(step.messages)) is None:
            ep.finish = "max_total_tokens"
        else:
            ep.logps.append(np.zeros(len(obs.ids), dtype=np.float32))


def _episode_sample(ep: _Live, reward: float) -> EpisodeSample:
    """The finished episode `ep` as one training sample, with the episode's `reward`."""
    trainable = np.asarray(ep.rollout.trainable, dtype=np.uint8)
    logp = np.concatenate(ep.logps) if ep.logps else np.zeros(0, np.float32)
    return EpisodeSample(
        prompt_ids=list(ep.prompt_ids), response_ids=ep.rollout.ids, logp_sparse=logp,
        finish_reason="stop" if ep.finish == "done" else "length" if ep.finish.startswith("max_") else "stop",
        kv_retained_tokens=ep.retained, kv_peak_bytes=max(ep.kv_bytes, default=0), trainable=trainable,
        kv_protected_fraction=ep.protected,
        reward=reward, finish=ep.finish, turns=ep.turns, tool_calls=ep.tool_calls,
        obs_tokens=int(len(trainable) - trainable.sum()), turn_kv_bytes=list(ep.kv_bytes),
        eviction_steps=ep.eviction_steps, rounding_hints=ep.rounding_hints)
