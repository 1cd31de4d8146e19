"""Trajectory groups over Redis Streams: the transport (docs/ARCHITECTURE.md, "Contracts": acknowledgement,
staleness). The run's other keys, and the table of every key, are in broker/run_state.py.

The stream `{cfg.stream}` holds exactly the unconsumed groups (entries are XACKed and XDELed together once
committed, dropped or dead-lettered); `{cfg.dead_letter_stream}` holds messages that failed validation
(reason, detail, msg_id, original bytes). Each stream operation changes the run's `counts` in the same
transaction, so produced == consumed + groups_filtered + dropped_stale + dead_lettered + duplicates + depth
when every message comes from GroupProducer.

Delivery is at least once; a group is trained at most once because commit() adds its id to `consumed` in
the same transaction as the XACK, and read() skips ids already there.

Every operation is safe to retry (the clients retry for broker.retry_s, broker/run_state.py "Retries"): a publish
records its reply under a call id and gives it back when the same call comes again (no second copy, no second
count); a settlement (commit, the drops of read(), discard_queue) counts, settles and dead-letters an entry only
when it deletes it from the stream, so a repeated one changes nothing; an entry whose delivery was lost with a
dropped connection stays in this consumer's pending list and is read again (read()).
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from urllib.parse import urlparse

import redis

from broker import run_state as rs
from broker.config import BrokerConfig
from broker.schema import SchemaError, TrajectoryGroup, decode_group, encode_group

COUNTERS = ("consumed", "groups_filtered", "dropped_stale", "dead_lettered", "duplicates", "reclaimed")
TRANSACTION_BYTES = 4 << 20
"""publish_many sends a batch in transactions of at most this many message bytes (at least one group each):
one MULTI/EXEC of 16 x 2 MB groups was measured 1.5x slower per group than one per group (redis 7.0), while
16 x 16 KB in one transaction is ~2x faster than one per group."""


def connect(cfg: BrokerConfig, **options) -> redis.Redis:
    """A redis-py client for cfg.url (redis:// or rediss:// for TLS, passed through to redis-py), with the
    password taken from the environment variable named by cfg.password_env. Replies are bytes. Connection errors
    and timeouts are retried with backoff for up to cfg.retry_s seconds (run_state.retry_policy), then raised.
    `options`: more redis-py keyword arguments (e.g. socket_timeout).
    Raises ValueError when cfg.url is empty or embeds a password (it would end up in logs and params)."""
    if not cfg.url:
        raise ValueError("BrokerConfig.url is empty: start broker.redis_server.LocalRedis or give a redis:// URL")
    if urlparse(cfg.url).password:
        raise ValueError(f"BrokerConfig.url embeds a password; remove it and export it as ${cfg.password_env}")
    return redis.Redis.from_url(cfg.url, password=os.environ.get(cfg.password_env) or None,
                                **{**rs.client_options(cfg.retry_s), **options})


def unreachable(cfg: BrokerConfig) -> str | None:
    """None when Redis at cfg.url answers one PING now (no retry, CONNECT_TIMEOUT_S), else why not, in a few
    words ("ConnectionError: Error 111 connecting to 127.0.0.1:6379. Connection refused.")."""
    try:
        with connect(replace(cfg, retry_s=0.0), socket_timeout=rs.CONNECT_TIMEOUT_S) as client:
            client.ping()
        return None
    except (redis.ConnectionError, redis.TimeoutError) as e:
        return f"{type(e).__name__}: {' '.join(str(e).split())}"


def stored_publish_reply(reply_key: int) -> str:
    """Lua that answers a retried publish (its first reply lost with the connection) from the ids stored under
    KEYS[reply_key], with the stream KEYS[1]'s depth, and publishes nothing again."""
    return f"""local done = redis.call('GET', KEYS[{reply_key}])
if done then
  local reply = {{redis.call('XLEN', KEYS[1])}}
  for id in string.gmatch(done, '%S+') do reply[#reply + 1] = id end
  return reply
end
"""


# KEYS: stream, counts, actor_counts, reply; ARGV: reply TTL s, JSON {counter: n} to add to actor_counts, messages...
# -> {depth, msg ids...}; a retry of the same call (its first reply lost with the connection) gets the ids it
# was given, publishing and counting nothing again
_PUBLISH = stored_publish_reply(4) + """local reply = {0}
for i = 3, #ARGV do
  reply[#reply + 1] = redis.call('XADD', KEYS[1], '*', 'group', ARGV[i])
end
redis.call('HINCRBY', KEYS[2], 'produced', #ARGV - 2)
for name, n in pairs(cjson.decode(ARGV[2])) do
  redis.call('HINCRBY', KEYS[3], name, n)
end
redis.call('SET', KEYS[4], table.concat(reply, ' ', 2), 'EX', ARGV[1])
reply[1] = redis.call('XLEN', KEYS[1])
return reply
"""

# KEYS: stream, consumed, counts, admission:pending, dead-letter stream, learner_version, admission:step_capacity
# ARGV: consumer group, learner version or '', step capacity or '', then 7 per entry: msg id, the counter it adds
# to, its group id to mark consumed or '', its admission deadline or '', dead-letter reason or '', detail, payload
# -> the number of entries counted. An entry is counted, settled and dead-lettered only when this call
# deletes it from the stream: settling an entry again (a retry whose first reply was lost) changes nothing.
_SETTLE = """
local added, order = {}, {}
for i = 4, #ARGV, 7 do
  local id, counter, gid, d = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if gid ~= '' then redis.call('SADD', KEYS[2], gid) end
  redis.call('XACK', KEYS[1], ARGV[1], id)
  if redis.call('XDEL', KEYS[1], id) == 1 then
    if not added[counter] then
      added[counter] = 0
      order[#order + 1] = counter
    end
    added[counter] = added[counter] + 1
    if d ~= '' then redis.call('HINCRBY', KEYS[4], d, -1) end
    if ARGV[i + 4] ~= '' then
      redis.call('XADD', KEYS[5], '*', 'reason', ARGV[i + 4], 'detail', ARGV[i + 5], 'msg_id', id, \
'payload', ARGV[i + 6])
    end
  end
end
local n = 0
for _, c in ipairs(order) do
  redis.call('HINCRBY', KEYS[3], c, added[c])
  n = n + added[c]
end
if ARGV[2] ~= '' then redis.call('SET', KEYS[6], ARGV[2]) end
if ARGV[3] ~= '' then redis.call('SET', KEYS[7], ARGV[3]) end
return n
"""


def _settle(client: redis.Redis, cfg: BrokerConfig, run_id: str, entries: list[tuple], learner_version=None,
            step_capacity=None) -> None:
    """Ack and delete stream entries in one script, each counted under its counter (and its group marked
    consumed, its admission deadline settled, or the entry dead-lettered) only if this call deleted it.
    `entries`: (msg id, counter, group id or "", deadline or None, dead letter (reason, detail, payload) or None).
    Publishes learner_version and step_capacity when given."""
    args = [cfg.consumer_group, "" if learner_version is None else int(learner_version),
            "" if step_capacity is None else int(step_capacity)]
    for msg_id, counter, group_id, deadline, dead in entries:
        args += [msg_id, counter, group_id, "" if deadline is None else int(deadline), *(dead or ("", "", ""))]
    keys = [rs.key(run_id, n) for n in (cfg.stream, rs.CONSUMED, rs.COUNTS, rs.ADMISSION_PENDING,
                                         cfg.dead_letter_stream, rs.LEARNER_VERSION, rs.ADMISSION_STEP_CAPACITY)]
    client.register_script(_SETTLE)(keys=keys, args=args)


def queue_depth(client: redis.Redis, cfg: BrokerConfig, run_id: str) -> int:
    """Unconsumed groups in the stream (not yet read, or read and not yet committed)."""
    return client.xlen(rs.key(run_id, cfg.stream))


def oldest_unread_s(client: redis.Redis, cfg: BrokerConfig, run_id: str) -> float | None:
    """How long the oldest group the learner has not read yet has been in the stream, seconds, on the server's
    clock (a stream id is its milliseconds at the XADD); None when every group in it was read (or there is no
    consumer group yet). Read-only: the driver asks it to tell a learner that waits for groups from one that does
    not read them."""
    stream = rs.key(run_id, cfg.stream)
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no stream yet
        return None
    name = cfg.consumer_group.encode()
    last = next((g["last-delivered-id"] for g in groups if g["name"] in (name, cfg.consumer_group)), None)
    if last is None:
        return None
    pipe = client.pipeline(transaction=False)
    pipe.xrange(stream, min=b"(" + (last if isinstance(last, bytes) else str(last).encode()), count=1)
    pipe.time()
    unread, (seconds, micros) = pipe.execute()
    if not unread:
        return None
    published_ms = int(unread[0][0].split(b"-")[0])
    return max(0.0, seconds + micros / 1e6 - published_ms / 1000)


def discard_queue(client: redis.Redis, cfg: BrokerConfig, run_id: str) -> int:
    """Remove every group still in the run's stream (delivered or not), counted as dropped_stale, in one
    transaction: what a resumed run does with the queue its previous life
    left (sampled for versions after the checkpoint, which are trained again); its admission pool is reset apart
    (broker.admission.reset_claims). Returns how many were removed."""
    ids = [msg_id for msg_id, _ in client.xrange(rs.key(run_id, cfg.stream))]
    if not ids:
        return 0
    # (the consumer group exists: GroupConsumer made it)
    _settle(client, cfg, run_id, [(m, "dropped_stale", "", None, None) for m in ids])
    return len(ids)


class GroupProducer:
    """Publishes trajectory groups of one run (actor side).

    Backpressure: after each publish / publish_many, while the stream holds more than cfg.high_watermark
    unconsumed groups, the call waits (polling every cfg.backpressure_poll_s); `backpressure_wait_s` (total
    seconds) and `backpressure_waits` (times) make the waiting visible. Nothing is ever trimmed from the
    stream. `stop` (optional threading.Event): setting it ends a backpressure wait early (the groups are
    already published), so a producer that is shutting down never hangs on a queue nobody reads any more.
    `admission` (a broker.admission.Admission): publishes groups made under a claim (publish_many's claim)."""

    def __init__(self, client: redis.Redis, cfg: BrokerConfig, run_id: str, stop: threading.Event | None = None,
                 admission=None):
        self.client, self.cfg, self.run_id = client, cfg, run_id
        self.admission = admission
        self.stop = stop or threading.Event()
        self.stream = rs.key(run_id, cfg.stream)
        self.backpressure_wait_s = 0.0
        self.backpressure_waits = 0
        self._publish = client.register_script(_PUBLISH)

    def publish(self, group: TrajectoryGroup) -> str:
        """Publish one group; returns its stream message id. See publish_many."""
        return self.publish_many([group])[0]

    def publish_many(self, groups: list[TrajectoryGroup], claim=None, counts: list[dict[str, int]] | None = None) \
            -> list[str]:
        """Encode (validating) all `groups`, then append them to the stream; returns their stream message ids,
        in order. Each transaction (one script of up to TRANSACTION_BYTES of messages) XADDs its groups, adds their
        number to the `produced` count and reads the depth; it is safe to retry (a call id: a second run of it
        publishes nothing again). Raises SchemaError for a bad group, ValueError when a
        group's run_id is not this producer's run, and then publishes none of `groups` (a connection error
        between two transactions leaves the earlier ones published, each counted exactly). Waits on the high
        watermark afterwards (a batch is not split by it, so one call may take the depth from
        cfg.high_watermark to cfg.high_watermark + len(groups)). With `claim` (a broker.admission.Claim of
        this producer's admission), each transaction is the admission publish script: it publishes only while
        the claim is held (raises broker.admission.ClaimExpired otherwise) and tags entries with the deadline.
        `counts` (one dict per group, e.g. {"rollout_groups": 1, "reward_errors": 2}): added to the run's
        `actor_counts` in the transaction that publishes their group (run_state.add_actor_counts)."""
        chunks, size = [], TRANSACTION_BYTES  # the messages of each transaction
        chunk_counts: list[Counter] = []  # the summed `counts` of each transaction's groups
        for group, group_counts in zip(groups, counts or [{}] * len(groups)):
            if group.run_id != self.run_id:
                raise ValueError(f"group.run_id {group.run_id!r} != producer run_id {self.run_id!r}")
            data = encode_group(group, self.cfg.max_response_tokens, self.cfg.max_prompt_tokens)
            if len(data) > self.cfg.max_message_bytes:
                raise SchemaError("message_too_large", f"group {group.group_id!r}: {len(data)} bytes > "
                                                       f"max_message_bytes = {self.cfg.max_message_bytes}")
            if size + len(data) > TRANSACTION_BYTES:
                chunks.append([])
                chunk_counts.append(Counter())
                size = 0
            chunks[-1].append(data)
            chunk_counts[-1].update(group_counts)
            size += len(data)
        msg_ids, depth = [], 0
        for chunk, added in zip(chunks, chunk_counts):
            if claim is not None:
                depth, chunk_ids = self.admission.publish(claim, chunk, added)
                msg_ids += [m.encode() for m in chunk_ids]
                continue
            reply = self._publish(keys=[self.stream, rs.key(self.run_id, rs.COUNTS),
                                        rs.key(self.run_id, rs.ACTOR_COUNTS), rs.reply_key(self.run_id, rs.call_id())],
                                  args=[rs.REPLY_TTL_S, json.dumps({k: int(n) for k, n in added.items() if n}), *chunk])
            msg_ids += reply[1:]
            depth = int(reply[0])
        if depth > self.cfg.high_watermark:
            t0 = time.monotonic()
            self.backpressure_waits += 1
            while self.client.xlen(self.stream) > self.cfg.high_watermark:
                if self.stop.wait(self.cfg.backpressure_poll_s):
                    break
            self.backpressure_wait_s += time.monotonic() - t0
        return [m.decode() for m in msg_ids]


@dataclass
class Delivery:
    """A validated group taken off the stream. staleness = learner_version (at read) - group.weight_version.
    deadline: the last learner version that may train it, for a group published under an admission claim
    (None otherwise)."""
    msg_id: str
    group: TrajectoryGroup
    staleness: int
    deadline: int | None = None


class GroupConsumer:
    """Reads trajectory groups of one run for the learner, in consumer group cfg.consumer_group.

    read() returns groups to train on; everything else is settled inside read(): undecodable or invalid
    messages go to the dead-letter stream, already-consumed group ids (duplicates) and groups staler than
    cfg.max_staleness (or sampled with a weight version the learner does not have: after a resume from an
    earlier checkpoint) are dropped; all three are acked, deleted and counted. commit() is called after the
    learner step that used the deliveries is committed (checkpointed): it marks the group ids consumed and
    acks them. A consumer restarted under the same name first gets back its own uncommitted messages;
    messages of a dead consumer are taken over after cfg.claim_min_idle_ms (XAUTOCLAIM).
    `counters`: this consumer's consumed, dropped_stale, dead_lettered, duplicates, reclaimed.
    `require_eviction_record`: a group without eviction records is dead-lettered (reason no_eviction_record): the
    learner replays them (learner.policy_target=sparse) and never trains such a group dense in silence.
    `kv_quant`: the run's KV quantizer (compressors.kv_quant.KVQuant.name); a group sampled with another
    (`TrajectoryGroup.kv_quant`) is dead-lettered (reason kv_quant_mismatch), never replayed with the wrong one;
    None: not checked."""

    def __init__(self, client: redis.Redis, cfg: BrokerConfig, run_id: str, consumer_name: str,
                 require_eviction_record: bool = False, kv_quant: str | None = None):
        self.client, self.cfg, self.run_id, self.name = client, cfg, run_id, consumer_name
        self.require_eviction_record, self.kv_quant = require_eviction_record, kv_quant
        self.stream = rs.key(run_id, cfg.stream)
        self.counters = {name: 0 for name in COUNTERS}
        self._in_flight: dict[bytes, str] = {}  # msg_id -> group_id, read and not yet committed
        self._history_from = b"0"  # own pending messages from an earlier life; None once read
        self._claim_from = b"0-0"  # XAUTOCLAIM cursor
        self._next_claim = 0.0  # monotonic time of the next XAUTOCLAIM scan
        try:
            client.xgroup_create(self.stream, cfg.consumer_group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _take(self, max_groups: int, block_ms: int) -> list[tuple[bytes, dict]]:
        """Up to max_groups raw entries: own earlier pending ones, then idle ones of other consumers,
        then new ones (blocking up to block_ms only when nothing else came)."""
        entries = []
        if self._history_from is not None:
            reply = self.client.xreadgroup(self.cfg.consumer_group, self.name, {self.stream: self._history_from},
                                           count=max_groups)
            got = reply[0][1] if reply else []
            entries += [(m, f) for m, f in got if m not in self._in_flight]
            self._history_from = got[-1][0] if len(got) == max_groups else None
        if len(entries) < max_groups and time.monotonic() >= self._next_claim:
            # 6.2 replies [cursor, entries]; 7.x adds a third field: ids deleted from the stream (dropped
            # from the pending list by the server). Entries deleted under 6.2 come back as (None, None).
            reply = self.client.xautoclaim(self.stream, self.cfg.consumer_group, self.name,
                                           min_idle_time=self.cfg.claim_min_idle_ms, start_id=self._claim_from,
                                           count=max_groups - len(entries))
            self._claim_from = reply[0]
            if self._claim_from in (b"0-0", "0-0"):
                self._next_claim = time.monotonic() + self.cfg.claim_min_idle_ms / 1000
            claimed = [(m, f) for m, f in reply[1] if m is not None and m not in self._in_flight]
            self.counters["reclaimed"] += len(claimed)
            entries += claimed
        if len(entries) < max_groups:
            reply = self.client.xreadgroup(self.cfg.consumer_group, self.name, {self.stream: ">"},
                                           count=max_groups - len(entries), block=None if entries else block_ms)
            entries += reply[0][1] if reply else []
        if not entries and self._history_from is None and self._pending_here() > len(self._in_flight):
            # delivered to this consumer and never seen: a read whose reply was lost with its connection (redis-py
            # sent it again). Those entries are pending here; the next read takes them from this consumer's history.
            self._history_from = b"0"
        return entries

    def _pending_here(self) -> int:
        """Entries delivered to this consumer and not yet acked (XPENDING's summary)."""
        summary = self.client.xpending(self.stream, self.cfg.consumer_group)
        name = self.name.encode()
        return sum(int(c["pending"]) for c in summary.get("consumers") or [] if c["name"] in (name, self.name))

    def read(self, max_groups: int = 16, block_ms: int | None = None) -> list[Delivery]:
        """Up to max_groups deliveries to train on; [] when nothing arrived within block_ms (default
        cfg.block_ms; 0 blocks forever). Never raises for a bad message (it is dead-lettered)."""
        entries = self._take(max_groups, self.cfg.block_ms if block_ms is None else block_ms)
        if not entries:
            return []
        cfg = self.cfg
        dead, groups, deadlines = [], [], {}
        for msg_id, fields in entries:
            if b"deadline" in fields:
                deadlines[msg_id] = int(fields[b"deadline"])
            payload = fields.get(b"group", b"")
            try:
                if b"group" not in fields:
                    raise SchemaError("missing_field", f"message {msg_id!r} has no 'group' field")
                group = decode_group(payload, cfg.max_message_bytes, cfg.max_response_tokens, cfg.max_prompt_tokens)
                if group.run_id != self.run_id:
                    raise SchemaError("run_id_mismatch", f"group.run_id {group.run_id!r} on the stream of "
                                                         f"run {self.run_id!r}")
                if self.require_eviction_record and group.samples[0].eviction_steps is None:
                    raise SchemaError("no_eviction_record", f"group {group.group_id!r} carries no eviction record "
                                                            "(learner.policy_target=sparse replays one)")
                if self.kv_quant is not None and group.kv_quant != self.kv_quant:
                    raise SchemaError("kv_quant_mismatch", f"group {group.group_id!r} was sampled with KV stored "
                                      f"at {group.kv_quant!r}, the run's compressor.kv_dtype/kv_scale is "
                                      f"{self.kv_quant!r}")
                groups.append((msg_id, group))
            except SchemaError as e:
                dead.append((msg_id, e, payload))

        learner_version, consumed = 0, []
        if groups:  # the learner version and the consumed flags in one round trip
            pipe = self.client.pipeline(transaction=False)
            pipe.get(rs.key(self.run_id, rs.LEARNER_VERSION))
            rs.consumed_flags(pipe, self.run_id, [g.group_id for _, g in groups])
            version, consumed = pipe.execute()
            learner_version = int(version or 0)

        deliveries, drops = [], {"duplicates": [], "dropped_stale": [], "dead_lettered": [m for m, _, _ in dead]}
        seen = set(self._in_flight.values())
        for (msg_id, group), already in zip(groups, consumed):
            staleness = learner_version - group.weight_version
            if already or group.group_id in seen:
                drops["duplicates"].append(msg_id)
            elif staleness > cfg.max_staleness or staleness < 0:
                # < 0: sampled with weights newer than the learner's, which a resume from an earlier checkpoint
                # discarded; no learner will ever have those weights, so the group counts as stale
                drops["dropped_stale"].append(msg_id)
            else:
                seen.add(group.group_id)
                self._in_flight[msg_id] = group.group_id
                deliveries.append(Delivery(msg_id.decode(), group, staleness, deadlines.get(msg_id)))

        if any(drops.values()):
            letters = {m: (e.reason, str(e)[:1000], payload) for m, e, payload in dead}
            _settle(self.client, cfg, self.run_id,
                    [(m, name, "", deadlines.get(m), letters.get(m)) for name, ids in drops.items() for m in ids])
            for name, ids in drops.items():
                self.counters[name] += len(ids)
        return deliveries

    def commit(self, deliveries: list[Delivery], filtered: list[Delivery] = (), dropped_stale: list[Delivery] = (),
               learner_version: int | None = None, step_capacity: int | None = None) -> None:
        """Mark the deliveries' groups consumed and ack them, in one transaction. Call only after the
        learner step that trained on them is committed; a crash before this re-delivers them (to this
        consumer name on restart, or to another consumer after claim_min_idle_ms).
        In the same transaction: `filtered` groups (not trained: zero-variance rewards) are marked consumed
        too (a redelivery is a duplicate) and counted as groups_filtered; `dropped_stale` (held groups that
        went over max_staleness) are counted as dropped_stale; claimed groups leave the admission pool; the
        learner's new `learner_version` and admission `step_capacity` are published (so an actor never sees
        the pool of the next step with the version of the previous one). Safe to repeat: an entry is counted and
        settled only by the call that deletes it from the stream."""
        everything = [*deliveries, *filtered, *dropped_stale]
        if not everything and learner_version is None:
            return
        entries = [(d.msg_id, name, d.group.group_id if name != "dropped_stale" else "", d.deadline, None)
                   for name, items in (("consumed", deliveries), ("groups_filtered", filtered),
                                       ("dropped_stale", dropped_stale)) for d in items]
        _settle(self.client, self.cfg, self.run_id, entries, learner_version, step_capacity)
        for name, items in (("consumed", deliveries), ("groups_filtered", filtered), ("dropped_stale", dropped_stale)):
            self.counters[name] += len(items)
        for d in everything:
            self._in_flight.pop(d.msg_id.encode(), None)
