"""compressors/kv_quant.py against values computed by hand (in the comments), not by the code under test: int8
rounding (half to even), fp8 E4M3 bit patterns, int4 nibble order, the zero vector's scale, bytes per vector, and the
refused pairs."""
from __future__ import annotations

import pytest
import torch

from compressors.kv_quant import KVQuant, budget_tokens, dequantize, quantize, quantize_dequantize, straight_through

INT8 = KVQuant("int8")
FP8 = KVQuant("fp8_e4m3")
FP8_LAYER = KVQuant("fp8_e4m3", "layer")
INT4 = KVQuant("int4")


def test_int8_amax_scale_codes_and_values():
    # amax 1.0 -> scale 1/127; x / scale = [127, -63.5, 31.75] -> codes [127, -64, 32] (-63.5: half to even is -64)
    codes, scale = quantize(torch.tensor([1.0, -0.5, 0.25]), INT8)
    assert codes.dtype == torch.int8 and codes.tolist() == [127, -64, 32]
    assert scale.dtype == torch.float32 and scale.item() == pytest.approx(1 / 127, rel=1e-7)
    # dequantized: code x scale = [1, -64/127, 32/127]
    back = dequantize(codes, scale, INT8, torch.float32)
    assert back.tolist() == pytest.approx([1.0, -64 / 127, 32 / 127], rel=1e-6)


def test_int8_rounds_half_to_even():
    # amax 127 -> scale exactly 1, so x / scale = x: ties 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -62.5 -> -62
    # (half away from zero would give 1, 2, 3, -63)
    codes, scale = quantize(torch.tensor([127.0, 0.5, 1.5, 2.5, -62.5, 200.0 / 2]), INT8)
    assert scale.item() == 1.0
    assert codes.tolist() == [127, 0, 2, 2, -62, 100]


def test_fp8_layer_scale_bits_by_hand_and_as_torch_casts():
    # E4M3 (bias 7, 3 mantissa bits): 1.0 = 0 0111 000 = 0x38; -2.0 = 1 1000 000 = 0xC0; 448 = 0 1111 110 = 0x7E
    # (largest finite); 500 saturates to 448; 2^-9 = the smallest subnormal 0x01; 1.0625 lies halfway between 1.0
    # (0x38) and 1.125 (0x39): even mantissa -> 0x38; 1.1875 halfway between 1.125 (0x39) and 1.25 (0x3A) -> 0x3A.
    x = torch.tensor([0.0, 1.0, -2.0, 448.0, 500.0, -1000.0, 2.0 ** -9, 1.0625, 1.1875])
    codes, scale = quantize(x, FP8_LAYER)
    assert scale is None and codes.dtype == torch.uint8
    assert codes.tolist() == [0x00, 0x38, 0xC0, 0x7E, 0x7E, 0xFE, 0x01, 0x38, 0x3A]
    inside = x.abs() <= 448                                   # torch's own cast, where no saturation is involved
    assert torch.equal(codes[inside], x[inside].to(torch.float8_e4m3fn).view(torch.uint8))
    assert dequantize(codes, None, FP8_LAYER, torch.float32).tolist() == [0.0, 1.0, -2.0, 448.0, 448.0, -448.0,
                                                                        2.0 ** -9, 1.0, 1.25]


def test_fp8_token_head_scale():
    # amax 1.0 -> scale 1/448; x / scale ~ [224, -448, 112, 0] (float32 rounding puts them a hair below, within
    # half a step of E4M3: 224 = 1.75 x 2^7 = 0 1110 110 = 0x76, -448 = 0xFE, 112 = 1.75 x 2^6 = 0 1101 110 = 0x6E)
    codes, scale = quantize(torch.tensor([0.5, -1.0, 0.25, 0.0]), FP8)
    assert codes.tolist() == [0x76, 0xFE, 0x6E, 0x00]
    assert scale.item() == pytest.approx(1 / 448, rel=1e-7)
    assert dequantize(codes, scale, FP8, torch.float32).tolist() == pytest.approx([0.5, -1.0, 0.25, 0.0], rel=1e-6)


def test_int4_packs_element_2i_in_the_low_nibble():
    # amax 7 -> scale 1; codes [7, -7, 1, -2]; two's complement nibbles 0x7, 0x9, 0x1, 0xE;
    # byte 0 = (0x9 << 4) | 0x7 = 0x97, byte 1 = (0xE << 4) | 0x1 = 0xE1
    x = torch.tensor([7.0, -7.0, 1.0, -2.0])
    codes, scale = quantize(x, INT4)
    assert scale.item() == 1.0 and codes.dtype == torch.uint8
    assert codes.tolist() == [0x97, 0xE1]
    assert dequantize(codes, scale, INT4, torch.float32).tolist() == [7.0, -7.0, 1.0, -2.0]


