"""Redis blips and outages, against a real redis-server: every client retries connection errors
with backoff for broker.retry_s and then raises within that bound; a restart of the server (same port, its
append-only file) in the middle of a sequence of publishes, reads and commits is ridden out with exact counts;
a command that Redis executed but whose reply was lost with the connection (a loopback relay that drops it) is
retried by redis-py and changes nothing the second time: no group is published, counted or trained twice."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import redis

from broker import run_state as rs
from broker.admission import Admission
from broker.config import BrokerConfig
from broker.redis_server import LocalRedis
from broker.run_state import actor_counts, key, run_counts
from broker.streams import GroupConsumer, GroupProducer, connect, discard_queue, queue_depth, unreachable

EXACT = {"produced": 0, "consumed": 0, "groups_filtered": 0, "dropped_stale": 0, "dead_lettered": 0, "duplicates": 0}


def counts(client) -> dict:
    """The run's counts over the fields of EXACT (other counters left out)."""
    return {k: v for k, v in run_counts(client, "run").items() if k in EXACT}


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True


def while_down(server: LocalRedis, down_s: float, command):
    """Stop `server` (SIGTERM), call `command()` in a thread while it is down, start the server again on its port
    and append-only file `down_s` later (from this thread: a server dies with the thread that started it), and
    return what the command returned once it did, with the seconds it took (it raises what the command raised)."""
    server._stop_process(hard=False)
    assert refused(server.port)
    out: dict = {}

    def call():
        t0 = time.monotonic()
        try:
            out["value"] = command()
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            out["error"] = e
        out["took"] = time.monotonic() - t0
    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(down_s)
    server._start()
    thread.join(timeout=60)
    if "error" in out:
        raise out["error"]
    return out["value"], out["took"]


def test_the_retry_bound_is_derived_from_retry_s():
    """redis-py's Retry bounds a count; the count is the first whose backoffs add up to retry_s, so the waiting
    ends within [retry_s, retry_s + one backoff cap]."""
    for retry_s in (0.0, 0.1, 1.0, 2.0, 30.0, 600.0):
        n = rs.retry_attempts(retry_s)
        policy = rs.retry_policy(retry_s)
        assert policy.get_retries() == n
        waited = sum(policy._backoff.compute(k) for k in range(1, n + 1))
        assert retry_s <= waited < retry_s + rs.RETRY_CAP_S, (retry_s, n, waited)
    assert rs.retry_attempts(0.0) == 0


@pytest.mark.timeout(120)
def test_a_client_rides_out_a_restart_with_exact_counts(redis_binary, make_group):
    """A producer, the learner's consumer and an admission pool on one client; the server is stopped and started
    again on its port (its data back from the append-only file) before a publish, before a commit, before a claim
    and while the learner blocks on the empty stream: each of those commands waits for the server and succeeds; at
    the end every group was published once, trained once, and every counter is exact. (Before run_state.retry_policy the
    first command after the stop raised ConnectionError: the clients were built with redis-py's defaults, which retry
    nothing.)"""
    with LocalRedis(appendonly=True, binary=redis_binary) as server:
        cfg = BrokerConfig(url=server.url, retry_s=15)
        client = connect(cfg)
        producer, consumer = GroupProducer(client, cfg, "run"), GroupConsumer(client, cfg, "run", "learner-0")
        producer.publish_many([make_group(f"g{i}", seed=i) for i in range(4)], counts=[{"rollout_groups": 1}] * 4)
        held = consumer.read(3, block_ms=100)

        _, took = while_down(server, 1.0, lambda: producer.publish_many(
            [make_group(f"g{i}", seed=i) for i in range(4, 6)], counts=[{"rollout_groups": 1}] * 2))
        assert took > 0.5  # it waited for the server
        _, took = while_down(server, 1.0, lambda: consumer.commit(held, learner_version=1))
        assert took > 0.5

        admission = Admission(client, cfg, "run")
        rs.open_pool(client, "run", last_version=5, capacity=2)
        (claim, why), took = while_down(server, 0.5, lambda: admission.claim(weight_version=1, groups=2))
        assert claim is not None and claim.groups == 2 and took > 0.25, why
        producer.admission = admission
        producer.publish_many([make_group("c0", weight_version=1), make_group("c1", weight_version=1)], claim=claim,
                              counts=[{"rollout_groups": 1}] * 2)
        rest = []
        while len(rest) < 5:
            got = consumer.read(8, block_ms=100)
            consumer.commit(got, learner_version=1)
            rest += got

        def publish_late():  # while the learner blocks on the empty stream (its read was sent before the stop)
            time.sleep(1.0)
            return GroupProducer(connect(cfg), cfg, "run").publish(make_group("late", weight_version=1))
        reader = threading.Thread(target=lambda: rest.extend(consumer.read(1, block_ms=20_000)))
        reader.start()
        time.sleep(0.3)
        while_down(server, 1.0, publish_late)
        reader.join(timeout=30)
        consumer.commit(rest[5:], learner_version=1)

        assert (sorted(d.group.group_id for d in [*held, *rest])
                == sorted([f"g{i}" for i in range(6)] + ["c0", "c1", "late"]))
        assert counts(client) == {**EXACT, "produced": 9, "consumed": 9}
        assert actor_counts(client, "run")["rollout_groups"] == 8
        assert consumer.counters["consumed"] == 9 and consumer.counters["duplicates"] == 0
        assert queue_depth(client, cfg, "run") == 0 and client.scard(key("run", rs.CONSUMED)) == 9
        assert admission.pending(1) == {}  # the claim's groups were settled once
        assert run_counts(client, "run")["admitted"] == 2


