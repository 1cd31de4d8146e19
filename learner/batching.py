"""The learner's batches: a step's trajectory groups collated into one typed batch (`collate` -> `LearnerBatch`,
CPU tensors), the tensors the loss reads over the whole step (`LossInputs`, on the learner's device), and how the
step's rows are cut: over the learner ranks by tokens (`token_balanced_split`), then into micro-batches of the
same count on every rank (`micro_batches`).

Shapes: S samples over all groups, L the longest prompt + response, T the longest response, K the samples' top-k
width, V the vocabulary."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import numpy as np
import torch
from torch import Tensor

from broker.schema import TrajectoryGroup
from learner.replay import collate_record


@dataclass
class LearnerBatch:
    """The step's samples, right-padded (`collate`); CPU tensors, 0 (top-k log-probs: -inf) on padding."""
    input_ids: Annotated[Tensor, "int64 [S, L]"]          # prompt + response
    attention_mask: Annotated[Tensor, "int64 [S, L]"]
    response_ids: Annotated[Tensor, "int64 [S, T]"]
    response_index: Annotated[Tensor, "int64 [S, T]"]     # the logit position predicting each token: P - 1 + t
    response_mask: Annotated[Tensor, "bool [S, T]"]       # the response tokens trained (the sample's `trainable`)
    logp_sparse: Annotated[Tensor, "float32 [S, T]"]      # the sampler's log-probs
    reward: Annotated[Tensor, "float32 [S]"]
    group_index: Annotated[Tensor, "int64 [S]"]           # the group of each sample
    temperature: Annotated[Tensor, "float32 [S]"]         # its group's sampler temperature
    seq_len: Annotated[Tensor, "int64 [S]"]               # P + R
    fresh: Annotated[Tensor, "bool [S]"]                  # staleness 0 (all True without the step's staleness)
    topk_ids: Annotated[Tensor | None, "int64 [S, T, K]"] = None          # every sample's top-k (SPEC §4, Sparrow)
    topk_logprobs: Annotated[Tensor | None, "float32 [S, T, K]"] = None
    replay_evicted_at: Annotated[Tensor | None, "int32 [S, layers, heads, L]"] = None   # learner/replay.py
    rounding_hints: list[np.ndarray | None] | None = None   # replaying: each sample's (learner/replay.py collate_hints)
    kv_quant: str = "model"        # the groups' KV quantizer (TrajectoryGroup.kv_quant), which replay applies

    @property
    def size(self) -> int:
        """S, the number of samples."""
        return self.input_ids.shape[0]


@dataclass
class LossInputs:
    """What a step's loss reads, over the whole step on the learner's device, the same on every rank whatever the
    number of ranks (Learner._prepare; the fused step's training forwards fill logp_old .. loss_mask). A
    micro-batch reads its rows."""
    batch: LearnerBatch
    mask: Annotated[Tensor, "bool [S, T]"]                # batch.response_mask
    advantages: Annotated[Tensor, "float32 [S]"]          # GRPO's, over the whole step
    fresh: Annotated[Tensor, "bool [S]"]                  # batch.fresh
    logp_old: Annotated[Tensor | None, "float32 [S, T]"] = None
    entropy: Annotated[Tensor | None, "float32 [S, T]"] = None          # of pi_old (no grad)
    logp_ref: Annotated[Tensor | None, "float32 [S, T]"] = None         # kl_coef > 0
    logp_dense: Annotated[Tensor | None, "float32 [S, T]"] = None       # replaying: the dense forward's
    accept_exact: Annotated[Tensor | None, "float32 [S, T]"] = None     # replaying: sum_v min(p, q)
    logp_unquantized: Annotated[Tensor | None, "float32 [S, T]"] = None  # replay_quant_gap: replay without qdq
    weights: Annotated[Tensor | None, "float32 [S, T]"] = None          # the correction's importance weights
    loss_mask: Annotated[Tensor | None, "float32 [S, T]"] = None        # after veto and token mask
    metrics: dict[str, float] = field(default_factory=dict)            # the correction's (SPEC §4)


