"""The run's state in Redis: every key of one run, each behind a typed accessor (docs/ARCHITECTURE.md).

Every key is `sparse-rl:{run_id}:{name}` (`key`). Accessors take a redis-py client or a pipeline (`r`), so a
caller can put several of them into one transaction. This module imports only redis: `sparse-rl scale` stays
light (no Ray, no torch).

| name                      | type   | writer                                     | readers                            |
|---------------------------|--------|--------------------------------------------|------------------------------------|
| `{broker.stream}`         | stream | actors (GroupProducer, admission publish)  | learner (GroupConsumer)            |
| `{broker.dead_letter_stream}` | stream | learner (GroupConsumer: invalid messages) | operators                       |
| `consumed`                | set    | learner (commit; restored at start)        | learner (duplicate check)          |
| `counts`                  | hash   | producers, consumer, admission scripts, resume | learner (step report), driver  |
| `actor_counts`            | hash   | actors (in each publish's transaction)     | driver (step metrics, accounting)  |
| `learner_version`         | int    | learner (start, every commit)              | actors, consumer, admission, scale |
| `kv_budget`               | int    | learner (budget controller)                | actors (every batch)               |
| `budget_log`              | list   | learner (one JSON line per step)           | driver (budget_log.jsonl)          |
| `prompt_confidence`       | hash   | actors (difficulty tiers)                  | actors                             |
| `prompt_cursor`           | int    | actors (INCRBY), learner (resume)          | actors                             |
| `prompt_redo`             | list   | learner (resume), admission scripts (a     | actors (LPOP)                      |
|                           |        | claim that ended unpublished)              |                                    |
| `generation_paused`       | flag   | driver (evaluation before training)        | actors                             |
| `actors_target`           | int    | driver, `sparse-rl scale`                  | driver (after every step)          |
| `admission:pending`       | hash   | admission scripts, consumer (settle)       | admission scripts                  |
| `admission:claims`        | hash   | admission scripts                          | admission scripts                  |
| `admission:expiry`        | zset   | admission scripts                          | admission scripts                  |
| `admission:claim_prompts` | hash   | actors (take_prompt_indices under a        | admission scripts                  |
|                           |        | claim), admission scripts                  |                                    |
| `admission:step_capacity` | int    | learner (open_pool, every commit)          | admission claim script             |
| `admission:last_version`  | int    | learner (open_pool)                        | admission                          |
| `reply`                   | string | the scripts that publish, claim or take    | the same call, retried after its   |
|                           |        | prompts: `reply:<call id>`, their reply,   | reply was lost                     |
|                           |        | kept REPLY_TTL_S                           |                                    |
| `phases`                  | hash   | rollout actors, learner ranks (at each     | driver (its wait lines:            |
|                           |        | change of phase: set_phase)                | read_phases)                       |

`counts` fields: produced, consumed, groups_filtered, dropped_stale, dead_lettered, duplicates, reclaimed, and
the admission counters admitted, claims_expired, claimed_returned, prompts_redone; each changed in the same
transaction as the operation it counts (broker/streams.py, broker/admission.py), so produced == consumed +
groups_filtered + dropped_stale + dead_lettered + duplicates + queue depth.

`actor_counts` fields: rollout_groups, reward_errors (samples whose reward function raised), tier/<tier>/groups,
each added in the transaction that publishes the groups they count (broker/streams.py publish_many), and
claims_lost (a publish refused because its claim expired); so a counter is never lost with an actor process and
rollout_groups == produced for a run whose groups all come from its actors.

Retries (`retry_policy`, broker.retry_s): every client retries a command whose connection failed, for up to
broker.retry_s. A command that the server executed but whose reply was lost with the connection is then sent
again, so every write is safe to repeat: SET/SADD/XACK by nature; the stream settlements (broker/streams.py)
count an entry only when they delete it from the stream; the scripts that add entries or hand out capacity or
prompt indices (publish, admission claim and publish, take_prompt_indices) record their reply under
`reply:<call id>` (an id drawn once per call, so redis-py's retry sends the same one) and give that reply
back when the id comes again; append_budget_log does not append the same record twice in a row.

`phases` fields: a part's id (`actor-<i>`, `learner-<rank>`) -> JSON {"phase", "since"[, "step"]}: what the part is
doing (PhaseBoard: written at each change of phase only, never per token or sample) and since when, in the Redis
server's clock (TIME), so the driver's durations (read_phases, same clock) hold across machines; "step": when the
learner's step had its groups. A part that never wrote, or whose write failed, has no field or an older one.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import threading
import uuid
from dataclasses import dataclass

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

CONSUMED, COUNTS, LEARNER_VERSION = "consumed", "counts", "learner_version"
ACTOR_COUNTS = "actor_counts"
KV_BUDGET, BUDGET_LOG, PROMPT_CONFIDENCE = "kv_budget", "budget_log", "prompt_confidence"
PROMPT_CURSOR, PROMPT_REDO = "prompt_cursor", "prompt_redo"
PAUSED, ACTORS_TARGET = "generation_paused", "actors_target"
ADMISSION_PENDING, ADMISSION_CLAIMS, ADMISSION_EXPIRY = "admission:pending", "admission:claims", "admission:expiry"
ADMISSION_STEP_CAPACITY, ADMISSION_LAST_VERSION = "admission:step_capacity", "admission:last_version"
ADMISSION_CLAIM_PROMPTS = "admission:claim_prompts"
REPLY = "reply"
PHASES = "phases"
COUNT_NAMES = ("produced", "consumed", "groups_filtered", "dropped_stale", "dead_lettered", "duplicates")
"""The `counts` fields reported as 0 before their first increment."""
ACTOR_COUNT_NAMES = ("rollout_groups", "reward_errors", "claims_lost")
"""The `actor_counts` fields reported as 0 before their first increment."""


def key(run_id: str, name: str) -> str:
    """The Redis key of `name` (a name of the table above, or a stream name from BrokerConfig)."""
    return f"sparse-rl:{run_id}:{name}"


# -- retries ----------------------------------------------------------------------------------------------
RETRY_BASE_S, RETRY_CAP_S = 0.05, 2.0
"""The backoff between two attempts of a command: 0.1 s after the first failure, doubling, at most 2 s (redis-py's
ExponentialBackoff: min(cap, base x 2^failures)). A restart that refuses connections for 0.15 s costs one 0.1 s wait."""
CONNECT_TIMEOUT_S = 2.0
"""How long one connection attempt waits for the server, seconds (a host that does not answer at all)."""
REPLY_TTL_S = 3600
"""How long a script's recorded reply (`reply:<call id>`) is kept, seconds: far beyond any retry of that call
(broker.retry_s is at most 600)."""
NOT_RETRIED = (redis.AuthenticationError, redis.exceptions.AuthorizationError, redis.exceptions.MaxConnectionsError)
"""ConnectionErrors in redis-py that waiting does not mend (a wrong or missing password, a full pool): raised at
once."""


def retry_attempts(retry_s: float) -> int:
    """The retries after a first failure whose backoffs (RETRY_BASE_S doubling to RETRY_CAP_S) first add up to
    `retry_s`: the count bound that makes redis-py's Retry give up after retry_s..retry_s + RETRY_CAP_S seconds of
    waiting (plus the attempts themselves: milliseconds when connections are refused, up to CONNECT_TIMEOUT_S each
    when the host does not answer). 0 for retry_s = 0."""
    backoff, retries, waited = ExponentialBackoff(cap=RETRY_CAP_S, base=RETRY_BASE_S), 0, 0.0
    while waited < retry_s:
        retries += 1
        waited += backoff.compute(retries)
    return retries


class _Retry(Retry):
    """redis-py's Retry, except for NOT_RETRIED (subclasses of ConnectionError in redis-py), raised at once."""

    def call_with_retry(self, do, fail, is_retryable=None, *args, **kwargs):
        def retryable(error: Exception) -> bool:
            return not isinstance(error, NOT_RETRIED) and (is_retryable is None or is_retryable(error))
        return super().call_with_retry(do, fail, retryable, *args, **kwargs)


