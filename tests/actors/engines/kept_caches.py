"""What the torch engine keeps between an episode's turns, read by the tests (tests/actors/engines/
test_episode_cache.py, tests/learner/test_multiturn_replay.py); the product only releases them
(`TorchEngine.release_episodes`)."""
from __future__ import annotations

from actors.engines.torch_engine import TorchEngine


def held_episodes(engine: TorchEngine) -> list[str]:
    """Keys of the episodes whose caches the engine keeps (see `TorchEngine.generate`'s episodes)."""
    return list(engine._episodes)
