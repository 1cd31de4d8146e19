"""The rollout-engine interface every backend implements (torch now, SGLang on GPU clusters).

Token ids in, token ids out: the learner never re-tokenises text (docs/ARCHITECTURE.md, "Contracts").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import numpy as np
import torch


@dataclass
class SamplingParams:
    """One `RolloutEngine.generate` request's sampling settings, in the engines' names (`n` samples per prompt, as
    SGLang and vLLM name it). A run's user config is `actors.config.SamplingConfig` (`samples_per_prompt` for n);
    `SamplingConfig.sampling_params()` turns it into this, field by field."""
    temperature: float = 1.0
    """Logits are divided by this before softmax; logp_sparse is the log-softmax of logits/temperature."""
    max_new_tokens: int = 256
    """Response length limit in tokens (finish_reason 'length' when reached)."""
    top_p: float = 1.0
    """Nucleus sampling; training rollouts require 1.0 (SPEC §3), evaluation may use less."""
    top_k: int = 0
    """Top-k sampling, 0 = off; training rollouts require 0."""
    n: int = 1
    """G: samples per prompt."""
    stop_strings: list[str] = field(default_factory=list)
    """Generation stops at the first token after which the decoded response contains one of these (that token
    is kept; finish_reason 'stop')."""
    seed: int | None = None
    """Seed of the sampling generator; equal seeds and inputs give equal samples."""
    ignore_eos: bool = False
    """Keep sampling past EOS until max_new_tokens or a stop string (benchmarks of fixed length)."""
    topk_logprobs: int = 0
    """K: also return, at every response position, the K most likely tokens of the sampling distribution and
    their log-probs (`Sample.topk_ids` / `Sample.topk_logprobs`); 0 = off. The learner's acceptance rate
    (learner/acceptance.py, Sparrow §3.1) is computed from them."""


SEED_STRIDE = 1000003
"""Row r of a call with base seed b gets the compressor seed (b x SEED_STRIDE + r) mod 2^63 (`row_seeds`)."""


def row_seeds(base: int, rows: int) -> list[int]:
    """The compressor's sample seed of each row of one generate batch (method random's hash, compressors/scores.py
    `random_hash`): (base x SEED_STRIDE + row) mod 2^63, row = 0 .. rows - 1 (prompt-major: prompt i's sample j is
    row i x n + j). Python ints in [0, 2^63)."""
    return [(int(base) * SEED_STRIDE + r) % 2**63 for r in range(rows)]


def compressor_seeds(seed: int | None, budgets: list[int], n: int, draw) -> list[int]:
    """Each request's compressor seed, prompt-major (len(budgets) x n), as the torch engine gives its rows
    (TorchEngine.generate, `_row_seeds`): the prompts go in one batch per distinct budget (ascending), batch k of
    several with base seed `seed + k`, and each batch's rows get `row_seeds(base, rows)` in prompt order;
    `draw()` -> int gives a batch's base when `seed` is None (the torch engine draws it from its sampling
    generator; unseeded calls are not reproducible on either engine). budgets: one per prompt (tokens)."""
    distinct = sorted(set(int(b) for b in budgets))
    out = [0] * (len(budgets) * n)
    for k, budget in enumerate(distinct):
        index = [i for i, b in enumerate(budgets) if int(b) == budget]
        base = draw() if seed is None else seed + (k if len(distinct) > 1 else 0)
        seeds = row_seeds(base, len(index) * n)
        for row, i in enumerate(index):
            out[i * n:(i + 1) * n] = seeds[row * n:(row + 1) * n]
    return out


def check_sampling(owner: str, *, temperature: float, max_new_tokens: int, top_p: float, top_k: int,
                   topk_logprobs: int = 0, **counts: int) -> None:
    """Range checks shared by SamplingParams and actors.config.SamplingConfig: temperature >= 0,
    max_new_tokens >= 1, 0 < top_p <= 1, top_k >= 0, topk_logprobs >= 0, and each of `counts` (e.g. n) >= 1.

    Raises ValueError naming every bad field as `owner.field`."""
    checks = [(temperature >= 0, "temperature", temperature, ">= 0"),
              (max_new_tokens >= 1, "max_new_tokens", max_new_tokens, ">= 1"),
              (0 < top_p <= 1, "top_p", top_p, "in (0, 1]"),
              (top_k >= 0, "top_k", top_k, ">= 0 (0 = off)"),
              (topk_logprobs >= 0, "topk_logprobs", topk_logprobs, ">= 0 (0 = off)")]
    checks += [(value >= 1, name, value, ">= 1") for name, value in counts.items()]
    bad = [f"{owner}.{name}={value}: expected {rule}" for ok, name, value, rule in checks if not ok]
    if bad:
        raise ValueError("; ".join(bad))


@dataclass
class Sample:
    """One generated response. `logp_sparse[t]` is float32, log pi_sparse(response_ids[t] | prefix)."""
    prompt_ids: list[int]
    response_ids: list[int]
    logp_sparse: np.ndarray
    finish_reason: str
    """'stop' (EOS or stop string) | 'length' (max_new_tokens)."""
    kv_retained_tokens: int
    """Tokens in the KV cache (per layer, per KV head) when the response ended."""
    kv_peak_bytes: int
    """Peak bytes of this sequence's K and V over all layers (measured buffer sizes, not counted tokens)."""
    topk_ids: np.ndarray | None = None
    """With SamplingParams.topk_logprobs = K: int32 [T, K], the K most likely tokens of the sampling
    distribution at each response position (most likely first); None otherwise."""
    topk_logprobs: np.ndarray | None = None
    """float32 [T, K]: their log-probs, the same distribution as logp_sparse (log_softmax(logits / temperature);
    temperature 0: log_softmax(logits)); None without topk_logprobs."""
    trainable: np.ndarray | None = None
    """uint8 [T] for a multi-turn episode (actors/envs/episode.py): 1 where the sampler generated the token, 0 on the
    environment's and the chat template's tokens; None (an engine's own samples): every token was sampled."""
    kv_protected_fraction: float = 0.0
    """The share of the cache's kept tokens that the compressor's protection held (sinks, protect_prompt,
    protect_values; not the window) at this sample's last compression, mean over layers and KV heads; 0 when it
    was never compressed or nothing is protected (Compressor.protected_share). Both engines: the torch engine's
    `BatchCache.protected_fraction`; SGLang's `sparse_rl_kv` backend computes it at each compression of the request and
    hands it over when the request ends (actors/engines/sglang/contract.py PROTECTED_ENV). Where they differ: the torch
    engine compacts the whole batch, so a row within its budget there gets a share while SGLang compresses only a row
    over its budget, and a compression due in the forward of a response's last token runs on the torch engine only
    (records.py); the `sparse_rl_kv_torch` reference backend: 0."""
    eviction_steps: np.ndarray | None = None
    """With the engine's record_evictions: uint16 [layers, heads, P + T], per key of this sample's own tokens
    (prompt, then response) the number of response tokens generated when it was evicted (65535 = never);
    heads = the model's KV heads, or 1 when every head kept the same keys. What the learner replays
    (learner/replay.py, learner.policy_target=sparse); None otherwise."""
    rounding_hints: np.ndarray | None = None
    """With the engine's record_evictions at a kv_dtype that rounds (fp8_e4m3, int8, int4, bf16): int64 [n], the
    elements of this sample's stored K/V whose code a recomputation's rounding noise could change
    (compressors.kv_quant.rounding_hints), each its flat index into [layers, 2 (K, V), kv_heads, P + T, head_dim]
    (the sample's own tokens, prompt then response) << 16 | the code the sampler stored (16 bits,
    compressors.kv_quant.code_bits), ascending. What the learner's replay stores instead of its own code at those
    elements (learner/replay.py); None otherwise."""


