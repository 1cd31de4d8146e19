"""Admission control (broker/admission.py) and dynamic sampling over a real redis-server.

- plan_step and step_capacity on hand-made inputs (expected values worked out by hand in the comments);
- claims: AReaL's capacity per deadline, partial grants, refusals (stale / done / starting), expiry of a
  claim without heartbeat (its groups return to the pool, its late publish is refused and not counted);
- dynamic sampling on a hand-made stream: zero-variance groups are skipped, counted, bounded by the extra
  reads, and never acknowledged twice.
"""
from __future__ import annotations

import time

import pytest

from broker.admission import Admission, ClaimExpired, Held, StepCollector, plan_step, step_capacity
from broker.config import BrokerConfig
from broker.run_state import actor_counts, key, open_pool, publish_learner_version, run_counts
from broker.streams import GroupConsumer, GroupProducer, connect
from learner.loss import zero_variance

RUN = "run"


def held(*items: str) -> list[Held]:
    """'c1' = claimed, deadline 1, informative; 'u2' = unclaimed deadline 2; a trailing 'z' = zero-variance."""
    return [Held(deadline=int(s[1:].rstrip("z")), claimed=s[0] == "c", informative=not s.endswith("z")) for s in items]


# ---- plan_step: pure -------------------------------------------------------------------------------------
def test_plan_without_admission_takes_the_earliest_deadlines():
    # no claims: groups_per_step = 2 informative groups, earliest deadline first, ties in read order
    assert plan_step(held("u2", "u1", "u1"), {}, version=0, capacity=2, groups_per_step=2,
                     reads_exhausted=False) == ([1, 2], [])
    # fewer than groups_per_step: read more
    assert plan_step(held("u1"), {}, 0, 2, 2, False) is None


def test_plan_waits_for_a_group_this_step_must_train():
    # version 0, C = 2: pending {0: 1, 1: 3}. R_0 = 1 - 0 = 1 group of deadline 0; R_1 = 4 - 1*2 = 2 groups of
    # deadline <= 1. Holding three deadline-1 groups and no deadline-0 one: wait (taking two deadline-1 groups
    # now would leave the deadline-0 group to be trained at version 1: stale).
    assert plan_step(held("c1", "c1", "c1"), {0: 1, 1: 3}, 0, 2, 2, False) is None
    # once it is held: the deadline-0 group (index 1) then one deadline-1 group (index 0)
    assert plan_step(held("c1", "c0", "c1"), {0: 1, 1: 3}, 0, 2, 2, False) == ([1, 0], [])


def test_plan_trains_more_than_a_step_when_the_pool_requires_it():
    # C = 3 > groups_per_step = 2 (a filtered share was admitted for): 3 pending groups of deadline 0 must
    # all be consumed at version 0: R_0 = 3, so 3 are trained
    assert plan_step(held("c0", "c0", "c0"), {0: 3}, 0, 3, 2, False) == ([0, 1, 2], [])
    # past deadlines (garbage of expired claims) are ignored: pending {-1: 5} asks nothing at version 0
    assert plan_step(held("c0", "c1"), {-1: 5, 0: 1, 1: 1}, 0, 2, 2, False) == ([0, 1], [])


def test_plan_filters_zero_variance_groups():
    # the zero-variance group is filtered; the informative ones fill the step
    assert plan_step(held("u0", "u0z", "u1"), {}, 0, 2, 2, False) == ([0, 2], [1])
    # one informative group only: wait for more until the reads are exhausted, then train what there is
    assert plan_step(held("u0", "u0z"), {}, 0, 2, 2, False) is None
    assert plan_step(held("u0", "u0z"), {}, 0, 2, 2, True) == ([0], [1])
    # none informative at the bound: the zero-variance groups are trained (a step needs a batch)
    assert plan_step(held("u0z", "u1z"), {}, 0, 2, 2, True) == ([0, 1], [])
    # a filtered claimed group counts towards what the pool requires: R_0 = 2, one filtered + one trained
    assert plan_step(held("c0z", "c0", "c1"), {0: 2, 1: 1}, 0, 2, 2, False) == ([1, 2], [0])


