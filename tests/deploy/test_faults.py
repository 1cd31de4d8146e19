"""Faults of a whole run end in bounded time with one line (issue 21): `sparse-rl train` of the `tiny` preset in a
subprocess, with real Ray, Redis and MLflow. Bad input: exit 2 before anything started (no run directory). A fault:
exit 1, MLflow FAILED. SIGTERM: exit 143, a checkpoint of the last step, MLflow KILLED. Nothing left running,
the embedded Redis included; no traceback on the console."""
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

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "deploy.cli"]
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

pytestmark = pytest.mark.system


def sparse_rl(*args, cwd=ROOT, timeout=300, env=None) -> subprocess.CompletedProcess:
    """`sparse-rl <args>` to its end (stdout and stderr together in .stdout)."""
    return subprocess.run([*CLI, *args], cwd=cwd, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


def one_line(text: str, prefix: str = "sparse-rl: ") -> str:
    """The single line of `text` starting with `prefix` (asserts there is exactly one, and no traceback)."""
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, text
    return lines[0]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"})


@pytest.mark.timeout(600)
def test_bad_data_files_fail_at_the_config_check(tmp_path):
    """A malformed line, an empty file, a row without `question`, in actors.data.path or eval.data: exit 2, one line
    naming the field, the file and the line; nothing started (no run directory). Also with the preflight off, where
    such a run used to start Ray, Redis and MLflow (and hang on an empty file)."""
    files = {
        "malformed": write_jsonl(tmp_path / "malformed.jsonl", [GOOD, '{"question": "2 + 2?", "answer": "#### 4"']),
        "empty": write_jsonl(tmp_path / "empty.jsonl", []),
        "no_question": write_jsonl(tmp_path / "no_question.jsonl", [GOOD, GOOD, json.dumps({"answer": "#### 3"})]),
    }
    expected = {"malformed": r"line 2: not JSON \(Expecting ',' delimiter at column 42\)",
                "empty": r"empty file: no JSON rows",
                "no_question": r"line 3: expected a JSON object with string fields 'question' and 'answer'"}
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD])
    runs = tmp_path / "runs"
    cases = [(name, f"actors.data.path={path}", [f"actors.data.path={path}", f"eval.data={good}"]) for name, path in files.items()]
    cases += [(name, f"eval.data={path}", [f"actors.data.path={good}", f"eval.data={path}"]) for name, path in files.items()]
    for i, (name, field, data) in enumerate(cases):
        preflight = "preflight.enabled=false" if i % 2 else "preflight.enabled=true"
        done = sparse_rl("train", "--config", "tiny", f"run_dir={runs}", "actors.data.source=gsm8k_jsonl", preflight,
                         *data, timeout=120)
        assert done.returncode == 2, (name, field, done.stdout)
        line = one_line(done.stdout)
        assert re.fullmatch(rf"sparse-rl: bad config: {re.escape(field)}: {expected[name]}.*", line), line
        assert not runs.exists(), (name, field, done.stdout)  # nothing was started or written
