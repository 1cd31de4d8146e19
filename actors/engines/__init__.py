"""Rollout engines: the interface (base.py), the torch engine with its KV-memory model, SGLang (sglang/)."""
