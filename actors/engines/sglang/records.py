"""Eviction records of the `sparse_rl_kv` backend (actors/engines/sglang/triton_backend.py): per request, layer and KV
head, the number of generated tokens at which each key was evicted -- the torch engine's record
(`actors.engines.torch_engine.sample_eviction_steps`, `Sample.eviction_steps`), which the learner replays
(learner/replay.py, `learner.policy_target=sparse`).

The backend packs each request's kept keys into the suffix [start, seq_len) of its row and tracks only start and
length on the host, so a key's row position no longer says which token it is. `EvictionRecorder` keeps, on the
device, per live request (a *record slot*):
- `origin` int32 [slots, layers, Hkv, largest budget]: after a compression of a row with budget B, the original
  token index of each packed position start + j, j < B (positions from start + B on hold the tokens appended since,
  at their own index; a row never compressed, start 0, holds every token at its own index). The suffix holds at most
  budget + interval tokens after a compression (docs/sglang.md, Schedule), of which only the B packed ones need the
  map, so `origin` is sized by the largest budget, not by budget + interval. Under budget_schedule length a row's
  budget grows between its compressions (compressors/budget.py `length_budgets`), so the number of mapped positions
  is the B of the row's *last* compression, which the backend keeps on the host and passes to `host_index`;
- `steps` int16 [slots, layers, Hkv, width + 1]: original token index -> generated tokens when evicted, as uint16
  bits (-1 = 65535 = never); column `width` is a dump column that the writes of kept keys and padding go to.
Slots are the live requests (a host map from SGLang's request row, taken at the row's prefill and given back when it
leaves), so the buffers grow with the most requests live at once (one generate call's), not with SGLang's request
pool; `width` grows in steps of RECORD_WIDTH_STEP tokens with the longest request compressed, `origin` with the
largest budget that entered or was compressed to (`fit`). Growing is eager (between steps) and reads nothing
back. When the last live request leaves (the end of a generate call) both buffers are dropped (slots and width back
to 0; `origin` keeps its budget dimension), so their size is bounded per call, not by the longest request ever
(an eval's longer responses are not held into training's calls); within a call they never shrink.

The same `origin` map gives the backend each live key's true position, which a compressor that reads positions
(method random, protect_prompt) needs at every compression; the backend keeps it then even when it records nothing
(`EvictionRecorder(directory=None)`: `origin` only, no `steps` columns, nothing written; its bytes:
`record_bytes_per_request` with tokens 0).

`record` (inside the backend's compression, `_compress_group`) is device ops only: no host sync (checked under the
backend's NoHostSync in the lane's self-check). `take` copies a leaving request's record to the host once and writes
it to `contract.record_path(directory, rid)` for `SGLangEngine.generate`.

Steps (the torch engine's, `BatchCache.compact`: evicted at column col + 1): a compression in the forward of decode
step s (s = 1 for the forward of the first sampled token) records s; a prompt compressed after its prefill records
0. The backend runs the compression due after step s's attention just before step s + 1's forward, while the row's
host step count is still s (`steps[row]`), and passes that count. A row that ends with the forward of step s never
runs the compression due in it (its row leaves first); the torch engine runs it and records s = T - 1 for a
T-token response. Such a key is seen by every query the sample's log-probs come from (the last one is at P + T - 2,
learner/replay.py: query q sees key k while q < P + steps), so both records replay the same.

Episodes (`SGLangEngine.generate(..., episodes=)`, docs/sglang.md "The compressed cache across turns"): an episode's
request row outlives its turns (SGLang's streaming session keeps it), so its record slot does too: the step recorded
is the episode's tokens after its first prompt when the key was evicted (the backend passes seq_len - first prompt;
on a first turn that is s), `snapshot` writes the record so far as each finished turn's request's, `resume` carries
the slot to the next turn's request id, and `drop` gives it back without a file when the episode's session closes.

Bytes: `actors.engines.kv_memory.record_bytes_per_request` (docs/sglang.md, Eviction records).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from actors.engines.kv_memory import RECORD_WIDTH_STEP
from actors.engines.sglang.contract import record_path

NEVER16 = -1
"""`steps` value of a key never evicted: uint16 65535 stored as int16."""


def int16_bits(steps: np.ndarray) -> np.ndarray:
    """Step counts int [n] in [0, 65535) as the int16 values holding their uint16 bits, int64 [n]. Raises ValueError
    for a count outside [0, 65535) (a record needs max_new_tokens < 65535)."""
    steps = np.asarray(steps, dtype=np.int64)
    if steps.size and (steps.min() < 0 or steps.max() >= 65535):
        raise ValueError(f"eviction record: step {int(steps.max())} outside [0, 65535)")
    return steps.astype(np.uint16).view(np.int16).astype(np.int64)


def save_npy(path: str, array: np.ndarray) -> None:
    """`array` as a numpy .npy at `path`, written to a temporary name, then renamed (a reader never sees a partial
    file): the backend's per-request handover to `SGLangEngine.generate` (records, protected shares)."""
    with open(path + ".tmp", "wb") as f:
        np.save(f, array)
    os.replace(path + ".tmp", path)