def test_step_capacity():
    assert step_capacity(4, filtered=0, seen=0, max_extra_reads=16) == 4
    assert step_capacity(4, filtered=3, seen=3, max_extra_reads=16) == 4  # fewer than a step seen: no estimate
    assert step_capacity(4, filtered=4, seen=8, max_extra_reads=16) == 8  # f = 1/2: 4 / (1 - 1/2)
    assert step_capacity(4, filtered=2, seen=8, max_extra_reads=16) == 6  # f = 1/4: ceil(4 / 0.75) = ceil(5.33)
    assert step_capacity(4, filtered=6, seen=8, max_extra_reads=2) == 6   # 16, capped at 4 + 2
    assert step_capacity(4, filtered=8, seen=8, max_extra_reads=16) == 20  # all filtered: the cap


# ---- claims over Redis -------------------------------------------------------------------------------------
def pool(server, max_staleness: int, capacity: int = 2, last_version: int = 100, ttl: float = 30.0):
    cfg = BrokerConfig(url=server.url, max_staleness=max_staleness, claim_ttl_s=ttl, high_watermark=1000)
    client = connect(cfg)
    admission = Admission(client, cfg, RUN)
    open_pool(client, RUN, last_version, capacity)
    return cfg, client, admission


def grants(admission, weight_version: int, asks: list[int]) -> list[int]:
    return [c.groups if c else 0 for c, _ in (admission.claim(weight_version, n) for n in asks)]


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_capacity_is_the_areal_formula(any_redis, max_staleness):
    # version 0, C = 2: (max_staleness + 0 + 1) * 2 groups with weights 0 fit, one at a time
    _, _, admission = pool(any_redis, max_staleness)
    assert sum(grants(admission, 0, [1] * 10)) == (max_staleness + 1) * 2


def test_partial_grants_and_refusals(any_redis):
    cfg, client, admission = pool(any_redis, max_staleness=1, capacity=2, last_version=2)
    assert grants(admission, 0, [3, 3]) == [3, 1]  # 4 fit into versions 0..1
    claim, why = admission.claim(0, 1)
    assert claim is None and why == "full"
    assert admission.pending(0) == {1: 4}
    publish_learner_version(client, RUN, 2)
    assert admission.claim(0, 1) == (None, "stale")  # deadline 0 + 1 < version 2
    claim, _ = admission.claim(2, 5)  # the deadline-1 groups are past: ignored
    assert (claim.groups, claim.deadline) == (2, 2)  # deadline 2 + 1 capped at the last version 2: one step, C = 2
    publish_learner_version(client, RUN, 3)
    assert admission.claim(3, 1) == (None, "done")
    client.delete(key(RUN, "admission:step_capacity"))
    assert admission.claim(3, 1) == (None, "starting")


def test_an_expired_claim_returns_its_groups_and_cannot_publish(any_redis, make_group):
    cfg, client, admission = pool(any_redis, max_staleness=0, capacity=2, ttl=1.0)
    producer = GroupProducer(client, cfg, RUN, admission=admission)
    kept, _ = admission.claim(0, 1)
    lost, _ = admission.claim(0, 1)
    assert admission.claim(0, 1) == (None, "full")
    for _ in range(8):  # 1.6 s: `lost` expires, `kept` is heart-beaten every 0.2 s
        time.sleep(0.2)
        assert admission.heartbeat(kept)
    assert not admission.heartbeat(lost)
    assert admission.pending(0) == {0: 1}  # `lost` went back to the pool ...
    again, _ = admission.claim(0, 1)
    assert again is not None and again.groups == 1  # ... and another actor can take it
    with pytest.raises(ClaimExpired):
        producer.publish_many([make_group("late", run_id=RUN)], claim=lost, counts=[{"rollout_groups": 1}])
    producer.publish_many([make_group("kept", run_id=RUN)], claim=kept,
                          counts=[{"rollout_groups": 1, "reward_errors": 2, "tier/hard/groups": 1}])
    counts = run_counts(client, RUN)
    assert counts["produced"] == 1 and counts["claims_expired"] == 1 and counts["claimed_returned"] == 1
    # the counts come with the publish, in its script: the refused one's are not added
    assert actor_counts(client, RUN) == {"rollout_groups": 1, "reward_errors": 2, "claims_lost": 0,
                                         "tier/hard/groups": 1}
    assert client.xlen(key(RUN, cfg.stream)) == 1
    assert admission.release(again) == 1 and admission.pending(0) == {0: 1}  # only `kept`, in the stream


# ---- dynamic sampling on a hand-made stream ------------------------------------------------------------------
def flat(group):
    """The same group with every reward 1.0 (zero variance)."""
    for s in group.samples:
        s.reward = 1.0
    return group


