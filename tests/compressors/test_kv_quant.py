"""compressors/kv_quant.py against values computed by hand (in the comments), not by the code under test: int8
rounding (half to even), fp8 E4M3 bit patterns, int4 nibble order, the zero vector's scale, bytes per vector, the
refused pairs; and the rounding hints against a Python loop over scalars (the boundaries from the formats' values)."""
from __future__ import annotations

import bisect

import numpy as np
import pytest
import torch

from compressors.kv_quant import (
    HINT_ULPS,
    QMAX,
    KVQuant,
    budget_tokens,
    code_bits,
    codes_from_bits,
    dequantize,
    pack_hints,
    quantize,
    quantize_dequantize,
    rounding_hints,
    straight_through,
    unpack_hints,
)

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


# ---------------------------------------------------------------------------------------------- rounding hints
EPS32 = torch.finfo(torch.float32).eps
HINTED = [INT8, INT4, FP8, FP8_LAYER, KVQuant("bf16")]


def _representable(q: KVQuant) -> list[float]:
    """Every finite value a code of `q` stands for in code units, ascending, by formula: integers -qmax .. qmax;
    E4M3 +-(1 + m / 8) 2^(e - 7) (e 1..15, but e 15 m 7, NaN) and the subnormals +-m / 8 2^-6; bfloat16 every
    finite upper half of a float32."""
    if q.dtype in ("int8", "int4"):
        qmax = {"int8": 127, "int4": 7}[q.dtype]
        return [float(k) for k in range(-qmax, qmax + 1)]
    if q.dtype == "fp8_e4m3":
        mags = {m / 8 * 2.0 ** -6 for m in range(8)} | {(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16)
                                                        for m in range(8) if (e, m) != (15, 7)}
        return sorted({s * v for v in mags for s in (1, -1)})
    halves = np.arange(2 ** 16, dtype=np.uint32) << 16
    finite = (halves >> 23) & 0xFF != 0xFF                     # exponent all ones: inf, NaN
    return sorted(set(halves[finite].view(np.float32).astype(np.float64).tolist()))


def _boundaries(q: KVQuant) -> list[float]:
    """The rounding boundaries of `q` in code units: the midpoints of consecutive representable values (none past
    the largest: the codes saturate)."""
    v = _representable(q)
    return [(a + b) / 2 for a, b in zip(v, v[1:])]


def _distance(u: float, mids: list[float]) -> float:
    """|u - the nearest boundary| (bisect over the sorted boundaries)."""
    i = bisect.bisect_left(mids, u)
    return min(abs(u - m) for m in mids[max(i - 1, 0):i + 1])


def _isolated(q: KVQuant, top: float, eps: float) -> list[float]:
    """Boundaries m with 0.05 top < |m| < 0.95 top whose neighbouring boundaries are more than 6 eps away."""
    mids = np.array(_boundaries(q))
    gaps = np.minimum(np.diff(mids, prepend=-np.inf), np.diff(mids, append=np.inf))
    return mids[(abs(mids) > 0.05 * top) & (abs(mids) < 0.95 * top) & (gaps > 6 * eps)].tolist()


TOP = {"int8": 127.0, "int4": 7.0, "fp8_e4m3": 448.0, "bf16": 4.0}
"""Element 0 of the hand-made vectors: the max, so that the token_head scale is exactly 1 (qmax / qmax)."""


def _planted(q: KVQuant, seed: int = 0) -> torch.Tensor:
    """A float32 vector [64] in code units (scale 1: element 0 is TOP), elements 1-8 put at isolated boundaries +- a
    fraction of eps (offsets eps x [-0.5, 0.3, 0.8, -0.9]: inside the band; [2, -3, 1.5, -1.2]: outside), the rest
    random in +-0.9 TOP."""
    g = torch.Generator().manual_seed(seed)
    top = TOP[q.dtype]
    eps = HINT_ULPS * EPS32 * top
    mids = _isolated(q, top, eps)
    u = (torch.rand(64, generator=g) * 2 - 1) * top * 0.9
    u[0] = top
    picks = torch.randint(len(mids), (8,), generator=g).tolist()
    for j, (pick, off) in enumerate(zip(picks, [-0.5, 0.3, 0.8, -0.9, 2, -3, 1.5, -1.2])):
        u[1 + j] = mids[pick] + off * eps
    return u


@pytest.mark.parametrize("q", HINTED, ids=lambda q: q.name)
def test_the_hint_set_is_exactly_the_elements_within_eps_of_a_boundary(q):
    """rounding_hints' set against a Python loop over the scalars: u within eps = HINT_ULPS x fp32 eps x max |u| of
    the nearest boundary (the midpoints of the representable values). The planted elements (1-4 inside the band,
    5-8 outside) and every random one (where the distance is not within 1e-3 eps of eps: fp32 vs float64) agree."""
    u = _planted(q)
    near, _ = rounding_hints(u, q)
    mids, eps = _boundaries(q), HINT_ULPS * EPS32 * float(u.abs().max())
    distance = [_distance(float(v), mids) for v in u.tolist()]
    expected = [d < eps for d in distance]
    assert expected[1:9] == [True] * 4 + [False] * 4
    clear = [abs(d - eps) > 1e-3 * eps for d in distance]
    assert [n for n, c in zip(near.tolist(), clear) if c] == [e for e, c in zip(expected, clear) if c]
    assert near[1:9].tolist() == [True] * 4 + [False] * 4


