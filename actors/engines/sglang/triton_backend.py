"""SGLang attention backend `sparse_rl_kv`: KV compression (docs/SPEC.md §5) on SGLang's own Triton kernels.

`SparseTritonAttnBackend` subclasses SGLang 0.5.23's `TritonAttnBackend` and reuses its decode and extend
kernels unchanged; it overrides only the metadata building, so CUDA graphs stay on. Schedule as
`actors.engines.torch_engine.TorchEngine`: a prompt longer than its budget is compressed right after its prefill; at
decode step s (s = 1 for the forward of the first sampled token), after the step's attention, a request
holding more than its budget is compressed if s % interval == 0 (`compressor.phase` request; aligned: if this
engine's decode step count g, the `decode_steps` stat, has g % interval == 0, one phase for every request), each
layer scored with its last `window` queries (post-RoPE). Each batched compression is one event
(`compression_events`; `compressions` counts the requests compressed).

Layout (one suffix per request). SGLang keeps token t of request row r in slot `req_to_token[r, t]` of every
layer's K/V buffer `[slots, kv_heads, head_dim]`. A compression of a row holding L tokens keeps, per layer and
KV head, `B` tokens (its budget, time order) and packs them into the slots of row positions [L - B, L); the
slots of [start, L - B) are freed to SGLang's allocator (one call per step) and those positions point at slot 0.
The live KV of a request is then always the suffix [start_r, seq_len) -- SGLang's sliding-window form -- so
the decode kernels read it through one `kv_indptr`/`kv_indices` table built with `kv_start_idx = start_r` and
lengths `seq_len - start_r` everywhere (kv splits too). RoPE needs nothing: keys are stored rotated and
positions stay logical. Attention over the packed slots of (layer, head) is exactly attention over that
(layer, head)'s kept tokens.

Where each part runs:
- in the graph (decode): SGLang's KV write and Triton decode kernel, then the query written into a ring buffer
  `qwin[layer, row, position % window]` (device ops only);
- metadata (`_update_decode_kv_buffers`, used by SGLang's capture/replay path, and the eager decode path):
  device ops only, into the parent's persistent buffers (`kv_indptr`, `cuda_graph_kv_indices`,
  `cuda_graph_num_kv_splits`), no host sync;
- between steps (`init_forward_metadata_out_graph` / `init_forward_metadata`, before the metadata): the rows
  due for compression since the last forward are compressed in one eager call (per layer batched over all
  due rows, left-padded; one group per distinct budget) and their slots freed with one allocator call. Which
  rows are due is known on the host from a mirror of each row's length, start and step (rows enter at their
  prefill, leave when SGLang frees the row), checked against SGLang's host `seq_lens_sum` every step.
- prefill: the parent's extend kernel (batched); then the last `window` queries go to the ring.

Eviction records (`SGLangEngine(record_evictions=True)` sets RECORDS_ENV): `EvictionRecorder`
(actors/engines/sglang/records.py) keeps, per live request, layer and KV head, the original token index of each
packed position and the generated-token count at which each key was evicted -- the torch engine's record, which the
learner replays; written inside the compression (device ops only), read out once when the request's row leaves.

Random eviction and protection (docs/sglang.md, "Random eviction and protection"): the select gets the torch engine's
SelectContext -- each request's seed (from its request id, `contract.rid_seed`), its length (the event) and first
prompt from the host mirror, each live key's true position per layer and KV head from the recorder's origin map (kept,
records or not, when the compressor reads positions) -- so it keeps the torch engine's sets, in device ops. With
protection, each compression also computes each row's protected share (`Compressor.protected_share`, mean over layers
and KV heads: the torch engine's `BatchCache.protected_fraction`) into `protected[row]` on the device (no host sync);
it is written out once when the request's row leaves (or its finished turn parks) to `PROTECTED_ENV`'s directory,
as the eviction records are, for `Sample.kv_protected_fraction`.

Per-request budgets: `SGLangEngine.generate(..., kv_budgets=)` puts a budget that is not the run's at the end of
the request's id (`actors.engines.sglang.engine.budget_rid`); the backend reads it from `ForwardBatch.rids` at the
request's prefill only. No custom logit processor is attached, so nothing of ours runs per decode step.

Length schedule (`compressor.budget_schedule: length`, Sparrow, arXiv 2606.08446 §3.2): the budget read at the
prefill is the row's start budget; a compression of a row whose host step count is s keeps
`compressors.budget.length_budgets(cfg, start budget, s)` tokens (`_budget_now`, the torch engine's
`SlotPlan.budget_at`), from the host mirror, as the due check already reads it: no device budget, no sync. Rows due
in one event are grouped by that budget, one `_compress_group` call per distinct budget (per chunk:
`compress_pending`, stats `compression_groups` / `compression_calls`).

Episodes (docs/sglang.md, "The compressed cache across turns on SGLang"): SGLang's streaming session keeps an
episode's request row between its turns; `wrap_streaming_session` parks the row when its turn ends (`park`: out of the
decode lanes, a compression due in the turn's last forward run then, the record so far written) and counts its held
slots for SGLang's idle leak check; the next turn extends the row (`_continue_rows`): its extend reads the live prefix
[start, prefix) (`_live_prefix_metadata`), and with compressor.protect_observation only the older cache [start, prefix)
is a compression candidate at that prefill (`candidates_end`), the new ids kept.

Limits (checked at start, ValueError naming the setting, see `check_server_args`): page size 1, no radix
cache, no chunked prefill, tp/pp/dp/dcp 1, no overlap scheduling, model-dtype KV (no fp8), the plain
`[slots, heads, dim]` MHA pool, no sliding window, no speculative decoding, no metadata glue graph.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import numpy as np
import torch
from sglang.srt.layers.attention.triton_backend import ForwardMetadata, TritonAttnBackend

from actors.engines.kv_memory import EVENT_BYTES_CAP, compression_event_bytes, event_calls, event_chunk_rows
from actors.engines.sglang.contract import (
    JOINS_ENV,
    KV_STATS_ENV,
    PROTECTED_ENV,
    RECORDS_ENV,
    protected_path,
    refusal_line,
    rid_budget,
    rid_seed,
    unsupported_compressor_settings,
)
from actors.engines.sglang.records import EvictionRecorder, int16_bits, save_npy
from compressors import CompressorConfig, SelectContext, build_compressor, gather_kv
from compressors.budget import length_budgets

SELF_CHECK_ENV = "SPARSE_RL_KV_SELF_CHECK"
"""When "1": every decode step runs the graph-replay metadata path instead of the eager one, on a batch padded
by SGLang 0.5.23's own CUDA-graph padding code (`padded_replay_view`: its decode input buffers and slot registry,
then `build_replay_fb_view`, padded up to the smallest capture size that holds it, the padded lanes holding
stale request rows of live requests on two steps in three), under a host-sync guard; checks the result equals
the eager path and the host mirror, that padded lanes read only the padding slot, have no negative length and
write no live row's query ring, and serves the forward from the replay buffers (CPU lane)."""
PAD_ROW = 0
"""SGLang's padding request row: `ReqToTokenPool` hands out rows from 1, so row 0 is never a live request's;
padded graph lanes read and write only it (its start stays 0, its `req_to_token` entries point at slot 0)."""
PAD_TAILS = ("reset", "stale_rows", "stale_all")
"""The padded tails the self-check replays in turn (`padded_replay_view`)."""


class HostSyncError(RuntimeError):
    """A device tensor was read on the host inside code that must be graph-safe."""


