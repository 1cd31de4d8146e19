"""Admission control: a rollout is generated only if it can still be trained within `broker.max_staleness`
(docs/ARCHITECTURE.md, "Staleness"). AReaL's rule (capacity = (max_staleness + version + 1) x batch -
(accepted + running)), made exact per group for a learner that reads groups in publication order:

- Every admitted group gets a *deadline* d = weight_version + max_staleness (capped at the run's last
  training version): the last learner version whose step may train it.
- An actor claims n groups atomically (a Lua script) against the pending groups of each deadline: for every
  version u >= v (v = the learner's current version), pending groups with deadline <= u must fit into the
  steps v..u, i.e. count(deadline <= u) <= (u - v + 1) x C, C = `step_capacity` groups per step. A claim may
  be granted in part (fewer groups than asked); it is refused when the actor's weights are too old (d < v)
  or training is over.
- The learner's step at version v must consume every pending group that the later steps could not hold:
  R_u = count(deadline <= u) - (u - v) x C groups of deadline <= u, for every u (EDF: earliest deadline
  first, see plan_step). It waits for them if they are still being generated. After the step the invariant
  holds again at v + 1, so no admitted group can become stale: the dequeue check stays as a safety net.
- A claim expires `broker.claim_ttl_s` after its last heartbeat (the actor refreshes it while it
  generates): a killed actor's groups return to the pool, and the learner stops waiting for them. An actor
  whose claim expired cannot publish (the publish script checks the claim): nothing it made is counted.
- Scaling keeps the invariant: the pool is global to the run, actors only draw from it.

Keys (broker/run_state.py, which also opens and resets the pool): `admission:pending` (hash deadline -> groups
claimed and not yet settled: being generated, or in the stream unconsumed), `admission:claims` (hash claim id ->
"remaining:deadline"), `admission:expiry` (sorted set claim id -> expiry, Redis server time in ms),
`admission:step_capacity` (C, written by the learner), `admission:last_version` (the last version that trains).
A claimed group's stream entry carries the fields `deadline` and `claim` next to `group`.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

import redis

from broker import run_state as rs
from broker.config import BrokerConfig
from broker.streams import Delivery, GroupConsumer, stored_publish_reply

_COMMON = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- a claim that ends unpublished hands its prompt indices out again (first, before fresh ones)
local function redo_prompts(prompts, redo, counts, id)
  local taken = redis.call('HGET', prompts, id)
  if taken then
    for i in string.gmatch(taken, '%d+') do
      redis.call('RPUSH', redo, i)
      redis.call('HINCRBY', counts, 'prompts_redone', 1)
    end
    redis.call('HDEL', prompts, id)
  end
end
-- claims past their expiry return their unpublished groups to the pool, their prompts to the redo list
local function reap(pending, claims, expiry, counts, prompts, redo, now)
  local gone = redis.call('ZRANGEBYSCORE', expiry, '-inf', now)
  for _, id in ipairs(gone) do
    local val = redis.call('HGET', claims, id)
    if val then
      local remaining, d = string.match(val, '^(%d+):(%-?%d+)$')
      redis.call('HINCRBY', pending, d, -tonumber(remaining))
      redis.call('HINCRBY', counts, 'claims_expired', 1)
      redis.call('HINCRBY', counts, 'claimed_returned', tonumber(remaining))
      redis.call('HDEL', claims, id)
      redo_prompts(prompts, redo, counts, id)
    end
    redis.call('ZREM', expiry, id)
  end
end
"""

