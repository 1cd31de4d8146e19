"""MLflow names (deploy/metric_names.py, docs/SPEC.md §4): every metric a real learner step and the driver's step
report give is logged as `<section>/<name>` in a known section, one MLflow name per internal name, the tracker
logs the MLflow names (and keeps the internal ones for the plot), and a bench reader finds a metric of a run
logged before the table under its old name. (The rollout actors' and the actor pool's names are checked on a real
run's MLflow store: tests/deploy/test_e2e.py test_tiny_run_end_to_end.)"""
import importlib.util
import logging
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from broker import run_state as rs
from deploy.metric_names import SECTIONS, TABLE, internal_name, metric_history, mlflow_name
from deploy.tracking import PLOTTED, Tracker
from learner.config import LearnerConfig
from learner.learner import Learner
from learner.step import StepReport
from tests.learner.conftest import make_groups, tiny_llama

_spec = importlib.util.spec_from_file_location("replication", Path(__file__).parents[2] / "bench" / "replication.py")
replication = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replication)

ADMISSION_COUNTS = ("reclaimed", "admitted", "claims_expired", "claimed_returned", "prompts_redone")
"""broker counters only the admission scripts and the consumer increment (broker/run_state.py `counts`)."""


def with_topk(groups, k=4):
    """Give every sample top-k arrays of a made-up pi_sparse (the accept_* metrics)."""
    import numpy as np

    for g in groups:
        for s in g.samples:
            T = len(s.response_ids)
            s.topk_ids = np.tile(np.arange(k, dtype=np.int32), (T, 1))
            s.topk_logprobs = np.full((T, k), -np.log(64.0), dtype=np.float32)
    return groups


@pytest.fixture(scope="module")
def step_names() -> set[str]:
    """The names of real learner steps (tiny Llama): correction with KL and difficulty tiers, top-k acceptance,
    eviction replay with distillation; and of the driver's step report (StepReport.as_metrics)."""
    from tests.learner.test_replay import learner_of, rollouts

    names: set[str] = set()
    groups = make_groups()
    for g, tier in zip(groups, ("hard", "new")):
        g.budget_tier = tier
    names |= set(Learner(tiny_llama(), LearnerConfig(lr=1e-3, kl_coef=0.05)).step(groups, staleness=[0, 1]))
    names |= set(Learner(tiny_llama(), LearnerConfig(lr=1e-3, kl_coef=0.0)).step(with_topk(make_groups()), [0, 0]))
    model, groups, _ = rollouts()
    names |= set(learner_of(model, distill_coef=0.5).step(groups, [0] * len(groups)))
    report = StepReport(version=1, metrics={}, trained_prompt_ids=[], trained=2, filtered=0, dropped_stale=0,
                        reads=2, filter_shortfall=0, groups_trained=2, step_capacity=2, queue_depth=0,
                        counts=dict.fromkeys((*rs.COUNT_NAMES, *ADMISSION_COUNTS), 0), rollout_utilization=1.0,
                        wait_s=0.0, step_s=1.0, idle_fraction_run=0.0)
    names |= set(report.as_metrics())
    return names


def test_every_step_metric_has_a_prefixed_name_in_a_known_section(step_names):
    assert {"rejection_rate", "mismatch_kl", "accept_p5", "replay_logp_max_abs", "broker_produced",
            "tier/hard/rejection_rate"} <= step_names      # the step gave what the checks below are about
    outside = sorted(n for n in step_names if "/" not in mlflow_name(n) or mlflow_name(n).split("/")[0] not in SECTIONS)
    assert not outside, outside
    assert mlflow_name("rejection_rate") == "correction/rejection_rate"
    assert mlflow_name("mismatch_kl") == "correction/mismatch_kl"
    assert mlflow_name("xi_sym_p5") == "correction/xi_sym_p5"
    assert mlflow_name("replay_mismatch_kl") == "replay/mismatch_kl"
    assert mlflow_name("broker_produced") == "broker/produced_total"
    assert mlflow_name("eval/sparse/reward") == "eval/sparse/reward"


