"""Environments of multi-turn rollouts: a gym-like, text in / text out interface shaped like SkyRL-gym's `Env` and
verl's ToolAgentLoop, and `EnvPool`, through which an actor runs a user's environments in a worker process with
a time limit per call (actors/user_code.py, the reward function's seam).

A user's environment: a factory "package.module:factory" (`EnvConfig.factory`), called as
`factory(**EnvConfig.options)`, makes one `Env` per sample (G per prompt, each reset with the same item):

    env.reset(item: actors.tasks.data.Prompt) -> list[{"role": str, "content": str}]     # the first prompt's messages
    env.step(action_text: str) -> (messages: list[dict], reward: float, done: bool, info: dict)
    env.close() -> None                                                              # optional

`action_text` is the sampled assistant turn decoded without special tokens; `messages` are the environment's new
messages (tool results, user turns), rendered after the sampled ids by actors/envs/turns.py, never trainable. The
episode's reward is `EnvConfig.reward`: "sum" of every step's reward, or the "last" step's.

Envs are stateful, so they live in the worker process (a dict of episodes there, `episode_call`). An environment
can never stop an actor: an exception, a non-finite reward or a result of the wrong shape (errors), or a call
longer than `step_timeout_s` (timeouts) ends that episode with reward 0 and is counted, never raised. A timeout
kills the worker, so every episode that lived in it ends too, with reward 0 (counted as lost).
"""
from __future__ import annotations

import inspect
import math
import numbers
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.config import load_callable
from actors.user_code import UserCode, UserCodeError, UserCodeTimeout


@dataclass
class EnvConfig:
    factory: str = ""
    """"" = single-turn rollouts (no environment). Otherwise "package.module:factory", called as
    `factory(**options)` once per sample, returning an Env (see the module docstring). Shipped:
    actors.envs.lookup:LookupEnv (the tool-gated key/value lookup)."""
    options: dict = field(default_factory=dict)
    """Keyword arguments of `factory` (e.g. {tool_disabled: true}); checked against its signature at config time."""
    step_timeout_s: float = 10.0
    """Longest one call of the environment (reset, step) may take, seconds. The environments run in one worker
    process of the actor; a call that takes longer ends its episode with reward 0 (counted in timeouts) and kills
    the worker, which ends every other episode it held with reward 0 (counted as lost). 0 = no limit: the
    environments run in the actor's own process, and one that never returns stops the actor."""
    max_turns: int = 4
    """Most sampled assistant turns per episode; the environment's answer to the last one ends the episode."""
    max_total_tokens: int = 1024
    """Most tokens of the whole rollout after its prompt: sampled + observation (template and environment)
    tokens. A turn is generated with at most the tokens left; an observation that does not fit ends the episode."""
    max_obs_tokens: int = 256
    """Most tokens of environment text one step may add (message contents, template tokens not counted); longer
    ones are cut on `obs_truncation`'s side."""
    obs_truncation: str = "right"
    """right: keep an observation's first max_obs_tokens tokens | left: keep its last ones."""
    reward: str = "sum"
    """The episode's reward: sum (of every step's reward) | last (the last step's reward)."""

    def __post_init__(self):
        checks = [(isinstance(self.step_timeout_s, (int, float)) and math.isfinite(self.step_timeout_s)
                   and self.step_timeout_s >= 0, "step_timeout_s", self.step_timeout_s, "seconds >= 0 (0 = no limit)"),
                  (self.max_turns >= 1, "max_turns", self.max_turns, ">= 1"),
                  (self.max_total_tokens >= 1, "max_total_tokens", self.max_total_tokens, ">= 1"),
                  (self.max_obs_tokens >= 1, "max_obs_tokens", self.max_obs_tokens, ">= 1"),
                  (self.obs_truncation in ("left", "right"), "obs_truncation", repr(self.obs_truncation),
                   "left | right"),
                  (self.reward in ("sum", "last"), "reward", repr(self.reward), "sum | last")]
        bad = [f"EnvConfig.{name}={value}: expected {rule}" for ok, name, value, rule in checks if not ok]
        if bad:
            raise ValueError("; ".join(bad))


