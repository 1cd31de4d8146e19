"""The torch engine's batch KV cache (actors/engines/torch_engine.py): one call's layout, its slot counts, and the
per-layer buffers the engine's forward reads, extends and compacts in place.

- `Layout`: the call's left-padded columns (prompt width P, each row's pad, the columns of the eviction record) and
  the ids it prefills;
- `SlotPlan`: the slots every layer holds (after the prefill, at most: capacity) and when a decode step compresses;
- `BatchCache`: per layer K/V/validity (+ H2O attention mass, + record columns, + true positions) buffers
  `[rows, kv_heads, capacity, ...]`, the last `window` queries per layer, the eviction record (`evicted_at`), the
  original row of each live row; extended by a prefill or a decode step, compacted with `select_slots` +
  `gather_kv` (recording what it drops), shrunk when rows finish, and read back as a `KeptEpisode`;
- `KeptEpisode`: what the engine keeps of a multi-turn episode between its turns.
"""
from __future__ import annotations

import dataclasses

import torch

# COMPACT_CHUNK: slots moved per step of the in-place compaction (the only extra K/V memory an eviction needs);
# actors/engines/kv_memory.py predicts the engine's KV bytes.
from actors.engines.kv_memory import COMPACT_CHUNK
from compressors import Compressor, CompressorConfig, SelectContext, accumulate_attention, gather_kv
from compressors.budget import length_budget
from compressors.kv_quant import KVQuant, code_bits, dequantize, quantize, rounding_hints

NEVER = torch.iinfo(torch.long).max
"""evicted_at's value of a key column that is never evicted."""
KV_ENTRIES = ("k", "v", "k_scale", "v_scale")
"""The entries of a layer's buffers that are stored K/V (codes and their scales): the bytes a cache holds."""


@dataclasses.dataclass
class KeptEpisode:
    """What the engine keeps of an episode between its turns. layers: per layer {k, v [Hkv, slots, D] (stored
    codes, BatchCache); k_scale, v_scale [Hkv, slots] (a scaled kv_dtype); valid
    [Hkv, slots]; mass (H2O) [Hkv, slots]; col (record_evictions): episode token index of each slot; pos (a
    compressor that reads positions): each slot's true position}, the retained slots in time order; qwin: per
    layer the last <= window queries [Hq, w, D]; length: tokens whose K/V were computed (the next position);
    pending: the last sampled token (its K/V not yet computed); prompt_len: the first prompt's tokens; evicted_at
    (record_evictions): int64 [layers, Hkv, length + 1] episode token index of the first query that no longer saw
    each key (int64 max = never); hints (record_evictions at a rounding kv_dtype): int64 [n, 6], the episode's
    rounding hints so far, one row (layer, 0 for K / 1 for V, KV head, episode token index, element of head_dim,
    code bits) each (`BatchCache.row_hints`)."""
    layers: list
    qwin: list
    length: int
    pending: int
    prompt_len: int
    evicted_at: torch.Tensor | None = None
    hints: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        return self.layers[0]["k"].shape[1]


