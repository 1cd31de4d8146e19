"""The learner step protocol (learner/step.py) fed with recorded trajectory groups gives the StepReport the code
before issue 20 gave (tests/learner/step_fixture.json: recorded once with LearnerWorker.train_step): metrics,
version, trained prompt ids, counts, and the broker state it leaves (counters, KV budget and its log, version,
step capacity, data position). Real Redis, real DeepSpeed (CPU), the tiny-char model."""
import json

import pytest
import torch

from broker import run_state as rs
from broker.streams import connect, queue_depth
from deploy.config import load_config
from deploy.model_cache import resolve_model
from learner.learner import Learner
from learner.step import LearnerStep, OneRank, Resume, StepConfig
from tests.learner import step_fixture as sf


def close(got, want, where):
    """Equal, floats to 1e-6 relative (the recording was exact on this machine; other CPUs may round apart)."""
    if isinstance(want, float) or isinstance(got, float):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9, nan_ok=True), where
    elif isinstance(want, dict):
        assert set(got) == set(want), (where, sorted(set(got) ^ set(want)))
        for k in want:
            close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            close(g, w, f"{where}[{i}]")
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
        close(json.loads(json.dumps(got)), want, f"step to version {report.version}")
        assert report.version == learner.version == want["learner_version"]
    assert (tmp_path / "latest").read_text().strip() == "version_2"  # checkpoint_interval 2


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)
