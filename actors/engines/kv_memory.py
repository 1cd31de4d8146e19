"""Predicted KV-cache bytes of the torch engine (the preflight, docs/SPEC.md §5.1): plain integers, no torch.

The torch engine (actors/engines/torch_engine.py) allocates, per layer, K and V buffers
`[rows, kv_heads, capacity, head_dim]` of the model dtype, with

    capacity = min(B + interval, min(P, B) + N)   compressing (B = kv_budget)
    capacity = P + N                              dense (method full)

(P = prompt width of the batch, the longest prompt; N = max_new_tokens), and reports as a sequence's peak KV
bytes (`Sample.kv_peak_bytes`) these buffers plus the largest K/V transient beside them: one layer's prompt
K/V at prefill (P tokens, model dtype), or one compaction chunk (min(32, B) tokens, stored precision) when
compressing, or, with compressor.kv_dtype stored in another dtype than the model's, one layer's K/V dequantized for a
read (capacity tokens, model dtype). At a quantized kv_dtype the buffers hold codes and scales
(`ModelShape.stored_vector_bytes`, compressors.kv_quant.KVQuant.vector_bytes). This module is that formula, so the
preflight can size a run before anything starts; tests/actors/engines/test_torch_engine.py and
test_kv_quant_cache.py check it against the engine's measured buffers.

`compression_event_bytes` bounds the transient device memory of one compression call of the SGLang sparse backend
(actors/engines/sglang/triton_backend.py), which lives outside SGLang's KV pool; `event_chunk_rows` /
`event_calls` split an event so that each call stays under `EVENT_BYTES_CAP` (docs/sglang.md, "Limits").
`record_bytes_per_request` counts the same backend's eviction records (docs/sglang.md, "Eviction records"), and
`query_ring_bytes` its query ring, for the request rows of SGLang's pool (`sglang_request_rows`).
"""
from __future__ import annotations

from dataclasses import dataclass

from compressors.budget import kv_dims

COMPACT_CHUNK = 32
"""Slots moved per step of the torch engine's in-place compaction (actors/engines/batch_cache.py)."""
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelShape:
    """KV-relevant shape of a decoder: layers, KV heads, head dim (elements), bytes per element of the model dtype
    (K/V as computed and read), and how the cache stores them (compressor.kv_dtype)."""
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    stored_vector_bytes: int = 0
    """Bytes one stored K or V vector takes, its scale included (compressors.kv_quant.KVQuant.vector_bytes);
    0: the model dtype, head_dim x dtype_bytes."""
    read_copy: bool = False
    """True when the stored codes are not of the model dtype: a read dequantizes one layer's K/V (every slot) into a
    model-dtype transient."""

    @property
    def vector_bytes(self) -> int:
        """Stored bytes of one K or V vector (one token, layer and KV head), scale included."""
        return self.stored_vector_bytes or self.head_dim * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers and KV heads as stored (codes and scales), bytes."""
        return 2 * self.layers * self.kv_heads * self.vector_bytes

    @property
    def slot_layer_bytes(self) -> int:
        """Stored K and V of one token in one layer (all KV heads), bytes."""
        return 2 * self.kv_heads * self.vector_bytes

    @property
    def model_slot_layer_bytes(self) -> int:
        """K and V of one token in one layer at the model dtype (a prefill's or a read's transient), bytes."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, config, dtype: str, kv_dtype: str = "model", kv_scale: str = "token_head") -> "ModelShape":
        """From a transformers config (num_hidden_layers, num_key_value_heads or num_attention_heads, head_dim or
        hidden_size / num_attention_heads), the engine dtype name (fp32 | bf16) and compressor.kv_dtype /
        kv_scale (compressors/kv_quant.py). Raises KeyError for another dtype name, ValueError for an unknown
        kv_dtype / kv_scale."""
        layers, kv_heads, head_dim = kv_dims(config)
        shape = cls(layers, kv_heads, head_dim, DTYPE_BYTES[dtype])
        if kv_dtype == "model":
            return shape
        import torch  # late: only a quantized cache needs the quantizer's dtypes

        from compressors.kv_quant import KVQuant
        quant = KVQuant(kv_dtype, kv_scale)
        quant.check(head_dim)
        model = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        return cls(shape.layers, kv_heads, head_dim, shape.dtype_bytes, quant.vector_bytes(head_dim, shape.dtype_bytes),
                   quant.code_dtype(model) != model)