def retry_policy(retry_s: float) -> Retry:
    """The Retry every Redis client of the project is built with (broker.streams.connect, LocalRedis.client,
    `sparse-rl scale`): connection errors and timeouts (a restarted server refusing connections, a dropped
    connection, Redis still loading its data: BusyLoadingError is a ConnectionError) are retried with exponential
    backoff for up to `retry_s` seconds (retry_attempts), then raised. 0: no retry."""
    cls = _Retry if "is_retryable" in inspect.signature(Retry.call_with_retry).parameters else Retry  # redis-py < 6
    return cls(ExponentialBackoff(cap=RETRY_CAP_S, base=RETRY_BASE_S), retry_attempts(retry_s),
               supported_errors=(redis.ConnectionError, redis.TimeoutError))


def client_options(retry_s: float) -> dict:
    """The keyword arguments of redis.Redis / Redis.from_url that give a client retry_policy(retry_s)."""
    return {"retry": retry_policy(retry_s), "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
            "socket_connect_timeout": CONNECT_TIMEOUT_S}


def call_id() -> str:
    """A fresh id for one call of a script that records its reply (`reply:<call id>`)."""
    return uuid.uuid4().hex


def reply_key(run_id: str, call: str) -> str:
    """The key under which the script call `call` (call_id) records its reply."""
    return key(run_id, f"{REPLY}:{call}")


