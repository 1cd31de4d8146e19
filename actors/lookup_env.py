"""Compatibility: the lookup environment moved to actors/envs/lookup.py. This module keeps run configs saved
before the move (`actors.lookup_env:lookup_items`, `actors.lookup_env:LookupEnv` in a run's config.yaml)
loadable by `--resume`; new configs name `actors.envs.lookup:...`."""
from actors.envs.lookup import LookupEnv, lookup_items

__all__ = ["LookupEnv", "lookup_items"]