# KEYS: pending, claims, expiry, counts, claim_prompts, prompt_redo, learner_version, step_capacity, last_version,
# reply; ARGV: claim id, weight_version, groups wanted, max_staleness, ttl ms, reply TTL s
# -> {granted, deadline} or {0, reason}; a retry of a granting call (its reply lost) gets the same grant
_CLAIM = _COMMON + """
local done = redis.call('GET', KEYS[10])
if done then
  local granted, d = string.match(done, '^(%d+):(%-?%d+)$')
  return {tonumber(granted), tonumber(d)}
end
local now = now_ms()
reap(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], now)
local v = tonumber(redis.call('GET', KEYS[7]) or '0')
local cap = redis.call('GET', KEYS[8])
if not cap then return {0, 'starting'} end
cap = tonumber(cap)
local n = tonumber(ARGV[3])
local d = tonumber(ARGV[2]) + tonumber(ARGV[4])
local last = redis.call('GET', KEYS[9])
if last then
  last = tonumber(last)
  if v > last then return {0, 'done'} end
  if d > last then d = last end
end
if d < v then return {0, 'stale'} end
local pend, top = {}, d
local flat = redis.call('HGETALL', KEYS[1])
for i = 1, #flat, 2 do
  local u, c = tonumber(flat[i]), tonumber(flat[i + 1])
  if u >= v and c > 0 then
    pend[u] = c
    if u > top then top = u end
  end
end
local cum, room = 0, n
for u = v, top do
  cum = cum + (pend[u] or 0)
  if u >= d and (u - v + 1) * cap - cum < room then room = (u - v + 1) * cap - cum end
end
if room < 1 then return {0, 'full'} end
redis.call('HINCRBY', KEYS[1], d, room)
redis.call('HSET', KEYS[2], ARGV[1], room .. ':' .. d)
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[5]), ARGV[1])
redis.call('HINCRBY', KEYS[4], 'admitted', room)
redis.call('SET', KEYS[10], room .. ':' .. d, 'EX', ARGV[6])
return {room, d}
"""

# KEYS: pending, claims, expiry, counts, claim_prompts, prompt_redo; ARGV: claim id, ttl ms
# -> 1 if the claim is still held (its expiry moved), else 0 (it expired: reaped now if nobody did yet)
_HEARTBEAT = _COMMON + """
local now = now_ms()
reap(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], now)
if not redis.call('ZSCORE', KEYS[3], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[2]), ARGV[1])
return 1
"""

# KEYS: pending, claims, expiry, counts, claim_prompts, prompt_redo; ARGV: claim id -> groups returned to the pool
_RELEASE = _COMMON + """
redo_prompts(KEYS[5], KEYS[6], KEYS[4], ARGV[1])
local val = redis.call('HGET', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if not val then return 0 end
local remaining, d = string.match(val, '^(%d+):(%-?%d+)$')
redis.call('HINCRBY', KEYS[1], d, -tonumber(remaining))
redis.call('HINCRBY', KEYS[4], 'claimed_returned', tonumber(remaining))
redis.call('HDEL', KEYS[2], ARGV[1])
return tonumber(remaining)
"""

# KEYS: pending, claims, expiry, counts, claim_prompts, prompt_redo -> HGETALL pending after expired claims were reaped
_PENDING = _COMMON + """
reap(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], now_ms())
return redis.call('HGETALL', KEYS[1])
"""

# KEYS: stream, counts, claims, expiry, claim_prompts, actor_counts, reply; ARGV: claim id, JSON {counter: n} to
# add to actor_counts, reply TTL s, message bytes...
# (a claim published in full forgets its prompt indices: they are in the stream now)
# -> {depth, msg ids...}, or -1 when the claim expired (nothing is published); a retry of the call (its reply lost)
# gets the ids it was given, publishing nothing again
_PUBLISH = stored_publish_reply(7) + """
local val = redis.call('HGET', KEYS[3], ARGV[1])
if not val then return -1 end
local remaining, d = string.match(val, '^(%d+):(%-?%d+)$')
remaining = tonumber(remaining)
local k = #ARGV - 3
if k > remaining then return redis.error_reply('publish of ' .. k .. ' groups on a claim of ' .. remaining) end
local reply = {0}
for i = 4, #ARGV do
  reply[#reply + 1] = redis.call('XADD', KEYS[1], '*', 'group', ARGV[i], 'deadline', d, 'claim', ARGV[1])
end
redis.call('HINCRBY', KEYS[2], 'produced', k)
for name, n in pairs(cjson.decode(ARGV[2])) do
  redis.call('HINCRBY', KEYS[6], name, n)
end
if k == remaining then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
  redis.call('HDEL', KEYS[5], ARGV[1])
else
  redis.call('HSET', KEYS[3], ARGV[1], (remaining - k) .. ':' .. d)
end
redis.call('SET', KEYS[7], table.concat(reply, ' ', 2), 'EX', ARGV[3])
reply[1] = redis.call('XLEN', KEYS[1])
return reply
"""


