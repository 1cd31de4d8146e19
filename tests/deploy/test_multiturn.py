"""The multi-turn pipeline end to end (docs/results.md 8): the `tiny-lookup` preset (real Ray, Redis, DeepSpeed, MLflow
on loopback) with an environment that answers every turn (tests/actors/scripted_envs.py, on the workers' PYTHONPATH),
so every episode runs its max_turns: observations travel untrainable through the broker to the learner."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from deploy.metric_names import metric_history
from tests.deploy.test_e2e import check_accounting

pytestmark = pytest.mark.system

ACTORS_TESTS = Path(__file__).resolve().parents[1] / "actors"   # scripted_envs.py
CLI = str(Path(sys.executable).with_name("sparse-rl"))
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ACTORS_TESTS), os.environ.get("PYTHONPATH")]))}


@pytest.mark.timeout(900)
def test_multi_turn_episodes_train_through_the_pipeline(tmp_path):
    """ScriptedEnv answers each turn with a tool message (reward 0.25 a step), so each episode has max_turns = 3
    turns and 3 rewarded steps (0.75), sparse (the preset's R-KV 48, the episode's compressed cache kept across
    turns) with eviction replay (learner.policy_target=sparse: each episode's record covers every turn;
    max_staleness 0, so every step's rows are fresh): the run trains its 3 steps with exact accounting and
    replayed log-probs equal to the rollouts' logp_sparse (<= 1e-4, every step); MLflow has 3 turns per episode,
    a non-zero environment share of the response tokens, KV bytes at the end of turns 1-3 (growing: every turn
    adds the observation), and no environment error; the held-out evaluation, dense and sparse, before and after,
    runs episodes too (3 turns, reward 0.75)."""
    done = subprocess.run([CLI, "train", "--config", "tiny-lookup", "run_dir=runs", "train.steps=3",
                           "eval.before=true", "actors.env.factory=scripted_envs:ScriptedEnv",
                           "learner.policy_target=sparse", "broker.max_staleness=0", "actors.count=1"],
                          cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=800)
    assert done.returncode == 0, done.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    check_accounting(summary, steps=3, groups_per_step=2, prompts_per_batch=2)
    client = MlflowClient(summary["mlflow_uri"])

    def values(name: str) -> list[float]:
        return [m.value for m in sorted(metric_history(client, summary["mlflow_run_id"], name), key=lambda m: m.step)]

    assert values("turns_per_episode") and set(values("turns_per_episode")) == {3.0}
    assert values("reward_mean") == [0.75] * 3
    assert len(values("replay_logp_max_abs")) == 3 and max(values("replay_logp_max_abs")) <= 1e-4
    assert all(0 < f < 1 for f in values("env_token_fraction")), values("env_token_fraction")
    kv = [values(f"kv_bytes_turn_{k}")[0] for k in (1, 2, 3)]
    assert kv[0] < kv[1] < kv[2], kv
    for when in ("eval", "eval_before"):
        for mode in ("dense", "sparse"):
            got = {k: summary[f"{when}/{mode}/{k}"] for k in ("n", "turns", "reward", "reward_errors")}
            assert got == {"n": 4.0, "turns": 3.0, "reward": 0.75, "reward_errors": 0.0}, (when, mode, got)
    assert summary["accounting"].get("env_errors", 0) == 0 and summary["accounting"].get("reward_errors", 0) == 0
