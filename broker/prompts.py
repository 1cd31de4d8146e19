"""The run's prompt stream and its position (the data position a checkpoint carries).

Actors take prompt indices from Redis: first the indices of `prompt_redo` (prompts handed out before a
resume whose groups were never trained, or taken under an admission claim that expired or was released
unpublished, e.g. of a killed actor), then fresh ones from the `prompt_cursor` counter. Index i is prompt
i mod len(prompts) of the run's prompt list (its order is fixed by the data config and the seed), so no
prompt is taken twice, whatever the number of actors.

`DataPosition` is the learner's record of which indices were trained: every index below `next_index`, plus
`trained_ahead` (indices trained out of order, above it: groups of other actors still in flight). It is bounded
by the groups in flight, and restoring it (`restore_prompt_position`) makes a resumed run train the prompts
that the interrupted run had not trained, in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import redis

from broker.streams import key

PROMPT_CURSOR = "prompt_cursor"
"""Key name: the counter handing out fresh prompt indices to all actors of a run."""
PROMPT_REDO = "prompt_redo"
"""Key name: a list of prompt indices handed out first (set when a run resumes from a checkpoint)."""


CLAIM_PROMPTS = "admission:claim_prompts"
"""Key name: hash admission claim id -> the prompt indices taken for it (comma-separated), until it is published;
a claim that expires or is released unpublished puts them back on `prompt_redo` (broker/admission.py)."""

# KEYS: prompt_redo, prompt_cursor, admission:claims, admission:claim_prompts; ARGV: n, claim id or ""
# -> the indices (redo first, then fresh), recorded with the claim; a claim gone already gets them but puts
# them back at once (its batch cannot be published)
_TAKE = """
local n = tonumber(ARGV[1])
local out = redis.call('LPOP', KEYS[1], n) or {}
if #out < n then
  local fresh = n - #out
  local stop = redis.call('INCRBY', KEYS[2], fresh)
  for i = stop - fresh, stop - 1 do out[#out + 1] = tostring(i) end
end
if ARGV[2] ~= '' then
  if redis.call('HEXISTS', KEYS[3], ARGV[2]) == 1 then
    redis.call('HSET', KEYS[4], ARGV[2], table.concat(out, ','))
  else
    for _, i in ipairs(out) do redis.call('RPUSH', KEYS[1], i) end
  end
end
return out
"""


def take_prompt_indices(client: redis.Redis, run_id: str, n: int, claim_id: str = "") -> list[int]:
    """The next `n` prompt indices for one actor batch, in one script: redo indices first, then fresh ones from
    the cursor; each index is given to one caller only. With `claim_id` (an admission claim) they are recorded
    with the claim (CLAIM_PROMPTS), so that they are handed out again if the claim ends unpublished."""
    keys = [key(run_id, k) for k in (PROMPT_REDO, PROMPT_CURSOR, "admission:claims", CLAIM_PROMPTS)]
    return [int(i) for i in client.register_script(_TAKE)(keys=keys, args=[int(n), claim_id])]


@dataclass
class DataPosition:
    """Which prompt indices the learner has trained (see the module doc).

    next_index: every index below it was trained. trained_ahead: sorted indices above it that were trained.
    seed, data: the run's seed and `actors.data` config (a dict) that fix the order of the prompts."""
    next_index: int = 0
    trained_ahead: list[int] = field(default_factory=list)
    seed: int = 0
    data: dict = field(default_factory=dict)

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

    def to_dict(self) -> dict:
        return {"next_index": self.next_index, "trained_ahead": list(self.trained_ahead), "seed": self.seed,
                "data": dict(self.data)}

    @classmethod
    def from_dict(cls, d: dict) -> "DataPosition":
        return cls(int(d.get("next_index", 0)), [int(i) for i in d.get("trained_ahead", [])], int(d.get("seed", 0)),
                   dict(d.get("data") or {}))


def restore_prompt_position(client: redis.Redis, run_id: str, position: DataPosition) -> None:
    """Set the run's prompt stream to continue at `position` (before any actor starts): the untrained indices
    below the highest trained one are handed out first, then fresh indices after it."""
    redo, cursor = position.untrained()
    pipe = client.pipeline(transaction=True)
    pipe.delete(key(run_id, PROMPT_REDO))
    if redo:
        pipe.rpush(key(run_id, PROMPT_REDO), *redo)
    pipe.set(key(run_id, PROMPT_CURSOR), cursor)
    pipe.execute()
