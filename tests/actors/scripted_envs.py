"""Environments for tests/actors/envs/test_env.py (and the episode tests), importable as `scripted_envs:<factory>`
(tests/actors/conftest.py puts this folder on sys.path; the env worker process gets the caller's sys.path). What
an env does is chosen by the action text, so one pool can hold well-behaved and misbehaving episodes at once."""
from __future__ import annotations

import json
import os
import time


class ScriptedEnv:
    """reset: one user message "start <item.question>". step(action): "raise" raises RuntimeError; "sleep" sleeps
    `sleep_s`; "nan" returns a NaN reward; "nonlist" returns a string as its messages; "fourtuple" returns 3
    values; "bye" ends the episode with reward `final`; anything else answers {"role": "tool", "content":
    "<pid> <turn> <action>"} with reward `step_reward`, not done (the pid: which process holds the env; the turn:
    its state across steps). An item whose question is "bad-reset": reset returns one message dict, not a list."""

    def __init__(self, step_reward: float = 0.25, final: float = 1.0, sleep_s: float = 60.0):
        self.step_reward, self.final, self.sleep_s = step_reward, final, sleep_s
        self.turn = 0

    def reset(self, item):
        if item.question == "bad-reset":  # a dict, not a list of them
            return {"role": "user", "content": item.question}
        return [{"role": "user", "content": f"start {item.question}"}]

    def step(self, action):
        self.turn += 1
        if action == "raise":
            raise RuntimeError("the tool crashed")
        if action == "sleep":
            time.sleep(self.sleep_s)
        if action == "nan":
            return [], float("nan"), True, {}
        if action == "nonlist":
            return "K7 = 42", 0.0, False, {}
        if action == "fourtuple":
            return [], 0.0, True
        if action == "bye":
            return [], self.final, True, {"turns": self.turn}
        return [{"role": "tool", "content": f"{os.getpid()} {self.turn} {action}"}], self.step_reward, False, {}


class ActionLogEnv:
    """One turn an episode: reset asks "start <item.question>"; step appends [question, action text] as one JSON
    line to the file `log` and ends the episode with reward 0 (tests/actors/test_evaluate.py reads what a turn
    sampled)."""

    def __init__(self, log: str):
        self.log, self.question = log, None

    def reset(self, item):
        self.question = item.question
        return [{"role": "user", "content": f"start {item.question}"}]

    def step(self, action):
        with open(self.log, "a") as f:
            f.write(json.dumps([self.question, action]) + "\n")
        return [], 0.0, True, {}


def only_positional(a, b):
    """A factory whose signature takes no keyword options."""
    return ScriptedEnv()
