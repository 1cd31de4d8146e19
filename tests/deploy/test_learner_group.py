"""The distributed learner: `learner.ranks` DeepSpeed ranks as real Ray actors in one placement group, one gloo
group on loopback, real DeepSpeed on the CPU, real Redis. The one-rank reference runs the same `Learner` code
in this process.

- 2 ranks vs 1 rank on the same groups (ZeRO-2 dense, ZeRO-3 with replay, ZeRO-3 with learner.lora; fp32): weights
  after one step within 1e-5 and the step metrics (loss, rejection_rate, mismatch_kl, ...) equal;
- gradients do not depend on the split (verl#5625): micro-batch 1, 2 and the whole minibatch on one rank, and
  two ranks, give the same gradients (rtol 1e-5);
- whole runs with `learner.ranks=2`: end to end with 2 actors (ZeRO-3 weight sync), a resumed run trains the
  prompts of an uninterrupted one, and a rank SIGKILLed mid-step fails the run naming the rank, nothing of the
  step acknowledged, and a resume trains that step's prompts.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from broker.config import BrokerConfig  # noqa: E402
from broker.faults import FAULTS_ENV  # noqa: E402
from broker.fingerprint import tolerance  # noqa: E402
from broker.lora import LoraConfig  # noqa: E402
from broker.run_state import key, read_learner_version, run_counts  # noqa: E402
from broker.schema import decode_group  # noqa: E402
from broker.streams import connect  # noqa: E402
from deploy.config import load_config  # noqa: E402
from deploy.driver import train  # noqa: E402
from deploy.learner_group import LearnerGroup  # noqa: E402
from deploy.metric_names import metric_history  # noqa: E402
from deploy.record import resume_config  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.learner import Learner  # noqa: E402
from tests.learner.conftest import make_groups, tiny_llama  # noqa: E402

COMMON = {"lr": 1e-3, "kl_coef": 0.05, "minibatch_size": 4, "micro_batch_size": 2, "ppo_epochs": 1,
          "dtype": "fp32", "token_mask": True, "rejection": "veto"}
METRICS = ("pg_loss", "kl_loss", "rejection_rate", "token_mask_fraction", "truncate_fraction", "mismatch_kl",
           "mismatch_kl_k1", "entropy", "reward_mean", "grad_norm", "optimizer_steps", "num_sequences")


@pytest.fixture(scope="module")
def shared_ray():
    """The local Ray of the tests that use `local_ray`, shut down at the end of the module (or before a test that
    starts its own, see own_ray)."""
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def local_ray(shared_ray):
    """A local Ray (4 CPUs), started once for all the tests that ask for it (ray.init takes seconds, up to half a
    minute on 2 busy cores); each test shuts its learner group down (ranks killed, placement group freed)."""
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield


@pytest.fixture(autouse=True)
def own_ray(request):
    """A test that does not use `local_ray` starts its own Ray (train(), or ray.init with the fault in its
    environment): the shared one is shut down first."""
    if "local_ray" not in request.fixturenames and ray.is_initialized():
        ray.shutdown()
    yield


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


def group_of(model_dir, redis_url, tmp_path, ranks: int, kv_dtype: str = "model", **learner) -> LearnerGroup:
    overrides = [f"model={model_dir}", f"run_dir={tmp_path}", f"broker.url={redis_url}", f"learner.ranks={ranks}",
                 "learner.collective_timeout_s=60", "train.learner_num_cpus=1",
                 f"actors.engine.compressor.kv_dtype={kv_dtype}"]
    overrides += [f"learner.{k}={v}" for k, v in learner.items()]
    return LearnerGroup(load_config("tiny", overrides), f"test-{uuid.uuid4().hex[:8]}")


def with_eviction_records(groups, layers: int = 2, kv_heads: int = 2, seed: int = 0):
    """The groups with a valid eviction record per sample (docs/SPEC.md §2.4): each key evicted after 0-3 generated
    tokens, or never (65535), drawn at random: the rank-equality of the replayed step needs no engine."""
    import numpy as np
    rng = np.random.default_rng(seed)
    for g in groups:
        for s in g.samples:
            T = len(s.response_ids)
            steps = rng.integers(0, min(T, 3) + 1, size=(layers, kv_heads, len(s.prompt_ids) + T))
            steps[rng.random(steps.shape) < 0.5] = 65535
            s.eviction_steps = steps.astype(np.uint16)
    return groups


@pytest.mark.system
@pytest.mark.timeout(600)
@pytest.mark.parametrize("zero_stage,policy_target,lora", [(2, "dense", 0), (3, "sparse", 0), (3, "dense", 4)])
def test_two_ranks_make_the_same_update_as_one(zero_stage, policy_target, lora, local_ray, model_dir, redis_server,
                                               tmp_path):
    """... with eviction replay too (policy_target sparse: the replayed and the dense forwards per micro-batch, here
    of an int8 KV cache with learner.replay_quant_gap: the replay without the quantize-dequantize runs on each
    rank's rows and replay_quant_gap is the one rank's), and with learner.lora (the adapter alone trained and
    exported, the KL reference through the ZeRO-3 engine with the adapter disabled; lr 1e-2 so that the adapter
    moves by more than 100x the tolerance; 7 sequences in micro-batches of 3, so that one rank's recompute has a
    padding slot, whose reference forward keeps the gathers in step)."""
    torch.set_num_threads(1)
    groups = steps_groups() if policy_target == "dense" else with_eviction_records(steps_groups())
    common = {**COMMON, "policy_target": policy_target}
    quantized = {}
    if policy_target == "sparse":     # an int8 cache's groups, replayed with and without the qdq
        for g in groups:
            g.kv_quant = "int8/token_head"
        common["replay_quant_gap"] = True
        quantized = {"kv_dtype": "int8"}
    if lora:
        groups[1].samples = groups[1].samples[:3]      # shares of 3 and 4 sequences: micro-batches [3] and [3, 1]
        common.update(lr=1e-2, micro_batch_size=3)
    one = Learner(str(model_dir), LearnerConfig(zero_stage=zero_stage, lora=LoraConfig(rank=lora), **common))
    before = {n: t.clone() for n, t in one.gather_buckets(0, keep=True).items()}
    expected = one.step(groups, staleness=[0, 1])
    after_one = {n: t.clone() for n, t in one.gather_buckets(0, keep=True).items()}

    group = group_of(model_dir, redis_server.url, tmp_path, 2, zero_stage=zero_stage, **quantized, **common,
                     **{"lora.rank": lora})
    try:
        got = ray.get(group.rank0.step_groups.remote(groups, [0, 1]))
        after_two = ray.get(group.rank0.full_weights.remote())
    finally:
        group.shutdown()

    assert got["learner_ranks"] == 2 and expected["learner_ranks"] == 1
    assert expected["rejection_rate"] == pytest.approx(1 / (7 if lora else 8)) and expected["token_mask_fraction"] > 0
    replayed = ("replay_logp_max_abs", "replay_dense_gap_max", "accept_exact_mean", "replay_tis_weight_mean",
                "replay_quant_gap")
    assert policy_target == "dense" or expected["replay_quant_gap"] > 1e-4   # the qdq changed the replay (8.3e-4)
    for name in METRICS + (replayed if policy_target == "sparse" else ()):
        assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
    assert set(after_two) == set(after_one)
    assert all(".lora_" in n for n in after_one) == bool(lora)        # with LoRA the adapter alone travels
    moved = max((after_one[n] - before[n]).abs().max().item() for n in after_one)
    assert moved > (1e-3 if lora else 1e-4)      # the step changed the weights: the comparison can fail
    for name, t in after_one.items():
        torch.testing.assert_close(after_two[name], t, rtol=0, atol=1e-5, msg=name)


@pytest.mark.system
@pytest.mark.timeout(600)
@pytest.mark.parametrize("loss_agg_mode", ["seq-mean-token-mean", "token-mean"])
def test_gradients_do_not_depend_on_the_split(local_ray, model_dir, redis_server, tmp_path, loss_agg_mode):
    torch.set_num_threads(1)
    groups = steps_groups()                     # 8 sequences, one minibatch (one vetoed: token-mean still counts it)
    common = {**COMMON, "minibatch_size": 0, "loss_agg_mode": loss_agg_mode}
    grads = {}
    for micro in (1, 2, 8):
        cfg = LearnerConfig(zero_stage=2, **{**common, "micro_batch_size": micro})
        grads[f"1 rank, micro-batch {micro}"] = Learner(str(model_dir), cfg).gradients(groups)
    group = group_of(model_dir, redis_server.url, tmp_path, 2, zero_stage=2, **common)
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


def trained_prompts(summary: dict) -> list[str]:
    """The prompt ids a run trained, in order (run_dir/trained_prompts.jsonl)."""
    lines = open(os.path.join(summary["run_dir"], "trained_prompts.jsonl")).read().splitlines()
    return [p for line in lines for p in json.loads(line)["prompt_ids"]]


@pytest.mark.system
@pytest.mark.timeout(1200)
def test_a_resumed_run_continues_its_record_and_trains_the_prompts_of_an_uninterrupted_one(tmp_path, redis_server):
    """k=2 steps with checkpoints, stop, `--resume` to version 4, then a fork of it; two learner ranks (ZeRO-2 shards).
    Resume: the same run directory, MLflow run (versions 1..4 in one history) and learner counters, new checkpoints
    in its own directory; its embedded Redis comes back with the queue the first life left, which is discarded, and
    the prompt ids trained, in order, are those of one uninterrupted 4-step run with the same seed. Fork
    (learner.resume_from): a new record tagged with its parent, whose checkpoints it never writes."""
    common = [f"run_dir={tmp_path}", "actors.count=1", "broker.max_staleness=100", "eval.enabled=false",
              "learner.ranks=2", "learner.zero_stage=2", "learner.checkpoint_interval=1",
              "learner.weight_sync_timeout_s=60"]
    whole = train(load_config("tiny", common + ["train.steps=4", f"broker.url={redis_server.url}"]))
    first = train(load_config("tiny", common + ["train.steps=2"]))
    run_dir, first_prompts = first["run_dir"], trained_prompts(first)
    second = train(resume_config(run_dir, ["train.steps=4"]), resume=run_dir)

    assert (second["run_dir"], second["mlflow_run_id"]) == (run_dir, first["mlflow_run_id"])
    gps = first["accounting"]["consumed"] // 2
    assert second["groups_trained"] == 4 * gps  # the learner's counter continued from the checkpoint's 2 * gps
    assert second["accounting"]["learner_version"] == 4 and set(second["accounting"]["actor_versions"].values()) == {4}
    assert len(trained_prompts(whole)) == 8 and len(first_prompts) == 4
    assert trained_prompts(second) == trained_prompts(whole)  # the record's log: versions 1..4
    client = MlflowClient(second["mlflow_uri"])
    history = metric_history(client, first["mlflow_run_id"], "rejection_rate")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    run = client.get_run(first["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["resumed_at_versions"] == "2"
    assert run.data.tags["resume_v2.train.steps"] == "4"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert (Path(run_dir) / "checkpoints" / "latest").read_text() == "version_4"

    forked = train(load_config("tiny", common + ["train.steps=5", f"learner.resume_from={run_dir}/checkpoints"]))
    assert forked["run_dir"] != run_dir and forked["accounting"]["learner_version"] == 5
    tags = MlflowClient(forked["mlflow_uri"]).get_run(forked["mlflow_run_id"]).data.tags
    assert tags["parent_run_id"] == first["run_id"] and tags["parent_mlflow_run_id"] == first["mlflow_run_id"]
    assert (Path(forked["run_dir"]) / "checkpoints" / "latest").read_text() == "version_5"
    assert (Path(run_dir) / "checkpoints" / "latest").read_text() == "version_4"  # the parent's are untouched


@pytest.mark.system
@pytest.mark.timeout(900)
def test_a_lora_run_resumes_its_adapter_and_ends_where_an_uninterrupted_one_does(tmp_path, redis_server):
    """learner.lora through `--resume` on tiny-learn (a reward the tiny model earns, so the adapter trains; the
    tiny preset's rewards are all 0 and leave lora_B at 0): 2 steps with checkpoints (the adapter alone), stop,
    resume to version 3. The resumed life syncs only the adapter (the actors start from the base and get version 2's
    adapter first), every actor's fingerprint matches the learner's (fp32 tolerance), and its final adapter (peft's
    format) equals that of one uninterrupted 3-step run with the same seed (1e-6; max_staleness 0, one actor: the
    same rollouts), while version 2's differs from it by more than 1e-4: the resumed learner continued the adapter
    and its Adam state (a fresh Adam's first step is lr x sign(g), not the resumed one's)."""
    from safetensors.torch import load_file

    common = [f"run_dir={tmp_path}", "actors.count=1", "broker.max_staleness=0", "eval.enabled=false",
              "learner.lora.rank=4", "learner.checkpoint_interval=1", "learner.weight_sync_timeout_s=60"]
    whole = train(load_config("tiny-learn", common + ["train.steps=3", f"broker.url={redis_server.url}"]))
    first = train(load_config("tiny-learn", common + ["train.steps=2"]))
    run_dir = first["run_dir"]
    adapter = {name: load_file(Path(s["run_dir"]) / "final" / "adapter_model.safetensors") for name, s in
               (("whole", whole), ("version 2", first))}
    second = train(resume_config(run_dir, ["train.steps=3"]), resume=run_dir)
    adapter["resumed"] = load_file(Path(run_dir) / "final" / "adapter_model.safetensors")

    assert second["run_dir"] == run_dir and second["accounting"]["learner_version"] == 3
    assert set(second["accounting"]["actor_versions"].values()) == {3}
    client = MlflowClient(second["mlflow_uri"])
    sent = metric_history(client, second["mlflow_run_id"], "weight_sync_bytes")
    assert sent and all(m.value < 2**20 for m in sent), sent   # the adapter alone, also right after the resume
    fingerprints = metric_history(client, second["mlflow_run_id"], "weight_sync_fingerprint_max_abs")
    assert fingerprints and all(m.value <= tolerance("fp32") for m in fingerprints), fingerprints
    assert set(adapter["resumed"]) == set(adapter["whole"])
    assert max(float(t.abs().max()) for n, t in adapter["whole"].items() if "lora_B" in n) > 1e-3   # it trained
    for name, t in adapter["whole"].items():
        torch.testing.assert_close(adapter["resumed"][name], t, rtol=0, atol=1e-6, msg=name)
    moved = max(float((adapter["whole"][n] - adapter["version 2"][n]).abs().max()) for n in adapter["whole"])
    assert moved > 1e-4, moved   # step 3 moved the adapter: the equality above could fail


@pytest.mark.system
@pytest.mark.timeout(900)
def test_a_learner_rank_killed_mid_step_fails_the_run_and_a_resume_trains_its_prompts(tmp_path, redis_server,
                                                                                     monkeypatch):
    """Rank 1 is SIGKILLed while it is in the step from version 2 (a test hook holds it there): the run ends with
    an error naming the rank (within learner.collective_timeout_s, no hang), the step's groups are not
    acknowledged, and a resume from the checkpoint of version 2 trains those groups' prompts first."""
    monkeypatch.setenv(FAULTS_ENV, "learner.step:1@2=sleep:120")
    common = [f"run_dir={tmp_path}", "actors.count=1", "broker.max_staleness=100", "eval.enabled=false",
              "learner.ranks=2", "learner.zero_stage=2", "learner.checkpoint_interval=1",
              "learner.collective_timeout_s=60", "learner.weight_sync_timeout_s=60"]
    cfg = load_config("tiny", common + ["train.steps=4", f"broker.url={redis_server.url}"])
    redis = connect(BrokerConfig(url=redis_server.url))
    killed = {}

    def operator():
        run_id = None
        while run_id is None:
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)] if ray.is_initialized() else []
            run_id = next((n.rsplit("-learner-", 1)[0] for n in names if n.endswith("-learner-1")), None)
            time.sleep(0.5)
        pid = ray.get(ray.get_actor(f"{run_id}-learner-1").pid.remote())
        stream = key(run_id, cfg.broker.stream)
        while not (read_learner_version(redis, run_id) == 2
                   and redis.xpending(stream, cfg.broker.consumer_group)["pending"] > 0):
            time.sleep(0.2)   # step 3 has read its groups: rank 1 is held in the step from version 2
        killed["pending"] = [m["message_id"] for m in
                             redis.xpending_range(stream, cfg.broker.consumer_group, "-", "+", 100)]
        killed["run_id"] = run_id
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=operator, daemon=True).start()
    with pytest.raises(RuntimeError, match=r"learner step 3 failed: .*learner rank 1 died") as failure:
        train(cfg)
    assert "nothing of this step was acknowledged" in str(failure.value)
    run_id, stream = killed["run_id"], key(killed["run_id"], cfg.broker.stream)
    assert run_counts(redis, run_id)["consumed"] == 2 * cfg.train.groups_per_step
    assert read_learner_version(redis, run_id) == 2
    pending = redis.xrange(stream)  # the step's groups are still in the stream, unacknowledged
    lost = [decode_group(fields[b"group"]).prompt_id for msg_id, fields in pending
            if msg_id.decode() in {m.decode() if isinstance(m, bytes) else m for m in killed["pending"]}]
    assert len(lost) == cfg.train.groups_per_step

    monkeypatch.delenv(FAULTS_ENV)
    resumed = train(load_config("tiny", common + [
        "train.steps=3", f"learner.checkpoint_dir={tmp_path / run_id / 'checkpoints'}"]))  # the same record
    assert resumed["run_dir"] == str(tmp_path / run_id) and resumed["accounting"]["learner_version"] == 3
    assert trained_prompts(resumed)[-len(lost):] == lost  # the step from version 2 trained the lost prompts