def test_int4_rounds_half_to_even():
    # amax 14 -> scale 2; x / scale = [7, -0.25, 1.25, -3.5 -> -4 (even)]; nibbles 0x7, 0x0, 0x1, 0xC
    codes, scale = quantize(torch.tensor([14.0, -0.5, 2.5, -7.0]), INT4)
    assert scale.item() == 2.0 and codes.tolist() == [0x07, 0xC1]


def test_a_zero_vector_gets_scale_one_and_reads_back_zero():
    for q in (INT8, FP8, INT4):
        codes, scale = quantize(torch.zeros(2, 4), q)
        assert scale.tolist() == [1.0, 1.0]
        back = dequantize(codes, scale, q, torch.float32)
        assert torch.equal(back, torch.zeros(2, 4)), q


def test_one_scale_per_vector_over_leading_dims():
    # [batch 2, heads 3, tokens 5, head_dim 8]: one scale per (batch, head, token), each its own vector's amax / 127
    x = torch.randn(2, 3, 5, 8)
    codes, scale = quantize(x, INT8)
    assert codes.shape == x.shape and scale.shape == (2, 3, 5)
    assert torch.allclose(scale, x.abs().amax(-1) / 127)
    err = (quantize_dequantize(x, INT8) - x).abs()
    assert (err <= scale[..., None] / 2 * (1 + 1e-5)).all()   # round to nearest: at most half a step


@pytest.mark.parametrize("q, head_dim_bytes", [
    # head_dim 64, model fp32 (4 B): the figures, K + V of one token per KV head and layer:
    # fp32 2 x 256 = 512 B, fp8 / int8 with a float32 scale 2 x (64 + 4) = 136 B
    (KVQuant("model"), 256), (KVQuant("bf16"), 128), (FP8, 68), (FP8_LAYER, 64), (INT8, 68), (INT4, 32 + 4),
])
def test_bytes_per_vector_count_the_scale_and_match_the_stored_tensors(q, head_dim_bytes):
    assert q.vector_bytes(64, 4) == head_dim_bytes
    assert q.token_bytes(layers=30, kv_heads=3, head_dim=64, model_bytes=4) == 2 * 30 * 3 * head_dim_bytes
    codes, scale = quantize(torch.randn(10, 64), q)           # what is really stored for 10 vectors
    stored = codes.numel() * codes.element_size() + (0 if scale is None else scale.numel() * scale.element_size())
    assert stored == 10 * head_dim_bytes


def test_budget_tokens_floors():
    assert budget_tokens(136 * 180 + 135, 136) == 180


@pytest.mark.parametrize("q, match", [
    (KVQuant("int8", "layer"), r"compressor\.kv_scale='layer' with compressor\.kv_dtype='int8'"),
    (KVQuant("int4", "layer"), r"compressor\.kv_scale='layer' with compressor\.kv_dtype='int4'"),
    (KVQuant("fp16"), r"compressor\.kv_dtype='fp16' is unknown"),
    (KVQuant("int8", "channel"), r"compressor\.kv_scale='channel' is unknown"),
])
def test_impossible_pairs_are_refused(q, match):
    with pytest.raises(ValueError, match=match):
        q.check()
    with pytest.raises(ValueError, match=match):
        quantize(torch.ones(4), q)


def test_int4_refuses_an_odd_head_dim():
    with pytest.raises(ValueError, match="head_dim=5 is odd"):
        quantize(torch.ones(3, 5), INT4)


def test_names_round_trip():
    for q in (KVQuant("model"), KVQuant("bf16"), FP8, FP8_LAYER, INT8, INT4):
        assert KVQuant.parse(q.name) == q
    assert FP8_LAYER.name == "fp8_e4m3/layer" and KVQuant("bf16", "layer").name == "bf16"
    with pytest.raises(ValueError):
        KVQuant.parse("int8/layer")


def test_model_and_bf16_store_no_scale():
    x = torch.tensor([1.0, 1.0 + 2.0 ** -8, 3.0])            # 1 + 2^-8: a tie between bf16's 1 and 1 + 2^-7 -> 1
    assert quantize(x, KVQuant("model"))[0] is x
    codes, scale = quantize(x, KVQuant("bf16"))
    assert scale is None and codes.dtype == torch.bfloat16 and codes.float().tolist() == [1.0, 1.0, 3.0]


def test_straight_through_forward_quantizes_backward_is_identity():
    x = torch.tensor([[1.0, -0.5, 0.25]], requires_grad=True)
    y = straight_through(x, INT8)
    assert y.detach().tolist()[0] == pytest.approx([1.0, -64 / 127, 32 / 127], rel=1e-6)
    (y * torch.tensor([2.0, 3.0, 4.0])).sum().backward()
    assert x.grad.tolist() == [[2.0, 3.0, 4.0]]
    assert straight_through(x, KVQuant("model")) is x
