"""The learner step protocol (learner/step.py) fed with recorded trajectory groups gives the StepReport the code
before it gave (tests/learner/step_fixture.json: recorded once with LearnerWorker.train_step): metrics,
version, trained prompt ids, counts, and the broker state it leaves (counters, KV budget and its log, version,
step capacity, data position). Real Redis, real DeepSpeed (CPU), the tiny-char model."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from broker import run_state as rs
from broker.streams import connect, queue_depth
from deploy.config import load_config
from deploy.model_cache import resolve_model
from learner.learner import Learner
from learner.step import LearnerStep, OneRank, Resume, StepConfig
from tests.learner import step_fixture as sf

LOGP_ATOL = 2e-6
"""How far one recomputed float32 log-prob may land from the recording on another CPU (vector width, thread count,
oneDNN/MKL kernels): a few float32 ulps of a log-softmax over the vocabulary. Measured: at most 1.4e-6 in xi
(= exp of a log-prob difference, near 1) over the default, AVX2 and AVX-512 kernels and 1 or 2 threads."""
F32 = 2.0 ** -23
"""float32 relative rounding: metrics accumulated in float32 carry a few of these relative to their own value."""
TOKEN_MEANS = {"mismatch_kl", "mismatch_kl_k1", "kl_loss", "ppo_kl", "pg_loss", "xi_mean", "tis_weight_mean",
               "ratio_mean", "entropy"}
"""Means over the step's response tokens of a function of log-probs whose slope is at most ~1 (k1, k3 KLs of
log-prob differences near 0, ratios near 1): N tokens with independent rounding move them by LOGP_ATOL / sqrt(N)."""
PER_TOKEN = re.compile(r"^(xi_(p\d+|max|sym_p\d+)|accept_.*)$")
"""One token's ratio (quantiles, maxima): xi = exp(logp_old - logp_sparse) moves by xi x LOGP_ATOL."""


def tolerance(key: str, want: float, report: dict) -> float:
    """The absolute tolerance of the float `want` of `key` in a step report, from the quantity's conditioning on
    the log-prob scale (not relative to itself: a KL near 1e-4 of log-prob differences near 1e-2 keeps few exact
    digits). Still catches one logp_sparse of the fixture moved by 1e-4 (it moves mismatch_kl_k1 by 1e-4 / N,
    N <= 129 tokens: above 3 x LOGP_ATOL / sqrt(N)), a changed lr (every later log-prob moves) and any change of
    a count, reward or ratio of counts (compared to 1e-9 relative)."""
    rounding = 8 * F32 * abs(want)
    if key in TOKEN_MEANS:
        tokens = report["num_sequences"] * report["response_length_mean"]
        return 3 * LOGP_ATOL / math.sqrt(tokens) + rounding
    if PER_TOKEN.match(key):
        return 2 * LOGP_ATOL * abs(want) + rounding
    if key == "grad_norm":   # a float32 sum of squares over every parameter's gradient
        return 1e-5 * abs(want)
    return 1e-9 * max(1.0, abs(want))   # counts, rewards, lengths, budgets, ratios of counts: exact


def close(got, want, where, report):
    """Equal: floats to `tolerance` (`report`: the recorded report of the step, for its token count), everything
    else exactly."""
    if isinstance(want, float) or isinstance(got, float):
        key = where.rsplit(".", 1)[-1]
        tol = tolerance(key, want, report) if math.isfinite(want) else 1e-9
        assert got == pytest.approx(want, rel=0, abs=tol, nan_ok=True), (where, got - want, tol)
    elif isinstance(want, dict):
        assert set(got) == set(want), (where, sorted(set(got) ^ set(want)))
        for k in want:
            close(got[k], want[k], f"{where}.{k}", report)
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            close(g, w, f"{where}[{i}]", report)
    else:
        assert got == want, where


def test_recorded_groups_give_the_recorded_step_reports(redis_server, tmp_path):
    fixture = sf.load()
    cfg = load_config("tiny-learn", sf.OVERRIDES + [f"learner.checkpoint_dir={tmp_path}"])
    cfg.model, cfg.broker.url = resolve_model(cfg.model), redis_server.url
    learner = Learner(cfg.model, cfg.learner)
    protocol = LearnerStep(StepConfig.of_run(cfg), sf.RUN_ID, learner, Resume())
    client, ranks = connect(cfg.broker), OneRank(learner, cfg.learner.checkpoint_dir)
    for (version, _), groups, want in zip(sf.PLAN, fixture["groups"], fixture["steps"]):
        sf.publish_claimed(client, cfg.broker, [sf.group_from_dict(g) for g in groups], version)
        report = protocol.train_step(ranks)
        got = {"report": {**sf.comparable(report.as_metrics()), "trained_prompt_ids": report.trained_prompt_ids},
               "counts": rs.run_counts(client, sf.RUN_ID), "queue_depth": queue_depth(client, cfg.broker, sf.RUN_ID),
               "kv_budget": rs.read_kv_budget(client, sf.RUN_ID, -1),
               "learner_version": rs.read_learner_version(client, sf.RUN_ID),
               "step_capacity": int(client.get(rs.key(sf.RUN_ID, rs.ADMISSION_STEP_CAPACITY))),
               "budget_log": [json.loads(x) for x in rs.read_budget_log(client, sf.RUN_ID)],
               "trained_ids": protocol.trained_ids, "position": protocol.position.to_dict()}
        want = {**want, "report": sf.comparable(want["report"])}
        close(json.loads(json.dumps(got)), want, f"step to version {report.version}", want["report"])
        assert report.version == learner.version == want["learner_version"]
    assert (tmp_path / "latest").read_text().strip() == "version_2"  # checkpoint_interval 2


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def test_the_recording_holds_on_another_numeric_path():
    """The recorded-step test again in a fresh process on ATEN_CPU_CAPABILITY=default (no AVX2/AVX-512 kernels):
    another CPU's rounding, on any machine, within `tolerance` (the recording was exact for the CPU it
    was made on and failed on another)."""
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip("already on a chosen numeric path")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "2"}
    test = f"{__file__}::test_recorded_groups_give_the_recorded_step_reports"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
