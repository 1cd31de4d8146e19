"""Faults of a whole run end in bounded time with one line: `sparse-rl train` of the `tiny` preset in a
subprocess, with real Ray, Redis and MLflow. Bad input: exit 2 before anything started (no run directory). A fault:
exit 1, MLflow FAILED. SIGKILL of the driver: what it started dies with it. Nothing left running, the embedded
Redis included; no traceback on the console. (SIGTERM and Ctrl-C: tests/deploy/test_stop_record.py.)"""
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

from broker.run_state import ADMISSION_CLAIMS, key

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


ONE_ACTOR = "actors.count=1"
"""Runs whose check needs no second rollout actor start one: each actor is a process that imports torch and loads
the model, about a fifth of a tiny run's CPU time on a loaded 2-core CI machine (docs/development.md, "CI time")."""

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
    cases = [(name, f"actors.data.path={path}", [f"actors.data.path={path}", f"eval.data={good}"])
             for name, path in files.items()]
    cases += [(name, f"eval.data={path}", [f"actors.data.path={good}", f"eval.data={path}"])
              for name, path in files.items()]
    for i, (name, field, data) in enumerate(cases):
        preflight = "preflight.enabled=false" if i % 2 else "preflight.enabled=true"
        done = sparse_rl("train", "--config", "tiny", f"run_dir={runs}", "actors.data.source=gsm8k_jsonl", preflight,
                         *data, timeout=120)
        assert done.returncode == 2, (name, field, done.stdout)
        line = one_line(done.stdout)
        assert re.fullmatch(rf"sparse-rl: bad config: {re.escape(field)}: {expected[name]}.*", line), line
        assert not runs.exists(), (name, field, done.stdout)  # nothing was started or written


class Run:
    """`sparse-rl train` started in the background (its own session, as a job under a scheduler), its console
    read line by line."""

    def __init__(self, *args, cwd=ROOT, env=None):
        self.proc = subprocess.Popen([*CLI, "train", *args], cwd=cwd, env=env or ENV, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []

    def until(self, pattern: str) -> re.Match:
        """Read the console until a line matches `pattern` (fails if the run ends first)."""
        for line in self.proc.stdout:
            self.lines.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        pytest.fail(f"the run ended before a line matched {pattern!r}:\n{self.text}")

    def finish(self, timeout: float) -> int:
        """Wait for the end (reading the rest of the console); returns the exit code."""
        self.lines.append(self.proc.stdout.read())
        return self.proc.wait(timeout=timeout)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def processes(self) -> list:
        """The driver's process tree now (Ray, the embedded Redis, the workers)."""
        import psutil
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def workers(self, name: str) -> list:
        """The processes of the run's tree whose name or command line holds `name` (a Ray actor class), skipping
        any that ends while it is read."""
        import psutil
        found = []
        for p in self.processes():
            try:
                if name in " ".join([p.name(), *p.cmdline()]):
                    found.append(p)
            except psutil.Error:
                pass
        return found

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def redis_port(text: str) -> int:
    return int(re.search(r"^redis: redis://127\.0\.0\.1:(\d+)/0$", text, re.M).group(1))


def running(p) -> bool:
    """The process runs (not ended, not a zombie); False when it ends while it is read."""
    import psutil
    try:
        return p.is_running() and p.status() != "zombie"
    except psutil.Error:
        return False


def assert_all_gone(processes: list, port: int | None, within_s: float = 30.0) -> None:
    """Every process of the run's tree has ended and the embedded Redis port is closed (unless `port` is None),
    within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in processes if running(p)]
        if not alive:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"still running {within_s:g} s later: {[(p.pid, p.name()) for p in alive]}")
    if port is None:
        return
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def wait_for_claims(run: Run, runs: Path, n: int, within_s: float = 120.0) -> None:
    """Until the run's broker holds `n` admission claims (a fixed sleep races the actors' batch boundaries)."""
    import redis

    (run_dir,) = runs.iterdir()
    r = redis.Redis(port=redis_port(run.text))
    deadline = time.monotonic() + within_s
    while r.hlen(key(run_dir.name, ADMISSION_CLAIMS)) < n:
        if time.monotonic() > deadline:
            pytest.fail(f"{n} admission claims not held within {within_s:g} s:\n{run.text}")
        time.sleep(0.05)


def mlflow_status(run_dir: Path) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return run.info.status


@pytest.mark.timeout(600)
def test_a_sigkilled_drivers_redis_and_ray_die_with_it(tmp_path):
    """SIGKILL of the driver at step 1 (no handler runs): what it started dies with it, its embedded Redis at once,
    Ray's processes once their agents notice the raylet's end. (SIGTERM and Ctrl-C, which do run handlers:
    tests/deploy/test_stop_record.py.)"""
    killed = Run("--config", "tiny", f"run_dir={tmp_path / 'killed'}", "train.steps=50", "eval.enabled=false",
                 ONE_ACTOR)
    try:
        killed.until(r"^step 1/50")
        tree = killed.processes()
        redis = [p for p in tree if p.name() == "redis-server"]  # (names read while they run)
        assert len(redis) == 1, [p.name() for p in tree]
        killed.proc.send_signal(signal.SIGKILL)
        killed.finish(timeout=60)
        assert_all_gone(redis, redis_port(killed.text))
        # Ray's agents wait out their own timeout (~60 s, a report to the dead GCS) before they exit
        assert_all_gone(tree, None, within_s=120)
    finally:
        killed.kill()


def record_files(run_dir: Path) -> dict[str, bytes]:
    """The record's small files (config, run info, prompt log, checkpoint pointer), by name."""
    names = ["config.yaml", "run.json", "trained_prompts.jsonl", "checkpoints/latest", "checkpoints/OWNER"]
    return {n: (run_dir / n).read_bytes() for n in names if (run_dir / n).is_file()}