@dataclasses.dataclass(frozen=True)
class Layout:
    """One call's left-padded layout: row r's tokens (its kept episode's, then the ids this call prefills) end at
    column `width` - 1 (P); column = episode token index + pad[r]; response token t is at column P + t.

    ids: int64 [R, M], the ids the call prefills (a kept episode's last sampled token first, then the given
        ids), left-padded to the longest (M); key_valid: bool [R, M], not padding; positions: int64 [R, M], their
        true positions (pads: 0); pad: int64 [R]; width: P; kept: slots of the largest kept episode (every kept
        cache is left-padded to it; 0 without one); columns: P + max_new_tokens, the eviction record's columns;
        first_prompt: per row the tokens of its episode's first prompt.
    """
    ids: torch.Tensor
    key_valid: torch.Tensor
    positions: torch.Tensor
    pad: torch.Tensor
    width: int
    kept: int
    columns: int
    first_prompt: list[int]

    @classmethod
    def of(cls, rows: list[list[int]], states: list[KeptEpisode | None], max_new: int, device) -> Layout:
        """The layout of `rows` (the given ids per row) after their kept episodes `states` (None: a first turn)."""
        new_ids = [([st.pending] if st else []) + list(p) for p, st in zip(rows, states)]
        R, M = len(rows), max(len(p) for p in new_ids)
        done = torch.tensor([st.length if st else 0 for st in states], device=device)   # tokens already cached
        lens = torch.tensor([len(p) for p in new_ids], device=device)
        P = int((done + lens).max())
        ids = torch.zeros(R, M, dtype=torch.long, device=device)
        for r, p in enumerate(new_ids):
            ids[r, M - len(p):] = torch.tensor(p, dtype=torch.long)
        cols = torch.arange(M, device=device)
        key_valid = cols[None, :] >= (M - lens)[:, None]
        positions = (cols[None, :] - (M - lens)[:, None] + done[:, None]).clamp(min=0)
        return cls(ids, key_valid, positions, pad=P - done - lens, width=P,
                   kept=max((st.slots for st in states if st), default=0), columns=P + max_new,
                   first_prompt=[st.prompt_len if st else len(p) for p, st in zip(rows, states)])

    @property
    def new(self) -> int:
        """M: the columns of the prefilled ids."""
        return self.ids.shape[1]

    def prefix(self, r: int) -> int:
        """Row r's tokens before its response (kept episode + prefilled ids): P - pad[r]."""
        return int(self.width - self.pad[r])

    def prefill_visible(self) -> torch.Tensor:
        """bool [R, 1, M, M]: causal attention among the prefilled ids; a pad query sees itself (no row is empty)."""
        cols = torch.arange(self.new, device=self.ids.device)
        eye = torch.eye(self.new, dtype=torch.bool, device=self.ids.device)
        return ((cols[None, :] <= cols[:, None]) & (self.key_valid[:, None, :] | eye))[:, None]


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """Slots per layer, row and KV head of one call's cache (one compressor, one start budget).

    cfg: the call's compressor config (method, kv_budget = the start budget, interval, phase); schedule: the
    engine's (budget_schedule, protect_observation); grows: budget_schedule length (the budget after t generated
    tokens is length_budget(schedule, kv_budget, t)); largest: the largest budget of the call; protect: the
    prefilled ids are not eviction candidates at the prefill (protect_observation, a kept cache); compress_prefill:
    the prefill compacts the cache; filled: slots after the prefill; capacity: slots of every buffer.
    """
    cfg: CompressorConfig
    schedule: CompressorConfig
    grows: bool
    largest: int
    protect: bool
    compress_prefill: bool
    filled: int
    capacity: int

    @classmethod
    def of(cls, cfg: CompressorConfig, schedule: CompressorConfig, kept: int, new: int, max_new: int) -> SlotPlan:
        """The plan of a call with `kept` slots of kept episodes, `new` prefilled columns and max_new tokens."""
        compress, budget = cfg.method != "full", cfg.kv_budget
        grows = compress and schedule.budget_schedule == "length"
        largest = length_budget(schedule, budget, max_new) if grows else budget
        protect = kept > 0 and schedule.protect_observation
        compress_prefill = compress and (kept > budget if protect else kept + new > budget)
        filled = (budget + new if protect else budget) if compress_prefill else kept + new
        capacity = min(max(filled, largest) + cfg.interval, filled + max_new) if compress else filled + max_new
        capacity = max(capacity, kept + new if kept else 0)                 # a kept cache is extended in place
        return cls(cfg, schedule, grows, largest, protect, compress_prefill, filled, capacity)

    @property
    def compress(self) -> bool:
        return self.cfg.method != "full"

    @property
    def chunk_slots(self) -> int:
        """Slots of one compaction chunk (0 for method full)."""
        return min(COMPACT_CHUNK, self.largest) if self.compress else 0

    def budget_at(self, step: int) -> int:
        """The budget a compression keeps after `step` generated tokens."""
        return length_budget(self.schedule, self.cfg.kv_budget, step) if self.grows else self.cfg.kv_budget

    def compact_to(self, step: int, decode_steps: int, filled: int) -> int | None:
        """The slots the decode forward of generated token `step` (the engine's `decode_steps`-th) compacts every
        layer to, with `filled` slots before it; None when it does not compress (not due, or within budget)."""
        now = self.budget_at(step)
        due = decode_steps if self.cfg.phase == "aligned" else step
        return now if self.compress and due % self.cfg.interval == 0 and filled + 1 > now else None


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """Per-layer sizes of the cache: layers, KV and query heads, head_dim (elements); dtype (the model's: K/V as
    computed and as read back) and device of K/V; quant: the precision K/V are stored at (compressor.kv_dtype,
    kv_scale; compressors/kv_quant.py)."""
    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    quant: KVQuant = KVQuant()

    @property
    def slot_bytes(self) -> int:
        """Stored bytes of one slot of one layer and KV head, K and V with their scales."""
        return 2 * self.quant.vector_bytes(self.head_dim, torch.empty(0, dtype=self.dtype).element_size())