class ClaimExpired(RuntimeError):
    """The claim a batch was generated under expired (its actor stopped heart-beating for longer than
    broker.claim_ttl_s); its groups went back to the pool and were not published."""


@dataclass
class Claim:
    """Groups an actor may generate: `groups` (<= what it asked for), all to be trained at a learner version
    <= `deadline`."""
    claim_id: str
    groups: int
    deadline: int


class Admission:
    """The admission pool of one run (actor and learner side). All state is in Redis; every operation is one
    Lua script, so actors and the learner never race. Nothing is admitted before the learner opened the pool
    (open_pool). Every script is safe to retry (the client retries for broker.retry_s): heartbeat, release and
    pending by nature, claim and publish by a recorded reply (run_state.reply_key)."""

    def __init__(self, client: redis.Redis, cfg: BrokerConfig, run_id: str):
        self.client, self.cfg, self.run_id = client, cfg, run_id
        self.keys = rs.admission_keys(run_id)  # pending, claims, expiry, counts, claim_prompts, prompt_redo
        self.ttl_ms = max(1, int(cfg.claim_ttl_s * 1000))
        self._claim = client.register_script(_CLAIM)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._release = client.register_script(_RELEASE)
        self._pending = client.register_script(_PENDING)
        self._publish = client.register_script(_PUBLISH)

    def claim(self, weight_version: int, groups: int) -> tuple[Claim | None, str]:
        """Ask for `groups` groups to generate with weights `weight_version`. Returns (Claim, "") when at least
        one group was granted, else (None, reason): "full" (wait for the learner), "stale" (weights older than
        learner version - max_staleness: wait for the next sync), "done" (every step has its groups) or
        "starting" (the learner has not opened the pool yet)."""
        claim_id = uuid.uuid4().hex
        granted, detail = self._claim(
            keys=self.keys + [rs.key(self.run_id, n) for n in (rs.LEARNER_VERSION, rs.ADMISSION_STEP_CAPACITY,
                                                               rs.ADMISSION_LAST_VERSION)]
            + [rs.reply_key(self.run_id, claim_id)],
            args=[claim_id, int(weight_version), int(groups), self.cfg.max_staleness, self.ttl_ms, rs.REPLY_TTL_S])
        if int(granted) < 1:
            return None, detail.decode() if isinstance(detail, bytes) else str(detail)
        return Claim(claim_id, int(granted), int(detail)), ""

    def take_prompts(self, claim: Claim) -> list[int]:
        """The prompt indices of the claim's groups (broker.run_state.take_prompt_indices), recorded with the
        claim: if it expires or is released unpublished, they are handed out again."""
        return rs.take_prompt_indices(self.client, self.run_id, claim.groups, claim.claim_id)

    def heartbeat(self, claim: Claim) -> bool:
        """Push the claim's expiry claim_ttl_s into the future; False when it had already expired."""
        return bool(self._heartbeat(keys=self.keys, args=[claim.claim_id, self.ttl_ms]))

    def release(self, claim: Claim) -> int:
        """Give a claim's unpublished groups back to the pool (the batch failed); returns how many."""
        return int(self._release(keys=self.keys, args=[claim.claim_id]))

    def publish(self, claim: Claim, messages: list[bytes], counts: dict[str, int] | None = None) \
            -> tuple[int, list[str]]:
        """XADD encoded groups made under `claim` (with their deadline), count them produced and add `counts`
        to the run's actor_counts, atomically, only if the claim is still held. Returns (stream depth, message
        ids). Raises ClaimExpired."""
        reply = self._publish(keys=[rs.key(self.run_id, self.cfg.stream), self.keys[3], self.keys[1], self.keys[2],
                                    self.keys[4], rs.key(self.run_id, rs.ACTOR_COUNTS),
                                    rs.reply_key(self.run_id, rs.call_id())],
                              args=[claim.claim_id, json.dumps({k: int(n) for k, n in (counts or {}).items() if n}),
                                    rs.REPLY_TTL_S, *messages])
        if reply == -1:
            raise ClaimExpired(f"claim {claim.claim_id} expired (no heartbeat for broker.claim_ttl_s="
                               f"{self.cfg.claim_ttl_s:g} s); its {len(messages)} group(s) were not published")
        return int(reply[0]), [m.decode() if isinstance(m, bytes) else m for m in reply[1:]]

    def last_version(self) -> int | None:
        """The run's last training version (open_pool), None when not set."""
        return rs.read_last_version(self.client, self.run_id)

    def pool_size(self, version: int, capacity: int) -> int:
        """The most groups that can be admitted and unsettled at learner `version`: capacity for each version
        from `version` to min(version + max_staleness, last version). A learner holding that many can get
        no more (a step must not wait for reads that admission can never let the actors make)."""
        last = self.last_version()
        top = version + self.cfg.max_staleness if last is None else min(last, version + self.cfg.max_staleness)
        return max(0, top - version + 1) * capacity

    def pending(self, version: int) -> dict[int, int]:
        """{deadline: groups claimed and not yet settled} for deadlines >= `version`, after reaping the
        expired claims (one round trip)."""
        flat = self._pending(keys=self.keys)
        out = {}
        for d, c in zip(flat[::2], flat[1::2]):
            if int(d) >= version and int(c) > 0:
                out[int(d)] = int(c)
        return out


