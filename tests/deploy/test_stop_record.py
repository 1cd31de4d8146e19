"""The record agrees with itself after any stop (issue 37 item 5): Ctrl-C or SIGTERM landing in the gap between the
learner's commit of a step and the driver's console line for it still leaves every version a checkpoint holds
with its line in trained_prompts.jsonl and its learner metrics in MLflow. `sparse-rl train` of the `tiny` preset
in a subprocess (real Ray, Redis, DeepSpeed and MLflow); the gap is held open with the fault seam
(broker/faults.py): `driver.log` (the driver has the step's report and has not logged it yet) and
`learner.committed` (the learner committed and has not answered the driver yet)."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from broker.run_state import read_learner_version
from learner.checkpoint import read_client_state
from tests.deploy.test_faults import ENV, ONE_ACTOR, Run, mlflow_status, redis_port

pytestmark = pytest.mark.system


def learner_steps(run_dir) -> set[int]:
    """The MLflow steps at which the learner's step report was logged (its `groups_trained`, under whatever
    section the MLflow name table puts it)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (name,) = [k for k in run.data.metrics if k == "groups_trained" or k.endswith("/groups_trained")]
    return {m.step for m in client.get_metric_history(run.info.run_id, name)}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("signum, fault, interval", [
    (signal.SIGINT, "driver.log:driver@2=sleep:300", 1),  # the driver holds the step's report, not yet logged
    (signal.SIGTERM, "learner.committed:0@2=sleep:300", 100),  # the driver has not heard of the commit; SIGTERM
    # then has the learner checkpoint that committed step (no interval checkpoint: checkpoint_interval=100)
], ids=["ctrl-c-driver-gap", "sigterm-learner-gap"])
def test_a_stop_between_the_commit_and_the_console_line_keeps_the_record_whole(tmp_path, signum, fault, interval):
    runs = tmp_path / "runs"
    run = Run("--config", "tiny", f"run_dir={runs}", "train.steps=50", f"learner.checkpoint_interval={interval}",
              "eval.enabled=false", ONE_ACTOR, env={**ENV, "SPARSE_RL_FAULTS": fault})
    try:
        run.until(r"^step 1/50")
        (run_dir,) = runs.iterdir()
        import redis

        r = redis.Redis(port=redis_port(run.text))
        deadline = time.monotonic() + 300
        while read_learner_version(r, run_dir.name) < 2:  # the commit of step 2 publishes version 2
            assert time.monotonic() < deadline, run.text
            time.sleep(0.2)
        time.sleep(3)  # the driver is in the gap now (its fault or the learner's holds it for 300 s)
        if signum == signal.SIGINT:
            os.killpg(run.proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the foreground process group
        else:
            run.proc.send_signal(signal.SIGTERM)  # as Slurm or docker stop: the driver alone
        rc = run.finish(timeout=240)
    finally:
        run.kill()
    assert rc == (130 if signum == signal.SIGINT else 143), run.text
    assert not re.search(r"^step 2/50", run.text, re.M), run.text  # the stop landed before step 2's console line
    assert "Traceback" not in run.text, run.text
    ckpt = run_dir / "checkpoints"
    version = int((ckpt / "latest").read_text().strip().rpartition("_")[2])
    assert version == 2, run.text
    lines = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    assert [line["version"] for line in lines] == [1, 2], lines
    assert lines[-1]["prompt_ids"] == read_client_state(ckpt)["extra"]["trained_prompt_ids"]  # the checkpoint's
    assert {1, 2} <= learner_steps(run_dir)
    assert mlflow_status(run_dir) == "KILLED"
    what = "interrupted" if signum == signal.SIGINT else r"terminated \(SIGTERM\)"
    assert re.search(rf"^sparse-rl: {what} at step 2 of 50; last checkpoint: {re.escape(str(ckpt))}/version_2 ",
                     run.text, re.M), run.text
