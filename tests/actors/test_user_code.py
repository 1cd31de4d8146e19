"""User code that hangs is bounded (actors/user_code.py): a reward that busy-loops times out at
actors.reward.timeout_s and the scorer stays usable, with this process's threads and CPU use back at their
baseline and no worker left running; a task generator that never returns ends the start with one line (exit 2);
the worker is reused from call to call and goes away with its caller. Real processes, real user code
(tests/actors/hanging_user_code.py), no mocks."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from actors.tasks.data import Prompt, task_problems
from actors.tasks.reward import RewardConfig, RewardResult, RewardScorer
from actors.user_code import UserCode, UserCodeError, UserCodeTimeout, call_with_timeout

HERE = Path(__file__).resolve().parent  # holds hanging_user_code.py
CLI = str(Path(sys.executable).with_name("sparse-rl"))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}


def item() -> Prompt:
    return Prompt("p-0", "q", "7", metadata={"target": 4})


def cpu_s(proc: psutil.Process) -> float:
    """CPU seconds used so far by `proc` and its live children."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def idle_cpu_s(proc: psutil.Process, seconds: float = 2.0) -> float:
    """CPU seconds `proc` and its children use in `seconds` of doing nothing."""
    before = cpu_s(proc)
    time.sleep(seconds)
    return cpu_s(proc) - before


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_busy_looping_reward_times_out_and_the_scorer_stays_usable():
    """actors.reward.timeout_s (10 s by default; 2 s here, each timeout burns a core for its length): each of 3
    samples whose reward busy-loops scores 0 (status error) after 2 s, its worker killed; the scorer then scores
    normal samples right, in one worker reused from sample to sample; this process (the actor's, here) has the
    threads it had before, uses no more CPU than before, and the killed workers are gone. (On the code before
    actors/user_code.py the first such sample never returns.)"""
    me = psutil.Process()
    assert RewardConfig().timeout_s == 10.0  # the default a run gets
    scorer = RewardScorer(RewardConfig(function="hanging_user_code:spin_reward", timeout_s=2.0))
    assert scorer("abc", [1, 2, 3], item()) == RewardResult(0.75, "wrong", "")  # 3 ids / target 4
    threads, baseline = me.num_threads(), idle_cpu_s(me)
    killed = []
    for n in range(1, 4):
        # (a new worker after a timeout)
        assert scorer("abcd", [1, 2, 3, 4], item()) == RewardResult(1.0, "correct", "")
        workers = {p.pid for p in me.children(recursive=True)}
        start = time.monotonic()
        result = scorer("spin", [1], item())
        took = time.monotonic() - start
        assert result == RewardResult(0.0, "error", "") and scorer.timeouts == n
        assert 2.0 <= took < 5.0, took
        assert scorer.last_error == ("reward function hanging_user_code:spin_reward timed out after 2 s on p-0 "
                                     "(actors.reward.timeout_s; the sample scored 0, counted in reward_errors)")
        killed += workers - {p.pid for p in me.children(recursive=True)}
        assert len(killed) == n and gone(killed[-1]) and scorer.code.pid is None
    assert scorer("abcd", [1, 2, 3, 4], item()) == RewardResult(1.0, "correct", "")  # usable after 3 timeouts
    worker = scorer.code.pid
    assert [scorer("ab", [1, 2], item()) for _ in range(5)] == [RewardResult(0.5, "wrong", "")] * 5
    assert scorer.code.pid == worker not in killed  # one worker for every sample, not a process per sample
    assert me.num_threads() == threads, (me.num_threads(), threads)
    after = idle_cpu_s(me)
    assert after <= baseline + 0.1, (after, baseline)
    assert all(gone(pid) for pid in killed)
    live = me.children(recursive=True)
    assert [p.pid for p in live] == [worker], live  # the live worker only, and it is idle
    assert idle_cpu_s(live[0], 1.0) < 0.05
    scorer.close()
    assert gone(worker)


def test_the_math_reward_runs_in_the_worker_too():
    scorer = RewardScorer(RewardConfig())
    assert scorer("#### 7", [1], item()) == RewardResult(1.0, "correct", "7")
    assert scorer("no number", [1], item()).status == "unparseable"
    assert scorer.code.pid is not None and scorer.code.pid != os.getpid()
    with pytest.raises(ValueError, match="cannot be parsed by math-verify"):  # a data error is raised, as before
        scorer("#### 7", [1], Prompt("p-1", "q", ""))