class BatchCache:
    """The batch KV cache of one call, changed in place by the engine's forward.

    layers: per layer {k, v [R, Hkv, capacity, D] (stored codes: shape.quant.code_dtype, int4 D / 2 bytes;
        the model dtype at kv_dtype model); k_scale, v_scale float32 [R, Hkv, capacity] (a token_head scale of
        fp8_e4m3 / int8 / int4); valid bool [R, Hkv, capacity]; mass float32
        [R, Hkv, capacity] (H2O's accumulated attention); col int64 [R, Hkv, capacity] (record_evictions: the
        layout column of each slot, -1 = none); pos int64 [R, Hkv, capacity] (a compressor that needs positions:
        each slot's true token position)}; the first `n` slots are filled, the same count on every row
        (validity marks each row's and head's own).
    qwin: per layer the last <= window queries [R, Hq, w, D] (pads zeroed; None until the first prefill).
    Stored precision: a token's K/V are quantized when written (`encode`) and every query, at a prefill (its own
    and the other new tokens' too) and at a decode step, attends to the dequantized ones (`read`), and
    compression scores the dequantized keys and values: what the cache holds, which a replay can recompute.
    evicted_at: with record_evictions, per layer int64 [R0, Hkv, columns]: the column of the first query that no
        longer sees each key column (NEVER: never evicted), indexed by original row (R0 = the call's rows).
    hints: with `hints`, the rounding hints of every K/V write so far (compressors.kv_quant.rounding_hints: the
        elements whose stored code a recomputation's rounding noise could change), a list of int64 [n, 7] CPU
        tensors, one row (original row, layer, 0 for K / 1 for V, KV head, layout column, element of head_dim, code
        bits) each; None without.
    row_ids: int64 [R], the original row of each live row; transient_bytes: the largest prefill K/V tensor pair.
    seed, prompt_len: int64 [R], each live row's sample seed and first prompt's tokens (the compressor's
        SelectContext; set by the engine); protected_fraction: float32 [R], the share of each live row's kept
        valid slots that protection held (sinks, protect_prompt, protect_values) at its last compression, mean
        over layers and KV heads (0: never compressed, or nothing protected).
    """

    def __init__(self, shape: CacheShape, rows: int, capacity: int, window: int, mass: bool, columns: int | None,
                 positions: bool = False, hints: bool = False):
        """Empty buffers of `capacity` slots for `rows` rows; `mass`: H2O's attention mass; `columns`: the
        eviction record's columns (record_evictions), None for no record; `positions`: keep each slot's true
        position (a compressor whose `needs` names positions); `hints`: record the rounding hints of every write."""
        dev, kv, quant = shape.device, (rows, shape.kv_heads, capacity), shape.quant
        self.shape, self.window, self.n, self.transient_bytes = shape, window, 0, 0
        self.layers: list[dict[str, torch.Tensor]] = []
        code = (*kv, quant.code_shape(shape.head_dim))
        for _ in range(shape.layers):
            layer = {"k": torch.zeros(*code, dtype=quant.code_dtype(shape.dtype), device=dev),
                     "v": torch.zeros(*code, dtype=quant.code_dtype(shape.dtype), device=dev),
                     "valid": torch.zeros(*kv, dtype=torch.bool, device=dev)}
            if quant.scaled:
                layer["k_scale"], layer["v_scale"] = torch.ones(*kv, device=dev), torch.ones(*kv, device=dev)
            if mass:
                layer["mass"] = torch.zeros(*kv, device=dev)
            if columns is not None:
                layer["col"] = torch.full(kv, -1, dtype=torch.long, device=dev)
            if positions:
                layer["pos"] = torch.zeros(*kv, dtype=torch.long, device=dev)
            self.layers.append(layer)
        self.qwin: list[torch.Tensor | None] = [None] * shape.layers
        self.evicted_at = None if columns is None else [
            torch.full((rows, shape.kv_heads, columns), NEVER, dtype=torch.long, device=dev)
            for _ in range(shape.layers)]
        self.hints: list[torch.Tensor] | None = [] if hints else None
        self.row_ids = torch.arange(rows, device=dev)
        self.seed = torch.zeros(rows, dtype=torch.long, device=dev)
        self.prompt_len = torch.zeros(rows, dtype=torch.long, device=dev)
        self.protected_fraction = torch.zeros(rows, device=dev)

    def load(self, states: list[KeptEpisode | None], layout: Layout) -> None:
        """Put each kept episode's slots in [kept - its slots, kept) of its row (record columns re-based to the
        layout: + pad), its queries at the end of the window (zeros before), its eviction record at its columns;
        n = layout.kept. Nothing to load without kept episodes."""
        old = self.n = layout.kept
        if old == 0:
            return
        shape, R = self.shape, len(states)
        width = max(st.qwin[0].shape[1] for st in states if st)
        self.qwin = [torch.zeros(R, shape.q_heads, width, shape.head_dim, dtype=shape.dtype, device=shape.device)
                     for _ in range(shape.layers)]
        for r, st in enumerate(states):
            if st is None:
                continue
            pad = int(layout.pad[r])
            for li, (c, kept) in enumerate(zip(self.layers, st.layers)):
                for name, t in kept.items():
                    c[name][r, :, old - st.slots:old] = t + pad if name == "col" else t
                self.qwin[li][r, :, width - st.qwin[li].shape[1]:] = st.qwin[li]
                if self.evicted_at is not None:
                    self.evicted_at[li][r, :, pad:pad + st.evicted_at.shape[2]] = rebased(st.evicted_at[li], pad)
            if self.hints is not None and st.hints is not None:            # token index -> layout column
                shift = torch.tensor([r, 0, 0, 0, pad, 0, 0])
                self.hints.append(torch.cat([torch.zeros_like(st.hints[:, :1]), st.hints], 1) + shift)

    def prefill(self, li: int, ks: torch.Tensor, vs: torch.Tensor, col: int, positions: torch.Tensor,
                visible: torch.Tensor, key_valid: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """Layer li's new K/V [R, Hkv, q, D] of a prefill, the last at layout column `col`, at true `positions`
        int64 [R, q]; visible bool [R, 1, q, q] among them, key_valid bool [R, q]. Returns (slots, visible
        [R, 1 or Hkv, q, S]): with no filled slots (n = 0) the new ones alone (written by `store` or `compact`);
        else they are written to [n, n + q) and slots are the layer's first n + q (views; no mass) with visibility
        of the older ones."""
        R, q = ks.shape[0], ks.shape[2]
        c, n = self.layers[li], self.n
        slots = {**self.encode(ks, vs), "valid": key_valid[:, None, :].expand(R, self.shape.kv_heads, q)}
        self.note_hints(li, ks, vs, col + 1 - q, key_valid)
        if "col" in c:
            slots["col"] = (col + 1 - q + torch.arange(q, device=ks.device)).expand(R, self.shape.kv_heads, q)
        if "pos" in c:
            slots["pos"] = positions[:, None, :].expand(R, self.shape.kv_heads, q)
        self.transient_bytes = max(self.transient_bytes, ks.nbytes + vs.nbytes)
        if not n:
            return slots, visible
        for name, t in slots.items():                                        # extend the kept cache in place
            c[name][:, :, n:n + q] = t
        old_seen = c["valid"][:, :, None, :n] & key_valid[:, None, :, None]  # pad queries see only themselves
        visible = torch.cat([old_seen, visible.expand(R, self.shape.kv_heads, q, q)], -1)
        return {name: t[:, :, :n + q] for name, t in c.items() if name != "mass"}, visible

    def append(self, li: int, ks: torch.Tensor, vs: torch.Tensor, col: int,
               positions: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """Layer li's K/V [R, Hkv, 1, D] of a decode step into slot n (layout column `col`, true `positions`
        int64 [R, 1]). Returns (slots: the layer's first n + 1 (views), visible bool [R, Hkv, 1, n + 1])."""
        c, n = self.layers[li], self.n
        for name, t in self.encode(ks, vs).items():
            c[name][:, :, n] = t[:, :, 0]
        self.note_hints(li, ks, vs, col)
        c["valid"][:, :, n] = True
        if "col" in c:
            c["col"][:, :, n] = col
        if "pos" in c:
            c["pos"][:, :, n] = positions
        slots = {name: t[:, :, :n + 1] for name, t in c.items()}
        return slots, slots["valid"][:, :, None, :]

    def encode(self, ks: torch.Tensor, vs: torch.Tensor) -> dict[str, torch.Tensor]:
        """K/V [R, Hkv, q, D] of the model dtype as stored: {k, v: codes [R, Hkv, q, D] (int4: D / 2), and with a
        token_head scale k_scale, v_scale float32 [R, Hkv, q]} (compressors.kv_quant.quantize; at kv_dtype model
        ks and vs themselves)."""
        (k, k_scale), (v, v_scale) = quantize(ks, self.shape.quant), quantize(vs, self.shape.quant)
        return {"k": k, "v": v} if k_scale is None else {"k": k, "v": v, "k_scale": k_scale, "v_scale": v_scale}

    def note_hints(self, li: int, ks: torch.Tensor, vs: torch.Tensor, first_col: int,
                   key_valid: torch.Tensor | None = None) -> None:
        """With `hints`: record the rounding hints of layer li's write of K/V [R, Hkv, q, D] (model dtype, before
        quantization) at layout columns first_col .. first_col + q - 1 (`self.hints`); key_valid bool [R, q] (a
        prefill: its padding is not recorded), None for all. One nonzero per tensor (a host sync on a GPU); the
        hints go to the CPU (56 B each until the call ends: not device memory, not in kv_peak_bytes)."""
        if self.hints is None:
            return
        quant = self.shape.quant
        for kv, x in enumerate((ks, vs)):
            near, codes = rounding_hints(x, quant)
            if key_valid is not None:
                near = near & key_valid[:, None, :, None]
            r, h, t, d = near.nonzero(as_tuple=True)
            fixed = torch.tensor([li, kv], device=r.device).expand(len(r), 2)
            self.hints.append(torch.cat([self.row_ids[r][:, None], fixed, torch.stack([h, first_col + t, d], 1),
                                         code_bits(codes[r, h, t, d], quant)[:, None]], 1).cpu())

    def row_hints(self, row: int, start: int) -> torch.Tensor:
        """Original row `row`'s rounding hints, int64 [n, 6] (layer, 0 for K / 1 for V, KV head, token index,
        element, code bits) on the CPU, token index = layout column - `start` (its first token's column). The first
        call concatenates `hints` into one CPU tensor (the call's writes are over)."""
        if len(self.hints) != 1:
            self.hints = [torch.cat(self.hints).cpu() if self.hints else torch.zeros(0, 7, dtype=torch.long)]
        mine = self.hints[0][self.hints[0][:, 0] == row, 1:]
        return mine - torch.tensor([0, 0, 0, start, 0, 0])

    def read(self, slots: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V [R, Hkv, S, D] of the model dtype that queries and the compressor see in `slots` (stored
        codes and scales, as `prefill` / `append` return them): dequantized (at kv_dtype model the stored
        tensors themselves, no copy)."""
        quant, dtype = self.shape.quant, self.shape.dtype
        return (dequantize(slots["k"], slots.get("k_scale"), quant, dtype),
                dequantize(slots["v"], slots.get("v_scale"), quant, dtype))

    def observe(self, li: int, slots: dict, qs: torch.Tensor, probs: torch.Tensor | None,
                key_valid: torch.Tensor | None) -> None:
        """After layer li's attention: slots["mass"] = the mass with this forward's probs float32 [R, Hq, q, S]
        (H2O), and the last `window` queries updated with qs [R, Hq, q, D]; key_valid bool [R, q] of a prefill
        (its pad queries zeroed), None for a decode step."""
        c = self.layers[li]
        if "mass" in c:                                                      # H2O: accumulated attention
            slots["mass"] = accumulate_attention(c["mass"][:, :, :self.n], probs)
        if key_valid is not None and self.qwin[li] is None:
            w = min(self.window, qs.shape[2])
            self.qwin[li] = qs[:, :, -w:] * key_valid[:, None, -w:, None]
        else:
            new_q = qs if key_valid is None else qs * key_valid[:, None, :, None]
            self.qwin[li] = torch.cat([self.qwin[li], new_q], dim=2)[:, :, -self.window:]

    def store(self, li: int, slots: dict, prefill: bool) -> None:
        """Keep layer li's slots uncompressed: a first prefill's (n = 0) go to [0, q); otherwise only the mass is
        not in the buffers yet."""
        c = self.layers[li]
        if prefill and not self.n:
            for name, t in slots.items():
                c[name][:, :, :t.shape[2]] = t
        elif "mass" in c:
            c["mass"][:, :, :slots["mass"].shape[2]] = slots["mass"]

    def compact(self, li: int, slots: dict, keep: torch.Tensor, col: int) -> None:
        """Compact layer li to the slots `keep` int64 [R, Hkv, k] (ascending) of `slots`, in place, in chunks of
        COMPACT_CHUNK (keep is ascending, so chunk j only reads slots >= its destination); with a record, the
        valid slots it drops are evicted at column col + 1 (the next query's)."""
        c = self.layers[li]
        if self.evicted_at is not None:
            kept = torch.zeros_like(slots["valid"]).scatter_(2, keep, True)
            r, hh, s = (slots["valid"] & ~kept).nonzero(as_tuple=True)
            self.evicted_at[li][self.row_ids[r], hh, slots["col"][r, hh, s]] = col + 1
        for j in range(0, keep.shape[2], COMPACT_CHUNK):
            idx = keep[:, :, j:j + COMPACT_CHUNK]
            moved = {name: gather_kv(t, idx) for name, t in slots.items()}
            for name, t in moved.items():
                c[name][:, :, j:j + idx.shape[2]] = t

    def drop(self, finished: list[int]) -> torch.Tensor:
        """Remove the live rows `finished` (indices into the live rows) from the buffers and the windows; returns
        the live indices that stay, int64 [R'] ascending."""
        live = torch.ones(len(self.row_ids), dtype=torch.bool, device=self.row_ids.device)
        live[finished] = False
        keep_rows = live.nonzero().squeeze(1)
        self.layers = [{name: t.index_select(0, keep_rows) for name, t in c.items()} for c in self.layers]
        self.qwin = [w.index_select(0, keep_rows) for w in self.qwin]
        self.row_ids, self.seed, self.prompt_len, self.protected_fraction = (
            t[keep_rows] for t in (self.row_ids, self.seed, self.prompt_len, self.protected_fraction))
        return keep_rows

    def retained(self, i: int) -> int:
        """Slots live row i holds (layer 0, KV head 0)."""
        return int(self.layers[0]["valid"][i, 0, :self.n].sum())

    def stored_bytes(self) -> int:
        """K/V bytes per row the buffers hold, codes and scales (KV_ENTRIES) of every slot of every layer:
        layers x kv_heads x capacity x CacheShape.slot_bytes."""
        return sum(t.nbytes for c in self.layers for name, t in c.items() if name in KV_ENTRIES) // len(self.row_ids)

    def peak_bytes(self, chunk_slots: int) -> int:
        """Peak K/V bytes per row: the stored buffers plus the largest transient beside them (one layer's prefill
        K/V at the model dtype; one compaction chunk of `chunk_slots` slots at the stored precision; when the
        stored dtype is not the model's, one layer's K/V dequantized for a read, every slot at the model dtype).
        Validity, positions and scores are not K/V and are not counted."""
        shape = self.shape
        chunk = chunk_slots * shape.kv_heads * shape.slot_bytes
        read = 0
        if self.layers[0]["k"].dtype != shape.dtype:                      # `read` copies (else it returns views)
            read = 2 * self.layers[0]["valid"].shape[2] * shape.kv_heads * shape.head_dim * \
                torch.empty(0, dtype=shape.dtype).element_size()
        return self.stored_bytes() + max(self.transient_bytes // len(self.row_ids), chunk, read)

    def kept_episode(self, i: int, r: int, layout: Layout, response: list[int]) -> KeptEpisode:
        """Live row i (original row r, its `response` so far) as a kept episode: its valid slots only, in time
        order, record columns re-based from the layout (- pad) to the episode's token index."""
        n, pad = self.n, int(layout.pad[r])
        count = max(int(c["valid"][i, :, :n].sum(-1).max()) for c in self.layers)
        layers = []
        for c in self.layers:
            order = torch.sort((~c["valid"][i, :, :n]).to(torch.int8), dim=-1, stable=True).indices[:, :count]
            kept = {name: gather_kv(t[i:i + 1, :, :n], order[None])[0] for name, t in c.items()}
            if "col" in kept:
                kept["col"] = kept["col"] - pad
            layers.append(kept)
        return KeptEpisode(layers, [w[i].clone() for w in self.qwin], layout.prefix(r) + len(response) - 1,
                           response[-1], layout.first_prompt[r])


def select_slots(compressor: Compressor, slots: dict, queries: torch.Tensor, candidates: int | None,
                 ctx: SelectContext) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots of one layer to keep, int64 [R, Hkv, k] ascending: compressor.select over every slot, or over
    the first `candidates` only, the later ones all kept after them; and, when the compressor protects tokens,
    the share of the kept valid candidates protection held, float32 [R] (Compressor.protected_share), else None.
    ctx: the row-level SelectContext fields (prompt_len, seed, event, layer); the per-slot ones the compressor
    needs (values, attn_mass, positions) are taken from `slots`. Raises RuntimeError if the compressor's indices
    are not strictly ascending."""
    end = slots["k"].shape[2] if candidates is None else candidates
    per_slot = {"values": "v", "attn_mass": "mass", "positions": "pos"}
    ctx = dataclasses.replace(ctx, **{f: slots[name][:, :, :end] for f, name in per_slot.items()
                                      if f in compressor.needs})
    keep = compressor.select(slots["k"][:, :, :end], queries, slots["valid"][:, :, :end], ctx)
    share = compressor.protected_share(keep, slots["valid"][:, :, :end], ctx) if compressor.cfg.protects else None
    if end < slots["k"].shape[2]:
        rest = torch.arange(end, slots["k"].shape[2], device=keep.device)
        keep = torch.cat([keep, rest.expand(*keep.shape[:2], rest.shape[0])], -1)
    if not bool((keep[..., 1:] > keep[..., :-1]).all()):
        raise RuntimeError("compressor.select returned slot indices that are not strictly ascending")
    return keep, share


def rebased(evicted_at: torch.Tensor, shift: int) -> torch.Tensor:
    """Column values of an eviction record shifted by `shift` (int64 max, never, stays)."""
    return torch.where(evicted_at == NEVER, NEVER, evicted_at + shift)