class NoHostSync(torch.overrides.TorchFunctionMode):
    """Raise HostSyncError, while active, on anything that makes the host wait for the device: a tensor -> Python
    value (.item, .tolist, int/float/bool/index of a tensor, .numpy), a copy to the host (.cpu, .to("cpu"), .to of
    a device tensor onto the CPU), an op whose output size depends on the data (nonzero, argwhere, masked_select,
    one-argument where, boolean-mask indexing or assignment), and a blocking host-to-device copy (.to / copy_ of
    a CPU tensor onto an accelerator without non_blocking=True; never seen on the CPU lane, where the device is
    the CPU). Triton's own launcher frames are exempt (under TRITON_INTERPRET=1 the interpreter copies kernel
    arguments through numpy; a real GPU launch only passes pointers)."""

    BANNED = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
              torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
              torch.Tensor.nonzero, torch.nonzero, torch.Tensor.argwhere, torch.argwhere, torch.Tensor.masked_select,
              torch.masked_select}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _host_sync(func, args, kwargs)
        if why and not _inside_triton():
            raise HostSyncError(f"host sync {why} in graph-safe code")
        return func(*args, **kwargs)


def _is_cpu(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"


def _host_sync(func, args, kwargs) -> str | None:
    """Why `func(*args, **kwargs)` would make the host wait for the device (NoHostSync), or None."""
    name = getattr(func, "__name__", str(func))
    if func in NoHostSync.BANNED:
        return name
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "where(condition) (nonzero)"
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
            return f"boolean-mask {'indexing' if func is torch.Tensor.__getitem__ else 'assignment'}"
    if func is torch.Tensor.to:
        src = args[0]
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        if target is not None and _is_cpu(target) and isinstance(src, torch.Tensor):
            return 'to("cpu")'
        if target is not None and not _is_cpu(target) and src.device.type == "cpu" and not kwargs.get(
                "non_blocking", False):
            return "blocking host-to-device to()"
    if func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor):
        dst, src = args[0], args[1]
        if (dst.device.type == "cpu") != (src.device.type == "cpu") and not (
                dst.device.type != "cpu" and kwargs.get("non_blocking", len(args) > 2 and args[2])):
            return "blocking copy_ between host and device"
    return None


def _inside_triton() -> bool:
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        if f"{os.sep}triton{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def real_lanes(fb) -> int:
    """Real (unpadded) lanes of forward batch `fb`: its batch_size minus the CUDA-graph padding lanes of a replay
    view (`num_padding`; 0 or absent on an eager batch). Host int, read from host fields (no device sync)."""
    return fb.batch_size - int(getattr(fb, "num_padding", 0) or 0)