EVICTION_NEVER = 65535
"""`Sample.eviction_steps` value of a key never evicted."""


def collapsed_heads(steps: np.ndarray) -> np.ndarray:
    """An eviction record uint16 [layers, heads, L] as every engine hands it over: [layers, 1, L] when every KV head
    of every layer holds the same values (shared selection), else unchanged; contiguous."""
    if (steps == steps[:, :1]).all():
        steps = steps[:, :1]
    return np.ascontiguousarray(steps)


class RolloutEngine(Protocol):
    weight_version: int
    """Version of the weights the engine currently samples with."""

    tokenizer: object
    """The model's Hugging Face tokenizer."""

    vocab_size: int
    """Rows of the model's embedding (its config's vocab_size): the range of token ids `score` takes."""

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 kv_budgets: list[int] | None = None) -> list[list[Sample]]:
        """Generate `params.n` samples for each prompt; returns one list of n Samples per prompt. `kv_budgets`:
        one KV budget (tokens) per prompt (SPEC §5.1: schedules, controller, tiers), None = the compressor's."""
        ...

    def expected_weights(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(Hugging Face name, full shape, dtype) of every weight the engine takes, tied aliases included: what
        broker.weight_sync.WeightReceiver.receive checks the learner's WeightManifest against."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace weights by Hugging Face parameter name; raises ValueError naming every unknown name or
        wrong shape/dtype before anything is changed. Sets `weight_version = version`."""
        ...

    def score(self, token_ids: list[list[int]]) -> list[np.ndarray]:
        """Teacher-forced log-probs of the engine's current weights, untempered: for each sequence, float32
        [len - 1], log p(token t | tokens before it) for t = 1..len - 1, from a forward that keeps every key (no KV
        compression; a sparse engine needs sequences no longer than its smallest budget). What the weight-sync
        fingerprint compares with the learner's (broker/fingerprint.py). Raises ValueError for no sequences, one
        shorter than 2 tokens, or an id outside [0, vocab_size)."""
        ...

    def shutdown(self) -> None:
        """Stop what the engine started (SGLang: its subprocesses; torch: nothing to stop, its kept episodes are
        dropped); the engine is not used after it."""
        ...

    def engine_stats(self) -> dict[str, float]:
        """The engine's own counters since its start (name -> value), which the actor logs per actor as
        `actor/<actor id>/<name>` (docs/SPEC.md §4); {} when the engine has none."""
        ...


def check_score(token_ids: list[list[int]], vocab_size: int) -> None:
    """Every engine's `score` input check: ValueError unless `token_ids` holds at least one sequence, each of >= 2
    ids in [0, vocab_size)."""
    if not token_ids or any(len(ids) < 2 for ids in token_ids):
        raise ValueError("score needs at least one token-id sequence, each of >= 2 tokens")
    bad = sorted({t for ids in token_ids for t in ids if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(f"score: token ids {bad[:8]} outside the vocabulary [0, {vocab_size})")


def check_params(prompts: list[list[int]], params: SamplingParams) -> None:
    """Every engine's input check: raises ValueError when `prompts` is empty or holds an empty prompt, or when
    `params` is out of range (check_sampling)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    check_sampling("SamplingParams", temperature=params.temperature, max_new_tokens=params.max_new_tokens,
                   top_p=params.top_p, top_k=params.top_k, topk_logprobs=params.topk_logprobs, n=params.n)