def collate(groups: list[TrajectoryGroup], replay: bool, staleness: list[int] | None = None) -> LearnerBatch:
    """Right-pad the groups' samples into a LearnerBatch; with `replay` (policy_target sparse) and records on the
    samples, their eviction records and rounding hints too; `staleness` (one per group) gives `fresh`.

    Raises:
        ValueError: naming the group and sample whose logp_sparse length differs from its response, whose
            prompt is empty, a group without samples / with temperature <= 0, or groups of different kv_quant.
    """
    rows = []
    quants = {group.kv_quant for group in groups}
    if len(quants) > 1:
        raise ValueError(f"the groups were sampled with different KV quantizers {sorted(quants)}: one step replays one")
    for g, group in enumerate(groups):
        if not group.samples:
            raise ValueError(f"group {group.group_id!r} has no samples")
        if not group.temperature > 0:
            raise ValueError(f"group {group.group_id!r}: temperature {group.temperature} must be > 0")
        for i, s in enumerate(group.samples):
            if len(s.logp_sparse) != len(s.response_ids):
                raise ValueError(f"group {group.group_id!r} sample {i}: logp_sparse has {len(s.logp_sparse)} "
                                 f"values for {len(s.response_ids)} response tokens")
            if len(s.prompt_ids) == 0:
                raise ValueError(f"group {group.group_id!r} sample {i}: empty prompt_ids")
            rows.append((g, group.temperature, s))
    S = len(rows)
    L = max(len(s.prompt_ids) + len(s.response_ids) for _, _, s in rows)
    T = max(1, max(len(s.response_ids) for _, _, s in rows))
    group_index = torch.tensor([g for g, _, _ in rows], dtype=torch.long)
    b = LearnerBatch(
        input_ids=torch.zeros(S, L, dtype=torch.long), attention_mask=torch.zeros(S, L, dtype=torch.long),
        response_ids=torch.zeros(S, T, dtype=torch.long), response_index=torch.zeros(S, T, dtype=torch.long),
        response_mask=torch.zeros(S, T, dtype=torch.bool), logp_sparse=torch.zeros(S, T, dtype=torch.float32),
        reward=torch.tensor([s.reward for _, _, s in rows], dtype=torch.float32), group_index=group_index,
        temperature=torch.tensor([t for _, t, _ in rows], dtype=torch.float32),
        seq_len=torch.zeros(S, dtype=torch.long),
        fresh=(torch.ones(S, dtype=torch.bool) if staleness is None
               else torch.tensor([staleness[g] == 0 for g in group_index.tolist()])),
        kv_quant=groups[0].kv_quant if groups else "model")
    widths = {None if s.topk_ids is None else s.topk_ids.shape[1] for _, _, s in rows}
    K = widths.pop() if len(widths) == 1 else None
    if K:
        b.topk_ids = torch.zeros(S, T, K, dtype=torch.long)
        b.topk_logprobs = torch.full((S, T, K), float("-inf"))
    for i, (_, _, s) in enumerate(rows):
        P, R = len(s.prompt_ids), len(s.response_ids)
        if K:
            b.topk_ids[i, :R] = torch.from_numpy(np.asarray(s.topk_ids, dtype=np.int64))
            b.topk_logprobs[i, :R] = torch.from_numpy(np.asarray(s.topk_logprobs, dtype=np.float32))
        b.input_ids[i, :P + R] = torch.from_numpy(np.concatenate([s.prompt_ids, s.response_ids]).astype(np.int64))
        b.attention_mask[i, :P + R] = 1
        b.response_ids[i, :R] = torch.from_numpy(np.asarray(s.response_ids, dtype=np.int64))
        b.response_index[i, :R] = torch.arange(P - 1, P - 1 + R)
        b.response_mask[i, :R] = True if s.trainable is None else torch.from_numpy(np.asarray(s.trainable) != 0)
        b.logp_sparse[i, :R] = torch.from_numpy(np.array(s.logp_sparse, dtype=np.float32))
        b.seq_len[i] = P + R
    records = [s.eviction_steps for _, _, s in rows]
    if replay and any(r is not None for r in records):
        present = [r for r in records if r is not None]
        b.replay_evicted_at = collate_record(records, [len(s.prompt_ids) for _, _, s in rows], L,
                                             present[0].shape[0], max(r.shape[1] for r in present))
        if any(s.rounding_hints is not None for _, _, s in rows):
            b.rounding_hints = [s.rounding_hints for _, _, s in rows]
    return b


def teacher_forced(token_ids: list[list[int]]) -> LearnerBatch:
    """Whole sequences as a LearnerBatch whose "response" is every token after the first (S sequences, L the
    longest, T = L - 1; reward 0, temperature 1, one group each): what the recompute's forward scores for the
    weight-sync fingerprint's probe (Learner.score). Raises ValueError for no sequences or one shorter than 2."""
    if not token_ids or any(len(ids) < 2 for ids in token_ids):
        raise ValueError("teacher_forced needs at least one sequence, each of >= 2 tokens")
    S, L = len(token_ids), max(len(ids) for ids in token_ids)
    b = LearnerBatch(
        input_ids=torch.zeros(S, L, dtype=torch.long), attention_mask=torch.zeros(S, L, dtype=torch.long),
        response_ids=torch.zeros(S, L - 1, dtype=torch.long),
        response_index=torch.arange(L - 1).repeat(S, 1), response_mask=torch.zeros(S, L - 1, dtype=torch.bool),
        logp_sparse=torch.zeros(S, L - 1), reward=torch.zeros(S), group_index=torch.arange(S),
        temperature=torch.ones(S), seq_len=torch.tensor([len(ids) for ids in token_ids]),
        fresh=torch.ones(S, dtype=torch.bool))
    for i, ids in enumerate(token_ids):
        b.input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        b.attention_mask[i, :len(ids)] = 1
        b.response_ids[i, :len(ids) - 1] = torch.tensor(ids[1:], dtype=torch.long)
        b.response_mask[i, :len(ids) - 1] = True
    return b


def token_balanced_split(rows: torch.Tensor, tokens: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Split `rows` (int64 [n], indices of sequences) over `world_size` ranks so that the ranks' token counts
    are balanced: longest first, each to the rank with the fewest tokens so far (ties: the lower rank).
    Deterministic, so every rank computes the same split. Each share keeps the order of `rows`; one rank gets
    `rows` itself. `tokens`: int64 [num_seqs] tokens of every sequence (indexed by row).

    Returns: world_size int64 tensors (possibly empty) that partition `rows`."""
    if world_size == 1:
        return [rows]
    load, owner = [0] * world_size, {}
    order = sorted(range(len(rows)), key=lambda i: (-int(tokens[rows[i]]), i))
    for i in order:
        r = min(range(world_size), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += int(tokens[rows[i]])
    return [rows[[i for i in range(len(rows)) if owner[i] == r]] for r in range(world_size)]


def micro_batches(shares: list[torch.Tensor], size: int, rank: int) -> list[torch.Tensor | None]:
    """This rank's share cut into micro-batches of `size`, padded with None to the largest count over the
    ranks: ZeRO-2/3 reduce gradients (and ZeRO-3 gathers parameters) in every backward/forward, so every
    rank runs the same number of them; a None slot is a forward/backward that contributes nothing."""
    count = max(-(-len(s) // size) for s in shares)
    mine = list(shares[rank].split(size)) if len(shares[rank]) else []
    return mine + [None] * (count - len(mine))