@pytest.mark.timeout(60)
def test_an_outage_longer_than_the_bound_raises_within_it(monkeypatch):
    """Redis gone for good: a command (on a connection that was open, or on a new client) raises ConnectionError
    after retry_s, not before and not much later; retry_s=0 raises at once; a wrong password is not retried."""
    with LocalRedis(password="pw") as server:
        monkeypatch.setenv("SPARSE_RL_REDIS_PASSWORD", "wrong")
        t0 = time.monotonic()
        with pytest.raises(redis.AuthenticationError):
            connect(BrokerConfig(url=server.url, retry_s=10)).ping()
        assert time.monotonic() - t0 < 1.0  # a wrong password is not a blip
        monkeypatch.setenv("SPARSE_RL_REDIS_PASSWORD", "pw")
        assert unreachable(BrokerConfig(url=server.url)) is None
        cfg = BrokerConfig(url=server.url, retry_s=2.0)
        client = connect(cfg)
        consumer = GroupConsumer(client, cfg, "run", "learner-0")  # its connection is open
    bound = (2.0, 2.0 + rs.RETRY_CAP_S + 1.0)
    t0 = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        consumer.read(4, block_ms=100)
    assert bound[0] <= time.monotonic() - t0 < bound[1]
    for retry_s in (2.0, 0.0):  # new clients
        t0 = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            connect(BrokerConfig(url=server.url, retry_s=retry_s)).get("x")
        assert retry_s <= time.monotonic() - t0 < retry_s + rs.RETRY_CAP_S + 1.0, retry_s
    assert unreachable(BrokerConfig(url=server.url)).startswith("ConnectionError: ")


