"""Admission control through the whole system (real Ray, redis-server, DeepSpeed, MLflow on the `tiny` preset):
3 rollout actors, one of them slow (every batch takes 3 s more), max_staleness 0, and one actor SIGKILLed in
the middle of a batch (it holds a claim). No group is dropped stale, every trained group was sampled with the
learner's current weights (staleness_max 0 at every step), the run does not stall, and the broker's
accounting is exact with at most one actor batch left at stop. The broker-level test with very different
speeds and its control without admission are in tests/broker/test_admission_actors.py.
"""
from __future__ import annotations

import os
import signal
import threading
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import ray  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from broker.faults import FAULTS_ENV  # noqa: E402
from deploy.config import load_config  # noqa: E402
from deploy.driver import train  # noqa: E402
from deploy.metric_names import metric_history  # noqa: E402

pytestmark = pytest.mark.system  # Ray, DeepSpeed, Redis (and MLflow) together: not in the quick lane


@pytest.mark.timeout(900)
def test_on_policy_run_with_a_slow_and_a_killed_actor(tmp_path, redis_server, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "actor.generate:actor-2=sleep:3")
    steps = 8
    cfg = load_config("tiny", [f"run_dir={tmp_path}", f"broker.url={redis_server.url}", "actors.count=3",
                               "broker.max_staleness=0", "broker.claim_ttl_s=3", f"train.steps={steps}",
                               "eval.enabled=false", "learner.weight_sync_timeout_s=30", "train.group_wait_s=300"])
    killed: list[str] = []

    def operator():  # SIGKILL actor-0 or actor-1, the first seen holding a claim (in the middle of a batch)
        while not ray.is_initialized():
            time.sleep(0.2)
        # At staleness 0 one actor holds the step's claim, whichever sees the new weights first (about evenly
        # drawn): watching two of the three, the odds that neither ever holds one in 8 steps are (1/3)^8.
        while True:
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
            for victim in [n for n in names if n.endswith(("-actor-0", "-actor-1"))]:
                try:
                    state = ray.get(ray.get_actor(victim).ping.remote(), timeout=10)
                except Exception:
                    state = {}
                if state.get("in_batch"):
                    os.kill(state["pid"], signal.SIGKILL)
                    killed.append(victim)
                    return
            time.sleep(0.05)

    threading.Thread(target=operator, daemon=True).start()
    summary = train(cfg)

    acc = summary["accounting"]
    assert killed
    assert acc["learner_version"] == steps and acc["consumed"] == steps * cfg.train.groups_per_step
    assert acc["dropped_stale"] == 0 and acc["duplicates"] == 0 and acc["dead_lettered"] == 0
    assert acc["produced"] == acc["consumed"] + acc["groups_filtered"] + acc["dropped_stale"] + acc["left_in_queue"]
    assert acc["left_in_queue"] <= cfg.actors.prompts_per_batch
    history = metric_history(MlflowClient(summary["mlflow_uri"]), summary["mlflow_run_id"], "staleness_max")
    assert len(history) == steps and all(m.value == 0 for m in history)
