"""Checkpoint and resume of the learner: weights, optimizer, weight version, consumed group ids, counters
and RNG state, through DeepSpeed's own checkpoint files (one tag per weight version, `latest` pointer
written last, so a crash mid-save leaves the previous checkpoint in force). With learner.lora only the adapter
is saved (DeepSpeed's `exclude_frozen_parameters`), with the base's identity and hash, which a resume checks."""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # the driver reads checkpoints (read_client_state) without importing the learner's stack
    from learner.learner import Learner


def save_checkpoint(learner: Learner, ckpt_dir: str | os.PathLike, consumed_group_ids: list[str],
                    counters: dict[str, float], data_position: dict | None = None, extra: dict | None = None) -> str:
    """Save everything needed to continue training under tag `version_{learner.version}`. With several
    learner ranks every rank calls it (DeepSpeed writes each rank's ZeRO shards; rank 0 the client state).

    Args:
        consumed_group_ids: ids of trained groups that can still be re-delivered (the caller's; skipped as
            duplicates after a resume). Keep it bounded: groups already acknowledged cannot come back.
        counters: the caller's running counters, e.g. staleness drops, consumed groups.
        data_position: the caller's record of which prompts were trained (a JSON-able dict,
            broker.prompts.DataPosition.to_dict()); restored as `learner.checkpoint_state["data_position"]`.
        extra: anything else the caller needs back (picklable), as `learner.checkpoint_state["extra"]`.
    Returns: the checkpoint directory of this tag.
    """
    tag = f"version_{learner.version}"
    client_state = {
        "weight_version": learner.version,
        "consumed_group_ids": list(consumed_group_ids),
        "counters": dict(counters),
        "data_position": data_position,
        "extra": extra,
        "lora": learner.lora_identity(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
    }
    learner.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state,
                                   exclude_frozen_parameters=learner.peft is not None)  # LoRA: the adapter only
    return os.path.join(str(ckpt_dir), tag)


def load_checkpoint(learner: Learner, ckpt_dir: str | os.PathLike) -> tuple[list[str], dict[str, float]]:
    """Restore the latest checkpoint of `ckpt_dir` into `learner` (weights, optimizer, version, RNG);
    the next `step` continues from the saved version. With several ranks every rank calls it. The whole
    client state (also `data_position`, None in checkpoints without one) is kept in `learner.checkpoint_state`.

    Returns: (consumed_group_ids, counters) as saved.
    Raises: FileNotFoundError when `ckpt_dir` holds no checkpoint; ValueError (one line, nothing loaded) when the
    checkpoint's LoRA (its settings, its base's identity and hash) differs from the learner's (check_lora): a LoRA
    checkpoint into a full fine-tuning learner, the reverse, other settings or another base.
    """
    check_lora(read_client_state(ckpt_dir).get("lora"), learner.lora_identity(), ckpt_dir)
    path, client_state = learner.engine.load_checkpoint(str(ckpt_dir), load_module_strict=learner.peft is None)
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint (no 'latest' tag) in {ckpt_dir}")
    learner.version = int(client_state["weight_version"])
    learner.checkpoint_state = client_state
    rng = client_state["rng"]
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return client_state["consumed_group_ids"], client_state["counters"]


def read_client_state(ckpt_dir: str | os.PathLike) -> dict:
    """The client state (what save_checkpoint passed: weight_version, consumed_group_ids, counters,
    data_position, extra, lora: None for full fine-tuning or a checkpoint from before LoRA; not rng) of the latest
    checkpoint in `ckpt_dir`, read from rank 0's model-states file without building an engine (memory-mapped: the
    weights beside it are not read). For checks before a resume starts anything (deploy/record.py). Raises
    FileNotFoundError when there is no checkpoint."""
    tag_dir = Path(ckpt_dir) / (Path(ckpt_dir) / "latest").read_text().strip()
    found = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))  # ZeRO-3: zero_pp_rank_0_mp_rank_00_...
    if not found:
        raise FileNotFoundError(f"no model-states file of rank 0 in {tag_dir}")
    state = torch.load(found[0], map_location="cpu", weights_only=False, mmap=True)
    return {k: state.get(k) for k in ("weight_version", "consumed_group_ids", "counters", "data_position", "extra",
                                      "lora")}


def check_lora(saved: dict | None, current: dict | None, ckpt_dir: str | os.PathLike) -> None:
    """Raise ValueError in one line unless the checkpoint's LoRA identity `saved` (its client state's "lora": None
    for full fine-tuning) is the learner's `current` (Learner.lora_identity): the same mode, settings (rank, alpha,
    target modules) and base hash (the base's path may differ)."""
    def said(identity: dict | None) -> str:
        if identity is None:
            return "full fine-tuning (learner.lora.rank=0)"
        return (f"learner.lora.rank={identity['rank']}, learner.lora.alpha={identity['alpha']:g}, "
                f"learner.lora.target_modules={identity['target_modules']} on base {identity['base_model']} "
                f"(weights hash {identity['base_hash']})")

    def key(identity: dict | None) -> dict | None:   # the base's path may differ (another machine): its hash not
        return None if identity is None else {k: v for k, v in identity.items() if k != "base_model"}

    if key(saved) == key(current):
        return
    if saved is not None and current is not None and saved["base_hash"] != current["base_hash"]:
        why = "another base model (model): an adapter applies to the weights it was trained on"
    else:
        why = "learner.lora differs"
    raise ValueError(f"checkpoint {ckpt_dir} was trained with {said(saved)}; this learner has {said(current)}: {why}; "
                     "resume with the checkpoint's model and learner.lora, or start a new run")
