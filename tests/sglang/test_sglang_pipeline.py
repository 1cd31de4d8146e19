"""SGLang-backed rollout actors through the whole pipeline (docs/sglang.md, "CPU test lane"): `tiny-sglang` on
real Ray, redis-server, DeepSpeed (CPU) and MLflow, two actors each hosting an in-process SGLang engine in
sparse mode (R-KV through the sparse_rl_kv backend) and recording each request's evictions, which the learner
replays (learner.policy_target=sparse), weights broadcast back into SGLang after every step and fingerprinted;
and an actor whose SGLang scheduler fails."""
from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from broker.faults import FAULTS_ENV
from deploy.config import load_config
from deploy.driver import train
from deploy.metric_names import metric_history
from tests.deploy.test_e2e import check_accounting

pytestmark = [pytest.mark.sglang, pytest.mark.system]


def train_tiny_sglang(tmp_path, redis_server, *overrides: str) -> tuple[dict, MlflowClient]:
    """A tiny-sglang run with eviction replay on-policy (learner.policy_target=sparse, broker.max_staleness=0) and
    `overrides`: its summary, after checking exact accounting and that every actor's SGLang engine ends on the
    learner's last version, and an MLflow client of its record."""
    cfg = load_config("tiny-sglang", [f"run_dir={tmp_path}", f"broker.url={redis_server.url}",
                                      "learner.weight_sync_timeout_s=120", "learner.policy_target=sparse",
                                      "broker.max_staleness=0", *overrides])
    summary = train(cfg)
    check_accounting(summary, steps=3, groups_per_step=cfg.train.groups_per_step,
                     prompts_per_batch=cfg.actors.prompts_per_batch)
    return summary, MlflowClient(summary["mlflow_uri"])


@pytest.mark.timeout(900)
def test_sglang_actors_train_through_the_pipeline(tmp_path, redis_server):
    summary, client = train_tiny_sglang(tmp_path, redis_server)
    for name in ("mismatch_kl", "rejection_rate", "kv_retained_ratio", "weight_sync_s"):
        history = metric_history(client, summary["mlflow_run_id"], name)
        assert [m.step for m in history] == [1, 2, 3], name
        assert all(math.isfinite(m.value) for m in history), name
    # sparse rollouts: the cache kept less than the whole sequence, and the learner saw a mismatch to correct
    assert 0 < summary["kv_retained_ratio"] < 1
    assert summary["mismatch_kl"] > 0
    # eviction replay of the SGLang rollouts (learner.policy_target=sparse), on-policy (broker.max_staleness=0: every
    # row is sampled with the step's weights, so every step measures it): the learner's replayed log-probs equal the
    # sampler's, while the dense recompute does not; and every weight sync's policy fingerprint matched (fp32)
    exact = {m.step: m.value for m in metric_history(client, summary["mlflow_run_id"], "replay_logp_max_abs")}
    assert sorted(exact) == [1, 2, 3] and max(exact.values()) <= 1e-4, exact
    dense = [m.value for m in metric_history(client, summary["mlflow_run_id"], "replay_dense_gap_max")]
    assert len(dense) == 3 and max(dense) > 1e-2, dense
    fingerprint = {m.step: m.value for m in metric_history(client, summary["mlflow_run_id"],
                                                           "weight_sync_fingerprint_max_abs")}
    assert sorted(fingerprint) == [1, 2, 3] and max(fingerprint.values()) <= 1e-3, fingerprint
    # each actor's SGLang engine reports its own measured KV pool and retractions (RolloutEngine.engine_stats) under
    # actor/<actor id>/ in MLflow, its peak within its pool; the backends compressed and freed slots (summed over the
    # actors: on a loaded machine one actor may have generated every group of the 3 steps, the other only scored the
    # fingerprint's probe, which compresses nothing)
    metrics = client.get_run(summary["mlflow_run_id"]).data.metrics
    per_actor = {actor: {name.split("/")[2]: v for name, v in metrics.items() if name.startswith(f"actor/{actor}/")}
                 for actor in summary["accounting"]["actor_versions"]}
    assert len(per_actor) == 2, per_actor
    for actor, mine in per_actor.items():
        assert mine["sglang_retractions"] == 0, actor
        assert 0 < mine["kv_pool_peak_used_slots"] <= mine["kv_pool_slots"], (actor, mine)
        assert mine["kv_pool_peak_used_fraction"] == mine["kv_pool_peak_used_slots"] / mine["kv_pool_slots"]
    assert sum(m["kv_compressions"] for m in per_actor.values()) > 0, per_actor
    assert sum(m["kv_freed_slots"] for m in per_actor.values()) > 0, per_actor


