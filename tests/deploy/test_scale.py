"""`sparse-rl scale` against a real redis-server: finds the run's broker from its run directory, refuses an
unknown run id, says what will happen, and answers without importing Ray or torch."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from broker.config import BrokerConfig
from broker.redis_server import LocalRedis
from broker.run_state import ACTORS_TARGET, key
from deploy.scale import write_run_info

PROBE = ("import sys, time; t = time.perf_counter(); from deploy.cli import main; rc = main(sys.argv[1:]); "
         "print('heavy imports:', sorted(m for m in ('ray', 'torch', 'omegaconf') if m in sys.modules)); "
         "print(f'seconds: {time.perf_counter() - t:.2f}'); sys.exit(rc)")


def scale_cli(*args, env=None):
    return subprocess.run([sys.executable, "-c", PROBE, "scale", *args], capture_output=True, text=True, timeout=60,
                          env=env)


def started_run(runs, run_id, broker: BrokerConfig, client, actors=2):
    """What the driver leaves for `scale` when a run starts: run.json in its directory, the actors_target key."""
    (runs / run_id).mkdir(parents=True)
    write_run_info(runs / run_id, run_id, broker)
    client.set(key(run_id, ACTORS_TARGET), actors)


def test_scale_finds_the_broker_from_the_run_directory(tmp_path, redis_server):
    client = redis_server.client()
    started_run(tmp_path, "tiny-20260101-000000-ab12", BrokerConfig(url=redis_server.url), client)
    proc = scale_cli("--run", "tiny-20260101-000000-ab12", "--actors", "5", "--run-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert ("run tiny-20260101-000000-ab12: rollout actors 2 -> 5, applied after the current learner step: "
            "3 new actor(s) start") in proc.stdout
    assert "heavy imports: []" in proc.stdout  # no Ray, no torch: it answers at once
    assert float(proc.stdout.split("seconds: ")[1]) < 1.0
    assert client.get(key("tiny-20260101-000000-ab12", ACTORS_TARGET)) == b"5"


def test_scale_refuses_an_unknown_run(tmp_path, redis_server):
    client = redis_server.client()
    started_run(tmp_path, "real-run", BrokerConfig(url=redis_server.url), client)
    proc = scale_cli("--run", "no-such-run", "--actors", "5", "--redis", redis_server.url)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"sparse-rl scale: run 'no-such-run': unknown to the broker at {redis_server.url}")
    assert client.get(key("no-such-run", ACTORS_TARGET)) is None and client.get(key("real-run", ACTORS_TARGET)) == b"2"
    proc = scale_cli("--run", "no-such-run", "--actors", "5", "--run-dir", str(tmp_path))  # no run directory
    assert proc.returncode == 2 and "run 'no-such-run': no " in proc.stderr and "Traceback" not in proc.stderr


def test_scale_of_an_ended_run_says_so(tmp_path):
    with LocalRedis() as server:  # the run's embedded broker, gone when the run ends
        started_run(tmp_path, "ended", BrokerConfig(url=server.url), server.client())
    started = time.monotonic()
    proc = scale_cli("--run", "ended", "--actors", "3", "--run-dir", str(tmp_path))
    assert proc.returncode == 2 and "does not answer" in proc.stderr and "has the run ended?" in proc.stderr
    assert "Traceback" not in proc.stderr and time.monotonic() - started < 30


def test_scale_uses_the_password_named_by_the_run(tmp_path, monkeypatch):
    with LocalRedis(password="s3cret-pw") as server:
        started_run(tmp_path, "locked", BrokerConfig(url=server.url, password_env="MY_REDIS_PW"), server.client())
        assert "s3cret" not in (tmp_path / "locked" / "run.json").read_text()
        monkeypatch.setenv("MY_REDIS_PW", "s3cret-pw")
        proc = scale_cli("--run", "locked", "--actors", "1", "--run-dir", str(tmp_path), env=dict(os.environ))
        assert proc.returncode == 0, proc.stderr
        assert "rollout actors 2 -> 1" in proc.stdout and "publish their current batch and stop" in proc.stdout
        assert server.client().get(key("locked", ACTORS_TARGET)) == b"1"


def test_scale_bad_urls_and_run_records_get_one_line_and_a_password_is_never_printed(tmp_path):
    cases = {("--redis", "notaurl"): "sparse-rl scale: --redis: 'notaurl' is not a redis:// URL (",
             ("--redis", "redis://127.0.0.1:abc/0"): "sparse-rl scale: --redis: 'redis://127.0.0.1:abc/0' is not a "
                                                     "redis:// URL (",
             ("--redis", "redis://:hunter2@127.0.0.1:1/0"): "sparse-rl scale: run 'x': the broker at "
                                                            "redis://:***@127.0.0.1:1/0 does not answer"}
    for args, expected in cases.items():
        proc = scale_cli("--run", "x", "--actors", "2", *args)
        assert proc.returncode == 2 and proc.stderr.startswith(expected), (args, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1 and "hunter2" not in proc.stderr, proc.stderr
    (tmp_path / "x").mkdir()
    for record, error in (("{bad", "JSONDecodeError"), ('{"run_id": "x"}', "KeyError: 'redis_url'"),
                          ("[1]", "TypeError")):
        (tmp_path / "x" / "run.json").write_text(record)
        proc = scale_cli("--run", "x", "--actors", "2", "--run-dir", str(tmp_path))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"sparse-rl scale: {tmp_path / 'x' / 'run.json'}: not the run record "
                                      f"`sparse-rl train` writes ({error}"), proc.stderr
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