def step_capacity(groups_per_step: int, filtered: int, seen: int, max_extra_reads: int) -> int:
    """C, the groups admitted per learner step: groups_per_step, scaled by 1 / (1 - f) for the share
    f = filtered / seen of groups filtered out as zero-variance so far (dynamic sampling, DAPO), and at most
    groups_per_step + max_extra_reads (what one step may read). f counts only after a step's worth of groups
    has been seen. Returns an int >= groups_per_step."""
    if seen < groups_per_step or filtered <= 0:
        return groups_per_step
    f = filtered / seen
    if f >= 1:
        return groups_per_step + max_extra_reads
    return min(groups_per_step + max_extra_reads, math.ceil(groups_per_step / (1 - f) - 1e-9))


@dataclass
class Held:
    """A group the learner has read and not yet settled: its deadline (claimed groups: the claim's; others:
    weight_version + max_staleness), whether it came under a claim, whether it is informative (its rewards
    are not all equal, or no filter)."""
    deadline: int
    claimed: bool
    informative: bool


def plan_step(held: list[Held], pending: dict[int, int], version: int, capacity: int, groups_per_step: int,
              reads_exhausted: bool) -> tuple[list[int], list[int]] | None:
    """Which held groups the learner step at `version` trains and which it filters out, or None to read
    (and wait) for more.

    Rules: (1) for every deadline u >= version, at least R_u = pending(<= u) - (u - version) x capacity of
    the claimed groups with deadline <= u are consumed (trained or filtered) by this step, so that the
    admission invariant holds at version + 1 (held groups are part of `pending`); if the held groups cannot
    meet R_u, wait. (2) Informative groups are taken earliest deadline first (ties: read order), at least
    groups_per_step of them, more only when (1) asks. (3) Every held non-informative group is filtered.
    (4) With fewer than groups_per_step informative groups: wait, unless `reads_exhausted` (the step read
    its maximum), then train what there is; with none at all, the held zero-variance groups are trained
    instead of filtered (a step needs a batch).
    Returns (train indices into `held`, in EDF order; filtered indices)."""
    filtered = [i for i, h in enumerate(held) if not h.informative]
    informative = sorted((i for i, h in enumerate(held) if h.informative), key=lambda i: (held[i].deadline, i))
    k = min(groups_per_step, len(informative))
    cumulative = 0
    for u in sorted(d for d in pending if d >= version):
        cumulative += pending[u]
        required = cumulative - (u - version) * capacity
        if required <= 0:
            continue
        have = sum(1 for i in filtered if held[i].claimed and held[i].deadline <= u)
        eligible = [j for j, i in enumerate(informative) if held[i].deadline <= u and held[i].claimed]
        if have + len(eligible) < required:
            return None  # a group this step must train is still being generated or is in the stream
        need = required - have
        if need > 0:
            k = max(k, eligible[need - 1] + 1)
    if k < groups_per_step and len(informative) < groups_per_step and not reads_exhausted:
        return None
    if not informative:
        return (filtered, []) if filtered else None
    return informative[:k], filtered


