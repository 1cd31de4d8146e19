"""Checkpoint and resume of the learner: weights, optimizer, weight version, consumed group ids, counters
and RNG state, through DeepSpeed's own checkpoint files (one tag per weight version, `latest` pointer
written last, so a crash mid-save leaves the previous checkpoint in force)."""
from __future__ import annotations

import os
import random

import numpy as np
import torch

from learner.learner import Learner


def save_checkpoint(learner: Learner, ckpt_dir: str | os.PathLike, consumed_group_ids: list[str],
                    counters: dict[str, float]) -> str:
    """Save everything needed to continue training under tag `version_{learner.version}`.

    Args:
        consumed_group_ids: ids of the groups trained on so far (the caller's; used to skip re-delivered
            messages after a resume).
        counters: the caller's running counters, e.g. staleness drops, consumed groups.
    Returns: the checkpoint directory of this tag.
    """
    tag = f"version_{learner.version}"
    client_state = {
        "weight_version": learner.version,
        "consumed_group_ids": list(consumed_group_ids),
        "counters": dict(counters),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
    }
    learner.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state)
    return os.path.join(str(ckpt_dir), tag)


def load_checkpoint(learner: Learner, ckpt_dir: str | os.PathLike) -> tuple[list[str], dict[str, float]]:
    """Restore the latest checkpoint of `ckpt_dir` into `learner` (weights, optimizer, version, RNG);
    the next `step` continues from the saved version.

    Returns: (consumed_group_ids, counters) as saved.
    Raises: FileNotFoundError when `ckpt_dir` holds no checkpoint.
    """
    path, client_state = learner.engine.load_checkpoint(str(ckpt_dir))
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint (no 'latest' tag) in {ckpt_dir}")
    learner.version = int(client_state["weight_version"])
    rng = client_state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return client_state["consumed_group_ids"], client_state["counters"]