class LosingRelay:
    """A TCP relay on 127.0.0.1 in front of a real redis-server that loses one reply when armed with a command
    name: it passes the next request holding that command on to the server, which executes it, then closes the
    client's connection instead of passing the reply back (what a connection dropped at the wrong moment does).
    A NOSCRIPT reply (the script is loaded and sent again) is passed on and the relay stays armed.
    `lost`: the command names whose reply was lost, in order."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.armed: bytes | None = None
        self.lost: list[str] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, command: str) -> None:
        with self.lock:
            self.armed = command.encode()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            cut: dict = {"command": None}
            threading.Thread(target=self._requests, args=(down, up, cut), daemon=True).start()
            threading.Thread(target=self._replies, args=(down, up, cut), daemon=True).start()

    @staticmethod
    def _close(*socks) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _requests(self, down, up, cut) -> None:
        try:
            while data := down.recv(1 << 20):
                with self.lock:
                    if self.armed is not None and f"${len(self.armed)}\r\n".encode() + self.armed + b"\r\n" in data:
                        cut["command"], self.armed = self.armed, None
                up.sendall(data)
        except OSError:
            pass
        self._close(down, up)

    def _replies(self, down, up, cut) -> None:
        try:
            while data := up.recv(1 << 20):
                if cut["command"] is not None:
                    if data.startswith(b"-NOSCRIPT"):
                        with self.lock:
                            cut["command"], self.armed = None, cut["command"]
                    else:
                        self.lost.append(cut["command"].decode())
                        break
                down.sendall(data)
        except OSError:
            pass
        self._close(down, up)


@pytest.fixture
def relay(redis_server):
    r = LosingRelay(redis_server.port)
    yield r
    r.close()


@pytest.mark.timeout(120)
def test_a_retried_publish_or_commit_never_counts_or_trains_twice(relay, redis_server, make_group):
    """Each write whose reply is lost once (the server executed it) is retried by the client and takes effect
    once: a publish (plain and under an admission claim), an admission claim, the prompt indices a batch takes,
    the learner's commit, the drops of a read, a discarded queue, a budget log line; a read whose reply was lost
    delivers its groups at the next read (not after claim_min_idle_ms). The counters stay exact.
    (With the retries and the transactions of before, the lost publish was published and counted twice and the
    lost commit counted its groups twice.)"""
    cfg = BrokerConfig(url=relay.url, retry_s=10, claim_min_idle_ms=600_000, max_staleness=1)
    client = connect(cfg)
    direct = redis_server.client()
    producer, consumer = GroupProducer(client, cfg, "run"), GroupConsumer(client, cfg, "run", "learner-0")
    admission = Admission(client, cfg, "run")
    producer.admission = admission
    assert consumer.read(1, block_ms=10) == []  # (its own history from an earlier life: none)
    producer.publish(make_group("warm"))  # the scripts are loaded
    got = consumer.read(1, block_ms=100)
    consumer.commit(got)

    relay.arm("EVALSHA")  # a plain publish
    ids = producer.publish_many([make_group("a", seed=1), make_group("b", seed=2)], counts=[{"rollout_groups": 1}] * 2)
    assert relay.lost == ["EVALSHA"]
    assert [m.decode() for m, _ in direct.xrange(key("run", cfg.stream))] == ids and len(ids) == 2
    assert counts(direct) == {**EXACT, "produced": 3, "consumed": 1}
    assert actor_counts(direct, "run")["rollout_groups"] == 2

    relay.arm("XREADGROUP")  # a read whose reply is lost: the groups are pending here, not seen
    lost_read = consumer.read(2, block_ms=100)
    assert relay.lost[-1] == "XREADGROUP" and lost_read == []
    deliveries = []
    for _ in range(3):
        deliveries += consumer.read(2, block_ms=100)
    assert [d.group.group_id for d in deliveries] == ["a", "b"] and consumer.counters["reclaimed"] == 0

    relay.arm("EVALSHA")  # the learner's commit
    consumer.commit(deliveries, learner_version=1)
    assert relay.lost[-1] == "EVALSHA"
    assert counts(direct) == {**EXACT, "produced": 3, "consumed": 3}
    assert consumer.counters["consumed"] == 3 and rs.read_learner_version(direct, "run") == 1

    rs.open_pool(client, "run", last_version=9, capacity=4)
    relay.arm("EVALSHA")  # an admission claim
    claim, why = admission.claim(weight_version=1, groups=3)
    assert relay.lost[-1] == "EVALSHA" and claim is not None and claim.groups == 3, why
    assert run_counts(direct, "run")["admitted"] == 3 and admission.pending(1) == {claim.deadline: 3}
    relay.arm("EVALSHA")  # the prompts of the claim's batch
    assert admission.take_prompts(claim) == [0, 1, 2] and relay.lost[-1] == "EVALSHA"
    assert rs.take_prompt_indices(direct, "run", 1) == [3]  # none skipped
    relay.arm("EVALSHA")  # the publish under the claim
    producer.publish_many([make_group(f"c{i}", weight_version=1, seed=10 + i) for i in range(3)], claim=claim)
    assert relay.lost[-1] == "EVALSHA"
    assert counts(direct) == {**EXACT, "produced": 6, "consumed": 3} and queue_depth(direct, cfg, "run") == 3

    claimed = []
    while len(claimed) < 3:
        claimed += consumer.read(3, block_ms=100)
    relay.arm("EVALSHA")
    consumer.commit(claimed[:2], filtered=claimed[2:], learner_version=2)
    assert relay.lost[-1] == "EVALSHA"
    assert counts(direct) == {**EXACT, "produced": 6, "consumed": 5, "groups_filtered": 1}
    assert admission.pending(2) == {}  # settled once, not twice (a negative count would over-admit)

    producer.publish(make_group("a", seed=1))  # a duplicate of a trained group, dropped at read
    producer.publish(make_group("s", weight_version=0, seed=3))  # stale at learner version 2
    relay.arm("EVALSHA")  # the drops' settlement
    assert consumer.read(2, block_ms=100) == []
    assert relay.lost[-1] == "EVALSHA"
    assert counts(direct) == {**EXACT, "produced": 8, "consumed": 5, "groups_filtered": 1, "duplicates": 1,
                              "dropped_stale": 1}

    producer.publish(make_group("left", weight_version=2))
    relay.arm("EVALSHA")  # a resume discards the queue
    assert discard_queue(client, cfg, "run") == 1 and relay.lost[-1] == "EVALSHA"
    assert counts(direct) == {**EXACT, "produced": 9, "consumed": 5, "groups_filtered": 1, "duplicates": 1,
                              "dropped_stale": 2}

    relay.arm("EVALSHA")
    rs.append_budget_log(client, "run", {"version": 2, "budget": 48})
    assert relay.lost[-1] == "EVALSHA" and rs.read_budget_log(direct, "run") == ['{"version": 2, "budget": 48}']

    produced = run_counts(direct, "run")
    assert produced["produced"] == produced["consumed"] + produced["groups_filtered"] + produced["dropped_stale"] \
        + produced["dead_lettered"] + produced["duplicates"] + queue_depth(direct, cfg, "run")
    assert direct.scard(key("run", rs.CONSUMED)) == 6  # warm, a, b, c0, c1, c2
    assert len(relay.lost) == 10
