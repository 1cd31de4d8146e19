"""Tiny real Llama models and trajectory groups for the learner tests."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from broker.schema import SampleRecord, TrajectoryGroup, decode_group, encode_group

VOCAB = 64


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer random Llama (hidden 32, 4 heads, 2 KV heads, vocab 64, tied embeddings)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def make_groups(num_groups: int = 2, G: int = 4, seed: int = 0, weight_version: int = 0,
                temperature: float = 1.0) -> list[TrajectoryGroup]:
    """Random prompt/response token ids; logp_sparse near a plausible value; rewards 0/1 mixed per group."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(0, VOCAB, size=int(rng.integers(3, 7))).astype(np.int32)
        samples = []
        for i in range(G):
            T = int(rng.integers(2, 9))
            samples.append(SampleRecord(
                prompt_ids=prompt, response_ids=rng.integers(0, VOCAB, size=T).astype(np.int32),
                logp_sparse=(-np.log(VOCAB) + rng.normal(0, 0.1, size=T)).astype(np.float32),
                finish_reason="length" if i == 0 else "stop", reward=float(i % 2), kv_retained_tokens=5))
        groups.append(TrajectoryGroup(run_id="test", group_id=f"g{seed}-{g}", prompt_id=f"p{g}",
                                      weight_version=weight_version, temperature=temperature,
                                      compressor="rkv", kv_budget=16, samples=samples))
    return groups


def wire_groups(out, compressor: str, kv_budgets: list[int], group_ids: list[str],
                weight_version: int = 0, temperature: float = 1.0, kv_quant: str = "model") -> list[TrajectoryGroup]:
    """An engine's `generate` output (a list of samples per prompt) as TrajectoryGroups through the wire
    (encode_group, decode_group): sample k of a prompt has reward k, group i is prompt i's; `kv_quant` the
    engine's KVQuant name."""
    groups = []
    for i, samples in enumerate(out):
        records = [SampleRecord(np.asarray(s.prompt_ids, np.int32), np.asarray(s.response_ids, np.int32),
                                s.logp_sparse, s.finish_reason, float(k), s.kv_retained_tokens, s.kv_peak_bytes,
                                eviction_steps=s.eviction_steps, rounding_hints=s.rounding_hints)
                   for k, s in enumerate(samples)]
        groups.append(decode_group(encode_group(TrajectoryGroup(
            run_id="r", group_id=group_ids[i], prompt_id=f"p{i}", weight_version=weight_version,
            temperature=temperature, compressor=compressor, kv_budget=kv_budgets[i], samples=records,
            kv_quant=kv_quant))))
    return groups


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)
