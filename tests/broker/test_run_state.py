"""The run's Redis state (broker/run_state.py): its table names every key the module defines, accessors read
back what they wrote on a real Redis, and one utilization formula."""
import re

from broker import run_state as rs


def add_count(r, run_id: str, name: str, n: int) -> None:
    """Add `n` to the run's `counts` field `name` (the broker's stream scripts do this in Redis)."""
    r.hincrby(rs.key(run_id, rs.COUNTS), name, int(n))


def test_the_table_lists_exactly_the_keys_the_module_defines():
    table = set(re.findall(r"^\| `([a-z_:]+)`", rs.__doc__, flags=re.M))
    names = {v for k, v in vars(rs).items() if k.isupper() and not k.startswith("_") and isinstance(v, str)}
    assert table == names


def test_accessors_read_back_what_they_wrote(redis_server):
    r = redis_server.client()
    assert rs.read_learner_version(r, "run") == 0 and not rs.run_known(r, "run")
    rs.publish_learner_version(r, "run", 3)
    rs.publish_kv_budget(r, "run", 48)
    rs.set_actors_target(r, "run", 5)
    rs.set_paused(r, "run", True)
    rs.append_budget_log(r, "run", {"version": 1})
    add_count(r, "run", "produced", 7)
    assert (rs.read_learner_version(r, "run"), rs.read_kv_budget(r, "run", 0),
            rs.read_actors_target(r, "run")) == (3, 48, 5)
    assert rs.run_known(r, "run") and rs.is_paused(r, "run") and rs.read_budget_log(r, "run") == ['{"version": 1}']
    assert rs.run_counts(r, "run") == {"produced": 7, "consumed": 0, "groups_filtered": 0, "dropped_stale": 0,
                                       "dead_lettered": 0, "duplicates": 0}
    rs.set_paused(r, "run", False)
    assert not rs.is_paused(r, "run") and rs.read_actors_target(r, "other") is None


def test_rollout_utilization_counts_trained_and_filtered_over_what_left_the_queue():
    counts = {"produced": 12, "consumed": 6, "groups_filtered": 2}
    assert rs.rollout_utilization(counts, in_flight=4) == 8 / 8
    assert rs.rollout_utilization(counts) == 8 / 12
    assert rs.rollout_utilization({"produced": 0, "consumed": 0, "groups_filtered": 0}) == 0.0


def test_phases_say_what_each_part_does_and_since_when_on_the_servers_clock(any_redis):
    """set_phase / read_phases / PhaseBoard: each part's phase with its duration on the server's
    clock; a board writes only at a change of phase (the same phase again keeps its `since`); `starts_step` marks
    when the learner's step had its groups, kept through its later phases; `during` puts back the phase it
    interrupted; a part whose write fails goes on (nothing raised) and writes again at its next call."""
    import time

    from broker.redis_server import LocalRedis

    r = any_redis.client()
    assert rs.read_phases(r, "run") == {}
    actor = rs.PhaseBoard(r, "run", "actor-0")
    actor("generating")
    time.sleep(0.3)
    actor("generating")  # again: nothing written, still generating since the first call
    phases = rs.read_phases(r, "run")
    assert phases["actor-0"].phase == "generating" and 0.3 <= phases["actor-0"].for_s < 5
    assert phases["actor-0"].step_s is None
    actor("scoring")
    assert rs.read_phases(r, "run")["actor-0"].phase == "scoring" and rs.read_phases(r, "run")["actor-0"].for_s < 0.3

    learner = rs.PhaseBoard(r, "run", "learner-0")
    learner("reading groups")
    learner("recompute", starts_step=True)
    time.sleep(0.3)
    learner("backward")
    lead = rs.read_phases(r, "run")["learner-0"]
    assert lead.phase == "backward" and lead.for_s < 0.3 <= lead.step_s < 5
    learner("reading groups")
    with learner.during("weight sync"):
        assert rs.read_phases(r, "run")["learner-0"].phase == "weight sync"
    assert rs.read_phases(r, "run")["learner-0"].phase == "reading groups"
    with learner.during("weight sync"):
        learner("recompute", starts_step=True)  # the step moved on meanwhile: its phase stands
    assert rs.read_phases(r, "run")["learner-0"].phase == "recompute"
    assert set(rs.read_phases(r, "run")) == {"actor-0", "learner-0"} and rs.read_phases(r, "other") == {}

    with LocalRedis() as gone:  # a Redis that stops answering: the part's calls return, nothing raised
        lost = rs.PhaseBoard(gone.client(retry_s=0), "run", "actor-1")
        lost("generating")
    lost("scoring")
    lost.r = r  # Redis back (here: another client): the next call writes, also of the phase it already was in
    lost("scoring")
    assert rs.read_phases(r, "run")["actor-1"].phase == "scoring"


def test_oldest_unread_group_is_aged_on_the_servers_clock(any_redis):
    """streams.oldest_unread_s: None while every group in the stream was read (or before the learner's consumer
    group exists), else how long the oldest group not yet read has been queued."""
    import time

    from broker.config import BrokerConfig
    from broker.streams import oldest_unread_s

    r, cfg = any_redis.client(), BrokerConfig(url=any_redis.url)
    stream = rs.key("run", cfg.stream)
    assert oldest_unread_s(r, cfg, "run") is None
    r.xgroup_create(stream, cfg.consumer_group, id="0", mkstream=True)
    assert oldest_unread_s(r, cfg, "run") is None
    r.xadd(stream, {"group": b"1"})
    time.sleep(0.3)
    r.xadd(stream, {"group": b"2"})
    assert 0.3 <= oldest_unread_s(r, cfg, "run") < 5
    r.xreadgroup(cfg.consumer_group, "learner-0", {stream: ">"}, count=1)
    assert oldest_unread_s(r, cfg, "run") < 0.3
    r.xreadgroup(cfg.consumer_group, "learner-0", {stream: ">"}, count=1)
    assert oldest_unread_s(r, cfg, "run") is None


def test_the_learner_worker_hands_its_phase_board_to_the_learner():
    """Learner.step reports its parts through an explicit hook (tests/learner/test_learner.py checks the calls); the
    learner worker passes its phase board as that hook, so that the console's line names them."""
    import inspect

    from deploy.learner_worker import LearnerWorker
    from learner.learner import PHASES

    assert "Learner(self.cfg.model, lcfg, phase=self.phase)" in inspect.getsource(LearnerWorker.__init__)
    assert PHASES == ("backward", "optimizer step")
