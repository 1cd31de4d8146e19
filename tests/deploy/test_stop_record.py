"""The record agrees with itself after any stop: Ctrl-C or SIGTERM landing in the gap between the
learner's commit of a step and the driver's console line for it still leaves every version a checkpoint holds
with its line in trained_prompts.jsonl and its learner metrics in MLflow. `sparse-rl train` of the `tiny` preset
in a subprocess (real Ray, Redis, DeepSpeed and MLflow); the gap is held open with the fault seam
(broker/faults.py): `driver.log` (the driver has the step's report and has not logged it yet) and
`learner.committed` (the learner committed and has not answered the driver yet). The Ctrl-C case also checks the
user's side of a stop (exit 130, one line saying where and how to resume, no traceback, MLflow KILLED, nothing of the
run left, its embedded Redis included) and resumes the run as the line says: the same MLflow run (versions 1..4,
FINISHED) and the counters continued (the embedded broker keeps its data in the run directory)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.run_state import read_learner_version
from learner.checkpoint import read_client_state
from tests.deploy.test_faults import ENV, ONE_ACTOR, Run, assert_all_gone, mlflow_status, one_line, redis_port

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
        tree, sent = run.processes(), time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(run.proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the foreground process group
        else:
            run.proc.send_signal(signal.SIGTERM)  # as Slurm or docker stop: the driver alone
        rc = run.finish(timeout=240)
        took = time.monotonic() - sent
    finally:
        run.kill()
    assert rc == (130 if signum == signal.SIGINT else 143), run.text
    assert took < 30, (took, run.text)
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
    assert_all_gone(tree, redis_port(run.text))  # the run's processes and its embedded Redis (stopped last)
    if signum == signal.SIGINT:
        ctrl_c_is_one_line_and_the_resume_it_prints_trains_on(run.text, run_dir)
    else:
        sigterm_is_one_line_and_the_resume_it_prints_trains_on(run.text, run_dir)


def sigterm_is_one_line_and_the_resume_it_prints_trains_on(text: str, run_dir: Path) -> None:
    """After SIGTERM at step 2 of 50 with no interval checkpoint (Slurm's time limit, pod deletion, docker stop): the
    learner checkpointed its last step, the one line says so and how to resume, Ray's native crash handler printed
    nothing, and the resume it prints trains on; a SIGTERM to that resume once it finished exits 0 with one line."""
    line = one_line(text)
    match = re.fullmatch(rf"sparse-rl: terminated \(SIGTERM\) at step 2 of 50; last checkpoint: "
                         rf"{re.escape(str(run_dir / 'checkpoints'))}/version_2 \(.*\); resume with: (\S+) train "
                         rf"--resume {re.escape(str(run_dir))}", line)
    assert match, line
    assert "logging.cc" not in text and "*** SIGTERM received" not in text, text
    assert match.group(1) == str(Path(sys.executable).parent / "sparse-rl"), line  # (Run starts that program's code)
    # the resume as printed; a SIGTERM once it printed `done` (summary written, MLflow FINISHED) changes nothing
    resumed = Run("--resume", str(run_dir), "train.steps=3", cwd=run_dir.parent)
    try:
        resumed.until(r"^\W*done\W*$")
        tree = resumed.processes()
        resumed.proc.send_signal(signal.SIGTERM)
        rc = resumed.finish(timeout=120)
    finally:
        resumed.kill()
    assert rc == 0, resumed.text
    assert "resumed at weight version 2" in resumed.text, resumed.text
    assert "sparse-rl: SIGTERM after the run finished: ignored (its record is complete); finishing the shutdown, " \
           "exit 0" in resumed.text, resumed.text
    assert mlflow_status(run_dir) == "FINISHED"
    assert_all_gone(tree, redis_port(resumed.text))


def ctrl_c_is_one_line_and_the_resume_it_prints_trains_on(text: str, run_dir: Path) -> None:
    """After a Ctrl-C at step 2 of 50: the one line as a user reads it, then `--resume` to 4 steps continues the
    same record (one MLflow run, versions 1..4 once each in the log of trained prompts, counters continued)."""
    from mlflow.tracking import MlflowClient

    from deploy.metric_names import metric_history

    assert "KeyboardInterrupt" not in text, text
    (line,) = [line for line in text.splitlines() if "interrupted" in line]
    ckpt = run_dir / "checkpoints"
    assert re.fullmatch(rf"sparse-rl: interrupted at step 2 of 50; last checkpoint: {re.escape(str(ckpt))}/version_2 "
                        rf"\(the learner may be a step ahead of the console; a resume continues from version \d+\); "
                        rf"resume with: {re.escape(str(Path(sys.executable).parent))}/sparse-rl train --resume "
                        rf"{re.escape(str(run_dir))}", line), line
    resumed = subprocess.run([sys.executable, "-m", "deploy.cli", "train", "--resume", str(run_dir), "train.steps=4"],
                             cwd=run_dir.parent, env=ENV, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed at weight version 2" in resumed.stdout, resumed.stdout
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # still one MLflow run
    assert run.info.status == "FINISHED"
    assert {m.step for m in metric_history(client, run.info.run_id, "reward_mean")} == {1, 2, 3, 4}
    logged = [json.loads(line)["version"] for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4], logged  # every version once, also the one the interrupted driver never logged
    summary = json.loads((run_dir / "summary.json").read_text())
    gps = int(re.search(r"^  groups_per_step: (\d+)$", (run_dir / "config.yaml").read_text(), re.M).group(1))
    assert summary["groups_trained"] == 4 * gps  # the learner's counter continued from the checkpoint
    acc = summary["accounting"]  # the broker's counters continued too: the identity holds over both lives
    assert acc["consumed"] >= 4 * gps
    assert acc["produced"] == (acc["consumed"] + acc["dropped_stale"] + acc["dead_lettered"] + acc["duplicates"]
                               + acc["left_in_queue"]), acc
