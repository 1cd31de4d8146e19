"""`sparse-rl scale`: change the rollout actor count of a running job, from another terminal, in well under a
second (this module imports neither Ray nor torch).

The driver writes `<run_dir>/<run id>/run.json` (the broker URL, never a password, and the name of the
environment variable that holds it) and sets the run's `actors_target` key; `scale` finds the broker there,
refuses a run id the broker does not know, and sets the key, which the driver reads after every learner step.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import redis

from broker import run_state as rs
from broker.config import BrokerConfig

RUN_INFO = "run.json"
TIMEOUT_S = 2.0
RETRY_S = 5.0
"""How long `scale` retries a broker that refuses connections (a Redis restart), at most the run's broker.retry_s:
a command typed at a terminal, which says within seconds that a run has ended."""


class ScaleError(Exception):
    """The scale request cannot be applied: unknown run, no broker found or reachable, bad count."""


def write_run_info(run_dir: Path, run_id: str, broker: BrokerConfig, **more) -> None:
    """What `scale` needs to find a running job: its id, broker URL (without a password) and password_env;
    `more`: what else the driver records (a resume reads the MLflow run and the checkpoint directory)."""
    info = {"run_id": run_id, "redis_url": broker.url, "password_env": broker.password_env,
            "retry_s": broker.retry_s, **more}
    (Path(run_dir) / RUN_INFO).write_text(json.dumps(info, indent=1) + "\n")


def without_password(url: str) -> str:
    """`url` with the password of its user-info part (redis://user:PASSWORD@host) replaced by ***."""
    return re.sub(r"(://[^:/@\s]*:)[^@/\s]+@", r"\1***@", url)


def request_scale(run_id: str, actors: int, redis_url: str = "", run_dir: str | Path = "runs") -> str:
    """Set the target actor count of `run_id`; returns (and prints) what will happen.

    The broker is `redis_url`, or, when empty, the one recorded in `<run_dir>/<run_id>/run.json`; the password
    comes from the environment variable named there (default SPARSE_RL_REDIS_PASSWORD).
    Raises ScaleError for a count < 1, a run without a readable run.json (and no redis_url), a URL that is not
    redis://, an unreachable broker, or a run id the broker has no record of; a password in the URL is never
    printed."""
    if actors < 1:
        raise ScaleError(f"--actors {actors}: expected >= 1")
    broker, source = BrokerConfig(url=redis_url), "--redis"
    if not redis_url:
        info_path = Path(run_dir) / run_id / RUN_INFO
        if not info_path.is_file():
            raise ScaleError(f"run {run_id!r}: no {info_path} (no such run under --run-dir {run_dir}); "
                             "give --run-dir, or the run's broker with --redis")
        try:
            info = json.loads(info_path.read_text())
            broker = BrokerConfig(url=info["redis_url"], password_env=info.get("password_env", broker.password_env),
                                  retry_s=float(info.get("retry_s", broker.retry_s)))
        except (ValueError, KeyError, TypeError) as e:
            raise ScaleError(f"{info_path}: not the run record `sparse-rl train` writes ({type(e).__name__}: "
                             f"{e}); give the run's broker with --redis") from None
        source = str(info_path)
    shown = without_password(broker.url)
    try:
        client = redis.Redis.from_url(broker.url, password=os.environ.get(broker.password_env) or None,
                                      **{**rs.client_options(min(broker.retry_s, RETRY_S)),
                                         "socket_connect_timeout": TIMEOUT_S, "socket_timeout": TIMEOUT_S})
    except ValueError as e:
        raise ScaleError(f"{source}: {shown!r} is not a redis:// URL ({without_password(str(e))})") from None
    try:
        current = rs.read_actors_target(client, run_id)
        if current is None and not rs.run_known(client, run_id):
            raise ScaleError(f"run {run_id!r}: unknown to the broker at {shown} (no "
                             f"{rs.key(run_id, rs.ACTORS_TARGET)}); "
                             "check the run id printed by `sparse-rl train`")
        rs.set_actors_target(client, run_id, actors)
    except redis.RedisError as e:
        raise ScaleError(f"run {run_id!r}: the broker at {shown} does not answer ({type(e).__name__}: "
                         f"{' '.join(str(e).split())}); has the run ended?") from None
    before = int(current or 0)
    if actors > before:
        change = f"{actors - before} new actor(s) start and receive the weights at the next weight sync"
    elif actors < before:
        change = f"the {before - actors} newest actor(s) publish their current batch and stop"
    else:
        change = "no change"
    message = f"run {run_id}: rollout actors {before} -> {actors}, applied after the current learner step: {change}"
    print(message)
    return message