def test_zero_variance_groups_are_skipped_counted_and_acked_once(any_redis, make_group):
    cfg = BrokerConfig(url=any_redis.url, max_staleness=1, high_watermark=1000)
    client = connect(cfg)
    producer = GroupProducer(client, cfg, RUN)
    groups = [make_group("g1", run_id=RUN), flat(make_group("g2", run_id=RUN)), flat(make_group("g3", run_id=RUN)),
              flat(make_group("g4", run_id=RUN)), make_group("g5", run_id=RUN), make_group("g6", run_id=RUN)]
    producer.publish_many(groups)
    consumer = GroupConsumer(client, cfg, RUN, "learner-0")
    informative = lambda g: not zero_variance([s.reward for s in g.samples])  # noqa: E731
    collector = StepCollector(consumer, None, groups_per_step=2, informative=informative, max_extra_reads=2)

    # step 1 reads g1, g2 (1 informative), then g3, g4 one by one: 4 reads = 2 + max_extra_reads, the bound
    train, filtered, stale, stats = collector.collect(0, 2, timeout_s=30, block_ms=100)
    assert [d.group.group_id for d in train] == ["g1"]
    assert [d.group.group_id for d in filtered] == ["g2", "g3", "g4"]
    assert stats["reads"] == 4 and stats["filter_shortfall"] == 1 and not stale
    consumer.commit(train, filtered, learner_version=1)
    train, filtered, _, stats = collector.collect(1, 2, timeout_s=30, block_ms=100)
    assert [d.group.group_id for d in train] == ["g5", "g6"] and not filtered and stats["filter_shortfall"] == 0
    consumer.commit(train, filtered, learner_version=2)

    counts = run_counts(client, RUN)
    assert (counts["consumed"], counts["groups_filtered"]) == (3, 3)
    assert counts["produced"] == counts["consumed"] + counts["groups_filtered"] + client.xlen(key(RUN, cfg.stream))
    # a filtered group delivered again (a producer retry) is a duplicate: dropped, not filtered (acked) twice
    producer.publish(flat(make_group("g2", run_id=RUN)))
    assert consumer.read(4, block_ms=100) == []
    counts = run_counts(client, RUN)
    assert (counts["groups_filtered"], counts["duplicates"]) == (3, 1)
    assert client.xpending(key(RUN, cfg.stream), cfg.consumer_group)["pending"] == 0
    assert client.xlen(key(RUN, cfg.stream)) == 0


def test_without_the_filter_zero_variance_groups_are_trained(any_redis, make_group):
    """The control of the test above: same stream, filter_groups=none."""
    cfg = BrokerConfig(url=any_redis.url, max_staleness=1, high_watermark=1000)
    client = connect(cfg)
    GroupProducer(client, cfg, RUN).publish_many([make_group("g1", run_id=RUN), flat(make_group("g2", run_id=RUN))])
    collector = StepCollector(GroupConsumer(client, cfg, RUN, "learner-0"), None, groups_per_step=2)
    train, filtered, _, _ = collector.collect(0, 2, timeout_s=30, block_ms=100)
    assert [d.group.group_id for d in train] == ["g1", "g2"] and not filtered


def test_a_step_stops_reading_when_it_holds_the_whole_pool(any_redis, make_group):
    """Last version, all groups zero-variance, C = 2 < groups_per_step + max_extra_reads = 4: admission never
    lets the actors make the 4 reads the bound asks for; the step trains the 2 it holds instead of waiting."""
    cfg, client, admission = pool(any_redis, max_staleness=1, capacity=2, last_version=0)
    claim, _ = admission.claim(0, 4)
    assert claim.groups == 2 and claim.deadline == 0
    GroupProducer(client, cfg, RUN, admission=admission).publish_many(
        [flat(make_group("g1", run_id=RUN)), flat(make_group("g2", run_id=RUN))], claim=claim)
    informative = lambda g: not zero_variance([s.reward for s in g.samples])  # noqa: E731
    collector = StepCollector(GroupConsumer(client, cfg, RUN, "learner-0"), admission, groups_per_step=2,
                              informative=informative, max_extra_reads=2)
    train, filtered, _, stats = collector.collect(0, 2, timeout_s=20, block_ms=100)  # TimeoutError if it waits
    assert sorted(d.group.group_id for d in train) == ["g1", "g2"] and not filtered  # nothing informative
    assert stats["reads"] == 2
