"""The run's prompt stream and its position (the data position a checkpoint carries).

Actors take prompt indices from Redis (broker/run_state.py: take_prompt_indices): first the indices of
`prompt_redo` (prompts handed out before a resume whose groups were never trained, or taken under an admission
claim that expired or was released unpublished, e.g. of a killed actor), then fresh ones from the
`prompt_cursor` counter. Index i is prompt i mod len(prompts) of the run's prompt list (its order is fixed by
the data config and the seed), so no prompt is taken twice, whatever the number of actors.

`DataPosition` is the learner's record of which indices were trained: every index below `next_index`, plus
`trained_ahead` (indices trained out of order, above it: groups of other actors still in flight). It is bounded
by the groups in flight, and restoring it (run_state.restore_prompt_stream with `untrained()`) makes a resumed
run train the prompts that the interrupted run had not trained, in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

NOT_ORDER = ("timeout_s",)
"""actors.data fields that do not change which prompt comes when (the task generator's timeout): left out of the
data position, so changing them neither blocks a resume nor changes a recorded position."""


@dataclass
class DataPosition:
    """Which prompt indices the learner has trained (see the module doc).

    next_index: every index below it was trained. trained_ahead: sorted indices above it that were trained.
    seed, data: the run's seed and `actors.data` config (a dict) that fix the order of the prompts."""
    next_index: int = 0
    trained_ahead: list[int] = field(default_factory=list)
    seed: int = 0
    data: dict = field(default_factory=dict)

    def __post_init__(self):
        self.data = {k: v for k, v in self.data.items() if k not in NOT_ORDER}

    def add(self, indices: list[int]) -> None:
        """Record trained indices (negative ones, from groups without an index, are ignored)."""
        ahead = set(self.trained_ahead) | {i for i in indices if i >= self.next_index}
        while self.next_index in ahead:
            ahead.remove(self.next_index)
            self.next_index += 1
        self.trained_ahead = sorted(ahead)

    def untrained(self) -> tuple[list[int], int]:
        """(indices below the highest trained one that were not trained, the first index after it): where a
        resumed run continues."""
        end = self.trained_ahead[-1] + 1 if self.trained_ahead else self.next_index
        ahead = set(self.trained_ahead)
        return [i for i in range(self.next_index, end) if i not in ahead], end

    def differences(self, seed: int, data: dict) -> list[str]:
        """What differs between the prompt order this position was saved with and `seed` / `data` (actors.data
        as a dict), one "field=value (checkpoint: value)" per difference; [] when a resume keeps the order."""
        changed = [f"seed={seed} (checkpoint: {self.seed})"] if seed != self.seed else []
        data = {k: v for k, v in data.items() if k not in NOT_ORDER}
        return changed + [f"actors.data.{k}={data.get(k)!r} (checkpoint: {self.data.get(k)!r})"
                          for k in sorted(set(data) | set(self.data)) if data.get(k) != self.data.get(k)]

    def to_dict(self) -> dict:
        return {"next_index": self.next_index, "trained_ahead": list(self.trained_ahead), "seed": self.seed,
                "data": dict(self.data)}

    @classmethod
    def from_dict(cls, d: dict) -> "DataPosition":
        return cls(int(d.get("next_index", 0)), [int(i) for i in d.get("trained_ahead", [])], int(d.get("seed", 0)),
                   dict(d.get("data") or {}))
