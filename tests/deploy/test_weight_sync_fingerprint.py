"""A weight sync that never reached the rollout engine (the engine reports the new version and keeps the old
weights: the fault `actor.load_weights:<actor>=stale`, broker/faults.py, here at every version from the start:
verl#7495's failure) ends the run with one line naming the actor and the version, exit 1, MLflow FAILED
(learner.weight_sync_fingerprint=error, the default: broker/fingerprint.py, deploy/actor_pool.py
check_fingerprints); the line's difference, one update of the tiny-learn preset, is more than 10x the fp32
tolerance, so the check can see a single missed version. The run checks every k = 2 versions
(learner.weight_sync_fingerprint_every; the main job's k = 1 checks each): version 1 goes unchecked and the run
ends at version 2, within k steps. The control: the same run with the check off finishes. `sparse-rl train` of the
`tiny-learn` preset (a tiny model that learns: its updates move the weights; the `tiny` preset's rewards are all 0,
so its steps change nearly nothing) in a subprocess, real Ray, Redis, DeepSpeed and MLflow; one rollout actor, so
that the version is swapped in by the next sync round at the latest. (Which versions a k scores, both sides:
tests/learner/test_learner_fingerprint.py.)"""
from __future__ import annotations

import re

import pytest

from broker.fingerprint import tolerance
from tests.deploy.test_faults import ENV, mlflow_status, one_line, sparse_rl

pytestmark = pytest.mark.system
EVERY = 2
BASE = ["--config", "tiny-learn", "train.steps=3", "actors.count=1", f"learner.weight_sync_fingerprint_every={EVERY}"]
FAULT = {**ENV, "SPARSE_RL_FAULTS": "actor.load_weights:actor-0=stale"}  # every version, from the start


@pytest.mark.timeout(600)
def test_a_stale_sync_ends_the_run_within_k_steps_with_one_line_naming_actor_and_version(tmp_path):
    done = sparse_rl("train", *BASE, f"run_dir={tmp_path}", env=FAULT, timeout=400)
    assert done.returncode == 1, done.stdout
    line = one_line(done.stdout)
    match = re.fullmatch(rf"sparse-rl: run failed: weight sync fingerprint: actor-0 at weight version {EVERY}: its "
                         r"engine's log-probs of the probe differ from the learner's by (\S+) nats \(tolerance 0\.001 "
                         r"at fp32\): the engine does not hold the weights it reports \(learner\.weight_sync_"
                         r"fingerprint=warn goes on past it\)", line)
    assert match, line  # version 2, not 1: version 1 went unchecked
    assert float(match.group(1)) > 10 * tolerance("fp32"), line   # one update moves the probe past the check's reach
    steps = [int(s) for s in re.findall(r"^step (\d+)/3", done.stdout, re.M)]
    assert steps and max(steps) <= EVERY, done.stdout              # found at the sync of step 2 or 3, never later
    (run_dir,) = tmp_path.iterdir()
    assert mlflow_status(run_dir) == "FAILED"


@pytest.mark.timeout(600)
def test_the_same_stale_sync_with_the_check_off_goes_unseen_and_the_run_finishes(tmp_path):
    done = sparse_rl("train", *BASE, f"run_dir={tmp_path}", "learner.weight_sync_fingerprint=off", env=FAULT,
                     timeout=400)
    assert done.returncode == 0, done.stdout
    assert "weight sync fingerprint" not in done.stdout and "Traceback" not in done.stdout, done.stdout
    assert re.search(r"^step 3/3", done.stdout, re.M), done.stdout
