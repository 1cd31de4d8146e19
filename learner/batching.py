"""How a step's rows are cut: over the learner ranks by tokens (`token_balanced_split`), then into micro-batches
of the same count on every rank (`micro_batches`)."""
from __future__ import annotations

import torch


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
