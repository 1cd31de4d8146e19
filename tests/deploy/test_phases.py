"""The console says what each part is doing: the learner's wait line names each actor's phase and
for how long, and a learner step that runs longer than train.wait_report_s gets its own line naming the rank and
the part of the step; no such line while everything is on time. `sparse-rl train` of the `tiny` preset in a
subprocess (real Ray, Redis, DeepSpeed and MLflow), made slow through a reward that never returns, the fault seam
(broker/faults.py) and SIGSTOP of the learner's process."""
from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

from tests.deploy.test_faults import ENV, ONE_ACTOR, Run, running

pytestmark = pytest.mark.system

WAIT_REPORT_S = 4
SLACK_S = 8.0
"""How much later than train.wait_report_s a line may come on a loaded 2-core machine (the driver looks every
WAIT_POLL_S = 2 s, and each look pings the actors)."""
SLOW = r"^learner step (\d+) slow: learner-0 ([a-z ]+) for (\d+) s \((.*)\)$"
"""The driver's line for a learner step that runs long."""
FROZEN_S = 24.0
"""How long the learner's process is frozen (SIGSTOP), seconds: longer than the latest line the test accepts
(WAIT_REPORT_S + SLACK_S + 10 = 22 s), so that a line later than that still comes during the freeze and fails the
test; the test waits it out whatever the line's time."""
WAITING_FOR_LEARNER = r"^waiting for the learner for (\d+) s \((?!starting\))(.*)\): learner-0 ([a-z ]+) for (\d+) s$"
"""The driver's line for another call on the learner that runs long during the run (e.g. a weight sync); not the
line that says the learner ranks are still starting ("(starting)"), which a loaded machine may print before any
step whether or not the learner is on time later."""


