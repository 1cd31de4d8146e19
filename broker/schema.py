"""The trajectory-group wire format (shared/ARCHITECTURE.md, "Contracts").

One message per prompt group: G samples of one prompt, all sampled with one weight version.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SCHEMA_VERSION = 1


@dataclass
class SampleRecord:
    """One response of a group. Arrays are 1-D: `prompt_ids` int32 [P], `response_ids` int32 [T],
    `logp_sparse` float32 [T] (log pi_sparse of each response token, <= 0)."""
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logp_sparse: np.ndarray
    finish_reason: str
    reward: float
    kv_retained_tokens: int = 0
    kv_peak_bytes: int = 0


@dataclass
class TrajectoryGroup:
    """The G samples of one prompt (a GRPO group) with the sampler settings they were drawn with."""
    run_id: str
    group_id: str
    prompt_id: str
    weight_version: int
    temperature: float
    compressor: str
    kv_budget: int
    samples: list[SampleRecord] = field(default_factory=list)
    actor_id: str = ""
    created_at: float = 0.0
    """Unix time (seconds) when the actor published the group."""
