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
"""A request whose KV budget is not the run's carries it in its SGLang request id
(`<uuid>:sparse_rl_kv_budget=<tokens>`, `request_rid`): SGLang hands every forward batch its requests' ids
(`ForwardBatch.rids`), so the backend reads the budget once, at the request's prefill, and nothing runs per
decode step (a custom logit processor, the earlier carrier, ran on every decode step of every request that
had one: a Python pass over the batch and two copies of its logits in SGLang's sampler)."""


KV_SEED_RID = ":sparse_rl_kv_seed="
"""A request whose compressor reads sample seeds (method random) carries its seed in its SGLang request id, after any
budget (`<uuid>[:sparse_rl_kv_budget=<tokens>]:sparse_rl_kv_seed=<seed>`): the seed the torch engine gives the same
row (`actors.engines.base.compressor_seeds`), read once at the request's prefill, as the budget is."""


def request_rid(budget: int | None = None, seed: int | None = None) -> str:
    """A unique SGLang request id carrying `budget` (KV_BUDGET_RID) and `seed` (KV_SEED_RID), each when not None."""
    import uuid

    rid = uuid.uuid4().hex
    if budget is not None:
        rid += f"{KV_BUDGET_RID}{int(budget)}"
    if seed is not None:
        rid += f"{KV_SEED_RID}{int(seed)}"
    return rid


def budget_rid(budget: int) -> str:
    """A unique SGLang request id carrying `budget` (KV_BUDGET_RID)."""
    return request_rid(budget)


def _rid_value(rid, tag: str, default: int) -> int:
    """The non-negative integer after `tag` in request id `rid` (up to the next ':'), or `default`."""
    _, sep, tail = str(rid).partition(tag)
    value = tail.split(":", 1)[0]
    return int(value) if sep and value.isdigit() else default


def rid_budget(rid, default: int) -> int:
    """The budget a request id carries (`request_rid`), or `default` for any other id."""
    return _rid_value(rid, KV_BUDGET_RID, default)


def rid_seed(rid) -> int:
    """The compressor seed a request id carries (`request_rid`), or 0 for an id without one."""
    return _rid_value(rid, KV_SEED_RID, 0)


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


PROTECTED_ENV = "SPARSE_RL_KV_PROTECTED"
"""Directory, set by `SGLangEngine` in sparse mode on `sparse_rl_kv` when the compressor protects tokens
(`CompressorConfig.protects`; a temporary directory per engine): when a request's row leaves SGLang's request pool
(or an episode's finished turn parks its row), the backend writes the request's protected share there, at
`protected_path(directory, request id)`, and `generate` reads it back by SGLang's `meta_info["id"]` into
`Sample.kv_protected_fraction` and deletes it -- the eviction records' handover (RECORDS_ENV)."""


def protected_path(directory: str, rid) -> str:
    """The file of request `rid`'s protected share in `directory`: a numpy .npy float32 scalar, the share of the kept
    tokens protection held at the request's last compression, mean over layers and KV heads (0: never compressed)."""
    return os.path.join(directory, str(rid).replace(os.sep, "_") + ".protected.npy")


FP8_POOL_TRY = ("SGLang's fp8 pool tried on the CPU lane (SGLang 0.5.23, TRITON_INTERPRET=1, 2026-12-07): ValueError: "
                "CPU FP8 KV cache requires Intel AMX support. (with SGLang's CPU gates lifted, compression's gather: "
                "NotImplementedError: \"scatter_gather_tensor_cpu\" not implemented for 'Float8_e4m3fn')")
"""What running SGLang's own fp8 KV pool (`kv_cache_dtype=fp8_e4m3`) under the sparse backend gave, quoted by the
refusals of compressor.kv_dtype and of kv_cache_dtype (docs/sglang.md, "Refused at start")."""
KV_DTYPE_REFUSAL = ("the sparse backend's KV pool stores the model dtype (quantized KV, its replay and its "
                    "preflight run on the torch engine, docs/kv_cache.md; or set kv_dtype=model)")
"""Why compressor.kv_dtype other than model is refused on SGLang (unsupported_compressor_settings); for fp8_e4m3,
SGLang's own fp8 pool, it also quotes FP8_POOL_TRY."""


def unsupported_compressor_settings(cfg, backend: str = SPARSE_BACKEND) -> dict[str, str]:
    """The settings of CompressorConfig `cfg` the sparse SGLang backend `backend` (SPARSE_BACKEND, the one a run uses,
    or TORCH_SPARSE_BACKEND) cannot run: {`field=value`: its reason} (empty: all supported), in field order.
    `sparse_rl_kv` tracks each request's seed (in its request id), length and first prompt on its host mirror and each
    kept key's true position on the device (actors/engines/sglang/records.py), so random and protection run there as
    on the torch engine; the torch reference backend's select gets each layer's keys, values and window queries only
    (docs/sglang.md, "What runs on which engine"). Sinks run on both (the first valid slots)."""
    bad = {}
    if cfg.method == "h2o":
        bad["method=h2o"] = ("needs each slot's accumulated attention mass per KV head, which SGLang's attention "
                             "kernels do not return")
    reference = f"the {TORCH_SPARSE_BACKEND} reference backend does not track"
    if backend == TORCH_SPARSE_BACKEND and cfg.method == "random":
        bad["method=random"] = f"{reference} each request's seed and its keys' true positions; use {SPARSE_BACKEND}"
    if backend == TORCH_SPARSE_BACKEND and cfg.protect_prompt != "off":
        bad[f"protect_prompt={cfg.protect_prompt}"] = (f"{reference} each request's prompt length and its keys' true "
                                                       f"positions; use {SPARSE_BACKEND}")
    if backend == TORCH_SPARSE_BACKEND and cfg.protect_values:
        bad[f"protect_values={cfg.protect_values}"] = (f"the {TORCH_SPARSE_BACKEND} reference backend was never run "
                                                       f"with it on the SGLang lane; use {SPARSE_BACKEND}")
    if cfg.kv_dtype != "model":
        bad[f"kv_dtype={cfg.kv_dtype}"] = KV_DTYPE_REFUSAL + (f"; {FP8_POOL_TRY}" if cfg.kv_dtype == "fp8_e4m3" else "")
    if cfg.kv_budget_bytes:
        bad[f"kv_budget_bytes={cfg.kv_budget_bytes}"] = ("a byte budget is resolved to tokens by the torch engine "
                                                         "only (CompressorConfig.with_byte_budget)")
    return bad


def refusal_line(bad: dict[str, str], prefix: str) -> str:
    """`bad` (unsupported_compressor_settings) as one line: `<prefix><field=value>: <reason>; ...`."""
    return "; ".join(f"{prefix}{setting}: {why}" for setting, why in bad.items())
