"""Admission control with real Ray actors and a real redis-server: 3 rollout actors of very different speeds
(a batch takes 0.05 s, 0.3 s and 2 s), max_staleness 0 and 1, the slow one killed in the middle of a batch.
The actors' generation is a sleep (the engine is not what is tested); claims, publishes, the learner's step
planning (StepCollector), commits and weight versions are the system's own code paths.

Checked: no group is dropped stale and every trained group respects the bound (with max_staleness 0 every
trained group was generated with the learner's current weights); the killed actor's claim expires and the
run does not stall; the accounting identity produced = trained + filtered + dropped + dead-lettered +
duplicates + left holds exactly; at stop at most one actor batch is left in the queue. Control: the same
run without admission control drops stale groups.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import uuid

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402

from broker.admission import Admission, ClaimExpired, StepCollector  # noqa: E402
from broker.config import BrokerConfig  # noqa: E402
from broker.run_state import key, open_pool, read_learner_version, run_counts  # noqa: E402
from broker.schema import SampleRecord, TrajectoryGroup  # noqa: E402
from broker.streams import GroupConsumer, GroupProducer, connect  # noqa: E402

pytestmark = pytest.mark.system  # Ray, DeepSpeed, Redis (and MLflow) together: not in the quick lane

SPEEDS = {"fast": 0.05, "medium": 0.3, "slow": 2.0}  # seconds per batch
PROMPTS_PER_BATCH, GROUPS_PER_STEP, STEPS, TTL_S = 2, 2, 12, 1.5


def make_group(run_id: str, weight_version: int, seed: int) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    samples = [SampleRecord(prompt_ids=rng.integers(0, 1000, 5, dtype=np.int32),
                            response_ids=rng.integers(0, 1000, 4, dtype=np.int32),
                            logp_sparse=-rng.exponential(1.0, 4).astype(np.float32), finish_reason="stop",
                            reward=float(i), kv_retained_tokens=9, kv_peak_bytes=64) for i in range(2)]
    return TrajectoryGroup(run_id=run_id, group_id=uuid.uuid4().hex, prompt_id="p", weight_version=weight_version,
                           temperature=1.0, compressor="rkv", kv_budget=8, samples=samples)


class SleepyRollout:
    """A rollout actor whose batch is a sleep of `batch_s`: at each batch boundary it takes the weights of the
    last sync round (`synced_version`), then claims (admission) or waits while its weights are older than
    learner version - max_staleness (no admission, the old rule), 'generates', publishes."""

    def __init__(self, url: str, run_id: str, max_staleness: int, admission: bool, name: str, batch_s: float):
        self.cfg = BrokerConfig(url=url, max_staleness=max_staleness, claim_ttl_s=TTL_S, high_watermark=1000)
        self.client, self.run_id, self.name, self.batch_s = connect(self.cfg), run_id, name, batch_s
        self.admission = Admission(self.client, self.cfg, run_id) if admission else None
        self.producer = GroupProducer(self.client, self.cfg, run_id, admission=self.admission)
        self.stopping, self.claim, self.lost = threading.Event(), None, 0
        self.loop = threading.Thread(target=self.run, daemon=True)
        self.loop.start()
        if admission:
            threading.Thread(target=self.heartbeat, daemon=True).start()

    def heartbeat(self):
        while True:
            time.sleep(TTL_S / 3)
            if self.claim is not None:
                self.admission.heartbeat(self.claim)

    def run(self):
        seed = 0
        while not self.stopping.is_set():
            version = int(self.client.get(key(self.run_id, "synced_version")) or 0)
            n = PROMPTS_PER_BATCH
            if self.name != "slow" and self.client.exists(key(self.run_id, "let_slow_claim")):
                self.stopping.wait(0.02)  # the test wants the slow actor to take the next claim
                continue
            if self.admission is not None:
                self.claim, _ = self.admission.claim(version, n)
                if self.claim is None:
                    self.stopping.wait(0.02)
                    continue
                n = self.claim.groups
            elif read_learner_version(self.client, self.run_id) - version > self.cfg.max_staleness:
                self.stopping.wait(0.02)
                continue
            self.client.set(key(self.run_id, f"busy:{self.name}"), 1)
            time.sleep(self.batch_s)
            groups = [make_group(self.run_id, version, seed + i) for i in range(n)]
            seed += n
            try:
                self.producer.publish_many(groups, claim=self.claim)
            except ClaimExpired:
                self.lost += 1
            self.claim = None
            self.client.delete(key(self.run_id, f"busy:{self.name}"))

    def stop(self) -> int:
        """Finish the current batch (published), stop; returns the batches whose claim expired."""
        self.stopping.set()
        self.loop.join()
        return self.lost


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor class lives in this test file
    yield
    ray.shutdown()


def run_pipeline(url: str, max_staleness: int, admission: bool) -> dict:
    """STEPS learner steps against the three actors; the slow actor is killed mid-batch after step 3."""
    run_id = f"adm-{uuid.uuid4().hex[:6]}"
    cfg = BrokerConfig(url=url, max_staleness=max_staleness, claim_ttl_s=TTL_S, high_watermark=1000)
    client = connect(cfg)
    consumer = GroupConsumer(client, cfg, run_id, "learner-0")
    pool = Admission(client, cfg, run_id) if admission else None
    open_pool(client, run_id, last_version=STEPS - 1, capacity=GROUPS_PER_STEP)
    actor = ray.remote(SleepyRollout).options(max_concurrency=2, num_cpus=0)
    actors = {name: actor.remote(url, run_id, max_staleness, admission, name, s) for name, s in SPEEDS.items()}
    collector = StepCollector(consumer, pool, GROUPS_PER_STEP)
    trained, killed = [], []

    def kill_slow_mid_batch():  # SIGKILL-like: the slow actor dies holding its claim, in the middle of a batch
        while read_learner_version(client, run_id) < 3:
            time.sleep(0.01)
        client.set(key(run_id, "let_slow_claim"), 1)  # the other two stop claiming until the slow one has
        while not client.exists(key(run_id, "busy:slow")):
            time.sleep(0.01)
        client.delete(key(run_id, "let_slow_claim"))
        ray.kill(actors["slow"], no_restart=True)
        killed.append(read_learner_version(client, run_id))

    killer = threading.Thread(target=kill_slow_mid_batch, daemon=True)
    killer.start()
    for version in range(STEPS):
        train, filtered, stale, _ = collector.collect(version, GROUPS_PER_STEP, timeout_s=120, block_ms=100)
        trained += [(version, d.group.weight_version) for d in train]
        time.sleep(0.05)  # the optimizer step
        consumer.commit(train, filtered, stale, learner_version=version + 1)
        time.sleep(0.05)  # the weight sync round, after which actors sample with the new weights
        client.set(key(run_id, "synced_version"), version + 1)
    killer.join()
    lost = sum(ray.get([a.stop.remote() for name, a in actors.items() if not (killed and name == "slow")]))
    counts = run_counts(client, run_id)
    return {"trained": trained, "counts": counts, "left": client.xlen(key(run_id, cfg.stream)), "lost": lost,
            "killed_mid_batch": bool(killed)}


def identity_holds(r: dict) -> bool:
    c = r["counts"]
    return c["produced"] == (c["consumed"] + c["groups_filtered"] + c["dropped_stale"] + c["dead_lettered"]
                             + c["duplicates"] + r["left"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_admission_no_stale_drops_exact_accounting(ray_local, redis_server, max_staleness):
    r = run_pipeline(redis_server.url, max_staleness, admission=True)
    c = r["counts"]
    assert r["killed_mid_batch"] and c["claims_expired"] >= 1  # the dead actor's claim came back to the pool
    assert c["consumed"] == STEPS * GROUPS_PER_STEP  # no stall: every step trained a full batch
    assert c["dropped_stale"] == 0
    assert all(version - weights <= max_staleness for version, weights in r["trained"])
    if max_staleness == 0:  # on-policy: each trained group was sampled with the learner's current weights
        assert all(version == weights for version, weights in r["trained"])
    assert identity_holds(r), (c, r["left"])
    assert r["left"] <= PROMPTS_PER_BATCH and r["lost"] == 0


@pytest.mark.timeout(600)
def test_without_admission_the_same_run_drops_stale_groups(ray_local, redis_server):
    """The control: the baseline (actors only wait while their weights are too old) drops groups as stale."""
    r = run_pipeline(redis_server.url, 0, admission=False)
    assert r["counts"]["dropped_stale"] > 0
    assert identity_holds(r)
