"""Ctrl-C on `sparse-rl train` (a real run of the `tiny` preset, real Ray, Redis and MLflow, in a subprocess):
one line saying where the run stopped and how to resume, exit code 130, no traceback, the MLflow run KILLED,
nothing left running. Then `sparse-rl train --resume`: the same MLflow run (versions 1..4, FINISHED), the
counters continued (the embedded broker keeps its data in the run directory)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from deploy.metric_names import metric_history

pytestmark = pytest.mark.system  # Ray, DeepSpeed, Redis (and MLflow) together: not in the quick lane

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_ctrl_c_stops_the_run_cleanly(tmp_path):
    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "deploy.cli", "train", "--config", "tiny", f"run_dir={runs}", "train.steps=50",
               "learner.checkpoint_interval=1", "actors.count=1"]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    # its own process group, signalled as a terminal's Ctrl-C signals the foreground group
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    output = []
    try:
        for line in proc.stdout:
            output.append(line)
            if line.startswith("step 1/50"):
                os.killpg(proc.pid, signal.SIGINT)
                break
        output.append(proc.stdout.read())
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(output)
    assert rc == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    lines = [line for line in text.splitlines() if "interrupted" in line]
    assert len(lines) == 1, text
    (run_dir,) = runs.iterdir()
    ckpt = run_dir / "checkpoints"
    match = re.fullmatch(rf"sparse-rl: interrupted at step (\d+) of 50; last checkpoint: {re.escape(str(ckpt))}/(\S+) "
                         rf"\(the learner may be a step ahead of the console; a resume continues from version \d+\); "
                         rf"resume with: {re.escape(sys.executable.rsplit('/', 1)[0])}/sparse-rl train --resume "
                         rf"{re.escape(str(run_dir))}", lines[0])
    assert match, lines[0]
    assert int(match.group(1)) >= 1 and (ckpt / match.group(2)).is_dir()

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "KILLED"
    port = int(re.search(r"^redis: redis://127\.0\.0\.1:(\d+)/0$", text, re.M).group(1))
    with pytest.raises(ConnectionRefusedError):  # its embedded Redis (own session, stopped last) is gone too
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    deadline = time.monotonic() + 30  # nothing of the run's process group is left
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        pytest.fail("processes of the interrupted run are still running")

    # resume it, as the line says (with fewer total steps, to keep the test short)
    resumed = subprocess.run([sys.executable, "-m", "deploy.cli", "train", "--resume", str(run_dir), "train.steps=4"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed at weight version" in resumed.stdout
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # still one MLflow run
    assert run.info.status == "FINISHED"
    assert {m.step for m in metric_history(client, run.info.run_id, "reward_mean")} == {1, 2, 3, 4}
    # the record's log of trained prompts has every version once, also the one the interrupted driver never logged
    logged = [json.loads(line)["version"] for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4], logged
    summary = json.loads((run_dir / "summary.json").read_text())
    gps = int(re.search(r"^  groups_per_step: (\d+)$", (run_dir / "config.yaml").read_text(), re.M).group(1))
    assert summary["groups_trained"] == 4 * gps  # the learner's counter continued from the checkpoint
    acc = summary["accounting"]  # the broker's counters continued too: the identity holds over both lives
    assert acc["consumed"] >= 4 * gps
    assert acc["produced"] == (acc["consumed"] + acc["dropped_stale"] + acc["dead_lettered"] + acc["duplicates"]
                               + acc["left_in_queue"]), acc
