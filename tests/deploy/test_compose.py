"""docker-compose.yml run for real on a Docker engine (opt-in lane: `pytest -m docker tests/deploy/test_compose.py`;
.ci/run runs it after the unit tests).

The images are built with no image registry (scripts/docker_images.sh: Debian base images from mmdebstrap,
torch from the host's CPU wheel), then the `tiny` job runs with 2 rollout actors. Every container uses the
host's network (docker-compose.loopback.yml) with free ports on 127.0.0.1, the private engine has no bridge
network (`--bridge=none`, `--iptables=false`) and the builds use `--network host`, so no test traffic goes to an
address but loopback. While the learner steps, the test adds actor nodes (`docker compose up -d --scale`) and
raises the run's actor count with `sparse-rl scale`, restarts Redis (`docker compose restart redis`),
then `docker kill`s a container that hosts an actor.

Checks: a third actor joins and its groups are trained; the Redis restart is waited out by every client; after the
kill the run goes on and ends with exact accounting (summary.json); ray-head exits 0; the MLflow server (over HTTP) has
the run with rejection_rate and mismatch_kl at every step; Redis refuses an unauthenticated PING; no process of the
stack listens or connects beyond loopback; `docker compose down -v` leaves no container, network or volume; the engine
it started stops.

Without Docker (no `docker`/`dockerd`, or an engine that cannot start) the lane skips with one line, except in CI
(env CI set), where it fails with the reason. SPARSE_RL_DOCKER_DATA_ROOT keeps the private engine's images in
that directory between runs (layer cache); by default they live in a temporary directory removed after.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from redis import exceptions as redis_errors

from broker.config import BrokerConfig
from broker.redis_server import free_port
from broker.run_state import key
from broker.schema import decode_group
from deploy.metric_names import metric_history

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "sparse-rl-lane"
STEPS = 100  # 1-2 s each on 2 busy cores: long enough for two actor nodes to start (a minute or two) and a
# killed actor to be replaced while the learner steps (measured: the kill at step 45, 150 steps ending 100 s later)
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
IMAGES = {"SPARSE_RL_BASE_IMAGE": "local/debian-python:bookworm",
          "SPARSE_RL_REDIS_IMAGE": "local/sparse-rl-redis:bookworm",
          "SPARSE_RL_IMAGE": "sparse-rl:lane"}


def unavailable(reason: str):
    """Fail in CI (the lane was measured to run on its machines), skip elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(f"docker lane: {reason}", pytrace=False)
    pytest.skip(reason)


def answers(env: dict) -> bool:
    return subprocess.run(["docker", "version"], env=env, capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="module")
def engine():
    """The environment that reaches a Docker engine: the one DOCKER_HOST (or the default socket) names when it
    answers, else a private dockerd started here (its data root in a temporary directory) and stopped after."""
    for tool in ("docker", "dockerd", "mmdebstrap"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} not installed (apt-get install docker.io iptables mmdebstrap; .ci/run does)")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if subprocess.run(["docker", "compose", "version"], env=env, capture_output=True).returncode != 0:
        unavailable("the Docker Compose v2 plugin is missing (docs/deploy-docker.md; .ci/run installs it)")
    if answers(env):
        yield env
        return
    if os.geteuid() != 0:
        unavailable("no Docker engine answers and starting one needs root")
    keep = os.environ.get("SPARSE_RL_DOCKER_DATA_ROOT")
    home = Path(tempfile.mkdtemp(prefix="srl-docker-", dir="/tmp"))  # short: sockets live under the exec root
    data = Path(keep) if keep else home / "data"
    sock = home / "docker.sock"
    log = open(home / "dockerd.log", "w")
    proc = subprocess.Popen(["dockerd", f"--data-root={data}", f"--exec-root={home}/exec",
                             f"--pidfile={home}/dockerd.pid", f"--host=unix://{sock}", "--bridge=none",
                             "--iptables=false"],
                            stdout=log, stderr=subprocess.STDOUT)
    env["DOCKER_HOST"] = f"unix://{sock}"
    try:
        deadline = time.time() + 60
        while not (sock.exists() and answers(env)):
            if proc.poll() is not None or time.time() > deadline:
                tail = (home / "dockerd.log").read_text()[-2000:]
                unavailable(f"dockerd did not start (exit {proc.poll()}): {tail.splitlines()[-1] if tail else ''}")
            time.sleep(0.5)
        yield env
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for mount in reversed(Path("/proc/self/mounts").read_text().splitlines()):  # dockerd leaves exec/netns/default
            if mount.split()[1].startswith(f"{home}/"):
                subprocess.run(["umount", mount.split()[1]], check=False)
        shutil.rmtree(home, ignore_errors=True)
    assert not psutil.pid_exists(proc.pid), "the private dockerd is still running"
    assert not home.exists(), f"{home} is left behind"