@pytest.mark.parametrize("q", HINTED, ids=lambda q: q.name)
def test_a_recomputation_within_noise_flips_codes_unless_it_takes_the_hints(q):
    """The sampler's vector x puts elements eps / 4 below boundaries; a recomputation x' = x + eps / 2 there (the
    rounding noise of another kernel, well inside the band) rounds them to the next code: its quantize-dequantize
    differs from the sampler's at exactly those elements. With the sampler's hints (index and code bits of its
    near elements) it equals the sampler's everywhere (same scale: element 0, the max, is not moved)."""
    u = _planted(q, seed=1)
    eps = HINT_ULPS * EPS32 * float(u.abs().max())
    mids = _isolated(q, float(u[0]), eps)
    x = u.clone()
    x[1:9] = torch.tensor(mids[len(mids) // 3:len(mids) // 3 + 8]) - eps / 4
    moved = x.clone()
    moved[1:9] += eps / 2
    sampler = quantize_dequantize(x, q)
    assert torch.equal((quantize_dequantize(moved, q) != sampler).nonzero().flatten(), torch.arange(1, 9))
    near, codes = rounding_hints(x, q)
    index = near.nonzero().flatten()
    assert set(range(1, 9)) <= set(index.tolist())
    hints = (index, code_bits(codes[near], q))
    assert torch.equal(quantize_dequantize(moved, q, hints), sampler)


def test_int4_hints_carry_the_elements_own_signed_nibble():
    # amax 7 -> scale 1; u = [7, -2.5 - eps/4, 1.5 + eps/4, 4.5 + eps/4, 0.25, 0] round to [7, -3, 2, 5, 0, 0];
    # near: elements 1-3 (0.25 and 0 are far from +-0.5); their codes as 16-bit two's complement 0xFFFD, 0x0002,
    # 0x0005; stored nibbles 0x7, 0xD, 0x2, 0x5, 0, 0: bytes (0xD << 4) | 0x7 = 0xD7, (0x5 << 4) | 0x2 = 0x52, 0x00
    eps = HINT_ULPS * EPS32 * 7
    x = torch.tensor([7.0, -2.5 - eps / 4, 1.5 + eps / 4, 4.5 + eps / 4, 0.25, 0.0])
    near, codes = rounding_hints(x, INT4)
    assert near.nonzero().flatten().tolist() == [1, 2, 3]
    bits = code_bits(codes[near], INT4)
    assert bits.tolist() == [0xFFFD, 0x0002, 0x0005]
    assert codes_from_bits(bits, INT4).tolist() == [-3, 2, 5]
    assert quantize(x, INT4)[0].tolist() == [0xD7, 0x52, 0x00]


def _raw(codes: torch.Tensor) -> torch.Tensor:
    """Codes as their bits (uint8 or int16), so that NaN patterns compare equal."""
    return codes.view(torch.uint8) if codes.element_size() == 1 else codes.view(torch.int16)


@pytest.mark.parametrize("q", HINTED, ids=lambda q: q.name)
def test_code_bits_round_trip(q):
    """codes_from_bits(code_bits(c)) == c bit for bit, in [0, 2^16): every fp8 byte (NaN patterns too), every int8 /
    int4 code, 500 random bf16 patterns."""
    if q.dtype == "fp8_e4m3":
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    elif q.dtype == "bf16":
        codes = torch.randint(-2 ** 15, 2 ** 15, (500,), generator=torch.Generator().manual_seed(0),
                              dtype=torch.int16).view(torch.bfloat16)
    else:
        qmax = int(QMAX[q.dtype])
        codes = torch.arange(-qmax, qmax + 1, dtype=torch.int8)
    bits = code_bits(codes, q)
    assert bits.dtype == torch.int64 and int(bits.min()) >= 0 and int(bits.max()) < 2 ** 16
    back = codes_from_bits(bits, q)
    assert back.dtype == codes.dtype and torch.equal(_raw(back), _raw(codes))


def test_packed_hints_keep_index_and_bits_sorted_by_index():
    # (index << 16) | bits: 0 << 16 | 1 = 1; 12345 << 16 | 0x80 = 809,041,920 + 128;
    # (2^47 - 1) << 16 | 0xFFFF = 2^63 - 1
    packed = pack_hints(torch.tensor([2 ** 47 - 1, 0, 12345]), torch.tensor([0xFFFF, 1, 0x80]))
    assert packed.tolist() == [1, 809_041_920 + 128, 2 ** 63 - 1]
    assert [t.tolist() for t in unpack_hints(packed)] == [[0, 12345, 2 ** 47 - 1], [1, 0x80, 0xFFFF]]


def test_hinted_straight_through_backward_is_the_identity():
    """With hints the forward takes the sampler's codes; the gradient reaching x is the upstream one, unchanged."""
    eps = HINT_ULPS * EPS32 * 127
    x = torch.tensor([[127.0, 10.5 + eps / 4, -3.2]], requires_grad=True)
    hints = (torch.tensor([1]), code_bits(torch.tensor([10], dtype=torch.int8), INT8))   # the sampler's 10, not 11
    y = straight_through(x, INT8, hints)
    assert y.detach().tolist() == [[127.0, 10.0, -3.0]]
    upstream = torch.tensor([[2.0, 3.0, 4.0]])
    (passed,) = torch.autograd.grad(y, x, upstream)
    assert torch.equal(passed, upstream)


def test_nothing_is_hinted_where_nothing_is_rounded():
    """kv_dtype model, and bf16 K/V of a bf16 model, store x itself: no hints."""
    x = torch.tensor([1.0, 1.0 + 2.0 ** -8, 3.0])
    assert not rounding_hints(x, KVQuant("model"))[0].any()
    assert not rounding_hints(x.to(torch.bfloat16), KVQuant("bf16"))[0].any()