# -- learner version, counters, consumed set ------------------------------------------------------------------
def publish_learner_version(r, run_id: str, version: int) -> None:
    """Publish the learner's current weight version (at start and in every step's commit)."""
    r.set(key(run_id, LEARNER_VERSION), int(version))


def read_learner_version(r, run_id: str) -> int:
    """The learner's current weight version; 0 before the first publish. Actors stay within max_staleness
    of it (generate only while their weight_version >= this - max_staleness)."""
    return int(r.get(key(run_id, LEARNER_VERSION)) or 0)


def run_known(r, run_id: str) -> bool:
    """Whether the broker has a record of `run_id` (its learner published a version)."""
    return bool(r.exists(key(run_id, LEARNER_VERSION)))


def run_counts(r, run_id: str) -> dict[str, int]:
    """The run's persistent counters (all consumers and producers, across restarts): produced, consumed,
    groups_filtered, dropped_stale, dead_lettered, duplicates (0 when never incremented), and the admission
    counters (admitted, claims_expired, claimed_returned) once used."""
    counts = dict.fromkeys(COUNT_NAMES, 0)
    counts.update({k.decode(): int(v) for k, v in r.hgetall(key(run_id, COUNTS)).items()})
    return counts


def add_actor_counts(r, run_id: str, counts: dict[str, int]) -> None:
    """Add each of `counts` (events, e.g. {"reward_errors": 3}) to the run's `actor_counts` (on a pipeline: in
    its transaction)."""
    for name, n in counts.items():
        if n:
            r.hincrby(key(run_id, ACTOR_COUNTS), name, int(n))


def actor_counts(r, run_id: str) -> dict[str, int]:
    """The run's actor counters (all actors, every process of each, since the run started): rollout_groups,
    reward_errors, claims_lost (0 when never incremented) and tier/<tier>/groups once used."""
    counts = dict.fromkeys(ACTOR_COUNT_NAMES, 0)
    counts.update({k.decode(): int(v) for k, v in r.hgetall(key(run_id, ACTOR_COUNTS)).items()})
    return counts


def rollout_utilization(counts: dict[str, int], in_flight: int = 0) -> float:
    """Groups trained or filtered / groups that left the actors and are no longer in flight:
    (consumed + groups_filtered) / (produced - in_flight). The step report passes the queue depth as
    `in_flight` (groups still queued may be trained later); the run's final accounting passes 0 (what is left in
    the queue then is waste)."""
    return (counts["consumed"] + counts["groups_filtered"]) / max(1, counts["produced"] - in_flight)