@pytest.mark.timeout(900)
def test_ctrl_c_after_training_points_at_eval_and_a_changed_resume_is_refused_untouched(tmp_path):
    """Ctrl-C during the final evaluation: the line points at `sparse-rl eval` of the final weights (training is
    done, a resume would exit 2), and that command works. Then `--resume` with a changed seed, data, learner.ranks
    and model (and ZeRO stage): exit 2 naming each, before anything is written (the record's files and MLflow run
    untouched, so that a plain `--resume` afterwards finds the record as the stop left it)."""
    runs = tmp_path / "runs"
    run = Run("--config", "tiny", f"run_dir={runs}", "train.steps=2", "learner.checkpoint_interval=1", ONE_ACTOR,
              "eval.before=false", "eval.limit=48", "eval.max_new_tokens=48")
    try:
        run.until(r"^groups produced")  # training is over; the evaluation starts
        os.killpg(run.proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C
        rc = run.finish(timeout=120)
    finally:
        run.kill()
    assert rc == 130, run.text
    (run_dir,) = runs.iterdir()
    final = run_dir / "final"
    line = one_line(run.text)
    match = re.fullmatch(rf"sparse-rl: interrupted at step 2 of 2, after training \(the final weights are in "
                         rf"{re.escape(str(final))}\); evaluate them with: (.+)", line)
    assert match, line
    assert mlflow_status(run_dir) == "KILLED"
    evaluated = subprocess.run(match.group(1).split(), cwd=tmp_path, env=ENV, capture_output=True, text=True,
                               timeout=600)
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    assert "accuracy" in evaluated.stdout

    before = record_files(run_dir)
    changed = ["seed=7", "actors.data.size=32", "learner.ranks=2", "learner.zero_stage=1", "model=tiny-char"]
    refused = sparse_rl("train", "--resume", str(run_dir), "train.steps=3", *changed, cwd=tmp_path, timeout=300)
    assert refused.returncode == 2, refused.stdout
    line = one_line(refused.stdout)
    assert line.startswith(f"sparse-rl: bad config: --resume {run_dir}: "), line
    assert "preflight:" not in refused.stdout, refused.stdout  # the refusal alone, not the KV table before it
    for field in ("seed=7 (the checkpoint's: 0)", "actors.data.size=32 (the checkpoint's: 64)",
                  "learner.ranks=2 (the checkpoint's: 1)", "learner.zero_stage=1 (the checkpoint's: 0)",
                  "model='tiny-char'"):
        assert field in line, line
    assert record_files(run_dir) == before
    assert mlflow_status(run_dir) == "KILLED"

    # (that a SIGTERM after `done` changes nothing: tests/deploy/test_stop_record.py, on its resume)


def learner_processes(run: Run) -> list:
    """The run's learner rank processes (Ray names them after LearnerWorker)."""
    return run.workers("LearnerWorker")


DIED = "run failed: learner rank 0 died while"
LEARNER_LOST = {  # name: (faults, extra overrides, the line after "sparse-rl: ")
    "actors loading": ("actor.start:*=sleep:300", [], f"{DIED} the actors were loading: "),  # they load 5 minutes
    "constructor": ("learner.init:0=exit", [], f"{DIED} starting: "),
    "weight sync": ("learner.send_weights:0@1=exit", ["learner.checkpoint_interval=1"],
                    f"{DIED} it sent the weights: "),
    "save_final": ("learner.save_final:0=exit", ["learner.checkpoint_interval=1"],
                   f"{DIED} it saved the final weights: "),
    "step raises": ("learner.step:0@0=fail", [], "run failed: learner step 1 failed: learner rank 0 raised "
                                                 "broker.faults.FaultInjectedError: "),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", LEARNER_LOST)
def test_a_learner_lost_outside_a_step_ends_the_run_at_once(tmp_path, name):
    """The learner dies in its constructor, while the actors load their model, during a weight sync, or while it
    saves the final weights, or its first step raises: each run ends within 30 s of the death with exit 1 and one
    line naming the rank and the phase, with the command to go on (start again without a checkpoint, resume with
    one, one step more when the final save died), MLflow FAILED, no process left. (One case per test, so that
    pytest's two workers share the five runs.)"""
    fault, extra, expected = LEARNER_LOST[name]
    runs = tmp_path / name.replace(" ", "_")
    env = {**ENV, "SPARSE_RL_FAULTS": fault}  # the fault seam, broker/faults.py
    run = Run("--config", "tiny", "train.steps=2", "eval.enabled=false", "train.wait_report_s=1", ONE_ACTOR,
              f"run_dir={runs}", *extra, env=env)
    try:
        if name == "actors loading":
            run.until(r"^waiting for the rollout actors for \d+ s: 1 rollout actor\(s\) starting")
            (learner,) = learner_processes(run)
            learner.kill()
        else:
            run.until(r"^redis: ")
        tree, died = run.processes(), time.monotonic()
        rc = run.finish(timeout=300)
        took = time.monotonic() - died
    finally:
        run.kill()
    assert rc == 1, (name, run.text)
    line = one_line(run.text)
    assert line.startswith(f"sparse-rl: {expected}"), (name, line)
    (run_dir,) = runs.iterdir()
    if extra:  # a checkpoint of version 1 (weight sync) or 2 (the last step): the resume command is runnable
        steps = " train.steps=3" if name == "save_final" else ""
        assert line.endswith(f"; resume with: {Path(sys.executable).parent}/sparse-rl train --resume "
                             f"{run_dir}{steps}"), line
    else:
        assert f"; start again with: {Path(sys.executable).parent}/sparse-rl train --config tiny" in line, line
    assert mlflow_status(run_dir) == "FAILED", name
    assert_all_gone(tree, redis_port(run.text))
    if name == "actors loading":
        assert took < 30, (name, took)
    # (a printed resume command is run to its end in tests/deploy/test_stop_record.py)


@pytest.mark.timeout(900)
def test_workers_import_the_installed_code_from_any_directory_and_counts_add_up(tmp_path):
    """Started from a directory holding decoy `actors`, `learner`, `broker`, `deploy` and `compressors` packages
    (a user's folders, an older checkout), the run imports the installed code everywhere and ends with exit 0.
    Its reward function fails on every sample: the run's reward_errors are the samples of every group produced
    (counts summed over the actors, not averaged), rollout_groups the groups produced, and the evaluation counts
    its reward errors too. Every process of actor 0 dies right after it published a batch, before the driver
    reads the step's metrics (Ray restarts it twice, then the driver replaces it; actor 1 starts 10 s late, so
    actor 0 publishes first): the counts of those batches are still in the run's totals."""
    cwd = tmp_path / "work"
    for name in ("actors", "learner", "broker", "deploy", "compressors"):
        (cwd / name).mkdir(parents=True)
        (cwd / name / "__init__.py").write_text(
            f"raise ImportError('the decoy {name} package in the cwd was imported')\n")
    user = tmp_path / "user_code"
    user.mkdir()
    (user / "failing_reward.py").write_text("def reward(text, response_ids, item):\n"
                                            "    raise ValueError('this reward always fails')\n")
    path = os.pathsep.join(filter(None, [str(user), os.environ.get("PYTHONPATH")]))  # (an empty entry = the cwd)
    env = {**ENV, "PYTHONPATH": path, "SPARSE_RL_FAULTS": "actor.published:actor-0=exit,actor.start:actor-1=sleep:10"}
    cli = str(Path(sys.executable).with_name("sparse-rl"))  # the console script: no cwd on the driver's sys.path
    done = subprocess.run([cli, "train", "--config", "tiny", "run_dir=runs", "train.steps=3", "eval.limit=4",
                           "actors.reward.function=failing_reward:reward", "eval.modes=[dense]"],
                          cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=800)
    assert done.returncode == 0, done.stdout
    assert "decoy" not in done.stdout, done.stdout
    (run_dir,) = (cwd / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    samples_per_prompt = 2  # the tiny preset
    assert acc["produced"] >= 6 and acc["rollout_groups"] == acc["produced"], acc
    assert acc["reward_errors"] == samples_per_prompt * acc["produced"], acc
    assert summary["eval/dense/reward_errors"] == summary["eval/dense/n"] == 4, summary
    assert re.search(rf"; reward errors {acc['reward_errors']}$", done.stdout, re.M), done.stdout


@pytest.mark.timeout(900)
def test_a_killed_actors_claimed_prompts_are_trained_later_in_the_same_run(tmp_path):
    """SIGKILL a rollout actor while it holds an admission claim (both actors sleep 10 s inside every batch,
    after the claim): once the claim expires, its prompt indices are handed out again, so the run trains every
    prompt index below its last exactly once (redone ones after later ones) and ends with exit 0. Every actor's
    process also dies when the driver stops generation at the end: the run still ends with exit 0, saying so."""
    runs = tmp_path / "runs"
    env = {**ENV, "SPARSE_RL_FAULTS": "actor.generate:*=sleep:10,actor.stop:*=exit"}  # the seam, broker/faults.py
    run = Run("--config", "tiny", f"run_dir={runs}", "train.steps=5", "eval.enabled=false", "broker.claim_ttl_s=3",
              env=env)
    try:
        run.until(r"^step 1/5")
        wait_for_claims(run, runs, 2)  # both actors are in their next batch, each holding a claim of 2 prompts
        rollout = run.workers("RolloutWorker")
        assert len(rollout) == 2, run.processes()
        rollout[0].kill()
        rc = run.finish(timeout=600)
    finally:
        run.kill()
    assert rc == 0, run.text
    assert re.search(r"^rollout actor \d+ is gone \(\w+Error: .*; its last batch is not counted$", run.text, re.M)
    assert "Traceback" not in run.text, run.text
    (run_dir,) = runs.iterdir()
    steps = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    trained = [int(pid.rsplit("-", 1)[1]) for s in steps for pid in s["prompt_ids"]]  # basic_arithmetic-s0-<index>
    assert len(trained) == 5 * 2, steps
    assert sorted(trained) == list(range(max(trained) + 1)), trained  # each index below the last, once
    acc = json.loads((run_dir / "summary.json").read_text())["accounting"]
    assert acc["claims_expired"] >= 1 and acc["prompts_redone"] >= 1, acc