def _peak(shape: ModelShape, capacity: int, prefill_tokens: int, chunk_tokens: int) -> int:
    """One sequence's buffers of `capacity` slots per layer at the stored precision plus the largest transient: a
    prefill of `prefill_tokens` (model dtype), a compaction chunk of `chunk_tokens` (stored; 0: none), and with
    `shape.read_copy` one layer's K/V read back at the model dtype (capacity slots), bytes."""
    read = shape.model_slot_layer_bytes * capacity if shape.read_copy else 0
    transient = max(shape.model_slot_layer_bytes * prefill_tokens, shape.slot_layer_bytes * chunk_tokens, read)
    return shape.layers * shape.slot_layer_bytes * capacity + transient


def cache_capacity(prompt_tokens: int, max_new_tokens: int, kv_budget: int, interval: int, compress: bool) -> int:
    """Slots per layer and KV head the torch engine allocates for a batch of prompt width `prompt_tokens`."""
    if not compress:
        return prompt_tokens + max_new_tokens
    return min(kv_budget + interval, min(prompt_tokens, kv_budget) + max_new_tokens)


def kv_peak_bytes_per_sequence(shape: ModelShape, prompt_tokens: int, max_new_tokens: int, kv_budget: int,
                               interval: int, compress: bool) -> int:
    """Predicted `Sample.kv_peak_bytes` of the torch engine, bytes: the cache buffers of one sequence plus the
    largest transient (prefill: one layer's prompt K/V; compressing: also one compaction chunk).

    All arguments are token counts (ints >= 1), `compress` False for method full (then kv_budget and interval
    are ignored). Raises ValueError for a count < 1."""
    if min(prompt_tokens, max_new_tokens) < 1 or (compress and min(kv_budget, interval) < 1):
        raise ValueError(f"prompt_tokens={prompt_tokens}, max_new_tokens={max_new_tokens}, kv_budget={kv_budget}, "
                         f"interval={interval}: expected >= 1")
    capacity = cache_capacity(prompt_tokens, max_new_tokens, kv_budget, interval, compress)
    return _peak(shape, capacity, prompt_tokens, min(COMPACT_CHUNK, kv_budget) if compress else 0)


def episode_kv_peak_bytes_per_sequence(shape: ModelShape, prompt_tokens: int, max_new_tokens: int, total_tokens: int,
                                       longest_prefill: int, kv_budget: int, interval: int, compress: bool) -> int:
    """Upper bound of `Sample.kv_peak_bytes` over every turn of one multi-turn episode whose cache the torch engine
    keeps across turns (actors/envs/episode.py, compressor.protect_observation on), bytes: the first turn as
    `kv_peak_bytes_per_sequence(prompt_tokens, max_new_tokens)`; a later turn prefills at most `longest_prefill`
    ids (the longest observation with its template tokens, + 1: the last sampled id) into the kept cache, whose
    older part its prefill compresses to kv_budget, so its buffers hold at most kv_budget + interval +
    longest_prefill slots (dense: prompt_tokens + total_tokens, the whole episode), plus one layer's prefill K/V
    (or, compressing, a compaction chunk; with `shape.read_copy`, one layer's K/V read back at the model dtype,
    if larger). Whatever the number of turns; `total_tokens`: the most tokens of the
    episode after its prompt (actors.env.max_total_tokens). Token counts are ints >= 1; raises ValueError for a
    count < 1."""
    if min(total_tokens, longest_prefill) < 1:
        raise ValueError(f"total_tokens={total_tokens}, longest_prefill={longest_prefill}: expected >= 1")
    first = kv_peak_bytes_per_sequence(shape, prompt_tokens, max_new_tokens, kv_budget, interval, compress)
    if not compress:
        return max(first, _peak(shape, prompt_tokens + total_tokens, max(prompt_tokens, longest_prefill), 0))
    return max(first, _peak(shape, kv_budget + interval + longest_prefill, longest_prefill,
                            min(COMPACT_CHUNK, kv_budget)))