@pytest.fixture(scope="module")
def images(engine):
    """The three images, built by scripts/docker_images.sh (the host's extra CA certificates go into the
    test-only base image when the host has any: pip in the build must trust a TLS-inspecting proxy)."""
    env = {**engine, **IMAGES}
    args = ["--host-ca"] if list(Path("/usr/local/share/ca-certificates").glob("*.crt")) else []
    started = time.monotonic()
    out = subprocess.run([str(ROOT / "scripts" / "docker_images.sh"), *args, "--", "--build-arg",
                          "PRELOAD_MODELS=tiny-llama"], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=3600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    print(f"images built in {time.monotonic() - started:.0f} s")
    if os.environ.get("SPARSE_RL_DOCKER_DATA_ROOT"):  # a kept data root: drop the images this build untagged
        subprocess.run(["docker", "image", "prune", "-f"], env=env, capture_output=True, timeout=300)
    return env


class Stack:
    """`docker compose` of the default file plus the loopback override, for one project."""

    def __init__(self, env: dict):
        self.env = env
        self.files = ["-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "docker-compose.loopback.yml")]

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(["docker", "compose", "-p", PROJECT, *self.files, *args], env=self.env, cwd=ROOT,
                             capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0 or not check, f"docker compose {' '.join(args)}: {out.stderr[-3000:]}"
        return out

    def docker(self, *args: str, timeout: float = 120) -> str:
        out = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"docker {' '.join(args)}: {out.stderr[-2000:]}"
        return out.stdout

    def containers(self, service: str = "", all_: bool = False) -> list[str]:
        args = ["ps", "-q", *(["-a"] if all_ else []), *([service] if service else [])]
        return self.compose(*args).stdout.split()

    def pids(self) -> set[int]:
        """Host pids of every process in the stack's running containers."""
        found = set()
        for cid in self.containers():
            out = subprocess.run(["docker", "top", cid, "-eo", "pid"], env=self.env, capture_output=True, text=True,
                                 timeout=120)
            if out.returncode and ("is not running" in out.stderr or "No such container" in out.stderr):
                continue  # it ended between `ps` and `top` (the run's end): no process of it is left to check
            assert out.returncode == 0, f"docker top {cid}: {out.stderr[-2000:]}"
            found.update(int(line) for line in out.stdout.split()[1:] if line.isdigit())
        return found

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, check=False).stdout


def stack_env(images: dict, password: str) -> dict:
    ports = {name: str(free_port()) for name in ("REDIS_PORT", "MLFLOW_PORT", "RAY_PORT", "RAY_DASHBOARD_PORT",
                                                  "RAY_CLIENT_PORT")}
    return {**images, **{f"SPARSE_RL_{k}": v for k, v in ports.items()},
            "SPARSE_RL_REDIS_PASSWORD": password, "SPARSE_RL_LISTEN_HOST": "127.0.0.1",
            "SPARSE_RL_RAY_NODE_IP": "127.0.0.1", "SPARSE_RL_REDIS_HOST": "127.0.0.1",
            "SPARSE_RL_MLFLOW_HOST": "127.0.0.1", "SPARSE_RL_RAY_HOST": "127.0.0.1",
            "SPARSE_RL_CONFIG": "tiny", "SPARSE_RL_ACTORS": "2",
            "SPARSE_RL_OVERRIDES": f"train.steps={STEPS} eval.enabled=false learner.weight_sync_timeout_s=30"}


def off_loopback(pids: set[int]) -> list[str]:
    """Sockets of `pids` that listen on, or connect to, an address other than loopback."""
    bad = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid not in pids:
            continue
        if conn.status == psutil.CONN_LISTEN or conn.type == 2 and not conn.raddr:  # TCP listener, bound UDP
            if conn.laddr.ip not in LOOPBACK:
                bad.append(f"pid {conn.pid} listens on {conn.laddr.ip}:{conn.laddr.port}")
        elif conn.raddr and conn.raddr.ip not in LOOPBACK:
            bad.append(f"pid {conn.pid} connects to {conn.raddr.ip}:{conn.raddr.port}")
    return bad


class ThirdActorWatch:
    """Finds the step where actor-2 (the actor added by `sparse-rl scale`) first trained: its groups are seen
    in the run's stream, and a group leaves the stream in the transaction that commits a learner step and
    publishes its version, so the version read just after one left is the step that took it (trained or
    filtered; trained_prompts.jsonl tells which)."""

    def __init__(self, client, run_id: str):
        self.client, self.run_id = client, run_id
        self.stream = key(run_id, BrokerConfig().stream)
        self.seen: dict[bytes, str] = {}      # stream id -> prompt id of actor-2's groups in the stream
        self.taken: list[tuple[int, str]] = []  # (version that took it, prompt id)

    def version(self) -> int:
        return int(self.client.get(key(self.run_id, "learner_version")) or 0)

    def poll(self) -> None:
        entries = dict(self.client.xrange(self.stream))
        for msg_id, fields in entries.items():
            if msg_id not in self.seen:
                group = decode_group(fields[b"group"])
                if group.actor_id == "actor-2":
                    self.seen[msg_id] = group.prompt_id
        gone = [m for m in self.seen if m not in entries]
        if gone:
            version = self.version()
            self.taken += [(version, self.seen.pop(m)) for m in gone]

    def first_trained(self, trained_prompts: dict[int, list[str]]) -> int | None:
        return next((v for v, prompt in self.taken if prompt in trained_prompts.get(v, [])), None)


@pytest.mark.timeout(3600)
def test_compose_run_scaled_and_an_actor_container_killed(images, tmp_path):
    import redis
    from mlflow.tracking import MlflowClient

    from tests.deploy.test_e2e import check_accounting

    password = os.urandom(16).hex()
    env = {**images, **stack_env(images, password)}
    stack = Stack(env)
    stack.compose("down", "-v", "--remove-orphans", check=False)  # a previous run's leftovers
    started = time.monotonic()
    events: dict[str, float] = {}
    off: list[str] = []
    try:
        stack.compose("up", "-d", "--no-build", "--scale", "actor=2", timeout=600)
        client = redis.Redis(host="127.0.0.1", port=int(env["SPARSE_RL_REDIS_PORT"]), password=password)
        run_id = wait_for_run(stack, client)
        watch = ThirdActorWatch(client, run_id)
        wait_until(lambda: watch.version() >= 1, 600, "the first learner step")
        events["first_step_s"] = round(time.monotonic() - started)
        # scale: one node per actor plus a spare (a killed container is not restarted), then the actor count
        stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "actor=4", "actor", timeout=300)
        scaled = stack.compose("exec", "-T", "ray-head", "sparse-rl", "scale", "--run", run_id, "--actors", "3")
        assert "rollout actors 2 -> 3" in scaled.stdout, scaled.stdout
        events["scaled_at"] = watch.version()
        off += off_loopback(stack.pids())

        deadline = time.time() + 900
        while not watch.taken:  # actor-2 joined: one of its groups was taken by a learner step
            assert time.time() < deadline and watch.version() < STEPS, \
                f"no group of actor-2 taken: {events}\n{stack.logs('ray-head')[-6000:]}"
            watch.poll()
            time.sleep(0.05)
        events["actor2_taken_at"] = watch.taken[0][0]
        off += off_loopback(stack.pids())

        # docker compose restart redis mid-run: SIGTERM makes redis-server write its append-only file on the
        # volume, a new process loads it; every client (driver, learner, actors) waits (broker.retry_s) and goes on
        stack.compose("restart", "redis", timeout=120)
        wait_until(lambda: answers_ping(client), 120, "Redis after its restart")
        events["redis_restarted_at"] = watch.version()

        # docker kill a container that hosts a rollout actor: the driver replaces it on the spare node
        victim = next(cid for cid in stack.containers("actor")
                      if "RolloutWorker" in stack.docker("top", cid, "-eo", "pid,args"))
        stack.docker("kill", victim)
        events["killed_at"] = watch.version()
        assert events["killed_at"] < STEPS - 2, f"the run was nearly over before the kill: {events}"
        off += off_loopback(stack.pids())

        head = stack.containers("ray-head", all_=True)[0]
        last_check = time.monotonic()
        while stack.docker("inspect", "-f", "{{.State.Running}}", head).strip() == "true":
            assert time.monotonic() - started < 3000, f"the run did not end: {events}"
            watch.poll()
            if time.monotonic() - last_check > 10:
                off += off_loopback(stack.pids())
                last_check = time.monotonic()
            time.sleep(0.05)
        events["run_s"] = round(time.monotonic() - started)
        exit_code = int(stack.docker("inspect", "-f", "{{.State.ExitCode}}", head).strip())
        head_log = stack.logs("ray-head")
        assert exit_code == 0, head_log[-6000:]
        print("\n".join(line for line in head_log.splitlines() if "rollout actor" in line)[-3000:])

        for name in ("summary.json", "trained_prompts.jsonl"):
            stack.docker("cp", f"{head}:/app/runs/{run_id}/{name}", str(tmp_path / name))
        summary = json.loads((tmp_path / "summary.json").read_text())
        trained = {r["version"]: r["prompt_ids"] for r in map(json.loads, open(tmp_path / "trained_prompts.jsonl"))}
        events["third_actor_first_trained_at"] = watch.first_trained(trained)
        print(f"run {run_id}: {events}")
        print("accounting:", json.dumps(summary["accounting"]))
        assert events["third_actor_first_trained_at"] is not None, (watch.taken, events)
        check_accounting(summary, steps=STEPS, groups_per_step=2, prompts_per_batch=2)
        assert len(summary["accounting"]["actor_versions"]) == 3, summary["accounting"]

        mlflow = MlflowClient(f"http://127.0.0.1:{env['SPARSE_RL_MLFLOW_PORT']}")
        for name in ("rejection_rate", "mismatch_kl"):
            steps = sorted(m.step for m in metric_history(mlflow, summary["mlflow_run_id"], name))
            assert steps == list(range(1, STEPS + 1)), (name, steps)
        live = [m.value for m in sorted(metric_history(mlflow, summary["mlflow_run_id"], "actors_live"),
                                        key=lambda m: m.step)]
        assert max(live) == 3 and live[-1] == 3, live

        assert unauthenticated_ping(int(env["SPARSE_RL_REDIS_PORT"])).startswith(b"-NOAUTH Authentication required")
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        redis_uid = stack.compose("exec", "-T", "redis", "grep", "^Uid:", "/proc/1/status").stdout.split()[1]
        assert redis_uid != "0", "redis-server runs as root"
        off += off_loopback(stack.pids())
        assert off == [], sorted(set(off))
    finally:
        down = stack.compose("down", "-v", "--remove-orphans", timeout=300, check=False)
    assert down.returncode == 0, down.stderr
    label = f"label=com.docker.compose.project={PROJECT}"
    leftovers = {kind: stack.docker(kind, "ls", "-q", *(["-a"] if kind == "container" else []), "--filter", label)
                 for kind in ("container", "network", "volume")}
    assert leftovers == {"container": "", "network": "", "volume": ""}, leftovers


def answers_ping(client) -> bool:
    try:
        return client.ping()
    except (redis_errors.ConnectionError, redis_errors.BusyLoadingError, redis_errors.TimeoutError):
        return False


def unauthenticated_ping(port: int) -> bytes:
    """Redis's reply to a bare PING on a new connection (no AUTH, no HELLO)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"PING\r\n")
        return conn.recv(1024)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.5)


def wait_for_run(stack: Stack, client) -> str:
    """The run id, once the driver has made its run directory and the broker knows the run."""
    deadline = time.time() + 900
    while time.time() < deadline:
        out = stack.compose("exec", "-T", "ray-head", "ls", "/app/runs", check=False)
        ids = out.stdout.split() if out.returncode == 0 else []
        if ids and client.exists(key(ids[0], "actors_target")):
            return ids[0]
        head = stack.containers("ray-head", all_=True)
        if head and stack.docker("inspect", "-f", "{{.State.Status}}", head[0]).strip() == "exited":
            pytest.fail(f"ray-head exited before the run started:\n{stack.logs('ray-head')[-6000:]}")
        time.sleep(2)
    pytest.fail(f"no run started within 900 s:\n{stack.logs('ray-head')[-6000:]}")
