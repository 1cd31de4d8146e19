"""Impossible settings and wrong inputs raise ValueError naming the field or argument."""
from __future__ import annotations

import re

import pytest
import torch

from compressors import CompressorConfig, SelectContext, accumulate_attention, build_compressor, gather_kv


@pytest.mark.parametrize("fields, name", [
    (dict(method="rkvv"), "compressor.method"),
    (dict(selection="per_layer"), "compressor.selection"),
    (dict(kv_budget=8, window=8), "compressor.kv_budget=8 must be > compressor.window=8"),
    (dict(window=0), "compressor.window"),
    (dict(interval=0), "compressor.interval"),
    (dict(phase="global"), "compressor.phase='global' is unknown"),
    (dict(rkv_lambda=1.5), "compressor.rkv_lambda"),
    (dict(pool_kernel=4), "compressor.pool_kernel"),
    (dict(similarity_threshold=2.0), "compressor.similarity_threshold"),
    (dict(method="h2o", window=8, h2o_recent=4), "compressor.h2o_recent"),
    (dict(method="h2o", kv_budget=64, h2o_recent=64), "compressor.h2o_recent"),
    (dict(method="streamingllm", kv_budget=10, window=8, sinks=4), "compressor.sinks"),
    (dict(method="streamingllm", sinks=-1), "compressor.sinks"),
    # protected tokens + window must leave the method a slot to choose (streamingllm's sinks alone: <=)
    (dict(kv_budget=12, window=8, sinks=4), "compressor.sinks=4 protected + compressor.window=8 leave no slot"),
    (dict(kv_budget=12, window=8, protect_values=4), "compressor.protect_values=4 protected + compressor.window=8"),
    (dict(kv_budget=12, window=8, sinks=1, protect_prompt="last:2", protect_values=1),
     "compressor.sinks=1 + compressor.protect_prompt=last:2 + compressor.protect_values=1 protected + "
     "compressor.window=8 leave no slot to choose in compressor.kv_budget=12"),
    (dict(method="streamingllm", kv_budget=12, window=8, sinks=3, protect_values=1), "compressor.protect_values=1"),
    (dict(protect_prompt="first:3"), "compressor.protect_prompt='first:3': expected off, all or last:<n>"),
    (dict(protect_prompt="last:0"), "compressor.protect_prompt='last:0'"),
    (dict(protect_values=-1), "compressor.protect_values=-1 must be >= 0"),
    (dict(method="h2o", kv_budget=12, window=2, h2o_recent=8, protect_values=4),
     "compressor.protect_values=4 protected + compressor.h2o_recent=8 leave no slot"),
    (dict(method="random", h2o_recent=32), "compressor.h2o_recent=32 is read by method h2o only"),
])
def test_config_errors_name_the_field(fields, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        build_compressor(CompressorConfig(**fields))


def test_protection_limits_and_defaults():
    # streamingllm's sinks alone may fill the budget with the window (its score is recency); another method's may not
    assert build_compressor(CompressorConfig(method="streamingllm", kv_budget=12, window=8, sinks=4))
    assert build_compressor(CompressorConfig(kv_budget=12, window=8, sinks=3, protect_prompt="all"))  # all: run time
    assert build_compressor(CompressorConfig(method="random", kv_budget=12, window=8))     # h2o_recent left at 64
    assert not CompressorConfig(method="rkv").protects and CompressorConfig(method="streamingllm").protects


def test_h2o_and_sinks_fields_only_checked_for_their_method():
    # h2o_recent=64 > kv_budget=16 is irrelevant to snapkv, and fatal to h2o
    assert build_compressor(CompressorConfig(method="snapkv", kv_budget=16, window=8)).cfg.method == "snapkv"
    with pytest.raises(ValueError, match="h2o_recent"):
        build_compressor(CompressorConfig(method="h2o", kv_budget=16, window=8))


def rkv(**kw):
    return build_compressor(CompressorConfig(method="rkv", kv_budget=4, window=2, **kw))


@pytest.mark.parametrize("keys, queries, valid, name", [
    (torch.randn(1, 6, 4), torch.randn(1, 2, 2, 4), None, "keys"),
    (torch.randn(1, 2, 6, 4), torch.randn(1, 3, 2, 4), None, "q_heads=3 is not a multiple of keys kv_heads=2"),
    (torch.randn(1, 2, 6, 4), torch.randn(1, 2, 2, 8), None, "queries shape"),
    (torch.randn(1, 2, 6, 4), torch.randn(1, 2, 3, 4), None, "w=3"),
    (torch.randn(1, 2, 6, 4), None, None, "queries"),
    (torch.randn(1, 2, 6, 4), torch.randn(1, 2, 2, 4), torch.ones(1, 5, dtype=torch.bool), "valid"),
    (torch.randn(1, 2, 6, 4), torch.randn(1, 2, 2, 4), torch.ones(1, 6), "valid must be a bool"),
    (torch.randn(1, 2, 4, 4), torch.randn(1, 2, 2, 4), None, "seq=4 slots <= compressor.kv_budget=4"),
])
def test_select_errors_name_the_argument(keys, queries, valid, name):
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        rkv().select(keys, queries, valid)


def test_h2o_requires_attention_mass():
    c = build_compressor(CompressorConfig(method="h2o", kv_budget=4, window=1, h2o_recent=2))
    assert c.needs_attention_mass and not rkv().needs_attention_mass
    with pytest.raises(ValueError, match="attn_mass"):
        c.select(torch.randn(1, 1, 6, 4), None, None)
    with pytest.raises(ValueError, match="attn_mass"):
        c.select(torch.randn(1, 1, 6, 4), None, None, SelectContext(attn_mass=torch.zeros(1, 1, 5)))


def test_accumulate_and_gather_errors():
    with pytest.raises(ValueError, match="probs"):
        accumulate_attention(torch.zeros(1, 2, 0), torch.rand(1, 3, 4))
    with pytest.raises(ValueError, match="q_heads=3 is not a multiple of attn_mass kv_heads=2"):
        accumulate_attention(torch.zeros(1, 2, 0), torch.rand(1, 3, 1, 4))
    with pytest.raises(ValueError, match="attn_mass shape"):
        accumulate_attention(torch.zeros(1, 1, 5), torch.rand(1, 1, 1, 4))
    with pytest.raises(ValueError, match="gather_kv"):
        gather_kv(torch.randn(2, 1, 4, 3), torch.zeros(1, 1, 2, dtype=torch.long))
