"""The run's Redis state (broker/run_state.py): its table names every key the module defines, accessors read
back what they wrote on a real Redis, and one utilization formula."""
import re

from broker import run_state as rs


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
    rs.add_count(r, "run", "produced", 7)
    assert (rs.read_learner_version(r, "run"), rs.read_kv_budget(r, "run", 0), rs.read_actors_target(r, "run")) == (3, 48, 5)
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
