"""The torch engine's cache at compressor.kv_dtype (actors/engines/batch_cache.py): the bytes it stores are the bytes
the precision predicts (codes + float32 scales), every query reads K/V at the stored precision (a teacher-forced
forward whose attention quantize-dequantizes K and V agrees), and kv_dtype model leaves generation as it was."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AttentionInterface

from actors.engines.base import SamplingParams
from actors.engines.kv_memory import ModelShape, cache_capacity, kv_peak_bytes_per_sequence
from actors.engines.torch_engine import TorchEngine
from compressors import CompressorConfig
from compressors.kv_quant import KVQuant, quantize_dequantize
from test_torch_engine import PROMPTS, flat, padded_batch, reference_logp, tiny_model, tiny_tokenizer

torch.set_num_threads(1)
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16                          # tiny_model's
QUANTS = [KVQuant("model"), KVQuant("bf16"), KVQuant("fp8_e4m3"), KVQuant("fp8_e4m3", "layer"), KVQuant("int8"),
          KVQuant("int4")]
# K and V of one token, all layers and KV heads, in an fp32 model (head_dim 16): 2 x 2 x 2 x vector bytes, with
# vector bytes 64 (fp32), 32 (bf16), 16 + 4 (fp8 / int8 with a float32 scale), 16 (fp8, layer scale), 8 + 4 (int4)
TOKEN_BYTES = {"model": 512, "bf16": 256, "fp8_e4m3/token_head": 160, "fp8_e4m3/layer": 128, "int8/token_head": 160,
               "int4/token_head": 96}


def _quantized_kv_reference(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Dense causal attention over left-padded rows (kwargs key_valid bool [R, L]; a pad query sees itself) whose
    K and V [R, Hkv, L, D] (after RoPE) are first quantize-dequantized with kwargs kv_quant."""
    q = kwargs["kv_quant"]
    key, value = quantize_dequantize(key, q), quantize_dequantize(value, q)
    L, groups = key.shape[2], query.shape[1] // key.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    mask = (causal[None] & kwargs["key_valid"][:, None, :]) | torch.eye(L, dtype=torch.bool)[None]
    scores = (query @ key.repeat_interleave(groups, 1).transpose(-1, -2)) * scaling
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    return (probs @ value.repeat_interleave(groups, 1)).transpose(1, 2).contiguous(), probs


AttentionInterface.register("quantized_kv_reference", _quantized_kv_reference)


@pytest.mark.parametrize("q", QUANTS, ids=lambda q: q.name)
def test_stored_bytes_equal_the_bytes_the_precision_predicts(q):
    """Dense (method full): a sample's kv_peak_bytes are the buffers, (P + N) slots x the token's bytes at the
    precision, plus the largest transient (the prefill's K/V at fp32; with a quantized dtype one layer's K/V read
    back at fp32); an episode kept after its turn holds its tokens x the token's bytes, measured on its tensors."""
    assert q.token_bytes(LAYERS, KV_HEADS, HEAD_DIM, 4) == TOKEN_BYTES[q.name]
    engine = TorchEngine(tiny_model("llama"), tiny_tokenizer(),
                         CompressorConfig(method="full", kv_dtype=q.dtype, kv_scale=q.scale))
    P, N = max(map(len, PROMPTS)), 20
    samples = flat(engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=N, n=1, seed=2,
                                                           ignore_eos=True), episodes=["a", "b", "c"]))
    per_layer_fp32 = 2 * KV_HEADS * HEAD_DIM * 4                # one slot's K and V of one layer, fp32
    transient = max(P * per_layer_fp32, (P + N) * per_layer_fp32 if q.stores else 0)   # fp32 model: bf16 copies too
    for s, key in zip(samples, "abc"):
        assert s.kv_peak_bytes == (P + N) * TOKEN_BYTES[q.name] + transient
        tokens = len(s.prompt_ids) + len(s.response_ids) - 1    # the last sampled token's K/V is not computed
        assert engine.episode_kv_bytes(key) == tokens * TOKEN_BYTES[q.name]


@pytest.mark.parametrize("q", [KVQuant("int8"), KVQuant("int4")], ids=lambda q: q.name)
def test_a_compressing_cache_stores_its_capacity_at_the_precision(q):
    """rkv, budget 12 + interval 5: the buffers hold cache_capacity slots (kv_memory.py) at the precision."""
    engine = TorchEngine(tiny_model("llama"), tiny_tokenizer(),
                         CompressorConfig(method="rkv", kv_budget=12, window=4, interval=5, kv_dtype=q.dtype))
    P, N = max(map(len, PROMPTS)), 30
    samples = flat(engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=N, n=2, seed=4,
                                                           ignore_eos=True)))
    capacity = cache_capacity(P, N, 12, 5, compress=True)
    transient = max(P, capacity) * 2 * KV_HEADS * HEAD_DIM * 4   # the prefill's fp32 K/V, or one layer read back
    assert {s.kv_peak_bytes for s in samples} == {capacity * TOKEN_BYTES[q.name] + transient}
    assert all(s.kv_retained_tokens <= 12 + 5 for s in samples)


