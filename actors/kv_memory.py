"""Predicted KV-cache bytes of the torch engine (issue 13, the preflight): plain integers, no torch.

The torch engine (actors/torch_engine.py) allocates, per layer, K and V buffers
`[rows, kv_heads, capacity, head_dim]` of the model dtype, with

    capacity = min(B + interval, min(P, B) + N)   compressing (B = kv_budget)
    capacity = P + N                              dense (method full)

(P = prompt width of the batch, the longest prompt; N = max_new_tokens), and reports as a sequence's peak KV
bytes (`Sample.kv_peak_bytes`) these buffers plus the largest K/V transient beside them: one layer's prompt
K/V at prefill (P tokens), or one compaction chunk (min(32, B) tokens) when compressing. This module is that
formula, so the preflight can size a run before anything starts; tests/actors/test_kv_budget.py checks it
against the engine's measured buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

COMPACT_CHUNK = 32
"""Slots moved per step of the torch engine's in-place compaction (actors.torch_engine.COMPACT_CHUNK)."""
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelShape:
    """KV-relevant shape of a decoder: layers, KV heads, head dim (elements), bytes per element of the cache."""
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers and KV heads, bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, config, dtype: str) -> "ModelShape":
        """From a transformers config (num_hidden_layers, num_key_value_heads or num_attention_heads, head_dim or
        hidden_size / num_attention_heads) and the engine dtype name (fp32 | bf16). Raises KeyError for another
        dtype name."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, DTYPE_BYTES[dtype])


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
    per_slot_layer = 2 * shape.kv_heads * shape.head_dim * shape.dtype_bytes  # K + V of one token in one layer
    capacity = cache_capacity(prompt_tokens, max_new_tokens, kv_budget, interval, compress)
    transient = per_slot_layer * prompt_tokens
    if compress:
        transient = max(transient, per_slot_layer * min(COMPACT_CHUNK, kv_budget))
    return shape.layers * per_slot_layer * capacity + transient


def episode_kv_peak_bytes_per_sequence(shape: ModelShape, prompt_tokens: int, max_new_tokens: int, total_tokens: int,
                                       longest_prefill: int, kv_budget: int, interval: int, compress: bool) -> int:
    """Upper bound of `Sample.kv_peak_bytes` over every turn of one multi-turn episode whose cache the torch engine
    keeps across turns (actors/episode.py, compressor.protect_observation on), bytes: the first turn as
    `kv_peak_bytes_per_sequence(prompt_tokens, max_new_tokens)`; a later turn prefills at most `longest_prefill`
    ids (the longest observation with its template tokens, + 1: the last sampled id) into the kept cache, whose
    older part its prefill compresses to kv_budget, so its buffers hold at most kv_budget + interval +
    longest_prefill slots (dense: prompt_tokens + total_tokens, the whole episode), plus one layer's prefill K/V
    (or, compressing, a compaction chunk). Whatever the number of turns; `total_tokens`: the most tokens of the
    episode after its prompt (actors.env.max_total_tokens). Token counts are ints >= 1; raises ValueError for a
    count < 1."""
    if min(total_tokens, longest_prefill) < 1:
        raise ValueError(f"total_tokens={total_tokens}, longest_prefill={longest_prefill}: expected >= 1")
    first = kv_peak_bytes_per_sequence(shape, prompt_tokens, max_new_tokens, kv_budget, interval, compress)
    per_slot_layer = 2 * shape.kv_heads * shape.head_dim * shape.dtype_bytes
    if not compress:
        return max(first, shape.layers * per_slot_layer * (prompt_tokens + total_tokens)
                   + per_slot_layer * max(prompt_tokens, longest_prefill))
    later = shape.layers * per_slot_layer * (kv_budget + interval + longest_prefill) + per_slot_layer * max(
        longest_prefill, min(COMPACT_CHUNK, kv_budget))
    return max(first, later)