def mark_consumed(r, run_id: str, group_ids: list[str]) -> None:
    """Add group ids to the consumed set (a re-delivery of one of them is a duplicate)."""
    if group_ids:
        r.sadd(key(run_id, CONSUMED), *group_ids)


def consumed_flags(r, run_id: str, group_ids: list[str]):
    """Whether each group id is in the consumed set (one SMISMEMBER; on a pipeline, its result)."""
    return r.smismember(key(run_id, CONSUMED), group_ids)


# -- KV budget, budget log, confidences -----------------------------------------------------------------------
def publish_kv_budget(r, run_id: str, budget: int) -> None:
    """Publish the controlled KV budget (tokens); actors apply it from their next batch."""
    r.set(key(run_id, KV_BUDGET), int(budget))


def read_kv_budget(r, run_id: str, default: int) -> int:
    """The controlled KV budget (tokens), `default` before the learner's first publish."""
    value = r.get(key(run_id, KV_BUDGET))
    return int(value) if value is not None else default


_APPEND_NEW = """
if redis.call('LINDEX', KEYS[1], -1) == ARGV[1] then return 0 end
return redis.call('RPUSH', KEYS[1], ARGV[1])
"""


def append_budget_log(r, run_id: str, record: dict) -> None:
    """Append one controller record (a JSON-able dict) to the run's budget log; not again when it is the last one
    already (a retry of this call after its reply was lost: each record names its step, so two equal ones in a row
    are one)."""
    r.register_script(_APPEND_NEW)(keys=[key(run_id, BUDGET_LOG)], args=[json.dumps(record)])


def read_budget_log(r, run_id: str) -> list[str]:
    """The budget log's JSON lines, in order."""
    return [line.decode() for line in r.lrange(key(run_id, BUDGET_LOG), 0, -1)]


def read_confidences(r, run_id: str, prompt_ids: list[str]) -> list[float | None]:
    """Confidence of each prompt (None: never sampled), one HMGET."""
    if not prompt_ids:
        return []
    return [None if v is None else float(v) for v in r.hmget(key(run_id, PROMPT_CONFIDENCE), prompt_ids)]


def write_confidences(r, run_id: str, confidences: dict[str, float]) -> None:
    """Record prompts' confidences (floats in [0, 1]), one HSET."""
    if confidences:
        r.hset(key(run_id, PROMPT_CONFIDENCE), mapping={k: repr(float(v)) for k, v in confidences.items()})


# -- prompt stream (broker/prompts.py: DataPosition) ------------------------------------------------------------
# KEYS: prompt_redo, prompt_cursor, admission:claims, admission:claim_prompts, reply; ARGV: n, claim id or "",
# reply TTL s -> the indices (redo first, then fresh), recorded with the claim; a claim gone already gets them but
# puts them back at once (its batch cannot be published). A retry of the call gets the indices it was given.
_TAKE = """
local done = redis.call('GET', KEYS[5])
if done then
  local out = {}
  for i in string.gmatch(done, '%d+') do out[#out + 1] = i end
  return out
end
local n = tonumber(ARGV[1])
local out = redis.call('LPOP', KEYS[1], n) or {}
if #out < n then
  local fresh = n - #out
  local stop = redis.call('INCRBY', KEYS[2], fresh)
  for i = stop - fresh, stop - 1 do out[#out + 1] = tostring(i) end
end
if ARGV[2] ~= '' then
  if redis.call('HEXISTS', KEYS[3], ARGV[2]) == 1 then
    redis.call('HSET', KEYS[4], ARGV[2], table.concat(out, ','))
  else
    for _, i in ipairs(out) do redis.call('RPUSH', KEYS[1], i) end
  end
end
redis.call('SET', KEYS[5], table.concat(out, ','), 'EX', ARGV[3])
return out
"""


