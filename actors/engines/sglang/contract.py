"""What the SGLang engine (engine.py here, in the actor's process) and the attention backends it registers
(triton_backend.py, kv_backend.py, in SGLang's scheduler subprocess) agree on across that process boundary:
backend names, environment-variable names, the budget carried in a request id, the eviction record's file, and the
decode graph backends sparse mode accepts. Both sides import it; it imports neither (docs/sglang.md)."""
from __future__ import annotations

import os

SPARSE_BACKEND = "sparse_rl_kv"
"""Name of our attention backend in SGLang's registry (`attention_backend=` of `sglang.Engine`): SGLang's Triton
kernels over the compressed KV (actors/engines/sglang/triton_backend.py)."""
TORCH_SPARSE_BACKEND = "sparse_rl_kv_torch"
"""The torch reference backend (actors/engines/sglang/kv_backend.py): eager, no CUDA graphs."""
COMPRESSOR_ENV = "SPARSE_RL_KV_COMPRESSOR"
"""Environment variable carrying the CompressorConfig (JSON) to SGLang's scheduler subprocess."""
KV_BUDGET_RID = ":sparse_rl_kv_budget="
"""A request whose KV budget is not the run's carries it at the end of its SGLang request id
(`<uuid>:sparse_rl_kv_budget=<tokens>`): SGLang hands every forward batch its requests' ids
(`ForwardBatch.rids`), so the backend reads the budget once, at the request's prefill, and nothing runs per
decode step (a custom logit processor, the earlier carrier, ran on every decode step of every request that
had one: a Python pass over the batch and two copies of its logits in SGLang's sampler)."""


def budget_rid(budget: int) -> str:
    """A unique SGLang request id carrying `budget` (KV_BUDGET_RID)."""
    import uuid

    return f"{uuid.uuid4().hex}{KV_BUDGET_RID}{int(budget)}"


def rid_budget(rid, default: int) -> int:
    """The budget a request id carries (`budget_rid`), or `default` for any other id."""
    head, sep, tail = str(rid).rpartition(KV_BUDGET_RID)
    return int(tail) if sep and tail.isdigit() else default


KV_STATS_ENV = "SPARSE_RL_KV_STATS"
"""Optional file path: the sparse backend writes its measured KV slot usage there (JSON)."""
JOINS_ENV = "SPARSE_RL_KV_JOINS"
"""File path, set by `SGLangEngine` under `compressor.phase: aligned`: at each prefill the `sparse_rl_kv` backend
appends one line `<request id> <decode_steps>` per request (the engine decode steps run before the request's
first), from which `generate` counts each request's KV under the shared phase exactly."""


DECODE_GRAPH_BACKENDS = ("full", "disabled")
"""Decode CUDA-graph backends sparse mode accepts (`cuda_graph_backend_decode`, `cuda_graph_config`)."""
RECORDS_ENV = "SPARSE_RL_KV_RECORDS"
"""Directory, set by `SGLangEngine(record_evictions=True)` in sparse mode (a temporary directory per engine): when a
request's row leaves SGLang's request pool (the request ended), the `sparse_rl_kv` backend writes its eviction record
there, at `record_path(directory, request id)` (actors/engines/sglang/records.py), and `generate` reads it back by
SGLang's `meta_info["id"]` and deletes it."""


def record_path(directory: str, rid) -> str:
    """The file of request `rid`'s eviction record in `directory`: a numpy .npy of uint16 [layers, kv_heads, tokens
    whose KV was computed], 65535 = never evicted (the request id with path separators replaced)."""
    return os.path.join(directory, str(rid).replace(os.sep, "_") + ".npy")


def unsupported_compressor_settings(cfg) -> list[str]:
    """The settings of CompressorConfig `cfg` the sparse SGLang backends cannot run yet, as `field=value` strings
    (empty: all supported). Its `select` gets each layer's values and index, not the samples' seeds, events or
    true positions and prompt lengths: method h2o (per-slot attention mass) and random (seeds, events, positions),
    protect_prompt (positions, prompt lengths), protect_values (supplied, untested on its lane), a kv_dtype
    other than model (its pool stores the model dtype) and kv_budget_bytes (resolved to tokens by the torch engine
    only) are refused. Sinks run there as for streamingllm (the
    first valid slots)."""
    bad = [f"method={cfg.method}"] if cfg.method in ("h2o", "random") else []
    if cfg.protect_prompt != "off":
        bad.append(f"protect_prompt={cfg.protect_prompt}")
    if cfg.protect_values:
        bad.append(f"protect_values={cfg.protect_values}")
    if cfg.kv_dtype != "model":
        bad.append(f"kv_dtype={cfg.kv_dtype}")
    if cfg.kv_budget_bytes:
        bad.append(f"kv_budget_bytes={cfg.kv_budget_bytes}")
    return bad