@pytest.mark.timeout(900)
def test_a_reward_that_never_returns_shows_the_actors_scoring(tmp_path):
    """The issue's case: a reward function that never returns (`time.sleep(1e9)`, actors.reward.timeout_s=3: each
    sample ends at the timeout, a batch of 4 samples scores for 12 s, three train.wait_report_s). While the learner
    waits for its groups the line names the phase the actors are in, "scoring" ("queue empty: actor-0 scoring for
    5 s, actor-1 scoring for 4 s"), not "still generating"; no learner line (the learner is on time). Every sample
    scores 0 and is a reward error, each actor says so once, and the run trains its step and ends with exit 0. (A
    busy-looping reward, which a timeout must kill rather than wait out: tests/actors/test_user_code.py.)"""
    user = tmp_path / "user_code"
    user.mkdir()
    (user / "hanging_reward.py").write_text("import time\n\n\ndef reward(text, response_ids, item):\n"
                                            "    time.sleep(1e9)\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(user), os.environ.get("PYTHONPATH")]))}
    run = Run("--config", "tiny", f"run_dir={tmp_path / 'runs'}", "train.steps=1", "eval.enabled=false",
              "actors.reward.function=hanging_reward:reward", "actors.reward.timeout_s=3",
              f"train.wait_report_s={WAIT_REPORT_S}", env=env)
    try:
        line = run.until(r"^learner waiting for the groups of step 1 for \d+ s: queue empty: .*scoring for \d+ s")
        rc = run.finish(timeout=600)
    finally:
        run.kill()
    assert rc == 0, run.text
    phases = re.findall(r"(actor-\d) ([a-z ]+) for (\d+) s", line.string)
    assert {actor for actor, _, _ in phases} == {"actor-0", "actor-1"}, line.string  # each live actor, named
    assert "still generating" not in run.text, run.text
    assert not re.search(SLOW, run.text, re.M) and not re.search(WAITING_FOR_LEARNER, run.text, re.M), run.text
    assert re.search(r"^step 1/1 ", run.text, re.M), run.text
    said = re.findall(r"(actor-\d+): reward function hanging_reward:reward timed out after 3 s on \S+ "
                      r"\(actors\.reward\.timeout_s; the sample scored 0, counted in reward_errors\); later timeouts "
                      r"are counted, not printed", run.text)
    assert said and len(said) == len(set(said)), run.text  # once per actor
    (run_dir,) = (tmp_path / "runs").iterdir()
    acc = json.loads((run_dir / "summary.json").read_text())["accounting"]
    assert acc["learner_version"] == 1
    assert acc["reward_errors"] == 2 * acc["produced"], acc  # samples_per_prompt 2 (the tiny preset)


@pytest.mark.timeout(900)
def test_a_frozen_learner_gets_a_line_within_wait_report_s(tmp_path):
    """The issue's case: the learner's process frozen (SIGSTOP) for FROZEN_S after step 2: a line naming learner-0 and
    its phase within train.wait_report_s (plus the time an actor takes to queue a group, when it froze while
    reading its groups: then the line says a group waits unread); after SIGCONT the run finishes."""
    run = Run("--config", "tiny", f"run_dir={tmp_path / 'runs'}", "train.steps=4", "eval.enabled=false", ONE_ACTOR,
              f"train.wait_report_s={WAIT_REPORT_S}")
    try:
        run.until(r"^step 2/4 ")
        (learner,) = run.workers("LearnerWorker")
        learner.suspend()  # SIGSTOP: only the learner rank's process, of the run this test started
        frozen = time.monotonic()
        thaw = threading.Timer(FROZEN_S, lambda: running(learner) and learner.resume())  # SIGCONT, whatever happens
        thaw.start()
        try:
            late = run.until(rf"{SLOW}|{WAITING_FOR_LEARNER}")
            noticed = time.monotonic() - frozen
        finally:
            thaw.join()
        rc = run.finish(timeout=600)
    finally:
        run.kill()
    assert rc == 0, run.text
    phase, detail = (late.group(2), late.group(4)) if late.group(2) else (late.group(7), late.group(6))
    assert phase in ("reading groups", "recompute", "backward", "optimizer step", "checkpoint", "commit", "idle",
                     "weight sync"), late.string
    limit = WAIT_REPORT_S + SLACK_S + (10 if phase == "reading groups" else 0)  # (an actor queues a group first)
    assert noticed <= limit < FROZEN_S, (noticed, late.string, run.text)
    if phase == "reading groups":
        assert "the oldest group in the queue unread for" in detail, late.string
    assert re.search(r"^step 4/4 ", run.text, re.M), run.text


LEARNER_HELD_S = 30
"""How long learner rank 0 is held at the start of its constructor, before its model loads, seconds: far longer
than the actors need to start and load the tiny model on a loaded 2-core machine."""


@pytest.mark.timeout(900)
def test_a_held_learner_start_and_a_stalled_step_each_get_their_lines(tmp_path):
    """One run, two holds (a whole run each would cost twice the start-up).
    The start: the rollout actors start with the learner ranks, not after them, so a run's start takes the longer of
    the two, not their sum: learner rank 0 held LEARNER_HELD_S at the start of its constructor (fault
    `learner.init:0=sleep:30`). A line every train.wait_report_s says that the driver waits for the learner to start,
    and an actor's model load shows on the console before the last of them.
    A step: the learner stalls 20 s at the start of its step from version 1 (fault `learner.step:0@1=sleep:20`): a
    line names the step, learner-0 and its phase (recompute) within train.wait_report_s of the stall, and again every
    train.wait_report_s while it lasts; the steps on time get no such line, and no call on the learner but the start
    gets a waiting line. The run finishes."""
    faults = f"learner.init:0=sleep:{LEARNER_HELD_S},learner.step:0@1=sleep:20"
    run = Run("--config", "tiny", f"run_dir={tmp_path / 'runs'}", "train.steps=3", "eval.enabled=false", ONE_ACTOR,
              f"train.wait_report_s={WAIT_REPORT_S}", env={**ENV, "SPARSE_RL_FAULTS": faults})
    try:
        stalled = run.until(SLOW)
        rc = run.finish(timeout=600)
    finally:
        run.kill()
    assert rc == 0, run.text
    waits = [m.start() for m in re.finditer(r"^waiting for the learner for \d+ s \(starting\): learner-0 \(phase not "
                                            r"known\)$", run.text, re.M)]  # every WAIT_REPORT_S while it is held
    loads = [m.start() for m in re.finditer(r"\(RolloutWorker pid=\d+\)\S*\s*Loading weights", run.text, re.M)]
    assert waits and loads, run.text  # (transformers' load bar, relayed by Ray)
    assert loads[0] < waits[-1], run.text  # an actor loaded its model while the learner was still held

    step, phase, seconds, detail = stalled.groups()
    assert (step, phase) == ("2", "recompute"), stalled.string
    assert WAIT_REPORT_S <= int(seconds) <= WAIT_REPORT_S + SLACK_S, stalled.string
    assert detail.endswith(" s since it had its groups"), stalled.string
    slow = re.findall(SLOW, run.text, re.M)
    assert {s for s, *_ in slow} == {"2"} and len(slow) >= 2, run.text  # again while it lasts; no other step
    assert not re.search(WAITING_FOR_LEARNER, run.text, re.M), run.text  # (the start's line says "(starting)")
    assert re.search(r"^step 3/3 ", run.text, re.M), run.text
