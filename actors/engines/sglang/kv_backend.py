"""SGLang attention backend `sparse_rl_kv`: per-request KV compression with `compressors/`, evicted slots freed.

Registered by `actors.engines.sglang.engine.register_sglang_plugin` (SGLang plugin entry point); selected with
`attention_backend="sparse_rl_kv"` plus `actors.engines.sglang.engine.sparse_engine_kwargs()`. Implements SPEC §5
inside SGLang 0.5.23, with the same schedule as `actors.engines.torch_engine.TorchEngine`:

- prefill: dense causal attention over the prompt; if the prompt is longer than `kv_budget`, each layer is
  compressed right after its attention, scored with the prompt's last `window` queries;
- decode step s (s = 1 for the forward of the first sampled token): attention over the request's retained
  slots; then, if s % interval == 0 and the request holds more than `kv_budget` tokens, each layer is
  compressed after its attention, scored with the last `window` queries of that layer.

How KV lives in SGLang's pool. SGLang stores token t of request r in slot `req_to_token[r, t]` of every
layer's K/V buffer `[slots, kv_heads, head_dim]` (keys after RoPE). A compression keeps, per layer and KV
head, the `kv_budget` best slots (in time order) and packs them into the slots of row positions
[0, kv_budget): slot j of layer l, head h holds the j-th kept token of (l, h). Attention is permutation
invariant and RoPE is already in the keys, so a query attending to these packed slots computes exactly the
attention over its (layer, head)'s kept tokens. Every other slot of the request is then unused by every
layer and head, so it is given back to SGLang's allocator, and its row entries are set to 0 (SGLang's
reserved padding slot); the allocator's `free` is wrapped to drop slot 0, so the scheduler's own free of the
row when the request ends (or is retracted) releases only the slots still held. Retained positions of a
request are [0, n_kept) (packed) and [gap_end, seq_len) (appended since the last compression).

Limits (docs/sglang.md): page size 1, no radix cache, no chunked prefill, no CUDA graphs, no overlap
scheduling, tensor/pipeline parallel size 1, full-attention models; H2O (needs accumulated attention mass
per slot) is not supported here. A retracted request is re-prefilled from its prompt + response so far and
compressed from scratch.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from actors.engines.sglang.contract import TORCH_SPARSE_BACKEND, refusal_line, unsupported_compressor_settings
from compressors import CompressorConfig, SelectContext, build_compressor, gather_kv

KV_STATS_ENV = "SPARSE_RL_KV_STATS"


class SparseKVAttnBackend(AttentionBackend):
    """Torch attention over each request's retained KV slots, compressing them with `compressors/`.

    runner: SGLang's ModelRunner (its req_to_token_pool, token_to_kv_pool, token_to_kv_pool_allocator).
    cfg: CompressorConfig; method rkv | snapkv | streamingllm, selection per_head | shared (h2o, random, protect_prompt,
    protect_values raise ValueError: contract.unsupported_compressor_settings).
    Raises ValueError if the engine settings break the assumptions above (page size, allocator type).
    """

    def __init__(self, runner, cfg: CompressorConfig):
        super().__init__()
        if cfg.method in ("h2o", "full"):
            raise ValueError(f"compressor.method={cfg.method!r} is not supported by the SGLang sparse backend "
                             "(h2o needs per-slot attention mass; full should use SGLang's own backend)")
        if bad := unsupported_compressor_settings(cfg, TORCH_SPARSE_BACKEND):
            raise ValueError(f"{refusal_line(bad, 'compressor.')} (the SGLang sparse backend cannot run this yet; "
                             "contract.unsupported_compressor_settings)")
        self.cfg = cfg
        self.compressor = build_compressor(cfg)
        self.device = runner.device
        self.req_to_token = runner.req_to_token_pool.req_to_token                 # [rows, max_context] int32
        self.kv_pool = runner.token_to_kv_pool
        self.allocator = runner.token_to_kv_pool_allocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        if type(self.allocator) is not TokenToKVPoolAllocator:
            raise ValueError(f"sparse_rl_kv needs SGLang's TokenToKVPoolAllocator (page_size=1, one full-attention "
                             f"pool), the engine has {type(self.allocator).__name__}")
        self.num_layers = self.kv_pool.layer_num
        rows = self.req_to_token.shape[0]
        self.n_kept = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.gap_end = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.steps = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.q_count = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.qwin = None                              # [rows, layers, window, q_heads, head_dim], made on first use
        self.keep_shared = {}
        self.stats = {"peak_used_slots": 0, "freed_slots": 0, "compressions": 0, "pool_slots": self.allocator.size,
                      "used_at_last_extend": 0}
        self.stats_path = os.environ.get(KV_STATS_ENV)
        self.forwards = 0

        # Slot 0 is SGLang's padding slot; compressed rows point evicted positions at it. Drop it when freeing.
        original_free = self.allocator.free

        def free(free_index: torch.Tensor):
            original_free(free_index[free_index != 0])

        self.allocator.free = free

    # ------------------------------------------------------------------ per-forward metadata
    def init_forward_metadata(self, forward_batch):
        """Per forward: on extend, reset the state of the batch's requests; on decode, advance their step
        counters, mark which compress after this step, and build the retained-slot table
        `live_idx` [batch, max_live] (slot ids, 0 where `live_mask` is False)."""
        fb = forward_batch
        if fb.forward_mode.is_idle():
            return
        reqs = fb.req_pool_indices.long()
        seq_lens = fb.seq_lens.long()
        self.keep_shared = {}
        if fb.forward_mode.is_decode():
            self.steps[reqs] += 1
            n_kept, gap_end = self.n_kept[reqs], self.gap_end[reqs]
            live_len = n_kept + seq_lens - gap_end
            max_live = int(live_len.max())
            j = torch.arange(max_live, device=self.device)[None, :]
            pos = torch.where(j < n_kept[:, None], j, gap_end[:, None] + j - n_kept[:, None])
            mask = j < live_len[:, None]
            idx = self.req_to_token[reqs[:, None], pos.clamp(max=self.req_to_token.shape[1] - 1)].long()
            self.live_idx, self.live_mask, self.live_len = idx.masked_fill(~mask, 0), mask, live_len
            self.due = (self.steps[reqs] % self.cfg.interval == 0) & (live_len > self.cfg.kv_budget)
            # Batch rows compressed this step, grouped by retained length (a scored row holds no padding).
            due = self.due.nonzero().squeeze(1)
            self.due_groups = [(n, due[live_len[due] == n]) for n in live_len[due].unique().tolist()]
        else:
            if fb.forward_mode != ForwardMode.EXTEND:
                raise RuntimeError(f"sparse_rl_kv supports extend and decode forwards, got {fb.forward_mode}; "
                                   "start SGLang with sparse_engine_kwargs() (no mixed chunks, no speculation)")
            if fb.extend_prefix_lens is not None and bool((fb.extend_prefix_lens > 0).any()):
                raise RuntimeError("sparse_rl_kv got an extend with a cached prefix; it needs "
                                   "disable_radix_cache=True and chunked_prefill_size=-1 (sparse_engine_kwargs())")
            self.n_kept[reqs], self.gap_end[reqs], self.steps[reqs], self.q_count[reqs] = 0, 0, 0, 0
            self.due = seq_lens > self.cfg.kv_budget
            self.stats["used_at_last_extend"] = int(self.allocator.size - self.allocator.available_size())
        self.forwards += 1
        used = self.allocator.size - self.allocator.available_size()
        self.stats["peak_used_slots"] = max(self.stats["peak_used_slots"], int(used))

    def _store(self, q, k, v, layer, fb, save_kv_cache):
        """Write this forward's K/V [tokens, kv_heads, head_dim] into the pool at `fb.out_cache_loc`; return
        (q as [tokens, q_heads, head_dim], K buffer, V buffer) of this layer. Makes the query window once."""
        if save_kv_cache:
            self.kv_pool.set_kv_buffer(layer, KVWriteLoc(fb.out_cache_loc, None), k, v)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if self.qwin is None:
            self.qwin = torch.zeros(self.req_to_token.shape[0], self.num_layers, self.cfg.window, *q.shape[1:],
                                    dtype=q.dtype, device=self.device)
        return q, self.kv_pool.get_key_buffer(layer.layer_id), self.kv_pool.get_value_buffer(layer.layer_id)

    # ------------------------------------------------------------------ extend (prefill)
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Dense causal attention over each request's prompt; q [tokens, q_heads * head_dim] after RoPE,
        k/v [tokens, kv_heads, head_dim]. Returns o [tokens, q_heads * head_dim]. Prompts longer than
        kv_budget are then compressed (this layer), and after the last layer their evicted slots freed."""
        fb, hq, hkv = forward_batch, layer.tp_q_head_num, layer.tp_k_head_num
        q, k_buf, v_buf = self._store(q, k, v, layer, fb, save_kv_cache)
        o = torch.empty(q.shape[0], hq, layer.v_head_dim, dtype=q.dtype, device=q.device)
        li, w_max = layer.layer_id, self.cfg.window
        start = 0
        for i, (r, n) in enumerate(zip(fb.req_pool_indices.tolist(), fb.extend_seq_lens_cpu)):
            n = int(n)
            slots = self.req_to_token[r, :n].long()
            qs = q[start:start + n].transpose(0, 1)[None]                         # [1, Hq, n, D]
            ks = k_buf[slots].transpose(0, 1)[None].to(q.dtype)                   # [1, Hkv, n, D]
            vs = v_buf[slots].transpose(0, 1)[None].to(q.dtype)
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=layer.scaling, enable_gqa=hq != hkv)
            o[start:start + n] = out[0].transpose(0, 1)
            w = min(w_max, n)
            self.qwin[r, li, w_max - w:] = qs[0, :, n - w:].transpose(0, 1)
            self.q_count[r] = w
            if bool(self.due[i]):
                self._compress(layer, k_buf, v_buf, torch.tensor([r], device=self.device), ks, vs,
                               qs[:, :, n - w:], torch.ones(1, n, dtype=torch.bool, device=self.device))
            start += n
        if li == self.num_layers - 1:
            self._release(fb.req_pool_indices.long()[self.due], fb.seq_lens.long()[self.due])
        return o.reshape(-1, hq * layer.v_head_dim)

    # ------------------------------------------------------------------ decode
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """One query per request over its retained slots (batched, masked); q [batch, q_heads * head_dim].
        Requests due for compression are then compressed (this layer); after the last layer their evicted
        slots are freed."""
        fb, hq, hkv = forward_batch, layer.tp_q_head_num, layer.tp_k_head_num
        q, k_buf, v_buf = self._store(q, k, v, layer, fb, save_kv_cache)
        reqs, li = fb.req_pool_indices.long(), layer.layer_id
        ks = k_buf[self.live_idx].transpose(1, 2).to(q.dtype)                     # [B, Hkv, S, D]
        vs = v_buf[self.live_idx].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(q[:, :, None], ks, vs, attn_mask=self.live_mask[:, None, None, :],
                                             scale=layer.scaling, enable_gqa=hq != hkv)      # [B, Hq, 1, D]
        self.qwin[reqs, li] = torch.cat([self.qwin[reqs, li, 1:], q[:, None]], dim=1)
        if li == 0:
            self.q_count[reqs] = (self.q_count[reqs] + 1).clamp(max=self.cfg.window)
        if self.due_groups:
            for n, group in self.due_groups:
                w = int(self.q_count[reqs[group]].min())
                queries = self.qwin[reqs[group], li, self.cfg.window - w:].permute(0, 2, 1, 3)   # [g, Hq, w, D]
                self._compress(layer, k_buf, v_buf, reqs[group], ks[group, :, :n], vs[group, :, :n], queries,
                               self.live_mask[group, :n])
            if li == self.num_layers - 1:
                due = torch.cat([group for _, group in self.due_groups])
                self._release(reqs[due], fb.seq_lens.long()[due])
        return out[:, :, 0].reshape(-1, hq * layer.v_head_dim)

    # ------------------------------------------------------------------ compression
    def _compress(self, layer, k_buf, v_buf, reqs, ks, vs, queries, valid) -> None:
        """Keep `kv_budget` slots per KV head of this layer for requests `reqs` [g] whose retained K/V are
        ks/vs [g, Hkv, n, D] (time order), and pack them into the slots of row positions [0, kv_budget)."""
        key = tuple(reqs.tolist())
        if self.cfg.selection == "shared" and layer.layer_id > 0:
            keep = self.keep_shared[key]                 # selection "shared": layer 0's choice for every layer
        else:
            keep = self.compressor.select(ks, queries, valid, SelectContext(values=vs, layer=layer.layer_id))
            self.keep_shared[key] = keep
        budget, hkv = self.cfg.kv_budget, ks.shape[1]
        target = self.req_to_token[reqs, :budget].long()[:, None, :].expand(-1, hkv, budget)
        heads = torch.arange(hkv, device=self.device)[None, :, None]
        k_buf[target, heads] = gather_kv(ks, keep).to(k_buf.dtype)
        v_buf[target, heads] = gather_kv(vs, keep).to(v_buf.dtype)

    def _release(self, reqs: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """After the last layer compressed requests `reqs` (logical lengths seq_lens): free their slots outside
        row positions [0, kv_budget), point those positions at slot 0, and record the new layout."""
        budget = self.cfg.kv_budget
        for r, n, gap in zip(reqs.tolist(), seq_lens.tolist(), self.gap_end[reqs].tolist()):
            row = self.req_to_token[r]
            freed = row[max(budget, gap):n].long()
            self.allocator.free(freed)
            row[budget:n] = 0
            self.stats["freed_slots"] += int((freed != 0).sum())
        self.n_kept[reqs], self.gap_end[reqs] = budget, seq_lens
        self.stats["compressions"] += int(reqs.numel())
        if self.stats_path:   # replaced whole: the engine's process may read it meanwhile
            with open(self.stats_path + ".part", "w") as f:
                json.dump(self.stats, f)
            os.replace(self.stats_path + ".part", self.stats_path)

    def support_triton(self):
        return False
