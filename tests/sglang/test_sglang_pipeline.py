"""SGLang-backed rollout actors through the whole pipeline (docs/sglang.md, "CPU test lane"): `tiny-sglang` on
real Ray, redis-server, DeepSpeed (CPU) and MLflow, two actors each hosting an in-process SGLang engine in
sparse mode (R-KV through the sparse_rl_kv backend) and recording each request's evictions, which the learner
replays (learner.policy_target=sparse), weights broadcast back into SGLang after every step."""
from __future__ import annotations

import math

import pytest
from mlflow.tracking import MlflowClient

from deploy.config import load_config
from deploy.driver import train
from deploy.metric_names import metric_history
from tests.deploy.test_e2e import check_accounting

pytestmark = [pytest.mark.sglang, pytest.mark.system]


@pytest.mark.timeout(900)
def test_sglang_actors_train_through_the_pipeline(tmp_path, redis_server):
    cfg = load_config("tiny-sglang", [f"run_dir={tmp_path}", f"broker.url={redis_server.url}",
                                      "learner.weight_sync_timeout_s=120", "learner.policy_target=sparse"])
    summary = train(cfg)

    # exact accounting, and every actor's SGLang engine ends on the learner's last version
    check_accounting(summary, steps=3, groups_per_step=cfg.train.groups_per_step,
                     prompts_per_batch=cfg.actors.prompts_per_batch)
    client = MlflowClient(summary["mlflow_uri"])
    for name in ("mismatch_kl", "rejection_rate", "kv_retained_ratio", "weight_sync_s"):
        history = metric_history(client, summary["mlflow_run_id"], name)
        assert [m.step for m in history] == [1, 2, 3], name
        assert all(math.isfinite(m.value) for m in history), name
    # sparse rollouts: the cache kept less than the whole sequence, and the learner saw a mismatch to correct
    assert 0 < summary["kv_retained_ratio"] < 1
    assert summary["mismatch_kl"] > 0
    # eviction replay of the SGLang rollouts (learner.policy_target=sparse): the learner's replayed log-probs equal
    # the sampler's on the rows sampled with the step's weights (a step that consumed only stale rows measures none
    # and logs none; step 1's rows are all fresh), while the dense recompute does not
    exact = {m.step: m.value for m in metric_history(client, summary["mlflow_run_id"], "replay_logp_max_abs")}
    assert 1 in exact and set(exact) <= {1, 2, 3} and max(exact.values()) <= 1e-4, exact
    dense = [m.value for m in metric_history(client, summary["mlflow_run_id"], "replay_dense_gap_max")]
    assert len(dense) == 3 and max(dense) > 1e-2, dense
