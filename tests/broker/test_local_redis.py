"""LocalRedis's start on a busy machine: a server that accepts connections but is too slow to answer is waited for
until `start_timeout_s`, then refused in one line (seen in the suite beside a training run: redis-server accepted
the connection, answered INFO after the client's 1 s socket timeout, and the start raised redis' TimeoutError)."""
from __future__ import annotations

import stat
import sys
import time

import pytest

from broker.redis_server import LocalRedis

SILENT = f"""#!{sys.executable}
# Stands where redis-server would: listens on the config's port, accepts, never answers.
import socket, sys, time
port = next(int(l.split()[1]) for l in open(sys.argv[1]) if l.startswith("port "))
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", port)); s.listen()
held = []
while True:
    held.append(s.accept()[0])
"""


def test_a_server_that_accepts_but_never_answers_is_refused_at_the_start_timeout(tmp_path):
    binary = tmp_path / "silent-redis-server"
    binary.write_text(SILENT)
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not start on 127\.0\.0\.1:\d+"):
        LocalRedis(binary=str(binary), start_timeout_s=3.0)
    assert 3.0 <= time.monotonic() - started < 15