SIMILARITY_BLOCK = 1 << 24
"""Entries of one row block of R-KV's key-similarity matrix (compressors.scores._BLOCK_ELEMENTS)."""
EVENT_METHODS = ("rkv", "snapkv", "streamingllm", "random")
"""Compressor methods the SGLang sparse backend runs (it refuses h2o at start)."""
EVENT_BYTES_CAP = 1 << 30
"""Transient bytes one call of the SGLang sparse backend's compression (`_compress_group`) may allocate: the rows
of one event are split into `event_calls` near-equal chunks of at most `event_chunk_rows` rows each, so that
`compression_event_bytes` stays under it."""


def compression_event_bytes(rows: int, live: int, budget: int, window: int, q_heads: int, kv_heads: int,
                            head_dim: int, dtype_bytes: int, method: str = "rkv", record: bool = False,
                            protects: bool = False, value_norms: bool = False) -> int:
    """Upper bound of the device bytes that one call of the `sparse_rl_kv` backend's compression
    (actors/engines/sglang/triton_backend.py `_compress_group`) holds at once, outside SGLang's KV pool and so outside
    `mem_fraction_static`: its index tensors, one layer's gathered K/V and queries, the compressor's float32
    scores and sort, and the gathered kept K/V. Layers run one after another and free their tensors, so the
    bound does not grow with the number of layers. Allocator rounding and fragmentation are not counted.

    rows: requests compressed in the call (g); live: tokens of the longest one (n, the rows are left-padded to
    it); budget: tokens kept (B < n); window: the compressor's window (w); q_heads / kv_heads / head_dim: the
    model's attention shape; dtype_bytes: bytes per K/V element (2 for bf16); method: rkv | snapkv |
    streamingllm | random; record: the backend keeps eviction records (`SGLangEngine(record_evictions=True)`,
    actors/engines/sglang/records.py) or the keys' true positions (a compressor that reads them: random,
    protect_prompt); protects: tokens besides the window are protected (`CompressorConfig.protects`: sinks,
    protect_prompt, protect_values); value_norms: protect_values > 0. Returns bytes (int). Raises ValueError on a
    count < 1, B >= n, or another method. The bound is the same for both selections: `shared` scores every head on
    the first layer as `per_head` does, then sorts g n entries (at most S) and reuses that kept set on the other
    layers, so it holds no tensor `per_head` does not.

    Terms (bytes; S = g Hkv n score entries; E = g (n - B) evicted positions at most):
    - index tensors, the whole call: int64 [g] x 3, [g, n] x 2 (packed), [g, B], [g, w], [E] x 2 (packed copy),
      bool [g, n], int64 slots [g, n], target [g, B];
    - plus the largest of the phases:
      building the slots, 12 g n (int32 gather + its int64 copy); after the layers, 24 E (freed slots + the indices
      that point them at slot 0); in a layer: K and V gathered, 2 g n Hkv D e, and the queries, g w Hq D e (rkv,
      snapkv: the methods that read them), plus the largest of: the kept K (or V) gathered, g Hkv B D (e + 4) (a
      float32 copy on the CPU for 16-bit dtypes); the window importance (rkv, snapkv), 8 g Hq w D (float32 queries,
      reshaped) + 8 g Hkv n D (float32 keys + matmul's copy) + 4 g Hq w n (logits) + 12 g Hkv w n (max over the group,
      scaled, masked, softmax); R-KV's redundancy, 4 g Hkv n (the importance) + 4 x 4 g Hkv n D (normalised keys, their
      flip, matmul's two operand copies) + 5 x the similarity block in float32 + bool (two blocks when there is more
      than one) + 24 S (first similar key and value per row, and their concatenation); the selection, 36 S (masked
      scores, flip, sort values + indices, and as much scratch for a device sort), random: 96 S (its int64 hash's
      temporaries and float64 scores, masked, flipped, sorted), + 32 S with `protects` (the keep classes, their
      stable sort, the reordered indices), + 4 S D + 32 S with `value_norms` (the values in float32, their norms and
      sort), + 8 S with `record` (each key's true position, held through the selection);
    - with `record`: index tensors int64 [g] x 2, [g, n] x 2 more, and a recording phase in each layer after the
      selection, 32 S + 12 g Hkv B (each live key's original index, int32 read and int64 kept, the kept and evicted
      masks, the record's column per key, the index write's linear indices and values; the kept keys' indices,
      int64 and int32).
    Checked against the CPU allocator's measured peak (tests/sglang/test_sglang_event_memory.py)."""
    g, n, B, w, hq, hkv, D, e = rows, live, budget, window, q_heads, kv_heads, head_dim, dtype_bytes
    if min(g, n, B, w, hq, hkv, D, e) < 1 or B >= n:
        raise ValueError(f"rows={g}, live={n}, budget={B}, window={w}, heads {hq}/{hkv}, head_dim={D}, "
                         f"dtype_bytes={e}: expected counts >= 1 and budget < live")
    if method not in EVENT_METHODS:
        raise ValueError(f"method={method!r}: expected rkv | snapkv | streamingllm | random")
    S, E = g * hkv * n, g * (n - B)
    reads = method in ("rkv", "snapkv")              # the window's queries gathered (CompressorConfig.reads_queries)
    index = 8 * (3 * g + 2 * g * n + g * B + g * w + 2 * E) + g * n + 8 * g * n + 8 * g * B
    layer = 2 * g * n * hkv * D * e + reads * g * w * hq * D * e
    select = (96 if method == "random" else 36) * S + 32 * S * protects + (4 * S * D + 32 * S) * value_norms \
        + 8 * S * record
    scores = [g * hkv * B * D * (e + 4), select]
    if method in ("rkv", "snapkv"):
        scores.append(8 * g * hq * w * D + 8 * g * hkv * n * D + 4 * g * hq * w * n + 12 * g * hkv * w * n)
    if record:
        index += 8 * (2 * g + 2 * g * n)
        scores.append(32 * S + 12 * g * hkv * B)
    if method == "rkv":
        block_rows = min(n, max(1, SIMILARITY_BLOCK // S))
        block = g * hkv * block_rows * n
        scores.append(4 * g * hkv * n + 16 * g * hkv * n * D + 5 * block * (1 if block_rows == n else 2) + 24 * S)
    return index + max(12 * g * n, 24 * E, layer + max(scores))


def event_chunk_rows(live: int, budget: int, window: int, q_heads: int, kv_heads: int, head_dim: int,
                     dtype_bytes: int, method: str = "rkv", record: bool = False, protects: bool = False,
                     value_norms: bool = False, cap: int = EVENT_BYTES_CAP) -> int:
    """The most rows one compression call may hold so that `compression_event_bytes` (same arguments) stays at or
    under `cap` bytes; at least 1 (a single row whose bound exceeds the cap is compressed alone)."""
    def fits(g: int) -> bool:
        return compression_event_bytes(g, live, budget, window, q_heads, kv_heads, head_dim, dtype_bytes,
                                       method, record, protects, value_norms) <= cap
    lo, hi = 1, 1
    while fits(hi * 2) and hi < 1 << 20:
        hi *= 2
    hi *= 2
    while hi - lo > 1:                    # fits(lo) or lo == 1; not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def event_calls(rows: int, chunk_rows: int) -> int:
    """Compression calls for `rows` due rows of one budget at most `chunk_rows` rows each (`event_chunk_rows`); the
    backend splits them evenly (numpy.array_split), so a call holds at most ceil(rows / calls) rows."""
    return -(-rows // chunk_rows)


RECORD_WIDTH_STEP = 256
"""Tokens by which the SGLang sparse backend's eviction record grows (actors/engines/sglang/records.py: the longest
request compressed, rounded up to a multiple of this)."""


def record_bytes_per_request(layers: int, kv_heads: int, largest_budget: int, tokens: int) -> int:
    """Device bytes the `sparse_rl_kv` backend's eviction records (actors/engines/sglang/records.py, with
    `SGLangEngine(record_evictions=True)`) hold per live request, outside SGLang's KV pool and so outside
    `mem_fraction_static`: the origin map, int32 [layers, kv_heads, largest_budget] (original token index of each
    packed position), and the step record, int16 [layers, kv_heads, width + 1] with width = `tokens` (the longest
    request's prompt + response tokens) rounded up to RECORD_WIDTH_STEP, + 1 dump column. The buffers hold one slot
    per request live at once (one generate call's: prompts x samples); they grow within a call and are given back
    when its last request leaves, so the bound is the largest call's (its most live requests, its longest request).
    tokens 0: no record, the origin map alone (+ the dump column), which the backend keeps for a compressor that reads
    true positions (random, protect_prompt) when it records nothing. All arguments are counts >= 1 (tokens >= 0);
    raises ValueError otherwise."""
    if min(layers, kv_heads, largest_budget, tokens + 1) < 1:
        raise ValueError(f"layers={layers}, kv_heads={kv_heads}, largest_budget={largest_budget}, tokens={tokens}: "
                         "expected counts >= 1 (tokens >= 0)")
    width = -(-tokens // RECORD_WIDTH_STEP) * RECORD_WIDTH_STEP
    return layers * kv_heads * (4 * largest_budget + 2 * (width + 1))


SGLANG_MAX_AUTO_ROWS = 4096
"""The most request rows SGLang 0.5.23 gives its pool when max_running_requests is unset (kv_cache_configurator.py
`resolve_max_num_reqs`: an estimate from the token capacity and the context length, clamped to [2048, 4096], and at
most half the token capacity)."""


def sglang_request_rows(max_running_requests: int | None, max_total_tokens: int | None) -> int:
    """Upper bound of the request rows of SGLang 0.5.23's pool (`req_to_token`'s first dimension, which the sparse
    backend sizes its per-row buffers by): min(max_running_requests, or SGLANG_MAX_AUTO_ROWS when unset, and
    max_total_tokens // 2 when set), + 1 padding row (row 0). Unset, SGLang's own count depends on the profiled token
    capacity and lies in [2048, 4096]: the bound may be up to 2x that (set actors.engine.sglang.max_running_requests
    to know it). Arguments: counts >= 1 or None."""
    rows = SGLANG_MAX_AUTO_ROWS if max_running_requests is None else int(max_running_requests)
    if max_total_tokens is not None:
        rows = min(rows, int(max_total_tokens) // 2)
    return max(rows, 1) + 1


def query_ring_bytes(rows: int, layers: int, window: int, q_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Device bytes of the `sparse_rl_kv` backend's per-row buffers (actors/engines/sglang/triton_backend.py, allocated
    at the engine's start for every request row of SGLang's pool, outside its KV pool and so outside
    `mem_fraction_static`): the query ring `qwin` [layers, rows, window, q_heads, head_dim] of the engine dtype
    (`dtype_bytes` a value; `window` 0: no ring, as the backend keeps none for a compressor that reads no queries,
    `CompressorConfig.reads_queries`) and three int64 [rows] vectors (each row's live start, each decode lane's row,
    the lane ids): rows x (layers x window x q_heads x head_dim x dtype_bytes + 24), for one backend per engine (SGLang
    0.5.23 builds one; its pdmux and two-batch-overlap modes, not checked with the sparse backend, would build
    several).
    The torch reference backend (`sparse_rl_kv_torch`, kv_backend.py) holds the same ring, made at its first
    forward whatever the method, and four int64 row vectors: 8 B a row more. rows: `sglang_request_rows`. All
    arguments are counts >= 1 (window >= 0); raises ValueError otherwise."""
    if min(rows, layers, window + 1, q_heads, head_dim, dtype_bytes) < 1:
        raise ValueError(f"rows={rows}, layers={layers}, window={window}, q_heads={q_heads}, head_dim={head_dim}, "
                         f"dtype_bytes={dtype_bytes}: expected counts >= 1 (window >= 0)")
    return rows * (layers * window * q_heads * head_dim * dtype_bytes + 3 * 8)
