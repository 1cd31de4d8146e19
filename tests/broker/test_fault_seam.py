"""The fault-injection seam (broker/faults.py): specs parse or are named when wrong, a point with no fault named
runs the function itself, and named faults fire only for their process and version."""
import os

import pytest

from broker import faults


def test_specs_parse_and_a_bad_one_is_named():
    assert faults.parse("learner.step:1@2=sleep:0.5, actor.start:*=fail,actor.generate:actor-2=exit") == [
        faults.Fault("learner.step", "1", 2, "sleep", 0.5), faults.Fault("actor.start", "*", None, "fail"),
        faults.Fault("actor.generate", "actor-2", None, "exit")]
    for bad in ("learner.step=sleep:1", "learner.step:1=nap:3", "learner.step:1@x=fail", "actor.start:a=sleep"):
        with pytest.raises(ValueError, match="SPARSE_RL_FAULTS"):
            faults.parse(bad)


def test_without_a_fault_the_function_itself_runs(monkeypatch):
    def step():
        return "stepped"
    monkeypatch.delenv(faults.FAULTS_ENV, raising=False)
    assert faults.wrap(step, "learner.step", 1) is step
    monkeypatch.setenv(faults.FAULTS_ENV, "learner.step:2=fail,actor.start:1=fail")   # other rank, other point
    assert faults.wrap(step, "learner.step", 1) is step


def test_a_named_fault_fires_for_its_process_and_version_only(monkeypatch):
    version, calls = [0], []
    monkeypatch.setenv(faults.FAULTS_ENV, "learner.step:1@1=fail")
    step = faults.wrap(lambda: calls.append(version[0]), "learner.step", 1, when=lambda: version[0])
    step()
    version[0] = 1
    with pytest.raises(faults.FaultInjectedError, match="learner.step of 1 fails"):
        step()
    version[0] = 2
    step()
    assert calls == [0, 2]
    monkeypatch.setenv(faults.FAULTS_ENV, "actor.start:*=fail")
    with pytest.raises(faults.FaultInjectedError):
        faults.wrap(lambda: None, "actor.start", "actor-7")()


def test_a_stale_fault_runs_the_stand_in_instead_of_the_call_at_its_version_only(monkeypatch):
    """`stale` (actor.load_weights): at its version the stand-in runs with the call's arguments and the function does
    not; at other versions the function runs; a point without a stand-in refuses the fault."""
    loading, loaded, stood_in = [0], [], []
    monkeypatch.setenv(faults.FAULTS_ENV, "actor.load_weights:actor-0@2=stale")
    load = faults.wrap(lambda tensors, version: loaded.append(version), "actor.load_weights", "actor-0",
                       when=lambda: loading[0], stale=lambda tensors, version: stood_in.append(version))
    for version in (1, 2, 3):
        loading[0] = version
        load([], version)
    assert loaded == [1, 3] and stood_in == [2]
    assert faults.parse("actor.load_weights:*=stale") == [faults.Fault("actor.load_weights", "*", None, "stale")]
    with pytest.raises(ValueError, match="`stale` at actor.load_weights: that point has no stand-in"):
        faults.wrap(lambda tensors, version: None, "actor.load_weights", "actor-0")


def test_kill_child_kills_this_processes_children_of_that_title_only(monkeypatch):
    """`kill_child:<title>` SIGKILLs the children whose command line starts with <title> (SGLang's subprocesses
    carry a title such as `sglang::scheduler`) and goes on: another child lives, the function still runs."""
    import subprocess
    import sys
    import time

    import psutil
    title = "sparse-rl-test::victim"
    code = "import time; time.sleep(60)"
    victim = subprocess.Popen(["bash", "-c", f"exec -a {title} {sys.executable} -c '{code}'"])
    bystander = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while psutil.Process(victim.pid).cmdline()[:1] != [title]:     # bash has exec'd it under its title
        assert time.monotonic() < deadline, psutil.Process(victim.pid).cmdline()
        time.sleep(0.05)
    try:
        monkeypatch.setenv(faults.FAULTS_ENV, f"actor.generate:actor-0=kill_child:{title}")
        assert faults.parse(os.environ[faults.FAULTS_ENV])[0].arg == title
        assert faults.wrap(lambda: "generated", "actor.generate", "actor-0")() == "generated"
        assert victim.wait(timeout=10) == -9
        assert bystander.poll() is None
    finally:
        victim.kill()
        bystander.kill()
    with pytest.raises(ValueError, match="kill_child"):
        faults.parse("actor.generate:actor-0=kill_child")