@pytest.mark.parametrize("q", QUANTS[1:], ids=lambda q: q.name)
def test_every_query_reads_the_stored_precision(q):
    """fp64 model, dense: the engine's log-probs equal a teacher-forced forward whose attention reads K and V
    quantize-dequantized at every position (prefill queries included), to rounding; and differ from the plain
    forward's (else the check would see nothing)."""
    model = tiny_model("qwen2", dtype=torch.float64)
    engine = TorchEngine(model, tiny_tokenizer(), CompressorConfig(method="full", kv_dtype=q.dtype, kv_scale=q.scale))
    samples = flat(engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=25, n=2, seed=5)))
    P = max(map(len, PROMPTS))
    key_valid = padded_batch(samples, P)[1].bool()
    model.set_attn_implementation("quantized_kv_reference")
    ref = reference_logp(model, samples, P, 1.0, kv_quant=q, key_valid=key_valid)
    plain = reference_logp(model, samples, P, 1.0, kv_quant=KVQuant("model"), key_valid=key_valid)
    model.set_attn_implementation("sdpa")
    gap = 0.0
    for s, r, d in zip(samples, ref, plain):
        got = torch.from_numpy(s.logp_sparse).double()
        assert torch.allclose(got, r, atol=2e-6, rtol=1e-6), (got - r).abs().max()
        gap = max(gap, float((got - d).abs().max()))
    assert gap > 1e-4, f"{q.name} did not change any log-prob: the check would not see a missing quantization"


def test_kv_dtype_model_is_unchanged():
    """kv_dtype model stores the model dtype (no scales): the preflight's prediction holds as before; and a bf16
    model stores bit-identical K/V at kv_dtype bf16, so its greedy samples equal kv_dtype model's."""
    model = tiny_model("llama")
    engine = TorchEngine(model, tiny_tokenizer(), CompressorConfig(method="full"))
    P, N = max(map(len, PROMPTS)), 15
    s = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=N, n=1, ignore_eos=True))[0][0]
    assert s.kv_peak_bytes == kv_peak_bytes_per_sequence(ModelShape(LAYERS, KV_HEADS, HEAD_DIM, 4), P, N, 0, 1,
                                                         compress=False)
    bf16 = tiny_model("llama", dtype=torch.bfloat16)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=N, n=1)
    cfgs = [CompressorConfig(method="rkv", kv_budget=12, window=4, interval=5, kv_dtype=d) for d in ("model", "bf16")]
    runs = [flat(TorchEngine(bf16, tiny_tokenizer(), cfg).generate(PROMPTS, greedy)) for cfg in cfgs]
    for a, b in zip(*runs):
        assert a.response_ids == b.response_ids and (a.logp_sparse == b.logp_sparse).all()
        assert a.kv_peak_bytes == b.kv_peak_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("q", QUANTS, ids=lambda q: q.name)
def test_the_preflight_predicts_the_quantized_peak(q, dtype):
    """kv_memory.kv_peak_bytes_per_sequence with ModelShape.from_hf_config(kv_dtype, kv_scale): predicted / measured
    peak = 1.0 (+- 0.1 allowed) for every precision, dense and R-KV (budget 12 + interval 5), on an fp32 and a bf16
    model (bf16 codes in a bf16 model are read without a copy)."""
    model = tiny_model("llama", dtype=dtype)
    name = "fp32" if dtype == torch.float32 else "bf16"
    shape = ModelShape.from_hf_config(model.config, name, q.dtype, q.scale)
    assert shape.bytes_per_token == q.token_bytes(LAYERS, KV_HEADS, HEAD_DIM, dtype.itemsize)
    P, N = max(map(len, PROMPTS)), 30
    for method in ("full", "rkv"):
        cfg = CompressorConfig(method=method, kv_budget=12, window=4, interval=5, kv_dtype=q.dtype, kv_scale=q.scale)
        out = TorchEngine(model, tiny_tokenizer(), cfg).generate(
            PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=N, n=2, seed=4, ignore_eos=True))
        measured = max(s.kv_peak_bytes for s in flat(out))
        predicted = kv_peak_bytes_per_sequence(shape, P, N, 12, 5, compress=method != "full")
        assert abs(predicted / measured - 1) <= 0.1 and predicted == measured, (method, predicted, measured)