def test_the_mapping_is_one_to_one(step_names):
    names = step_names | set(TABLE)
    mlflow = [mlflow_name(n) for n in names]
    assert len(set(mlflow)) == len(mlflow)
    assert all(internal_name(mlflow_name(n)) == n for n in names)
    same = {n for n in names if mlflow_name(n) == n}    # only the names already in their sections
    assert all(n.startswith(("eval/", "tier/")) for n in same), sorted(same)
    assert not (set(mlflow) - same) & names               # no MLflow name is another metric's internal name


def test_the_tracker_logs_mlflow_names_and_plots_internal_ones(tmp_path):
    tracker = Tracker("", "exp", "run", tmp_path)
    tracker.log_metrics({"rejection_rate": 0.25, "reward_mean": 0.5, "eval/dense/reward": 0.1, "broker_produced": 4}, 1)
    logged = tracker.client.get_run(tracker.run_id).data.metrics
    assert logged == {"correction/rejection_rate": 0.25, "rollout/reward_mean": 0.5, "eval/dense/reward": 0.1,
                      "broker/produced_total": 4.0}
    assert tracker.history["rejection_rate"] == {1: 0.25}     # what training.png draws, under PLOTTED's names
    assert tracker.first_values("eval/") == {"eval/dense/reward": 0.1}
    resumed = Tracker("", "exp", "run", tmp_path, resume_run_id=tracker.run_id)
    assert resumed.history["reward_mean"] == {1: 0.5} and set(PLOTTED) <= set(resumed.history)


def test_a_new_run_store_is_a_copy_of_a_migrated_one_not_made_again(tmp_path, monkeypatch):
    """MLflow's creation of a sqlite store runs every schema migration (seconds of each run's start): the first
    Tracker makes `<cache>/mlflow-<version>.db` with MLflow, every later new store is a copy of it (no "Creating
    initial MLflow database tables" from MLflow), and each store keeps its own experiment, runs and metrics."""
    monkeypatch.setenv("SPARSE_RL_CACHE", str(tmp_path / "cache"))
    created = []
    handler = logging.Handler()
    handler.emit = lambda record: created.append(record.getMessage())
    logger = logging.getLogger("mlflow.store.db.utils")
    logger.addHandler(handler)
    try:
        runs = {}
        for name in ("a", "b", "c"):
            (tmp_path / name).mkdir()
            runs[name] = Tracker("", "exp", name, tmp_path / name)
            runs[name].log_metrics({"reward_mean": ord(name) / 100}, 1)
            if name == "a":
                assert any("Creating initial" in m for m in created), created  # the template, by MLflow
                created.clear()
    finally:
        logger.removeHandler(handler)
    assert not any("Creating initial" in m for m in created), created  # b and c: copies
    assert (tmp_path / "cache" / f"mlflow-{mlflow.__version__}.db").exists()
    for name, _tracker in runs.items():
        client = MlflowClient(f"sqlite:///{tmp_path / name / 'mlflow.db'}")
        (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
        assert (run.info.run_name, run.data.metrics) == (name, {"rollout/reward_mean": ord(name) / 100})


def test_a_bench_reader_finds_a_metric_of_an_old_run_under_its_old_name(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("e", artifact_location=(tmp_path / "artifacts").as_uri())
    old, new = client.create_run(exp).info.run_id, client.create_run(exp).info.run_id
    for step in (1, 2):
        client.log_metric(old, "rejection_rate", 0.1 * step, step=step)       # a run logged before the table
        client.log_metric(new, "correction/rejection_rate", 0.2 * step, step=step)
        client.log_metric(new, "rejection_rate", 9.0, step=step)              # never read when the new name is there
    assert [m.value for m in metric_history(client, old, "rejection_rate")] == pytest.approx([0.1, 0.2])
    assert replication.histories(tmp_path, {"mlflow_run_id": old})["rejection_rate"] == pytest.approx([0.1, 0.2])
    assert replication.histories(tmp_path, {"mlflow_run_id": new})["rejection_rate"] == pytest.approx([0.2, 0.4])
    client.log_metric(old, "correction/rejection_rate", 0.3, step=3)     # the old run resumed with this table
    assert replication.histories(tmp_path, {"mlflow_run_id": old})["rejection_rate"] == pytest.approx([0.1, 0.2, 0.3])
