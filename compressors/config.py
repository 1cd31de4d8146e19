"""Typed config of the KV compressors (docs/SPEC.md §5)."""
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

    def validate(self) -> None:
        """Raise ValueError naming the field (`compressor.<field>`) for an impossible setting.

        Checked: method and selection names; 1 <= window < kv_budget; interval >= 1; 0 <= rkv_lambda <= 1;
        pool_kernel odd and >= 1 (same padding); 0 <= similarity_threshold <= 1; for h2o
        window <= h2o_recent < kv_budget; for streamingllm sinks >= 0 and sinks + window <= kv_budget.
        """
        if self.method not in METHODS:
            raise ValueError(f"compressor.method={self.method!r} is unknown; expected one of {METHODS}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"compressor.selection={self.selection!r} is unknown; expected one of {SELECTIONS}")
        if self.window < 1:
            raise ValueError(f"compressor.window={self.window} must be >= 1")
        if self.kv_budget <= self.window:
            raise ValueError(f"compressor.kv_budget={self.kv_budget} must be > compressor.window={self.window}")
        if self.interval < 1:
            raise ValueError(f"compressor.interval={self.interval} must be >= 1")
        if not 0.0 <= self.rkv_lambda <= 1.0:
            raise ValueError(f"compressor.rkv_lambda={self.rkv_lambda} must be in [0, 1]")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"compressor.pool_kernel={self.pool_kernel} must be odd and >= 1 (same padding)")
        if not 0.0 <= self.similarity_threshold <= 1.0:
            raise ValueError(f"compressor.similarity_threshold={self.similarity_threshold} must be in [0, 1]")
        if self.method == "h2o":
            if self.h2o_recent < self.window:
                raise ValueError(
                    f"compressor.h2o_recent={self.h2o_recent} must be >= compressor.window={self.window}")
            if self.h2o_recent >= self.kv_budget:
                raise ValueError(
                    f"compressor.h2o_recent={self.h2o_recent} must be < compressor.kv_budget={self.kv_budget}")
        if self.method == "streamingllm":
            if self.sinks < 0:
                raise ValueError(f"compressor.sinks={self.sinks} must be >= 0")
            if self.sinks + self.window > self.kv_budget:
                raise ValueError(
                    f"compressor.sinks={self.sinks} leaves fewer than compressor.window={self.window} recent "
                    f"slots in compressor.kv_budget={self.kv_budget} (need sinks + window <= kv_budget)")
