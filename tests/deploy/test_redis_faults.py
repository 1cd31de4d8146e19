"""A Redis blip is survived, a Redis outage ends the run cleanly: whole runs of the `tiny` preset
(real Ray, Redis, MLflow, on loopback) whose embedded redis-server is restarted mid-step on its port and data
directory (as `docker compose restart redis` does), or stopped for good."""
from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
import redis

from broker.redis_server import find_redis_server
from tests.deploy.test_e2e import check_accounting
from tests.deploy.test_faults import ONE_ACTOR, Run, assert_all_gone, mlflow_status, redis_port, running

pytestmark = pytest.mark.system


def embedded_redis(run: Run):
    """The run's redis-server process (started by the driver's LocalRedis)."""
    found = [p for p in run.processes() if p.name() == "redis-server"]
    assert len(found) == 1, [p.name() for p in run.processes()]
    return found[0]


def the_line(text: str) -> str:
    """The one `sparse-rl: ` line of the driver, which printed no traceback of its own (lines Ray forwards from
    the workers start with `(<actor> pid=...)`)."""
    assert not re.search(r"^Traceback", text, re.M), text
    lines = [line for line in text.splitlines() if line.startswith("sparse-rl: ")]
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.timeout(900)
def test_a_redis_restart_mid_step_is_survived_with_exact_accounting(tmp_path):
    """SIGTERM to the embedded redis-server in the middle of step 2, started again half a second later on the
    same port and data directory (its append-only file): every client (driver, learner, actors) waits for it and
    goes on: the run ends with exit 0, no actor was replaced, every group was trained once (accounting exact).
    (Before run_state.retry_policy the clients retried nothing: the first command after the stop raised.)"""
    runs = tmp_path / "runs"
    run = Run("--config", "tiny", f"run_dir={runs}", "train.steps=4", "eval.enabled=false")
    again = None
    try:
        run.until(r"^step 1/4")
        server = embedded_redis(run)
        (run_dir,) = runs.iterdir()
        # LocalRedis's binary by the name it was started with: psutil's exe() resolves links, and Debian's
        # /usr/bin/redis-server links to redis-check-rdb, which acts by the name it is called (it then checks the
        # config file as an RDB file and exits 1)
        binary, conf = find_redis_server(), run_dir / "redis" / "redis.conf"  # (in the run's data directory)
        port = redis_port(run.text)
        server.terminate()  # redis-server flushes its append-only file and closes every connection
        deadline = time.monotonic() + 30
        while running(server):  # (the driver reaps it: a zombie until then)
            assert time.monotonic() < deadline, "redis-server did not stop"
            time.sleep(0.05)
        time.sleep(0.5)  # connections are refused meanwhile
        again = subprocess.Popen([binary, conf], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping()
                break
            except redis.exceptions.BusyLoadingError:
                pass
            except redis.ConnectionError:
                assert time.monotonic() < deadline and again.poll() is None, "redis-server did not start again"
            time.sleep(0.05)
        rc = run.finish(timeout=600)
    finally:
        run.kill()
        if again is not None:
            again.kill()
            again.wait()
    assert rc == 0, run.text
    assert "replacing it" not in run.text and "Traceback" not in run.text, run.text
    summary = json.loads((run_dir / "summary.json").read_text())
    check_accounting(summary, steps=4, groups_per_step=2, prompts_per_batch=2)
    assert len(summary["accounting"]["actor_versions"]) == 2, summary["accounting"]  # both actors lived on
    assert mlflow_status(run_dir) == "FINISHED"


@pytest.mark.timeout(900)
def test_a_redis_outage_longer_than_the_bound_ends_the_run_with_one_line(tmp_path):
    """The embedded redis-server killed for good at step 1 with broker.retry_s=5: the run ends within the bound
    and the shutdown (exit 1), with one line naming Redis and its address and how to start again, MLflow FAILED,
    nothing of the run left running."""
    runs = tmp_path / "runs"
    run = Run("--config", "tiny", f"run_dir={runs}", "train.steps=50", "eval.enabled=false", "broker.retry_s=5",
              ONE_ACTOR)
    try:
        run.until(r"^step 1/50")
        tree, port = run.processes(), redis_port(run.text)
        embedded_redis(run).kill()
        gone = time.monotonic()
        rc = run.finish(timeout=300)
        took = time.monotonic() - gone
    finally:
        run.kill()
    assert rc == 1, run.text
    line = the_line(run.text)
    assert re.fullmatch(rf"sparse-rl: run failed: Redis at redis://127\.0\.0\.1:{port}/0 did not answer for "
                        rf"broker\.retry_s=5 s \(ConnectionError: .*{port}.*\); last checkpoint: none .*; start again "
                        rf"with: .*sparse-rl train --config tiny .*", line), line
    assert took < 5 + 45, (took, run.text)  # the bound, then the shutdown (seconds on 2 busy cores)
    (run_dir,) = runs.iterdir()
    assert mlflow_status(run_dir) == "FAILED"
    assert_all_gone(tree, port)