def test_the_seam_reuses_its_worker_reports_errors_and_runs_in_process_without_a_limit():
    code = UserCode("hanging_user_code:pid_and", 30)
    (pid, value), (again, _) = code(value={"a": [1, 2]}), code()
    assert pid == again == code.pid != os.getpid() and value == {"a": [1, 2]}
    with pytest.raises(UserCodeError, match=r"^KeyError: 'boom'$"):
        UserCode("hanging_user_code:fails", 30)("boom")
    with pytest.raises(UserCodeError, match=r"^\w+: its result cannot be sent back"):
        call_with_timeout("hanging_user_code:unpicklable_result", 30)
    with pytest.raises(UserCodeError, match="cannot load hanging_user_code:nope in the worker"):
        call_with_timeout("hanging_user_code:nope", 30)
    assert code(7) == (pid, 7)  # still the same worker after the others' errors
    assert UserCode("hanging_user_code:pid_and", 0)(3) == (os.getpid(), 3)  # 0: no limit, this process
    start = time.monotonic()
    with pytest.raises(UserCodeTimeout, match=r"^tests' loop did not return within 1.5 s \(some.setting\)$"):
        call_with_timeout("hanging_user_code:forever", 1.5, name="tests' loop", setting="some.setting")
    assert time.monotonic() - start < 1.5 + 30  # the worker's start (not timed) and 1.5 s
    code.close()
    assert gone(pid) and code.pid is None
    assert code()[0] not in (None, pid)  # a new worker after close()


def test_the_worker_dies_with_its_caller_while_it_busy_loops():
    """SIGKILL the process that called a function that never returns: its worker exits within seconds."""
    script = ("import sys, threading, time; sys.path.insert(0, sys.argv[1])\n"
              "from actors.user_code import UserCode\n"
              "code = UserCode('hanging_user_code:forever', 600)\n"
              "threading.Thread(target=code, daemon=True).start()\n"
              "while code.pid is None: time.sleep(0.05)\n"
              "print(code.pid, flush=True); time.sleep(600)\n")
    caller = subprocess.Popen([sys.executable, "-c", script, str(HERE)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(caller.stdout.readline())
        time.sleep(1.0)
        assert psutil.Process(worker).cpu_times().user > 0.2  # it is busy-looping
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    deadline = time.monotonic() + 10
    while not gone(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(worker)


def test_a_task_generator_that_never_returns_times_out_naming_it():
    start = time.monotonic()
    with pytest.raises(UserCodeTimeout) as e:
        task_problems("hanging_user_code:generate_forever", 4, 0, timeout_s=1)
    assert str(e.value) == ("task generator hanging_user_code:generate_forever did not return within 1 s "
                            "(actors.data.timeout_s)")
    assert time.monotonic() - start < 1 + 30
    assert [p.question for p in task_problems("hanging_user_code:yielding_generator", 2, 5)] == ["Say 5", "Say 6"]
    with pytest.raises(ValueError, match=r"^data\.function='hanging_user_code:fails': TypeError: "):
        task_problems("hanging_user_code:fails", 2, 0)  # fails(message) has no `size` parameter


def test_a_hanging_task_generator_ends_the_start_with_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([CLI, "train", "--config", "tiny", f"run_dir={tmp_path}", "actors.data.source=function",
                           "actors.data.function=hanging_user_code:generate_forever", "actors.data.timeout_s=2"],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "sparse-rl: bad config: actors.data (function): UserCodeTimeout: task generator "
        "hanging_user_code:generate_forever did not return within 2 s (actors.data.timeout_s)"], proc.stderr
    assert not list(tmp_path.iterdir())  # nothing started


@pytest.mark.parametrize("field", ["actors.reward.timeout_s", "actors.data.timeout_s"])
def test_a_bad_timeout_is_one_line_naming_the_dotted_field(field):
    from deploy.config import ConfigError, load_config
    assert RewardConfig().timeout_s == 10.0
    for value in ("-1", "nan"):
        with pytest.raises(ConfigError) as e:
            load_config("tiny", [f"{field}={value}"], check_files=False)
        assert str(e.value) == f"{field}={float(value)}: expected seconds >= 0 (0 = no limit)"