def check_env_factory(spec: str, options: dict | None = None) -> Callable:
    """The factory named by `spec`, after checking it can be called as `factory(**options)`.

    Raises ValueError starting with `env.factory=<spec>:` (as load_callable) when it cannot be imported or is
    not callable, or when its signature does not accept `options`."""
    fn = load_callable(spec, "env.factory")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: it is called as it is
        return fn
    try:
        signature.bind(**dict(options or {}))
    except TypeError as e:
        raise ValueError(f"env.factory={spec!r}: cannot be called as {spec.partition(':')[2]}(**options) with the "
                         f"environment's options {dict(options or {})} ({e}; signature {signature})") from None
    return fn


# -- the worker process: the live environments -------------------------------------------------------------------
_EPISODES: dict[str, Any] = {}
"""The environments of this worker process by episode key (the actor's process itself with step_timeout_s 0)."""


def episode_call(op: str, key: str, *args) -> Any:
    """The worker's side of EnvPool: op "reset" (args: factory spec, options, item) makes the episode's Env and
    returns `env.reset(item)`; "step" (args: action_text) returns `env.step(action_text)`; "close" drops the Env
    (calling its close() if it has one; what close() raises is ignored). Raises KeyError for an unknown key."""
    if op == "reset":
        spec, options, item = args
        _EPISODES[key] = env = load_callable(spec, "env.factory")(**options)
        return env.reset(item)
    if op == "step":
        return _EPISODES[key].step(*args)
    env = _EPISODES.pop(key, None)
    try:
        getattr(env, "close", lambda: None)()
    except Exception:
        pass
    return None


# -- the actor's side --------------------------------------------------------------------------------------------
ENV_FAILURES = {"error": "env_errors", "timeout": "env_timeouts", "lost": "env_lost"}
"""An episode's failure kind (EnvStep.failure, EpisodeSample.finish) -> the run's count of such episodes
(summary.json's accounting; MLflow rollout/<name>). An episode that fails scores 0 and is counted there only."""


@dataclass(frozen=True)
class EnvStep:
    """What one environment call gave: `messages` (list of {"role", "content"} str dicts), `reward` (float),
    `done`, `info` (dict, the env's own), and `failure`: "" | "error" | "timeout" | "lost" (the call failed, or
    the worker holding the episode was killed: the episode is over, reward 0; `error` says why, one line)."""
    messages: list
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)
    failure: str = ""
    error: str = ""


@dataclass
class _EnvEpisode:
    """What the pool keeps of one episode's environment: where its Env lives, the rewards its steps gave, and how
    it failed ("" while it has not)."""
    worker: int | None  # the pid of the worker process that holds the env (None: no limit, this process)
    rewards: list = field(default_factory=list)
    failure: str = ""