def grown(t: torch.Tensor, shape: tuple[int, ...], fill: int, keep: tuple[int, ...] | None = None) -> torch.Tensor:
    """A new tensor of `shape` (same dtype and device) filled with `fill`, holding t[:keep] at [:keep] (each dim;
    keep: t's shape when None)."""
    keep = tuple(t.shape) if keep is None else keep
    out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    index = tuple(slice(0, k) for k in keep)
    out[index] = t[index]
    return out


class EvictionRecorder:
    """The eviction records of the live requests of one `sparse_rl_kv` backend (module docstring).

    layers / kv_heads: the KV pool's; budget: the run's budget (tokens; `origin` grows for a larger one);
    device: the pool's; directory: where `take` writes the records (contract.RECORDS_ENV), or None: no record, only
    `origin`, the true position of every live key (`origins`), which a compressor that reads positions needs
    (method random, protect_prompt; `Compressor.needs`): `steps` stays one dump column and nothing is written.
    """

    def __init__(self, layers: int, kv_heads: int, budget: int, device, directory: str | None):
        self.layers, self.kv_heads, self.device, self.directory = layers, kv_heads, device, directory
        self.records = directory is not None
        """True when the records themselves are kept and written (else the positions only)."""
        self._release(int(budget))
        self.slot: dict[int, int] = {}
        """SGLang request row -> record slot, for the live requests."""
        self.rid: dict[int, str] = {}
        self.heads = torch.arange(kv_heads, device=device)[None, :, None]
        self.packed = torch.arange(int(budget), device=device)

    def _release(self, budget: int) -> None:
        """No slot, no column: `steps` int16 [0, layers, Hkv, 1] (the dump column), `origin` int32 [0, layers, Hkv,
        budget]; what they held goes back to the allocator (on a GPU, to torch's cache in SGLang's scheduler)."""
        self.width = 0
        """Record columns (original token indices) held; column `width` is the dump column."""
        self.steps = torch.full((0, self.layers, self.kv_heads, 1), NEVER16, dtype=torch.int16, device=self.device)
        self.origin = torch.zeros(0, self.layers, self.kv_heads, budget, dtype=torch.int32, device=self.device)
        self.free: list[int] = []

    @property
    def bytes(self) -> int:
        """Device bytes the recorder holds now (`steps` + `origin`)."""
        return self.steps.nbytes + self.origin.nbytes

    def enter(self, rows: list[int], rids: list, budgets: list[int]) -> None:
        """Requests entering at their prefill: request rows (host ints), SGLang request ids, budgets (tokens). Takes
        a slot per row (growing the buffers for more live requests or a larger budget) and resets its record to
        never. Eager; device ops only."""
        for row in rows:                              # a row SGLang handed out again without freeing it
            if row in self.slot:
                self.free.append(self.slot.pop(row))
        short, old = len(rows) - len(self.free), self.steps.shape[0]
        budget = max(self.origin.shape[3], max(budgets, default=0))
        if short > 0 or budget > self.origin.shape[3]:
            slots = old + max(short, 0)
            self.steps = grown(self.steps, (slots, *self.steps.shape[1:]), NEVER16)
            self.origin = grown(self.origin, (slots, self.layers, self.kv_heads, budget), 0)
            self.free += list(range(old, slots))
            self.packed = torch.arange(budget, device=self.device)
        taken = [self.free.pop() for _ in rows]
        for row, rid, s in zip(rows, rids, taken):
            self.slot[row], self.rid[row] = s, rid
        if taken:
            self.steps[torch.tensor(taken, device=self.device)] = NEVER16

    def slots_of(self, rows: np.ndarray) -> np.ndarray:
        """The record slots of request rows (host int64 [g])."""
        return np.asarray([self.slot[int(r)] for r in rows], dtype=np.int64)

    def fit(self, length: int, budget: int = 0) -> None:
        """Grow the record to hold original token indices < `length` and `origin` to map `budget` packed positions
        (host ints or numpy integers; a budget at most the current one changes nothing: budget_schedule length grows
        a row's budget past the one it entered with). Eager, before a compression; reads nothing back."""
        length, budget = int(length), int(budget)
        if budget > self.origin.shape[3]:
            self.origin = grown(self.origin, (*self.origin.shape[:3], budget), 0)
            self.packed = torch.arange(budget, device=self.device)
        if length <= self.width or not self.records:
            return
        width = -(-length // RECORD_WIDTH_STEP) * RECORD_WIDTH_STEP
        keep = (self.steps.shape[0], self.layers, self.kv_heads, self.width)   # not the old dump column
        self.steps = grown(self.steps, (self.steps.shape[0], self.layers, self.kv_heads, width + 1), NEVER16, keep)
        self.width = width

    @staticmethod
    def host_index(pos: np.ndarray, start: np.ndarray, packed) -> tuple[np.ndarray, np.ndarray]:
        """For one compression group (host, the backend's mirror): left-padded live positions pos int64 [g, n], the
        rows' starts int64 [g], the positions each row's last compression packed, `packed` int64 [g] or one int for
        all (its budget B then: the budget of *that* compression, smaller than the one now due under budget_schedule
        length) -> (mapped bool [g, n]: the position is one of the B packed by the row's last compression; rel int64
        [g, n]: its index in `origin`, 0 elsewhere)."""
        rel = pos - start[:, None]
        mapped = (start[:, None] > 0) & (rel >= 0) & (rel < np.asarray(packed).reshape(-1, 1))
        return mapped, np.where(mapped, rel, 0)

    def origins(self, li: int, slots: torch.Tensor, pos: torch.Tensor, mapped: torch.Tensor,
                rel: torch.Tensor) -> torch.Tensor:
        """Original token index of each live position of layer li, int64 [g, Hkv, n]: slots int64 [g]; pos int64
        [g, n] (positions, left-padded), mapped bool [g, n], rel int64 [g, n] (`host_index`). Device ops only."""
        table = self.origin[slots[:, None, None], li, self.heads, rel[:, None, :]].long()
        return torch.where(mapped[:, None, :], table, pos[:, None, :])

    def record(self, li: int, slots: torch.Tensor, origin: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor,
               step: torch.Tensor) -> None:
        """Layer li of one compression: the kept keys' original indices into `origin` (packed order), the evicted
        ones' record set to `step`. slots int64 [g]; origin int64 [g, Hkv, n] (`origins`); valid bool [g, n] (live,
        not padding); keep int64 [g, Hkv, B] (positions kept, ascending); step int64 [g] (int16 bits, `int16_bits`).
        Device ops only (no host sync). Positions only (`records` False): `origin` alone."""
        B = keep.shape[2]
        self.origin[slots[:, None, None], li, self.heads, self.packed[:B]] = origin.gather(2, keep).to(torch.int32)
        if not self.records:
            return
        kept = torch.zeros(origin.shape, dtype=torch.bool, device=origin.device).scatter_(2, keep, True)
        column = torch.where(valid[:, None, :] & ~kept, origin, self.width)          # kept and padding: the dump
        self.steps[slots[:, None, None], li, self.heads, column] = step.to(torch.int16)[:, None, None].expand(
            column.shape)

    def resume(self, rows: list[int], rids: list) -> None:
        """Episodes continuing on their kept request rows (host ints) under new SGLang request ids: the records go on
        (a row's record covers its whole episode); rows without a slot are ignored."""
        for row, rid in zip(rows, rids):
            if row in self.slot:
                self.rid[row] = rid

    def snapshot(self, row: int, length: int, rid) -> None:
        """A parked episode's record so far, uint16 [layers, Hkv, length] (`length`: the episode's tokens whose KV
        was computed), written as request `rid`'s (`write`); the slot stays for the episode's next turn. Rows without a
        slot, and positions only (`records` False), are ignored. One device-to-host copy (between turns; not graph
        code)."""
        if row in self.slot and self.records:
            self.write(self.slot[row], rid, length)

    def drop(self, row: int) -> None:
        """A parked episode's row leaves (its session closed): its slot is given back without a record (its last
        turn's was written by `snapshot`); the last live request's leaving gives the buffers back."""
        if row not in self.slot:
            return
        self.free.append(self.slot.pop(row))
        self.rid.pop(row)
        if not self.slot:
            self._release(self.origin.shape[3])

    def write(self, s: int, rid, length: int) -> None:
        """Record slot `s` as uint16 [layers, Hkv, length] (never past the record's width: never) to
        `record_path(directory, rid)`, written to a temporary name, then renamed (a reader never sees a partial file).
        One device-to-host copy."""
        out = np.full((self.layers, self.kv_heads, length), np.uint16(65535), dtype=np.uint16)
        n = min(length, self.width)
        out[:, :, :n] = self.steps[s, :, :, :n].cpu().numpy().view(np.uint16)
        save_npy(record_path(self.directory, rid), out)

    def take(self, row: int, length: int) -> None:
        """A request's row leaves: its record, uint16 [layers, Hkv, length] (`length`: tokens whose KV was computed;
        never past the record's width), to `record_path(directory, rid)` (`write`), and its slot given back; the last
        live request's leaving gives the buffers back (`_release`: a long request's width is not kept into the next
        generate call). One device-to-host copy (the request has ended; not graph code); positions only (`records`
        False): the slot given back, nothing written. Rows without a slot are ignored."""
        if row not in self.slot:
            return
        s, rid = self.slot.pop(row), self.rid.pop(row)
        self.free.append(s)
        if self.records:
            self.write(s, rid, length)
        if not self.slot:   # no request live (a generate call ended): the buffers go, the next `enter` grows them
            self._release(self.origin.shape[3])
