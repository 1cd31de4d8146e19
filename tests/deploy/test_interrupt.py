"""Ctrl-C on `sparse-rl train` (a real run of the `tiny` preset, real Ray, Redis and MLflow, in a subprocess):
one line saying where the run stopped and how to resume, exit code 130, no traceback, the MLflow run KILLED,
nothing left running."""
from __future__ import annotations

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

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_ctrl_c_stops_the_run_cleanly(tmp_path):
    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "deploy.cli", "train", "--config", "tiny", f"run_dir={runs}", "train.steps=50",
               "learner.checkpoint_interval=1"]
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
    match = re.fullmatch(rf"sparse-rl: interrupted at step (\d+) of 50; last checkpoint: {re.escape(str(ckpt))}/(\S+); "
                         rf"resume with: sparse-rl train --config tiny run_dir={re.escape(str(runs))} train\.steps=50 "
                         rf"learner\.checkpoint_interval=1 learner\.checkpoint_dir={re.escape(str(ckpt))}", lines[0])
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