def test_several_ranks_need_a_zero_stage_and_say_so():
    from deploy.config import ConfigError
    with pytest.raises(ConfigError, match=r"^learner\.zero_stage=0: expected 1, 2 or 3 with ranks=2"):
        load_config("tiny", ["learner.ranks=2"], check_files=False)
    with pytest.raises(ConfigError, match=r"learner\.placement='SIDEWAYS'"):
        load_config("tiny", ["learner.placement=SIDEWAYS"], check_files=False)


@pytest.mark.system
@pytest.mark.timeout(600)
def test_a_hanging_rank_fails_the_step_within_the_collective_timeout(model_dir, redis_server, tmp_path, monkeypatch):
    """Rank 1 hangs (a test hook holds it before its step for longer than learner.collective_timeout_s): rank 0's
    collective times out and the step fails naming rank 1, instead of waiting for it."""
    # the rank processes inherit it from this process's Ray
    monkeypatch.setenv(FAULTS_ENV, "learner.step:1@0=sleep:300")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        group = group_of(model_dir, redis_server.url, tmp_path, 2, zero_stage=2, collective_timeout_s=15,
                         **{**COMMON})
        try:
            with pytest.raises(ray.exceptions.RayTaskError,
                               match=r"step at learner version 0 failed: learner rank\(s\) \[1\] did not finish "
                                     r"within learner.collective_timeout_s=15 s"):
                ray.get(group.rank0.step_groups.remote(steps_groups(), [0, 1]))
        finally:
            group.shutdown()
    finally:
        ray.shutdown()