class StepCollector:
    """The learner's reading loop for one step (admission-aware, with dynamic sampling): reads groups off
    the stream, keeps the ones a later step trains (they stay un-acked), and returns what plan_step picks.

    `informative(group) -> bool`: False for a group to filter out (zero-variance rewards), None = no filter.
    `max_extra_reads`: with a filter, a step reads at most groups_per_step + max_extra_reads groups before it
    trains what it has (it still reads the groups admission requires); it also stops reading once it holds
    the whole admission pool (Admission.pool_size): no more groups can come."""

    def __init__(self, consumer: GroupConsumer, admission: Admission | None, groups_per_step: int,
                 informative=None, max_extra_reads: int = 0):
        self.consumer, self.admission = consumer, admission
        self.groups_per_step, self.informative, self.max_extra_reads = groups_per_step, informative, max_extra_reads
        self.held: list[tuple[Delivery, Held]] = []  # read in earlier steps, not yet settled

    def collect(self, version: int, capacity: int, timeout_s: float, block_ms: int = 1000) \
            -> tuple[list[Delivery], list[Delivery], list[Delivery], dict]:
        """Read until plan_step agrees. Returns (train, filtered, stale, stats): `stale` are held groups over
        max_staleness at this version (cannot happen under admission; the safety net), stats: reads (groups
        taken off the stream in this step), wait_s, filter_shortfall (groups_per_step - informative groups
        trained, when the read bound cut the step short). Raises TimeoutError after timeout_s."""
        max_staleness = self.consumer.cfg.max_staleness
        stale = [d for d, _ in self.held if version - d.group.weight_version > max_staleness]
        self.held = [(d, h) for d, h in self.held if version - d.group.weight_version <= max_staleness]
        reads, start = 0, time.monotonic()
        bound = self.groups_per_step + self.max_extra_reads if self.informative else None
        pool = self.admission.pool_size(version, capacity) if self.admission and bound is not None else None
        while True:
            pending = self.admission.pending(version) if self.admission else {}
            exhausted = bound is not None and (reads >= bound or (pool is not None and len(self.held) >= pool))
            plan = plan_step([h for _, h in self.held], pending, version, capacity, self.groups_per_step, exhausted)
            if plan is not None:
                break
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"learner waited {timeout_s:.0f} s (train.group_wait_s) and holds "
                                   f"{len(self.held)} group(s) for step version {version} (pending by deadline: "
                                   f"{pending}): are the rollout actors alive?")
            informative_held = sum(h.informative for _, h in self.held)
            want = max(1, self.groups_per_step - informative_held)
            if bound is not None and not exhausted:
                want = min(want, bound - reads)
            for d in self.consumer.read(want, block_ms=block_ms):
                reads += 1
                good = self.informative is None or bool(self.informative(d.group))
                deadline = d.deadline if d.deadline is not None else d.group.weight_version + max_staleness
                self.held.append((d, Held(deadline, d.deadline is not None, good)))
        train_idx, filtered_idx = plan
        informative_trained = sum(1 for i in train_idx if self.held[i][1].informative)
        train = [self.held[i][0] for i in train_idx]
        filtered = [self.held[i][0] for i in filtered_idx]
        settled = set(train_idx) | set(filtered_idx)
        self.held = [x for i, x in enumerate(self.held) if i not in settled]
        for d in train:  # staleness at the version that trains it (held groups waited a step or more)
            d.staleness = version - d.group.weight_version
        return train, filtered, stale, {"reads": reads, "wait_s": time.monotonic() - start,
                                        "filter_shortfall": max(0, self.groups_per_step - informative_trained)}