class EnvPool:
    """The actor's environments: one Env per episode key, in one worker process (`UserCode`, timeout
    `cfg.step_timeout_s`). `reset(key, item)`, `step(key, action_text)`, `close(key)`; `episode_reward(key)`.

    Never raises for what an environment does: failures come back as EnvStep.failure and are counted in
    `counts` ({"errors", "timeouts", "lost"}: episodes, each counted once), `last_error` keeps the latest
    message. Raises ValueError at construction for an empty or bad factory (see check_env_factory), KeyError for
    a key that was not reset or is closed, and pickling errors of the item as they are."""

    def __init__(self, cfg: EnvConfig):
        if not cfg.factory:
            raise ValueError("env.factory='': no environment configured (single-turn rollouts)")
        check_env_factory(cfg.factory, cfg.options)
        self.cfg, self.name = cfg, cfg.factory
        self.code = UserCode(f"{__name__}:episode_call", cfg.step_timeout_s, name=f"environment {cfg.factory}",
                             setting="actors.env.step_timeout_s", preload=("actors.tasks.data", "actors.envs.env"))
        self._prefix = uuid.uuid4().hex[:8]  # keys of pools sharing a process (step_timeout_s 0) stay apart
        self._episodes: dict[str, _EnvEpisode] = {}
        self.counts = {"errors": 0, "timeouts": 0, "lost": 0}
        self.last_error = ""

    def reset(self, key: str, item) -> EnvStep:
        """Make episode `key`'s Env and reset it with `item` (an actors.tasks.data.Prompt): EnvStep.messages is the
        first prompt's conversation (a non-empty list), or the failure."""
        self._episodes[key] = _EnvEpisode(worker=None)
        step = self._call(key, "reset", self.cfg.factory, dict(self.cfg.options), item)
        if step.failure:
            return step
        self._episodes[key].worker = self.code.pid
        return step

    def step(self, key: str, action_text: str) -> EnvStep:
        """Episode `key`'s Env answers the sampled turn `action_text` (decoded, special tokens skipped). A failed
        or lost episode answers its failure again (counted once)."""
        episode = self._episodes[key]
        if not episode.failure and episode.worker != self.code.pid:
            self._fail(key, "lost", f"its worker process was killed (another episode's call timed out after "
                                    f"{self.cfg.step_timeout_s:g} s, actors.env.step_timeout_s)")
        if episode.failure:
            return EnvStep([], done=True, failure=episode.failure, error=self.last_error)
        step = self._call(key, "step", action_text)
        if not step.failure:
            episode.rewards.append(step.reward)
        return step

    def episode_reward(self, key: str) -> float:
        """The episode's reward so far: EnvConfig.reward "sum" of its steps' rewards or the "last" one (0.0
        before any step), 0.0 for a failed episode."""
        episode = self._episodes[key]
        if episode.failure or not episode.rewards:
            return 0.0
        return float(sum(episode.rewards) if self.cfg.reward == "sum" else episode.rewards[-1])

    def close(self, key: str) -> None:
        """Drop episode `key` here and in the worker (its Env's close() is called; nothing it does is raised)."""
        episode = self._episodes.pop(key)
        if not episode.failure and episode.worker == self.code.pid:
            try:
                self.code("close", self._worker_key(key))
            except Exception as e:  # a close() that hangs or kills the worker: the next call starts a new one
                self.last_error = f"environment {self.name}: closing {key}: {e}"

    def shutdown(self) -> None:
        """Stop the worker process (every open episode in it is lost)."""
        self.code.close()

    def _worker_key(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def _call(self, key: str, op: str, *args) -> EnvStep:
        try:
            value = self.code(op, self._worker_key(key), *args)
        except UserCodeTimeout as e:
            return self._fail(key, "timeout",
                              f"{op} did not return within {e.timeout_s:g} s (actors.env.step_timeout_s)")
        except Exception as e:  # UserCodeError "<type>: <text>"; with no limit (in this process) the env's own
            what = str(e) if isinstance(e, UserCodeError) else f"{type(e).__name__}: {e}"
            return self._fail(key, "error", f"{op} raised {what}")
        problem, step = _checked(op, value)
        return self._fail(key, "error", problem) if problem else step

    def _fail(self, key: str, kind: str, why: str) -> EnvStep:
        self._episodes[key].failure = kind
        self.counts[{"error": "errors", "timeout": "timeouts", "lost": "lost"}[kind]] += 1
        self.last_error = (f"environment {self.name} on {key}: {' '.join(why.split())[:300]} (the episode scored 0, "
                           f"counted in env {kind}s)")
        return EnvStep([], done=True, failure=kind, error=self.last_error)


def _checked(op: str, value) -> tuple[str, EnvStep | None]:
    """("", EnvStep) for a well-formed reset/step result, else (what is wrong, None)."""
    if op == "reset":
        problem = _message_problem(value) or ("" if value else "returned no messages")
        return (f"reset {problem}", None) if problem else ("", EnvStep(list(value)))
    if not isinstance(value, (tuple, list)) or len(value) != 4:
        return f"step returned {type(value).__name__}: expected (messages, reward, done, info)", None
    messages, reward, done, info = value
    problem = _message_problem(messages)
    if not problem and not (isinstance(reward, numbers.Real) and math.isfinite(reward)):
        problem = f"returned reward {reward!r}: expected a finite number"
    if not problem and not (isinstance(done, (bool, numbers.Integral)) or type(done).__name__ == "bool_"):
        problem = f"returned done {done!r}: expected a bool"
    if not problem and not isinstance(info, (dict, type(None))):
        problem = f"returned info of type {type(info).__name__}: expected a dict"
    if problem:
        return f"step {problem}", None
    return "", EnvStep(list(messages), float(reward), bool(done), dict(info or {}))


def _message_problem(messages) -> str:
    """"" when `messages` is a list of {"role": str, "content": str} dicts, else what is wrong."""
    if not isinstance(messages, list):
        return f"returned {type(messages).__name__}: expected a list of {{'role': str, 'content': str}} dicts"
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"returned message {i} {m!r:.80}: expected a {{'role': str, 'content': str}} dict"
    return ""