class SparseTritonAttnBackend(TritonAttnBackend):
    """SGLang's Triton attention over each request's live KV suffix, compressed with `compressors/`.

    runner: SGLang's ModelRunner; cfg: CompressorConfig (rkv | snapkv | streamingllm | random, any protection; h2o
    and full raise ValueError). Raises ValueError naming the setting when the runner breaks the layout assumptions.
    """

    needs_cpu_seq_lens = True        # the host mirror is checked against seq_lens_sum every step

    def __init__(self, runner, cfg: CompressorConfig):
        if cfg.method in ("h2o", "full"):
            raise ValueError(f"compressor.method={cfg.method!r} is not supported by the SGLang sparse backend "
                             "(h2o needs per-slot attention mass; full should use SGLang's own backend)")
        if bad := unsupported_compressor_settings(cfg):
            raise ValueError(f"{refusal_line(bad, 'compressor.')} (the SGLang sparse backend cannot run this yet; "
                             "contract.unsupported_compressor_settings)")
        check_runner(runner)
        super().__init__(runner)
        self.enable_lean_attention = False      # its eager gate reads the dense seq_lens_sum
        self.cfg, self._compressors = cfg, {}
        self.kv_pool, self.allocator = runner.token_to_kv_pool, runner.token_to_kv_pool_allocator
        self.start_layer, self.num_layers = self.kv_pool.start_layer, self.kv_pool.layer_num
        rows = self.req_to_token.shape[0]
        k0 = self.kv_pool.get_key_buffer(self.start_layer)
        self.head_dim, self.kv_dtype_bytes = k0.shape[-1], k0.element_size()
        self.qwin = torch.zeros(self.num_layers, rows, cfg.window, self.num_head, self.head_dim,
                                dtype=runner.model_config.dtype, device=self.device) if cfg.reads_queries else None
        """Query ring [layers, rows, window, q_heads, head_dim]: position p of row r at slot p % window; None
        (no memory, no writes) when the compressor reads no queries (streamingllm, random)."""
        self.start_dev = torch.zeros(rows, dtype=torch.int64, device=self.device)
        """Device copy of each row's live start (positions before it hold no KV)."""
        self.lane_rows = torch.zeros(rows, dtype=torch.int64, device=self.device)
        """Persistent [lanes] int64: the request row each decode lane reads and writes (the graph reads it by
        address): the lane's own row for a real lane, PAD_ROW for a padded lane (`_live_kv_indices`)."""
        self.lane_ids = torch.arange(rows, dtype=torch.int64, device=self.device)
        self.pad_row = torch.full((), PAD_ROW, dtype=torch.int64, device=self.device)
        self.real_bs = 0
        """Real (unpadded) lanes of the batch whose metadata is being built (host int, from num_padding)."""
        self._init_mirror(rows)
        self.extend_ring = None
        self.extend_rows, self.extend_prefix = np.zeros(0, np.int64), np.zeros(0, np.int64)
        """The request rows of the last extend and their prefixes (host; `_live_prefix_metadata`)."""
        self.stats = {"peak_used_slots": 0, "freed_slots": 0, "compressions": 0, "pool_slots": self.allocator.size,
                      "compression_events": 0, "last_extend_decode_step": 0, "used_at_last_extend": 0,
                      "max_live_by_budget": {}, "self_checks": 0, "decode_steps": 0,
                      "graph_replays": 0, "graph_captures": 0, "padded_lanes_checked": 0, "stale_lanes_checked": 0,
                      "compression_calls": 0, "compression_groups": 0, "event_bytes_bound": 0,
                      "query_ring_bytes": 0 if self.qwin is None else self.qwin.nbytes}
        self.stats_path = os.environ.get(KV_STATS_ENV)
        self.joins_path = os.environ.get(JOINS_ENV) if cfg.phase == "aligned" else None
        self.self_check = os.environ.get(SELF_CHECK_ENV) == "1"
        records = os.environ.get(RECORDS_ENV)
        self.recorder = (EvictionRecorder(self.num_layers, self.kv_pool.head_num, cfg.kv_budget, self.device, records)
                         if records or cfg.reads_positions else None)
        """The requests' eviction records (RECORDS_ENV set: SGLangEngine(record_evictions=True)), or, for a compressor
        that reads true positions (random, protect_prompt), the positions alone (`EvictionRecorder.records` False);
        else None."""
        self.protected = torch.zeros(rows, dtype=torch.float32, device=self.device) if cfg.protects else None
        """float32 [rows] per request row: the share of its kept tokens protection held at its last compression,
        mean over layers and KV heads (`Compressor.protected_share`; 0 before the first, reset at each prefill: the
        torch engine's `BatchCache.protected_fraction`, per call); None when the compressor protects nothing."""
        self.protected_dir = os.environ.get(PROTECTED_ENV) if cfg.protects else None
        """Where a leaving request's share is written (`PROTECTED_ENV`, `_hand_protected`), or None."""
        self.event_bytes_cap = EVENT_BYTES_CAP
        """Bytes one compression call may hold outside SGLang's pool (`_event_chunks`)."""
        self._ptrs, self._pad_buffers = None, None
        self._runner = runner             # its capture buckets (padded_replay_view)
        self._wrap_pools(runner)
        wrap_streaming_session(self)

    def _init_mirror(self, rows: int) -> None:
        """The host mirror of every request row of SGLang's pool (`rows`): numpy arrays, filled at each row's
        prefill, read and advanced between steps (no device value is read)."""
        self.alive = np.zeros(rows, dtype=bool)
        self.seq_len, self.start = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        self.steps, self.budget = np.zeros(rows, dtype=np.int64), np.full(rows, self.cfg.kv_budget, dtype=np.int64)
        """Host mirror per request row: decode steps since its prefill (s), and its start budget (tokens, read from
        the request id at the prefill); a compression keeps `_budget_now`."""
        self.kept = np.zeros(rows, dtype=np.int64)
        """Host mirror per request row: the positions its last compression packed (that compression's budget; 0
        before the first), which the eviction record's map needs when the budget grows
        (`EvictionRecorder.host_index`)."""
        self.parked = np.zeros(rows, dtype=bool)
        """Host mirror per request row: an episode's row that SGLang's streaming session keeps between its turns
        (`park`): alive, out of the decode lanes, its start, ring, record and `first_prompt` kept."""
        self.first_prompt = np.zeros(rows, dtype=np.int64)
        """Host mirror per request row: its episode's first prompt (tokens); the step a compression records is
        seq_len - first_prompt, the episode's tokens after it (the torch engine's, `sample_eviction_steps`)."""
        self.candidates_end = np.zeros(rows, dtype=np.int64)
        """Host mirror per request row: > 0 while a later turn's protected prefill compression is pending: the turn's
        prefix length; only the positions before it are candidates (compressor.protect_observation), 0 otherwise."""
        self.pending: set[int] = set()
        """Request rows due for compression (`compress_pending`)."""
        self.rid: list = [None] * rows
        """Host mirror per request row: the SGLang request id of its live request (its turn's, for an episode)."""
        self.seed = np.zeros(rows, dtype=np.int64)
        """Host mirror per request row: its compressor seed (method random), read from the request id at its prefill
        (`contract.rid_seed`: `actors.engines.base.compressor_seeds`, the torch engine's row seed); 0 without one."""

    def _wrap_pools(self, runner) -> None:
        """Slot 0 (SGLang's padding slot) is dropped when freeing (compressed rows point evicted positions at
        it); a freed request row leaves the host mirror."""
        free, pool = self.allocator.free, runner.req_to_token_pool
        free_rows, clear = pool.free_rows, pool.clear

        def free_slots(free_index: torch.Tensor):
            free(free_index[free_index != 0])

        def free_req_rows(indices):
            self._leave(list(indices))
            free_rows(indices)

        def clear_rows():
            self._leave(np.flatnonzero(self.alive).tolist())
            clear()

        self.allocator.free, pool.free_rows, pool.clear = free_slots, free_req_rows, clear_rows

    def _leave(self, rows: list[int]) -> None:
        """Request rows leaving (their request ended, its episode's session closed, or the pool was cleared): out of
        the host mirror; with a recorder, each live row's eviction record is written out (`EvictionRecorder.take`),
        a parked episode's is dropped (its last turn's record was written when it parked); each live, unparked row's
        protected share is written out too (`_hand_protected`; a parked row's went when it parked)."""
        self._hand_protected([r for r in rows if self.alive[r] and not self.parked[r]])
        for r in rows:
            if self.recorder is not None and self.alive[r]:
                if self.parked[r]:
                    self.recorder.drop(r)
                else:
                    self.recorder.take(r, int(self.seq_len[r]))
            self.alive[r], self.parked[r], self.candidates_end[r] = False, False, 0
            self.pending.discard(r)

    def park(self, row: int, rid, finished: bool) -> None:
        """SGLang's streaming session keeps request row `row` (host int) after its turn ended (`finished`) or was
        retracted: the row leaves the decode lanes with its KV, start, query ring and record. A compression still due
        from the turn's last forward runs now (the torch engine runs it in that forward, step T - 1), so the kept
        cache is the torch engine's `KeptEpisode`; then, for a finished turn, the episode's record so far is written
        as request `rid`'s (`EvictionRecorder.snapshot`). Host side, eager (called from SGLang's result processing,
        between forwards)."""
        if not self.alive[row]:
            raise RuntimeError(f"sparse_rl_kv: SGLang's streaming session kept request row {row}, which the backend "
                               "does not hold")
        self.parked[row] = True
        self.compress_pending(only=[row])
        if finished and self.recorder is not None:
            self.recorder.snapshot(row, int(self.seq_len[row]), rid)
        if finished:
            self._hand_protected([row], [rid])

    def _hand_protected(self, rows: list[int], rids: list | None = None) -> None:
        """The protected shares of request rows `rows` (host ints; as their live requests', or as `rids`') written to
        `protected_path(PROTECTED_ENV's directory, rid)` (`save_npy`: float32 scalar) for `SGLangEngine.generate`;
        nothing without that directory. One device-to-host copy for all of them (the requests have ended; not graph
        code)."""
        if self.protected_dir is None or not rows:
            return
        shares = self.protected[torch.tensor(rows, device=self.device)].cpu().numpy()
        for rid, share in zip(rids or [self.rid[r] for r in rows], shares):
            save_npy(protected_path(self.protected_dir, rid), np.float32(share))

    def session_held_slots(self, kv) -> int:
        """KV slots a streaming session's row holds (SGLang's `ReqKvInfo` of the row): its live suffix [start,
        allocated), not the logical length SGLang's `kv_private_tokens` counts (evicted positions point at slot 0,
        which is never held)."""
        return max(0, int(kv.kv_allocated_len) - max(int(self.start[kv.req_pool_idx]), int(kv.cache_protected_len)))

    # ------------------------------------------------------------------ between steps (eager)
    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """SGLang's CUDA-graph metadata entry (decode runner: capture with in_capture=True, every replay with
        False, on the padded replay view): replays first run the between-steps work (eager), then the graph
        metadata (device ops only). Counts `graph_captures` / `graph_replays` (decode) in the stats."""
        if forward_batch.forward_mode.is_decode():
            self.stats["graph_captures" if in_capture else "graph_replays"] += 1
        if not in_capture:
            self._between_steps(forward_batch)
        self._graph_metadata(forward_batch, in_capture)

    def _graph_metadata(self, fb, in_capture: bool) -> None:
        """The parent's graph metadata into its persistent buffers, with this batch's real lane count known to
        `_live_kv_indices` (lanes past it are padding)."""
        self.real_bs = real_lanes(fb)
        super().init_forward_metadata_out_graph(fb, in_capture)

    def init_forward_metadata(self, forward_batch):
        fb = forward_batch
        if fb.forward_mode.is_decode() and fb.spec_info is None and self.self_check:
            return self._self_checked_decode_metadata(fb)
        self._between_steps(fb)
        if not fb.forward_mode.is_decode() or fb.spec_info is not None:
            super().init_forward_metadata(fb)
            if fb.forward_mode.is_extend():
                self._live_prefix_metadata(fb)
            return
        self.forward_metadata = self._eager_decode_metadata(fb)

    def _live_prefix_metadata(self, fb) -> None:
        """An extend continuing parked episodes: the prefix its kernels read (`forward_metadata.kv_indptr` /
        `kv_indices`, which the parent fills over the logical prefix [0, prefix), slot 0 below a compressed row's
        start) rebuilt over each row's live prefix [start, prefix) by `pack_read_stream(kv_start_idx=start)`, as the
        decode metadata reads the live suffix. The parent's extend kernels (two-stage, and the deterministic unified
        one, which takes the prefix lengths from kv_indptr) then attend over exactly the kept keys and the new ids.
        Nothing when no row of the batch has a compressed prefix."""
        rows, prefix = self.extend_rows, self.extend_prefix
        start = np.where(prefix > 0, self.start[rows], 0)
        if not start.any():
            return
        live = prefix - start
        live_t, start_t = self._to_device(live, start)
        kv_indptr = self.kv_indptr[:len(rows) + 1]
        kv_indptr[1:] = torch.cumsum(live_t, dim=0)
        kv_indices = torch.empty(int(live.sum()), dtype=torch.int64, device=self.device)
        self.kv_index_translator.pack_read_stream(fb.kv_loc_plan, req_pool_indices=fb.req_pool_indices[:len(rows)],
                                                  seq_lens=live_t, indptr=kv_indptr, out=kv_indices,
                                                  kv_start_idx=start_t)
        self.forward_metadata.kv_indptr, self.forward_metadata.kv_indices = kv_indptr, kv_indices

    def _between_steps(self, fb) -> None:
        """Compress the rows that became due in the last forward, then advance the host mirror for this one."""
        mode = fb.forward_mode
        if mode.is_idle():
            return
        self.stats["peak_used_slots"] = max(self.stats["peak_used_slots"],
                                            int(self.allocator.size - self.allocator.available_size()))
        self.compress_pending()
        if mode.is_decode():
            self._advance_decode(fb)
        elif mode.is_extend():
            self._enter_extend(fb)
        if self.recorder is not None:
            self.stats["record_bytes"] = self.recorder.bytes       # device bytes of the records now
        self._write_stats()

    def _advance_decode(self, fb) -> None:
        """A decode forward: the host mirror's lengths and step counts of the live rows (parked episode rows are not
        in the batch) + 1 (checked against SGLang's host `seq_lens_sum`: RuntimeError when they drifted),
        `max_live_by_budget` (keyed by the start budget), and the rows due after this step's attention into
        `pending`: phase request: s % interval == 0 (s = the row's
        steps), aligned: g % interval == 0 (g = `decode_steps`), and the row holds more than `_budget_now`. Host
        numpy only (no device value read)."""
        rows = np.flatnonzero(self.alive & ~self.parked)
        real_bs = real_lanes(fb)
        self.seq_len[rows] += 1
        self.steps[rows] += 1
        expected = int(self.seq_len[rows].sum())
        if len(rows) != real_bs or (fb.seq_lens_sum is not None and fb.seq_lens_sum - (fb.batch_size - real_bs)
                                    * self.get_cuda_graph_seq_len_fill_value() != expected):
            raise RuntimeError(f"sparse_rl_kv host mirror drifted from SGLang's batch ({len(rows)} rows, "
                               f"{expected} tokens vs batch {real_bs}, seq_lens_sum {fb.seq_lens_sum}): a scheduler "
                               "mode the backend does not support (see check_server_args)")
        live = self.seq_len[rows] - self.start[rows]
        seen = self.stats["max_live_by_budget"]
        for b in np.unique(self.budget[rows]):
            key = str(int(b))
            seen[key] = max(seen.get(key, 0), int(live[self.budget[rows] == b].max()))
        self.stats["decode_steps"] += 1
        step = self.stats["decode_steps"] if self.cfg.phase == "aligned" else self.steps[rows]
        due = rows[(step % self.cfg.interval == 0) & (live > self._budget_now(rows))]
        self.pending.update(due.tolist())

    def _budget_now(self, rows: np.ndarray) -> np.ndarray:
        """The budget, tokens, a compression of request rows `rows` (int64 [g]) keeps now: int64 [g],
        `compressors.budget.length_budgets` of their start budgets at their host step counts, so with
        budget_schedule length it grows with each row's response (Sparrow, arXiv 2606.08446 §3.2; the torch engine's
        `SlotPlan.budget_at`, actors/engines/batch_cache.py), and is the start budget under any other schedule. Read
        between steps, while a due row's count is still the s of the step it became due in (0 at the prefill: the
        start budget). Host numpy from the mirror: no device budget, no sync."""
        return length_budgets(self.cfg, self.budget[rows], self.steps[rows])

    def _enter_extend(self, fb) -> None:
        """An extend (prefill) forward into the host mirror: new requests (an episode's first turn too,
        `_start_rows`) and episodes continuing on the row SGLang's streaming session kept (`_continue_rows`); the
        joins file (phase aligned); the ring slots of each row's last `window` prefilled queries (`extend_ring`, at
        their true positions). Raises RuntimeError for a cached prefix on a row that is not a parked episode's row of
        exactly that length (a radix cache or chunked prefill would give one: sparse_engine_kwargs() turns both off)."""
        rows_t = fb.req_pool_indices_cpu if fb.req_pool_indices_cpu is not None else fb.req_pool_indices.cpu()
        rows = rows_t.numpy().astype(np.int64)[:fb.batch_size]
        lens = np.asarray(fb.extend_seq_lens_cpu[:len(rows)], dtype=np.int64)
        prefix = (np.asarray(fb.extend_prefix_lens_cpu[:len(rows)], dtype=np.int64)
                  if fb.extend_prefix_lens_cpu is not None else np.zeros_like(lens))
        rids = list(fb.rids[:len(rows)]) if fb.rids is not None else [None] * len(rows)
        budgets = np.array([rid_budget(rid, self.cfg.kv_budget) for rid in rids], dtype=np.int64)
        cont = prefix > 0
        wrong = cont & ~(self.alive[rows] & self.parked[rows] & (self.seq_len[rows] == prefix))
        if wrong.any():
            raise RuntimeError(f"sparse_rl_kv got an extend with a cached prefix of {prefix[wrong].tolist()} tokens on "
                               f"request rows {rows[wrong].tolist()}, which hold no parked episode of that length; it "
                               "needs disable_radix_cache=True and chunked_prefill_size=-1 (sparse_engine_kwargs())")
        self._start_rows(rows[~cont], lens[~cont], [r for r, c in zip(rids, cont) if not c], budgets[~cont])
        self._continue_rows(rows[cont], prefix[cont], lens[cont], [r for r, c in zip(rids, cont) if c], budgets[cont])
        self.extend_rows, self.extend_prefix = rows, prefix
        self.stats["used_at_last_extend"] = int(self.allocator.size - self.allocator.available_size())
        self.stats["last_extend_decode_step"] = self.stats["decode_steps"]
        if self.joins_path and fb.rids is not None:    # each request's phase, for SGLangEngine's KV counts
            with open(self.joins_path, "a") as f:
                f.write("".join(f"{rid} {self.stats['decode_steps']}\n" for rid in rids))
        if self.qwin is None:
            return
        # ring positions of the last `window` prefilled queries of each request (token index, row, ring slot)
        w, offsets = self.cfg.window, np.concatenate([[0], np.cumsum(lens)])
        tok = np.concatenate([np.arange(max(0, n - w), n) + o for n, o in zip(lens, offsets[:-1])])
        pos = np.concatenate([np.arange(max(0, n - w), n) + p for n, p in zip(lens, prefix)])
        row = np.repeat(rows, np.minimum(lens, w))
        self.extend_ring = tuple(torch.from_numpy(a).to(self.device) for a in (tok, row, pos % w))

    def _start_rows(self, rows: np.ndarray, lens: np.ndarray, rids: list, budgets: np.ndarray) -> None:
        """Requests entering at their prefill (request rows, prompt tokens, SGLang request ids, start budgets; host):
        start 0, step 0; a prompt longer than its budget is due (compressed after its prefill)."""
        self.alive[rows], self.seq_len[rows], self.start[rows], self.steps[rows] = True, lens, 0, 0
        self.budget[rows], self.kept[rows], self.first_prompt[rows] = budgets, 0, lens
        self.seed[rows] = [rid_seed(rid) for rid in rids]
        self.parked[rows], self.candidates_end[rows] = False, 0
        self._new_requests(rows, rids)
        self.start_dev[torch.from_numpy(rows).to(self.device)] = 0
        if self.recorder is not None:
            self.recorder.enter(rows.tolist(), rids, budgets.tolist())
        self.pending.update(rows[lens > budgets].tolist())

    def _continue_rows(self, rows: np.ndarray, prefix: np.ndarray, lens: np.ndarray, rids: list,
                       budgets: np.ndarray) -> None:
        """Episodes whose next turn extends the row SGLang's streaming session kept (`park`; host arrays: rows, the
        turn's prefix = the row's logical length, the ids it prefills at their true positions [prefix, prefix +
        lens), request ids, budgets), as the torch engine's later turns (`SlotPlan`, actors/engines/batch_cache.py):
        the step count restarts (the turn's interval), the budget is the turn's request's; with
        compressor.protect_observation the kept cache alone is due when it holds more than the budget (the
        candidates end at the prefix: the prefilled ids stay until the turn's first compression event), without it
        the whole row when it holds more. The extend reads the live prefix (`_live_prefix_metadata`)."""
        self.parked[rows], self.seq_len[rows], self.steps[rows], self.budget[rows] = False, prefix + lens, 0, budgets
        self.seed[rows] = [rid_seed(rid) for rid in rids]           # each turn's own (the torch engine's, per call)
        self._new_requests(rows, rids)
        if self.recorder is not None:
            self.recorder.resume(rows.tolist(), rids)
        kept = prefix - self.start[rows]
        if self.cfg.protect_observation:
            due = kept > budgets
            self.candidates_end[rows[due]] = prefix[due]
        else:
            due = kept + lens > budgets
        self.pending.update(rows[due].tolist())

    def _new_requests(self, rows: np.ndarray, rids: list) -> None:
        """Request rows (host) taking new requests `rids` (a prefill, or an episode's next turn): their request ids,
        and their protected shares reset to 0 (the torch engine's are per call). Eager, device ops only."""
        for r, rid in zip(rows.tolist(), rids):
            self.rid[r] = rid
        if self.protected is not None and len(rows):
            self.protected[torch.from_numpy(rows).to(self.device)] = 0

    def compressor_for(self, budget: int):
        if budget not in self._compressors:
            self._compressors[budget] = build_compressor(dataclasses.replace(
                self.cfg, kv_budget=int(budget), budget_schedule="constant", budget_control="off",
                budget_tiers="off"))
        return self._compressors[budget]

    def compress_pending(self, only: list[int] | None = None) -> None:
        """Compress every pending row (of `only`, request rows, when given: a parked row's, `park`) to its budget now
        (`_budget_now`; all layers), then free their evicted slots
        with one allocator call: one event (`compression_events`). Rows are grouped by that budget, and each group
        runs as its `_event_chunks` calls of `_compress_group` (per layer one batched select, rows left-padded to
        the longest). Calls per event = the sum, over the distinct budgets of its due rows, of each budget's chunks:
        one per distinct budget when no group is split. Under budget_schedule length a row's budget is
        length_budget(start budget, s), so rows due together with one start budget but different step counts s
        (phase request: s a different multiple of interval, a row that joined later; phase aligned: any s) are
        separate groups until both budgets reach kv_budget_final. Counted in the stats: `compression_groups`
        (distinct budgets, summed over events) and `compression_calls` (calls)."""
        due = set(self.pending) if only is None else self.pending.intersection(only)
        if not due:
            return
        rows = np.array(sorted(due), dtype=np.int64)
        self.pending -= due
        now = self._budget_now(rows)
        order = np.argsort(now, kind="stable")                               # grouped by budget, host (mirror)
        rows, now = rows[order], now[order]
        budgets, first = np.unique(now, return_index=True)
        freed = torch.cat([self._compress_group(chunk, b) for b, group in zip(budgets, np.split(rows, first[1:]))
                           for chunk in self._event_chunks(group, b)])
        self.allocator.free(freed)
        self.stats["freed_slots"] += freed.numel()
        self.stats["compressions"] += len(rows)
        self.stats["compression_events"] += 1
        self.stats["compression_groups"] += len(budgets)

    def _event_chunks(self, group: np.ndarray, budget) -> list[np.ndarray]:
        """`group` (request rows due at one budget) split into consecutive chunks of at most
        `actors.engines.kv_memory.event_chunk_rows` rows (`event_calls` chunks of near-equal size), so that each
        `_compress_group` call's transient device memory, bounded by `compression_event_bytes` (outside SGLang's KV
        pool), stays under `self.event_bytes_cap` bytes (a single row above it is compressed alone). Host only (the
        mirror). Counts `compression_calls` and keeps the largest bound of a call, `event_bytes_bound` (bytes), in the
        stats."""
        live, budget = int((self._candidates_end(group) - self.start[group]).max()), int(budget)
        shape = (budget, self.cfg.window, self.num_head, self.kv_pool.head_num, self.head_dim, self.kv_dtype_bytes,
                 self.cfg.method, self.recorder is not None, self.cfg.protects, self.cfg.protect_values > 0)
        chunks = np.array_split(group,
                                event_calls(len(group), event_chunk_rows(live, *shape, cap=self.event_bytes_cap)))
        self.stats["compression_calls"] += len(chunks)
        self.stats["event_bytes_bound"] = max(self.stats["event_bytes_bound"],
                                              compression_event_bytes(len(chunks[0]), live, *shape))
        return chunks

    def _write_stats(self) -> None:
        """The stats into `KV_STATS_ENV`'s file, replaced whole (the engine's process may read it meanwhile)."""
        if self.stats_path:
            with open(self.stats_path + ".part", "w") as f:
                json.dump(self.stats, f)
            os.replace(self.stats_path + ".part", self.stats_path)

    def _to_device(self, *arrays) -> list[torch.Tensor]:
        """Host arrays (built from the mirror) as int64 device tensors of their shapes, in one copy: packed into one
        buffer, pinned and sent with non_blocking=True on an accelerator (the host does not wait; PyTorch's caching
        host allocator keeps the pinned buffer until the copy has run); on the CPU the packed buffer itself."""
        flat = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.int64).ravel() for a in arrays]))
        if torch.device(self.device).type != "cpu":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        ends = np.cumsum([np.size(a) for a in arrays])
        return [flat[e - np.size(a):e].view(np.shape(a)) for a, e in zip(arrays, ends)]

    def _compress_group(self, rows: np.ndarray, budget) -> torch.Tensor:
        """Compress rows (all holding more than `budget` candidate tokens) to `budget`; returns the freed slots. Each
        row's candidates are its live positions [start, end), end = its length, or a later turn's prefix while its
        protected prefill compression is due (`_candidates_end`): the kept ones are packed into [end - budget, end),
        positions from end on stay (one live suffix). The index arrays are built on the host from the mirror (numpy:
        left-padded candidate positions, the evicted positions [start, end - budget) of every row, the last `window`
        queries' ring slots; with a recorder, the rows' record slots, which positions its map holds (the positions
        each row's last compression packed, `self.kept`, which under budget_schedule length can be less than
        `budget`) and the step recorded, the episode's tokens after its first prompt) and reach the device in one
        pinned non-blocking copy (`_to_device`); no per-row loop, nothing read back from the device
        (`_compress_device`, under NoHostSync in the self-check)."""
        w = self.cfg.window
        length, start, end = self.seq_len[rows], self.start[rows], self._candidates_end(rows)
        new_start = end - budget
        n = (end - start).max()
        pos = end[:, None] - n + np.arange(n)[None, :]                          # left-padded candidate positions
        live = pos >= start[:, None]
        evict_row, evict_col = np.where(live & (pos < new_start[:, None]))       # host numpy, the mirror
        host = [rows, np.maximum(pos, 0), live, new_start[:, None] + np.arange(budget)[None, :],
                (length[:, None] - w + np.arange(w)[None, :]) % w, evict_row, evict_col, new_start,
                np.stack([self.first_prompt[rows], self.seed[rows], length])]     # the rows' SelectContext
        if self.recorder is not None:                    # the steps recorded: each row's own, before this step's
            self.recorder.fit(length.max(), budget)                           # host numpy: the mirror
            step = length - self.first_prompt[rows]
            host += [self.recorder.slots_of(rows), *EvictionRecorder.host_index(pos, start, self.kept[rows]),
                     int16_bits(step) if self.recorder.records else np.zeros_like(step)]
        with NoHostSync() if self.self_check else contextlib.nullcontext():
            freed = self._compress_device(budget, *self._to_device(*host))
        self.start[rows], self.kept[rows], self.candidates_end[rows] = new_start, budget, 0
        return freed

    def _candidates_end(self, rows: np.ndarray) -> np.ndarray:
        """Where the compression candidates of request rows `rows` end, int64 [g] (host): a later turn's prefix while
        its protected prefill compression is due (`candidates_end`), else the row's length."""
        return np.where(self.candidates_end[rows] > 0, self.candidates_end[rows], self.seq_len[rows])

    def _compress_device(self, budget, rows_t, pos_t, valid, target_pos, qpos, evict_row, evict_col, new_start_t,
                         row_ctx, *record) -> torch.Tensor:
        """`_compress_group`'s device half (device ops only): per layer, gather the rows' live K/V and window
        queries, select, write the kept K/V into the slots of the packed positions (and, with `record` = the
        recorder's slots, mapped, rel and step tensors, the eviction record); point the evicted positions at slot 0
        and set the rows' device start. Returns the freed slots int64 [E]. The select reads the torch engine's
        SelectContext: row_ctx int64 [3, g] = each row's first prompt (prompt_len), seed and length (the event: its
        newest token's true position + 1), and, with a recorder, each live key's true position per layer and KV head
        (`EvictionRecorder.origins`: positions). With protection, the rows' protected shares into `protected`
        (`Compressor.protected_share` per layer, mean over layers: the torch engine's `_forward`)."""
        valid = valid.bool()
        slots = self.req_to_token[rows_t[:, None], pos_t].long().masked_fill(~valid, 0)
        target = self.req_to_token[rows_t[:, None], target_pos].long()
        compressor, keep, shares = self.compressor_for(budget), None, []
        heads = torch.arange(self.kv_pool.head_num, device=self.device)[None, :, None]
        for li in range(self.num_layers):
            k_buf = self.kv_pool.get_key_buffer(li + self.start_layer)
            v_buf = self.kv_pool.get_value_buffer(li + self.start_layer)
            ks, vs = k_buf[slots].transpose(1, 2), v_buf[slots].transpose(1, 2)   # [g, Hkv, n, D]
            origin = self.recorder.origins(li, record[0], pos_t, record[1].bool(), record[2]) if record else None
            if keep is None or self.cfg.selection != "shared":
                queries = None if self.qwin is None else self.qwin[li][rows_t[:, None], qpos].transpose(1, 2)
                ctx = SelectContext(values=vs, positions=origin, prompt_len=row_ctx[0], seed=row_ctx[1],
                                    event=row_ctx[2], layer=li)
                keep = compressor.select(ks, queries, valid, ctx)
                share = compressor.protected_share(keep, valid, ctx) if self.protected is not None else None
                del ctx                     # its values and positions: freed with this layer's (below)
            shares.append(share)
            if record:                                                              # keep: [g, Hkv, budget]
                self.recorder.record(li, record[0], origin, valid, keep, record[3])
            k_buf[target[:, None, :], heads] = gather_kv(ks, keep)
            v_buf[target[:, None, :], heads] = gather_kv(vs, keep)
            del ks, vs, origin              # freed before the next layer's gather (compression_event_bytes)
        freed = slots[evict_row, evict_col]                 # live slots of the evicted positions (never slot 0)
        self.req_to_token[rows_t[evict_row], pos_t[evict_row, evict_col]] = 0
        self.start_dev[rows_t] = new_start_t
        if self.protected is not None:
            self.protected[rows_t] = torch.stack(shares).mean(0)
        return freed

    # ------------------------------------------------------------------ metadata (device ops only)
    def _live_kv_indices(self, plan, bs: int, seq_lens, req_pool_indices, kv_indptr, kv_indices):
        """Fill kv_indptr[:bs+1] and kv_indices with each request's live suffix [start, seq_len); returns
        (kv_indptr[:bs+1], live lengths [bs] int64). Lanes from `self.real_bs` on are CUDA-graph padding: their
        request row is replaced by PAD_ROW in `self.lane_rows` (the rows the graph's ring write uses), whatever
        SGLang left in req_pool_indices there (zeros in 0.5.23; a stale row of a live request if a padded tail
        is not reset), so a padded lane reads only the padding slot, its length is SGLang's fill value (>= 0)
        and it never writes a live row's query ring. Device ops only (graph-safe: no host sync)."""
        rows = self.lane_rows[:bs]
        torch.where(self.lane_ids[:bs] < self.real_bs, req_pool_indices[:bs], self.pad_row, out=rows)
        start = self.start_dev[rows]
        live = seq_lens[:bs] - start
        kv_indptr[1:bs + 1] = torch.cumsum(live, dim=0)
        self.kv_index_translator.pack_read_stream(plan, req_pool_indices=rows, seq_lens=live,
                                                  indptr=kv_indptr[:bs + 1], out=kv_indices, kv_start_idx=start)
        return kv_indptr[:bs + 1], live

    def _update_decode_kv_buffers(self, plan, bs, seq_lens, req_pool_indices):
        """SGLang's capture/replay hook for decode (`_apply_cuda_graph_metadata`): the live suffixes into the
        persistent `kv_indptr` / `cuda_graph_kv_indices`; the live lengths size the kv splits."""
        kv_indptr, live = self._live_kv_indices(plan, bs, seq_lens, req_pool_indices, self.kv_indptr,
                                                self.cuda_graph_kv_indices)
        return kv_indptr, self.window_kv_indptr, None, live

    def _eager_decode_metadata(self, fb) -> ForwardMetadata:
        """Decode metadata outside a CUDA graph (fresh work buffers, as the parent's eager path)."""
        bs, dev = fb.batch_size, self.device
        self.real_bs = bs
        kv_indices = torch.empty(fb.seq_lens_sum if fb.seq_lens_sum is not None else bs * self.max_context_len,
                                 dtype=torch.int64, device=dev)
        kv_indptr, live = self._live_kv_indices(fb.kv_loc_plan, bs, fb.seq_lens, fb.req_pool_indices,
                                                self.kv_indptr, kv_indices)
        num_kv_splits = torch.empty(bs, dtype=torch.int32, device=dev)
        uneven = torch.zeros(1, dtype=torch.int32, device=dev)
        self.get_num_kv_splits(num_kv_splits, live, uneven)
        return ForwardMetadata(
            attn_logits=torch.empty(bs, self.num_head, self.max_kv_splits, self.v_head_dim, dtype=torch.float32,
                                    device=dev),
            attn_lse=torch.empty(bs, self.num_head, self.max_kv_splits, dtype=torch.float32, device=dev),
            max_extend_len=None, num_kv_splits=num_kv_splits, kv_indptr=kv_indptr, kv_indices=kv_indices,
            qo_indptr=None, custom_mask=None, mask_indptr=None, window_kv_indptr=self.window_kv_indptr,
            window_kv_indices=None, window_num_kv_splits=None, window_kv_offsets=None, uneven_batch=uneven)

    def padded_replay_view(self, fb):
        """The replay view SGLang 0.5.23's decode CUDA-graph runner hands `init_forward_metadata_out_graph` for
        decode batch `fb` (`DecodeCudaGraphRunner.load_batch`), built with the runner's own code: its capture
        buckets (`get_batch_sizes_to_capture` of this engine's runner), `_pad_to_bucket` (the smallest captured
        size >= the batch), its `DecodeInputBuffers` + decode slot registry (`fill_from`: the padded tail's
        req_pool_indices / positions / out_cache_loc reset to 0, seq_lens to the fill value), then
        `build_replay_fb_view`. Then a fault is injected into the padded tail, in turn by self-check step:
        `PAD_TAILS[k % 3]` -- "reset": as SGLang leaves it; "stale_rows": each padded lane holds the request
        row and position (minus 1) of a live request of this batch, seq_lens reset (what a padded tail that is
        not reset would carry from the previous replay: SGLang's KEEP_PAD policy, its pre-planned load);
        "stale_all": seq_lens (minus 1) stale too. Returns (view, tail kind, stale lanes), or (None, "eager", 0)
        for a batch larger than every captured size (SGLang decodes it eagerly). Host side, eager (the
        self-check's setup, not graph code)."""
        from sglang.srt.model_executor.cuda_graph_buffer_registry import build_decode_registry
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.model_executor.runner.base_cuda_graph_runner import (
            BaseCudaGraphRunner,
            get_batch_sizes_to_capture,
        )
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view
        from sglang.srt.model_executor.runner_utils.buffers import DecodeInputBuffers

        fill, raw = self.get_cuda_graph_seq_len_fill_value(), fb.batch_size
        if self._pad_buffers is None:
            buckets, _ = get_batch_sizes_to_capture(self._runner)
            max_bs = max(buckets)
            buffers = DecodeInputBuffers.create(
                device=self.device, max_bs=max_bs, max_num_token=max_bs, hidden_size=1,
                next_token_logits_buffer=torch.empty(0, device=self.device), dtype=torch.float32, num_dp_ranks=1,
                pp_size=1, is_encoder_decoder=False, require_mlp_tp_gather=False, seq_len_fill_value=fill,
                encoder_len_fill_value=0, num_tokens_per_req=1, cache_loc_dtype=fb.out_cache_loc.dtype,
                enable_mamba_track=False)
            registry = build_decode_registry(device=self.device, max_bs=max_bs, max_num_token=max_bs,
                                             seq_len_fill_value=fill, cache_loc_dtype=fb.out_cache_loc.dtype,
                                             share_pool=False, source=buffers)
            self._pad_buffers = (sorted(buckets), buffers, registry)
        buckets, buffers, registry = self._pad_buffers
        if raw > buckets[-1]:
            return None, "eager", 0
        bs = BaseCudaGraphRunner._pad_to_bucket(raw, buckets)
        registry.fill_from(fb, raw_bs=raw, padded_bs=bs, raw_num_tokens=raw, padded_num_tokens=bs)
        tail = PAD_TAILS[self.stats["self_checks"] % len(PAD_TAILS)]
        stale = bs - raw if tail != "reset" else 0
        if stale:
            src = torch.arange(stale, device=self.device) % raw
            buffers.req_pool_indices[raw:bs] = fb.req_pool_indices[src]
            buffers.positions[raw:bs] = fb.positions[src] - 1
            if tail == "stale_all":
                buffers.seq_lens[raw:bs] = fb.seq_lens[src] - 1
        view = build_replay_fb_view(forward_batch=fb, buffers=buffers, bs=bs, raw_bs=raw, num_tokens=bs,
                                    global_num_tokens_cpu=None, seq_len_fill_value=fill,
                                    capture_forward_mode=ForwardMode.DECODE, is_encoder_decoder=False)
        return view, tail, stale

    def _self_checked_decode_metadata(self, fb) -> None:
        """SELF_CHECK_ENV: this decode step's metadata through the replay path on SGLang's padded view
        (`padded_replay_view`): the between-steps work, then the graph metadata under NoHostSync into the
        persistent graph buffers; checks them against the eager path and the host mirror (real lanes), that
        every lane's live length is >= 0, that padded lanes read only the padding slot 0, and that the graph's
        ring write of the padded lanes leaves every live row's query ring untouched; serves this forward from
        the graph buffers. Raises RuntimeError naming each failed check."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        if self._ptrs is None:
            self.init_cuda_graph_state(self.req_to_token.shape[0], self.req_to_token.shape[0])
        view, _, stale = self.padded_replay_view(fb)
        if view is None:                                # larger than every capture bucket: SGLang runs it eagerly
            self._between_steps(fb)
            self.forward_metadata = self._eager_decode_metadata(fb)
            return
        raw, bs = fb.batch_size, view.batch_size
        self._between_steps(view)                       # the replay's eager half, on the padded view
        eager = self._eager_decode_metadata(fb)
        eager_indptr = eager.kv_indptr.clone()          # the same persistent kv_indptr: keep the eager result
        with NoHostSync():
            self._graph_metadata(view, False)
        graph = self._build_cuda_graph_forward_metadata(bs, ForwardMode.DECODE, None)
        ptrs = (self.kv_indptr.data_ptr(), self.cuda_graph_kv_indices.data_ptr(),
                self.cuda_graph_num_kv_splits.data_ptr(), self.cuda_graph_attn_logits.data_ptr(),
                self.lane_rows.data_ptr())
        nnz = int(eager_indptr[-1])
        rpi, lens = fb.req_pool_indices.tolist(), fb.seq_lens.tolist()
        want = [self.req_to_token[r, int(self.start[r]):n].long() for r, n in zip(rpi, lens)]
        lane_lens = graph.kv_indptr[1:] - graph.kv_indptr[:-1]
        problems = []
        if self._ptrs is not None and ptrs != self._ptrs:
            problems.append("persistent buffers moved")
        if not torch.equal(graph.kv_indptr[:raw + 1], eager_indptr):
            problems.append("kv_indptr differs from the eager path")
        if not torch.equal(graph.kv_indices[:nnz], eager.kv_indices[:nnz]):
            problems.append("kv_indices differ from the eager path")
        if not torch.equal(graph.num_kv_splits[:raw], eager.num_kv_splits):
            problems.append("num_kv_splits differ from the eager path")
        if not torch.equal(eager.kv_indices[:nnz], torch.cat(want)):
            problems.append("kv_indices differ from the host mirror's live suffixes")
        if bool((lane_lens < 0).any()):
            problems.append(f"negative live lengths {lane_lens.tolist()} (padded lanes from {raw})")
        elif bool((graph.kv_indices[nnz:int(graph.kv_indptr[-1])] != 0).any()):
            problems.append("a padded lane reads a slot other than the padding slot 0")
        if self.qwin is not None and self._padded_lane_writes_a_live_ring(bs, raw, view.positions):
            problems.append("a padded lane wrote into a live row's query ring")
        if problems:
            raise RuntimeError("sparse_rl_kv self-check failed: " + "; ".join(problems))
        self._ptrs = ptrs
        self.real_bs = raw
        self.stats["self_checks"] += 1
        self.stats["padded_lanes_checked"] += bs - raw
        self.stats["stale_lanes_checked"] += stale
        self._write_stats()
        self.forward_metadata = self._build_cuda_graph_forward_metadata(raw, ForwardMode.DECODE, None)

    def _padded_lane_writes_a_live_ring(self, bs: int, raw: int, positions) -> bool:
        """The self-check's ring probe: lanes [raw, bs) (padding) write NaN queries through `_write_ring` into a
        copy of layer 0's ring, the real lanes rewrite what is there; True when a live row's ring then holds NaN."""
        ring = self.qwin[0].clone()
        q = torch.full((bs, *ring.shape[2:]), float("nan"), dtype=ring.dtype, device=self.device)
        q[:raw] = ring[self.lane_rows[:raw], positions[:raw] % self.cfg.window]
        self._write_ring(ring, positions, q)
        live_rows = torch.from_numpy(np.flatnonzero(self.alive)).to(self.device)
        return bool(ring[live_rows].isnan().any())

    # ------------------------------------------------------------------ attention
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """The parent's decode (KV write + Triton kernel over the live suffix), then this step's query into
        the ring (device ops only, in the graph)."""
        o = super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        if self.qwin is not None:
            ring = self.qwin[layer.layer_id - self.start_layer]
            self._write_ring(ring, forward_batch.positions, q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim))
        return o

    def _write_ring(self, ring, positions, q) -> None:
        """Lane i's query q[i] ([lanes, q_heads, head_dim]) into ring[lane_rows[i], positions[i] % window] of one
        layer's ring [rows, window, q_heads, head_dim]: padded lanes write PAD_ROW (`_live_kv_indices`). In the
        graph; device ops only."""
        ring[self.lane_rows[:q.shape[0]], positions % self.cfg.window] = q.to(ring.dtype)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """The parent's extend (batched prefill), then the prompts' last `window` queries into the ring."""
        o = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        if self.qwin is not None:
            tok, row, slot = self.extend_ring
            ring = self.qwin[layer.layer_id - self.start_layer]
            ring[row, slot] = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)[tok].to(ring.dtype)
        return o


def check_runner(runner) -> None:
    """Refuse a ModelRunner whose pools break the suffix layout (ValueError naming the setting)."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool, alloc = runner.token_to_kv_pool, runner.token_to_kv_pool_allocator
    if type(alloc) is not TokenToKVPoolAllocator or getattr(runner, "page_size", 1) != 1:
        raise ValueError(f"sparse_rl_kv needs page_size=1 and SGLang's TokenToKVPoolAllocator, the engine has "
                         f"page_size={getattr(runner, 'page_size', None)}, {type(alloc).__name__}")
    if type(pool) is not MHATokenToKVPool or pool.get_key_buffer(pool.start_layer).dim() != 3:
        raise ValueError(f"sparse_rl_kv needs the [slots, kv_heads, head_dim] MHA KV layout, the engine has "
                         f"{type(pool).__name__} (SGLANG_USE_HND_KVCACHE or a hybrid/paged pool?)")
    if runner.kv_cache_dtype != runner.model_config.dtype:
        raise ValueError(f"kv_cache_dtype={runner.kv_cache_dtype}: sparse_rl_kv needs the model dtype "
                         f"({runner.model_config.dtype}); fp8 KV is not supported")
    if runner.sliding_window_size is not None:
        raise ValueError("sparse_rl_kv does not support sliding-window models")
    from sglang.srt.runtime_context import get_exec

    graph = get_exec().graph
    check_graph_settings(graph.cuda_graph_config, graph.enable_torch_compile)


