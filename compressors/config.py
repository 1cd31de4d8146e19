"""Typed config of the KV compressors (shared/SPEC.md §5)."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("rkv", "snapkv", "h2o", "streamingllm", "full")
SELECTIONS = ("per_head", "shared")


@dataclass
class CompressorConfig:
    method: str = "rkv"
    """KV eviction policy: one of rkv | snapkv | h2o | streamingllm | full (full = dense, no eviction)."""
    kv_budget: int = 512
    """B: tokens kept per sequence, per layer, per KV head after a compression (prompt included)."""
    window: int = 8
    """W: observation window; the last W queries score the cache and the last W tokens are always kept."""
    interval: int = 128
    """Decode steps between compressions; the cache moves between kv_budget and kv_budget + interval tokens."""
    rkv_lambda: float = 0.1
    """R-KV mixing weight: score = lambda * importance - (1 - lambda) * redundancy."""
    pool_kernel: int = 7
    """1-D max-pool kernel (stride 1, same padding) applied to the importance scores (R-KV, SnapKV)."""
    similarity_threshold: float = 0.5
    """R-KV: cosine similarity above which the most recent similar key is kept as the representative."""
    sinks: int = 4
    """StreamingLLM: attention-sink tokens always kept at the start of the sequence."""
    h2o_recent: int = 64
    """H2O: most recent tokens always kept besides the heavy hitters (must be >= window)."""
    selection: str = "per_head"
    """per_head (R-KV reference: one kept set per layer and KV head) | shared (one set per sequence, chosen
    from layer 0 and used by every layer and head, as the authors' SGLang fork)."""