def take_prompt_indices(r: redis.Redis, run_id: str, n: int, claim_id: str = "") -> list[int]:
    """The next `n` prompt indices for one actor batch, in one script: redo indices first, then fresh ones from
    the cursor; each index is given to one caller only. With `claim_id` (an admission claim) they are recorded
    with the claim (`admission:claim_prompts`), so that they are handed out again if the claim ends unpublished
    (the admission scripts put them back on `prompt_redo`)."""
    keys = [key(run_id, k) for k in (PROMPT_REDO, PROMPT_CURSOR, ADMISSION_CLAIMS, ADMISSION_CLAIM_PROMPTS)]
    keys.append(reply_key(run_id, call_id()))
    return [int(i) for i in r.register_script(_TAKE)(keys=keys, args=[int(n), claim_id, REPLY_TTL_S])]


def restore_prompt_stream(r: redis.Redis, run_id: str, redo: list[int], cursor: int) -> None:
    """Hand out `redo` first, then fresh indices from `cursor` (one transaction; before any actor starts)."""
    pipe = r.pipeline(transaction=True)
    pipe.delete(key(run_id, PROMPT_REDO))
    if redo:
        pipe.rpush(key(run_id, PROMPT_REDO), *redo)
    pipe.set(key(run_id, PROMPT_CURSOR), cursor)
    pipe.execute()


# -- driver controls ------------------------------------------------------------------------------------------
def set_paused(r, run_id: str, paused: bool) -> None:
    """While paused, rollout actors start no new batch (a key, so an actor restarted by Ray obeys it too)."""
    if paused:
        r.set(key(run_id, PAUSED), 1)
    else:
        r.delete(key(run_id, PAUSED))


def is_paused(r, run_id: str) -> bool:
    return bool(r.exists(key(run_id, PAUSED)))


def set_actors_target(r, run_id: str, actors: int) -> None:
    """The actor count the driver scales to after the next learner step."""
    r.set(key(run_id, ACTORS_TARGET), int(actors))


def read_actors_target(r, run_id: str) -> int | None:
    """The requested actor count, None when never set."""
    value = r.get(key(run_id, ACTORS_TARGET))
    return None if value is None else int(value)


# -- admission pool (the scripts in broker/admission.py hold the claim logic) ----------------------------------
def admission_keys(run_id: str) -> list[str]:
    """pending, claims, expiry, counts, claim_prompts, prompt_redo: the keys every admission script gets first."""
    return [key(run_id, n) for n in (ADMISSION_PENDING, ADMISSION_CLAIMS, ADMISSION_EXPIRY, COUNTS,
                                     ADMISSION_CLAIM_PROMPTS, PROMPT_REDO)]


def settle_admitted(r, run_id: str, deadlines: list[int]) -> None:
    """Claimed groups (their deadlines) left the queue: they leave the admission pool."""
    for d in set(deadlines):
        r.hincrby(key(run_id, ADMISSION_PENDING), d, -deadlines.count(d))


def set_step_capacity(r, run_id: str, capacity: int) -> None:
    """C, the groups admitted per learner step."""
    r.set(key(run_id, ADMISSION_STEP_CAPACITY), int(capacity))


def read_last_version(r, run_id: str) -> int | None:
    """The run's last training version (open_pool), None when not set."""
    value = r.get(key(run_id, ADMISSION_LAST_VERSION))
    return None if value is None else int(value)


def open_pool(r: redis.Redis, run_id: str, last_version: int, capacity: int) -> None:
    """Open admission (the learner, once it knows its version): `last_version` is the last learner version
    whose step trains (train.steps - 1: the driver trains up to version train.steps), so no group is admitted
    that could only be trained after the run, and the run stops with (almost) nothing left in the queue;
    `capacity` is C, the groups per step (step_capacity)."""
    pipe = r.pipeline(transaction=True)
    pipe.set(key(run_id, ADMISSION_LAST_VERSION), int(last_version))
    set_step_capacity(pipe, run_id, capacity)
    pipe.execute()