def check_graph_settings(cuda_graph_config, enable_torch_compile: bool) -> None:
    """Refuse, in the scheduler, the graph settings SGLang resolved that sparse mode was never run under
    (ValueError naming the setting): a prefill CUDA graph (SGLang 0.5.23 defaults to its breakable, piecewise
    prefill graph on CUDA; `sparse_engine_kwargs()` turns it off), a decode graph other than full / disabled,
    torch.compile. `SGLangEngine` refuses the same settings before SGLang starts (check_sparse_settings)."""
    from actors.engines.sglang.contract import DECODE_GRAPH_BACKENDS

    prefill, decode = cuda_graph_config.prefill.backend, cuda_graph_config.decode.backend
    if prefill != "disabled":
        raise ValueError(f"cuda_graph_backend_prefill={prefill!r}: sparse_rl_kv runs the prefill eagerly (set "
                         "cuda_graph_backend_prefill='disabled')")
    if decode not in DECODE_GRAPH_BACKENDS:
        raise ValueError(f"cuda_graph_backend_decode={decode!r}: sparse_rl_kv needs one of {DECODE_GRAPH_BACKENDS}")
    if enable_torch_compile:
        raise ValueError("enable_torch_compile=True: sparse_rl_kv was not run under torch.compile; turn it off")