@pytest.mark.timeout(900)
def test_an_sglang_actor_trains_a_lora_adapter_through_the_pipeline(tmp_path, redis_server, monkeypatch):
    """learner.lora on the SGLang engine (docs/sglang.md, "LoRA"): one actor, the adapter alone over the weight sync
    after every step, applied through SGLang's LoRA manager (`lora_backend=torch_native` on the CPU). The reward is the
    first token's parity (tests/sglang/tiny.py: it varies within a group, so the adapter gets a gradient; the task's
    own reward is 0 for every sample of a random model, B would stay 0 and an adapter never applied would go unseen)
    at learner.lr 1e-2, so each version moves the policy. Every sync's fingerprint matches the learner's (adapter
    on), the learner's replay of the SGLang rollouts equals their log-probs, and the final directory is an adapter
    with B != 0."""
    from broker.lora import load_saved_adapter

    # the reward lives in tests/, which the editable install does not map: the Ray workers (started by train, with
    # this environment) import it from the checkout's root
    root = str(Path(__file__).resolve().parents[2])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    summary, client = train_tiny_sglang(tmp_path, redis_server, "actors.count=1", "learner.lora.rank=8",
                                        "learner.lr=1e-2",
                                        "actors.engine.sglang.engine_kwargs.lora_backend=torch_native",
                                        "actors.reward.function=tests.sglang.tiny:first_token_parity")
    history = {name: {m.step: m.value for m in metric_history(client, summary["mlflow_run_id"], name)}
               for name in ("weight_sync_fingerprint_max_abs", "replay_logp_max_abs", "weight_sync_bytes")}
    print("lora on sglang:", history)
    assert sorted(history["weight_sync_fingerprint_max_abs"]) == [1, 2, 3]
    assert max(history["weight_sync_fingerprint_max_abs"].values()) <= 1e-3, history
    assert max(history["replay_logp_max_abs"].values()) <= 1e-4, history
    assert max(history["weight_sync_bytes"].values()) < 2**20, history    # the adapter alone (tiny-llama: 12.9 MB)
    adapter = load_saved_adapter(tmp_path / summary["run_id"] / "final")
    moved = max(float(t.abs().max()) for name, t in adapter.tensors if ".lora_B." in name)
    print("largest |B| of the final adapter:", moved)
    assert moved > 1e-3, "the adapter never moved: the fingerprint could not tell whether SGLang applies it"


class SGLangProcesses(threading.Thread):
    """Every process titled `sglang::...` (SGLang's scheduler and detokenizer) that descends from this test's
    process (its Ray's workers), seen twice a second while the run goes on: `alive()` are those still running,
    wherever they were re-parented to. Other SGLang processes on the machine are not looked at."""

    def __init__(self):
        super().__init__(daemon=True)
        self.seen: dict[int, psutil.Process] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            for child in psutil.Process().children(recursive=True):
                try:
                    if child.cmdline() and child.cmdline()[0].startswith("sglang::"):
                        self.seen.setdefault(child.pid, child)
                except psutil.Error:
                    pass

    def alive(self) -> list[str]:
        out = []
        for p in self.seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:   # a zombie runs nothing
                    out.append(f"{p.pid} {' '.join(p.cmdline())}")
            except psutil.Error:
                pass
        return out


@pytest.mark.timeout(900)
def test_a_failed_scheduler_ends_its_actor_in_one_line_and_leaves_no_sglang_process(tmp_path, redis_server,
                                                                                   monkeypatch, capfd):
    """actor-0's SGLang scheduler dies (SIGKILL, broker/faults.py kill_child) at its first batch (weights version
    0): the driver says so in one line naming the actor and the scheduler, replaces the actor, and the run trains
    every step; the failed actor ends what is left of its engine (RolloutWorker.close) and, at the run's end, the
    others theirs: no SGLang process outlives the run."""
    watch = SGLangProcesses()
    watch.start()
    monkeypatch.setenv(FAULTS_ENV, "actor.generate:actor-0@0=kill_child:sglang::scheduler")
    cfg = load_config("tiny-sglang", [f"run_dir={tmp_path}", f"broker.url={redis_server.url}",
                                      "learner.weight_sync_timeout_s=120"])
    try:
        summary = train(cfg)
    finally:
        watch.done.set()
        watch.join()

    out = capfd.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("rollout actor 0 ")]
    assert len(lines) == 1 and "sglang::scheduler" in lines[0] and "replacing it" in lines[0], out
    assert summary["accounting"]["consumed"] == 3 * cfg.train.groups_per_step
    assert summary["accounting"]["duplicates"] == 0
    assert "actor-0" not in summary["accounting"]["actor_versions"]
    assert len(watch.seen) >= 4, watch.seen           # a scheduler and a detokenizer per engine, 3 engines
    deadline = time.monotonic() + 30
    while watch.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not watch.alive()
