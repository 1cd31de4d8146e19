"""Actor liveness tells *starting* from *dead* (real Ray, redis-server, DeepSpeed, MLflow on the `tiny` preset):

- an actor that starts slower than learner.weight_sync_timeout_s is not killed: it joins the weight sync once
  ready, while the learner keeps stepping without it;
- a dead actor is replaced while the learner waits for groups, and the run completes; meanwhile the console
  says why the learner waits;
- when no actor can ever start, the run fails fast saying so (not after train.group_wait_s).
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import ray  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from broker.config import BrokerConfig  # noqa: E402
from broker.faults import FAULTS_ENV  # noqa: E402
from broker.run_state import read_learner_version  # noqa: E402
from broker.streams import connect  # noqa: E402
from deploy.config import load_config  # noqa: E402
from deploy.driver import train  # noqa: E402
from deploy.metric_names import metric_history  # noqa: E402
from deploy.scale import request_scale  # noqa: E402

pytestmark = pytest.mark.system  # Ray, DeepSpeed, Redis (and MLflow) together: not in the quick lane


def run_id_of_running_job() -> str:
    while True:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)] if ray.is_initialized() else []
        found = next((n.rsplit("-actor-", 1)[0] for n in names if "-actor-" in n), None)
        if found:
            return found
        time.sleep(0.5)


def actors_live(summary) -> list[float]:
    history = metric_history(MlflowClient(summary["mlflow_uri"]), summary["mlflow_run_id"], "actors_live")
    return [m.value for m in sorted(history, key=lambda m: m.step)]


@pytest.mark.timeout(900)
def test_slow_starting_actor_is_not_killed_and_joins_while_the_learner_steps(tmp_path, redis_server, monkeypatch,
                                                                            capfd):
    # actor-0 (at start) and actor-1 (added at run time) take longer to start than the 3 s ping timeout; the
    # learner stalls 40 s at its step from version 3 (two steps after the scale-up), so that actor-1, which takes
    # ~20 s to import torch and load the model on a loaded machine, joins well before the end without 30 steps of work
    monkeypatch.setenv(FAULTS_ENV, "actor.start:actor-0=sleep:6,actor.start:actor-1=sleep:6,learner.step:0@3=sleep:40")
    steps = 10
    cfg = load_config("tiny", [f"run_dir={tmp_path}", f"broker.url={redis_server.url}", "actors.count=1",
                               f"train.steps={steps}", "eval.enabled=false", "learner.weight_sync_timeout_s=3",
                               "train.group_wait_s=120", "actors.prompts_per_batch=1", "train.groups_per_step=4"])
    redis = connect(BrokerConfig(url=redis_server.url))
    scaled_at: list[int] = []

    def operator():
        run_id = run_id_of_running_job()
        while read_learner_version(redis, run_id) < 1:
            time.sleep(0.2)
        request_scale(run_id, 2, run_dir=tmp_path)
        scaled_at.append(read_learner_version(redis, run_id))

    threading.Thread(target=operator, daemon=True).start()
    summary = train(cfg)
    out = capfd.readouterr().out

    assert "is gone" not in out and "replacing it" not in out, out
    assert summary["actors_replaced"] == 0
    live = actors_live(summary)
    # actor-1 joined and ended on the last version
    assert scaled_at and len(summary["accounting"]["actor_versions"]) == 2, (scaled_at, live, out)
    assert set(summary["accounting"]["actor_versions"].values()) == {steps}
    assert live[-1] == 2
    # while actor-1 was loading (6 s and more), the learner went on stepping with actor-0 alone
    assert live[scaled_at[0]:].count(1.0) >= 2, (scaled_at, live)


@pytest.mark.timeout(900)
def test_dead_actor_is_replaced_while_the_learner_waits(tmp_path, redis_server, capfd):
    steps = 5
    cfg = load_config("tiny", [f"run_dir={tmp_path}", f"broker.url={redis_server.url}", "actors.count=1",
                               "actors.max_restarts=0", f"train.steps={steps}", "eval.enabled=false",
                               "learner.weight_sync_timeout_s=30", "train.group_wait_s=90", "train.wait_report_s=2"])
    redis = connect(BrokerConfig(url=redis_server.url))
    killed: list[int] = []

    def operator():  # SIGKILL the only actor once version 2 is out: the learner then waits with no live actor
        run_id = run_id_of_running_job()
        while read_learner_version(redis, run_id) < 2:
            time.sleep(0.2)
        victim = ray.get_actor(f"{run_id}-actor-0")
        os.kill(ray.get(victim.ping.remote())["pid"], signal.SIGKILL)
        killed.append(read_learner_version(redis, run_id))

    threading.Thread(target=operator, daemon=True).start()
    summary = train(cfg)
    out = capfd.readouterr().out

    assert killed and summary["actors_replaced"] >= 1
    assert "rollout actor 0 is gone" in out, out
    # while the replacement loads (a new Ray worker needs > 2 s here), the console says why the learner waits
    assert re.search(r"learner waiting for the groups of step \d+ for \d+ s: no live rollout actor, "
                     r"1 starting \(loading the model\)", out), out
    assert summary["accounting"]["learner_version"] == steps
    assert list(summary["accounting"]["actor_versions"].values()) == [steps]  # the replacement, on the last version


@pytest.mark.timeout(600)
def test_the_run_fails_fast_when_no_actor_can_start(tmp_path, redis_server, monkeypatch, capfd):
    # every actor dies in its constructor, as with a model it cannot load
    monkeypatch.setenv(FAULTS_ENV, "actor.start:*=fail")
    cfg = load_config("tiny", [f"run_dir={tmp_path}", f"broker.url={redis_server.url}", "actors.count=1",
                               "actors.max_restarts=0", "eval.enabled=false", "train.group_wait_s=1800",
                               "train.wait_report_s=1"])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"no rollout actor can start: 3 in a row failed, the last one died while "
                                           r"starting \(.*actor.start of \* fails \(injected fault\)"):
        train(cfg)
    out = capfd.readouterr().out
    assert out.count("died while starting") == 3, out
    assert "waiting for the rollout actors for" in out and "rollout actor(s) starting (loading the model)" in out, out
    assert time.monotonic() - started < 1800  # long before train.group_wait_s (no timing target: it must not wait it)