def reset_claims(r, run_id: str) -> None:
    """Forget every claim and pending group of the run (a resume: the actors that held them are gone and the
    queue was discarded, broker.streams.discard_queue)."""
    r.delete(*(key(run_id, n) for n in (ADMISSION_PENDING, ADMISSION_CLAIMS, ADMISSION_EXPIRY,
                                        ADMISSION_CLAIM_PROMPTS)))


# -- phases (what each part is doing, for the console) ----------------------------------------------------------
STEP_PHASES = ("recompute", "backward", "optimizer step", "checkpoint", "commit")
"""The learner's phases from the moment its step has its groups to its commit (deploy/learner_worker.py,
learner/step.py); its others: loading, idle, reading groups, weight sync, saving the final weights. The actors':
loading, paused, waiting for weights, waiting for queue space, waiting for a claim, generating, scoring,
publishing, stopped (actors/rollout_actor.py)."""


# KEYS: phases; ARGV: part, phase, "1" when the phase starts a learner step's work (then "step" = now) -> now.
# "since" and "step" are the server's time (s): every part and the driver share one clock.
_SET_PHASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local record = {phase = ARGV[2], since = now}
if ARGV[3] == '1' then
  record.step = now
else
  local old = redis.call('HGET', KEYS[1], ARGV[1])
  if old then record.step = cjson.decode(old).step end
end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(record))
return tostring(now)
"""


@dataclass(frozen=True)
class Phase:
    """What a part was doing when the phases were read: `phase`, for `for_s` seconds; `step_s`: how long the learner's
    step has been at work since it had its groups (None for the actors)."""
    phase: str
    for_s: float
    step_s: float | None = None


def set_phase(r, run_id: str, part: str, phase: str, starts_step: bool = False) -> None:
    """Record that `part` (e.g. "actor-0", "learner-1") is now in `phase`, since now (the server's TIME); with
    `starts_step`, also that the learner's step starts its work now. Raises what the client raises (PhaseBoard
    ignores it)."""
    r.register_script(_SET_PHASE)(keys=[key(run_id, PHASES)], args=[part, phase, "1" if starts_step else ""])


def read_phases(r, run_id: str) -> dict[str, Phase]:
    """Every part's phase now, by part id (one round trip: the server's TIME and the hash)."""
    pipe = r.pipeline(transaction=False)
    pipe.time()
    pipe.hgetall(key(run_id, PHASES))
    (seconds, micros), raw = pipe.execute()
    now, out = seconds + micros / 1e6, {}
    for part, value in raw.items():
        try:
            record = json.loads(value)
            step = record.get("step")
            out[part.decode()] = Phase(str(record["phase"]), max(0.0, now - float(record["since"])),
                                       None if step is None else max(0.0, now - float(step)))
        except (ValueError, KeyError, TypeError):
            continue  # (not written by set_phase: left out)
    return out


class PhaseBoard:
    """One part's entry in the run's `phases`: `board("scoring")` at each change of phase (a call with the
    phase it is in already writes nothing, so a loop that waits again keeps its `since`). A write that fails
    (Redis away) is ignored: the phases are for the console, never a reason for the part to fail."""

    def __init__(self, r, run_id: str, part: str):
        self.r, self.run_id, self.part = r, run_id, part
        self.current: str | None = None
        self.lock = threading.Lock()

    def __call__(self, phase: str, starts_step: bool = False) -> None:
        with self.lock:
            if phase == self.current and not starts_step:
                return
            try:
                set_phase(self.r, self.run_id, self.part, phase, starts_step)
                self.current = phase
            except Exception:
                self.current = None  # (ignored, see the class; the next call writes again)

    @contextlib.contextmanager
    def during(self, phase: str):
        """`phase` for the body of a with block that runs beside the part's loop (the learner's weight broadcast
        while its step waits for groups), then the phase it interrupted again, unless the loop changed it meanwhile."""
        before = self.current
        self(phase)
        try:
            yield
        finally:
            if self.current == phase and before is not None:
                self(before)