_SESSION_ORIGINALS: dict = {}
"""SGLang's own StreamingSession.try_cache_finished_req, kept when `wrap_streaming_session` first wraps it in this
(scheduler) process (SchedulerPoolStatsObserver.session_held_tokens is replaced, not wrapped)."""


def wrap_streaming_session(backend: SparseTritonAttnBackend) -> None:
    """Tie SGLang 0.5.23's streaming sessions (`srt/session/streaming_session.py`), which keep an episode's request
    row between its turns, to `backend` (in SGLang's scheduler process, one backend per process; a later backend
    replaces the earlier one's ties):
    - `StreamingSession.try_cache_finished_req(req)` -> True when the session kept the row of a turn that finished
      (or was retracted): then `backend.park(row, req.rid, req.finished())`, with the row read before SGLang detaches
      the request's KV record;
    - `SchedulerPoolStatsObserver.session_held_tokens()`, which SGLang's idle leak check (`available + evictable +
      protected + session_held == total`, strict by default) adds up per kept row as its logical length: each row's
      held slots (`backend.session_held_slots`), since a compressed row holds only its live suffix.
    Class attributes are replaced (the observer is a frozen, slotted dataclass)."""
    from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver
    from sglang.srt.session.streaming_session import StreamingSession

    keep = _SESSION_ORIGINALS.setdefault("try_cache_finished_req", StreamingSession.try_cache_finished_req)

    def try_cache_finished_req(session, req) -> bool:
        row = req.kv.req_pool_idx if req.kv.holds_kv else None
        kept = keep(session, req)
        if kept and row is not None:
            backend.park(int(row), req.rid, bool(req.finished()))
        return kept

    def session_held_tokens(observer) -> int:
        return sum(backend.session_held_slots(kv) for kv in observer._session_kv_rows())

    StreamingSession.try_cache_finished_req = try_cache_finished_req
    SchedulerPoolStatsObserver.session_held_tokens = session_held_tokens
