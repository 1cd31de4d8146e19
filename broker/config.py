"""Typed config of the trajectory broker (docs/ARCHITECTURE.md, "Contracts")."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BrokerConfig:
    url: str = ""
    """redis:// or rediss:// (TLS) URL of the Redis server, without a password. Empty: the driver starts a
    local redis-server (broker.redis_server.LocalRedis) and fills this in."""
    password_env: str = "SPARSE_RL_REDIS_PASSWORD"
    """Name of the environment variable holding the Redis password (unset or empty: no password). The
    password itself never appears in a config, a log or MLflow params."""
    stream: str = "groups"
    """Stream of trajectory groups; the Redis key is `sparse-rl:{run_id}:{stream}`."""
    dead_letter_stream: str = "dead_letters"
    """Stream receiving messages that failed validation (reason + original bytes);
    key `sparse-rl:{run_id}:{dead_letter_stream}`."""
    consumer_group: str = "learner"
    """Redis consumer group the learner reads the stream with."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest accepted encoded group, bytes. Bigger messages are dead-lettered (reason message_too_large)."""
    max_response_tokens: int = 32768
    """Longest accepted response, tokens (reason too_many_tokens)."""
    max_prompt_tokens: int = 32768
    """Longest accepted prompt, tokens (reason too_many_tokens)."""
    high_watermark: int = 256
    """Producers wait while the stream holds more than this many unconsumed (not yet committed) groups."""
    backpressure_poll_s: float = 0.05
    """Seconds between depth checks while a producer waits on the high watermark."""
    block_ms: int = 1000
    """Default time a consumer read blocks waiting for new groups, milliseconds."""
    claim_min_idle_ms: int = 60000
    """A message delivered to a consumer and not committed for this long is taken over by another
    consumer (XAUTOCLAIM), milliseconds. Must exceed the longest learner step."""
    max_staleness: int = 1
    """Largest accepted learner_version - weight_version when a group is taken off the stream; older
    groups are dropped and counted. 0 = on-policy only (the paper's synchronous setting)."""
    admission: bool = True
    """Admission control (broker/admission.py, after AReaL's staleness manager): an actor generates a batch
    only after claiming it in Redis against a capacity that guarantees every admitted group is trained within
    max_staleness, so groups are never generated to be dropped. false: actors only wait while their weights
    are older than learner version - max_staleness, and stale groups are dropped at dequeue (the baseline)."""
    claim_ttl_s: float = 15.0
    """An admission claim expires this long after its last heartbeat, seconds (actors heartbeat every third
    of it while they generate): the groups of a killed actor return to the pool after at most this long, and
    the learner stops waiting for them."""
    retry_s: float = 30.0
    """How long every Redis client of the run (actors, learner, driver) retries a command whose connection failed
    (refused, dropped, timed out, or Redis still loading its data after a restart), seconds, with backoff from
    0.1 s doubling to 2 s; then the command raises and the run ends with one line naming Redis and its address.
    A restart of Redis is survived (every write is safe to repeat: broker/run_state.py "Retries"). 0 = no retry;
    at most 600 (a longer outage: let the run end and --resume it). An actor that waits longer than claim_ttl_s
    loses its claim (the batch is generated again)."""

    def __post_init__(self):
        """Raise ValueError naming every bad field as `BrokerConfig.<field>=<value>: expected ...`."""
        checks = [
            (self.max_message_bytes >= 1, "max_message_bytes", "expected >= 1"),
            (self.max_response_tokens >= 1, "max_response_tokens", "expected >= 1"),
            (self.max_prompt_tokens >= 1, "max_prompt_tokens", "expected >= 1"),
            (self.high_watermark >= 1, "high_watermark", "expected >= 1"),
            (self.backpressure_poll_s > 0, "backpressure_poll_s", "expected > 0"),
            (self.block_ms >= 0, "block_ms", "expected >= 0 (0 = block until a group arrives)"),
            (self.claim_min_idle_ms >= 1, "claim_min_idle_ms", "expected >= 1"),
            (self.max_staleness >= 0, "max_staleness", "expected >= 0"),
            (self.claim_ttl_s > 0, "claim_ttl_s", "expected > 0"),
            (0 <= self.retry_s <= 600, "retry_s", "expected 0 <= retry_s <= 600 (seconds, 0 = no retry)"),
        ]
        errors = [f"BrokerConfig.{name}={getattr(self, name)!r}: {rule}" for ok, name, rule in checks if not ok]
        if errors:
            raise ValueError("; ".join(errors))