@pytest.mark.parametrize("q", [KVQuant("model"), KVQuant("int8"), KVQuant("int4")], ids=lambda q: q.name)
def test_a_byte_budget_keeps_the_tokens_that_fit_at_the_precision(q):
    """compressor.kv_budget_bytes = 14.5 tokens' bytes at the precision: the engine keeps kv_budget = 14 tokens
    (floor), each sample holds at most 14 + interval, its peak is the preflight's at 14 tokens; the same bytes hold
    more tokens at a lower precision; a byte budget of window tokens' bytes is refused naming the field."""
    token = TOKEN_BYTES[q.name]
    cfg = CompressorConfig(method="rkv", kv_budget_bytes=token * 29 // 2, window=4, interval=5, kv_dtype=q.dtype)
    cfg.validate()
    engine = TorchEngine(tiny_model("llama"), tiny_tokenizer(), cfg)
    assert engine.compressor_cfg.kv_budget == 14 and engine.compressor.cfg.kv_budget == 14
    P, N = max(map(len, PROMPTS)), 30
    samples = flat(engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=N, n=2, seed=4,
                                                           ignore_eos=True)))
    assert all(s.kv_retained_tokens <= 14 + 5 for s in samples) and max(s.kv_retained_tokens for s in samples) > 14
    shape = ModelShape.from_hf_config(engine.model.config, "fp32", q.dtype, q.scale)
    assert {s.kv_peak_bytes for s in samples} == {kv_peak_bytes_per_sequence(shape, P, N, 14, 5, compress=True)}
    with pytest.raises(ValueError, match=rf"^compressor\.kv_budget_bytes={4 * token} holds 4 tokens of {token} B "
                                         rf"\(compressor\.kv_dtype={q.dtype}\): expected more than "
                                         r"compressor\.window=4"):
        TorchEngine(tiny_model("llama"), tiny_tokenizer(), dataclasses.replace(cfg, kv_budget_bytes=4 * token))


def test_the_sglang_backend_refuses_a_quantized_kv_dtype():
    """Its pool stores the model dtype: kv_dtype is one of the settings it cannot run (field=value, with that
    reason)."""
    from actors.engines.sglang.contract import unsupported_compressor_settings
    bad = unsupported_compressor_settings(CompressorConfig(kv_dtype="int8"))
    assert list(bad) == ["kv_dtype=int8"] and "KV pool stores the model dtype" in bad["kv_dtype=int8"]
    assert unsupported_compressor_settings(CompressorConfig(kv_dtype="model")) == {}


def test_a_kept_quantized_episode_continues_at_its_precision():
    """Multi-turn (method full): turn 2 reloads turn 1's stored codes and scales and appends to them; the episode
    then holds all its tokens x the int8 token bytes, and its log-probs equal the quantized teacher-forced forward
    over the whole episode (prompt, turn 1, the appended ids, turn 2)."""
    q = KVQuant("int8")
    model = tiny_model("llama", dtype=torch.float64)
    engine = TorchEngine(model, tiny_tokenizer(), CompressorConfig(method="full", kv_dtype="int8"))
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=1, seed=6, ignore_eos=True)
    first = engine.generate([PROMPTS[1]], params, episodes=["e"])[0][0]
    second = engine.generate([[40, 41, 42]], params, episodes=["e"])[0][0]
    episode = PROMPTS[1] + first.response_ids + [40, 41, 42]
    assert engine.episode_kv_bytes("e") == (len(episode) + len(second.response_ids) - 1) * TOKEN_BYTES[q.name]
    whole = dataclasses.replace(second, prompt_ids=episode)
    model.set_attn_implementation("quantized_kv_reference")
    key_valid = padded_batch([whole], len(episode))[1].bool()
    ref = reference_logp(model, [whole], len(episode), 1.0, kv_quant=q, key_valid=key_valid)[0]
    model.set_attn_implementation("sdpa")
    assert torch.allclose(torch.from_numpy(second.logp_sparse).double(), ref, atol=2e-6, rtol=1e-6)


def test_the_actor_publishes_the_tokens_a_byte_budget_holds():
    """actors/rollout_actor.py batch_budgets: with compressor.kv_budget_bytes every prompt's budget (what its group's
    kv_budget says on the wire) is the engine's resolved token budget, not compressor.kv_budget's default."""
    from types import SimpleNamespace

    from actors.rollout_actor import RolloutWorker
    cfg = CompressorConfig(method="rkv", kv_budget_bytes=160 * 20, window=4, interval=5, kv_dtype="int8")
    engine = TorchEngine(tiny_model("llama"), tiny_tokenizer(), cfg)
    worker = SimpleNamespace(cfg=SimpleNamespace(actors=SimpleNamespace(engine=SimpleNamespace(compressor=cfg)),
                                                 train_steps=10),
                             engine=engine)
    assert RolloutWorker.batch_budgets(worker, ["p", "q"], version=3) == ([20, 20], ["", ""])
