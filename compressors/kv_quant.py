"""Quantized KV storage: the one function that stores K or V at a lower precision and reads it back. The torch
engine's cache (actors/engines/batch_cache.py) stores K/V with it; the learner's replayed forward calls the same
function (`straight_through`, learner/replay.py) so both see the same values at the same positions.

A K or V vector is one token's `head_dim` values for one layer and KV head. Precisions (`compressor.kv_dtype`):

    model     the model dtype, stored as it is (no quantization; the default)
    bf16      bfloat16, no scale (round to nearest even)
    fp8_e4m3  torch.float8_e4m3fn codes (stored as their uint8 bits), x / scale rounded to nearest even, saturating
              at +-448 (the E4M3 format of "FP8 Formats for Deep Learning", arXiv 2209.05433: bias 7, no infinities);
              dequantized code x scale
    int8      round(x / scale) clamped to [-127, 127] (symmetric; torch.round: half to even)
    int4      round(x / scale) clamped to [-7, 7], packed two per byte (element 2i in the low nibble, 2i + 1 in the
              high one, two's complement); head_dim must be even

Scale granularity (`compressor.kv_scale`) of fp8_e4m3 / int8 / int4:

    token_head  one float32 scale per vector (token, layer, KV head; K and V each their own): amax / qmax
                (qmax 448, 127, 7; a zero vector gets scale 1), computed when the token is written and stored beside
                its codes (4 B per vector, counted in every byte figure)
    layer       one static scale per layer for K and one for V, 1.0 (SGLang's fp8 KV pool, `kv_cache_dtype=fp8_e4m3`,
                with a checkpoint that carries no k_scale / v_scale); fp8_e4m3 only; model constants, not per-sequence
                bytes

The arithmetic runs in float32 whatever the model dtype; a dequantized vector is returned in the dtype asked for.

Rounding hints (docs/kv_cache.md "Rounding hints"): the sampler and the learner compute K/V with different rounding
(a decode step against one forward over the sequence), and an element within that noise of a code boundary would get
the other code on one side. `rounding_hints` finds those elements where the sampler stores them (its code units
within eps = HINT_ULPS x the model dtype's epsilon x the vector's max of a boundary); the engine sends their codes
(`code_bits`, packed with their positions by `pack_hints`) and the learner's `straight_through(x, q, hints)` stores
them instead of its own.
MiKV (arXiv 2402.18096) and "More Tokens, Lower Precision" (arXiv 2412.12706) motivate the pairing with eviction.
"""
from __future__ import annotations

import dataclasses

import torch

KV_DTYPES = ("model", "bf16", "fp8_e4m3", "int8", "int4")
KV_SCALES = ("token_head", "layer")
QMAX = {"fp8_e4m3": 448.0, "int8": 127.0, "int4": 7.0}
"""The largest code magnitude of each scaled precision (float8_e4m3fn's largest finite value; symmetric integers)."""
SCALE_BYTES = 4
"""Bytes of one token_head scale (float32)."""
HINT_ULPS = 1024.0
"""The half-width of a rounding hint's band (`rounding_hints`): eps = HINT_ULPS x finfo(model dtype).eps x the
vector's largest magnitude in code units. Measured at the main job's shape (`python bench/replay_kv_quant.py --noise
--arms fp8_replay_eqbytes --threads 1`: smollm2-count-warm's 16 rollouts at fp32, fp8_e4m3 per token and KV head,
R-KV at 180 tokens, the replay hinted so that no flip cascades): the learner's K/V differ from the sampler's by at
most 88 fp32 epsilons in code units relative to their vector's max (69 of x itself; 8 at layer 0, 19-88 over the
other 29 layers, AVX-512 CPU). 1024 is 11.6x that."""
HINT_CODE_BITS = 16
"""A packed rounding hint (`pack_hints`) holds the sampler's code in its low 16 bits, the element's index above."""


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """A KV quantizer: `dtype` one of KV_DTYPES, `scale` one of KV_SCALES (read by fp8_e4m3 / int8 / int4 only).
    `name` is the spelling meant to travel with each trajectory group so the learner replays the sampler's."""
    dtype: str = "model"
    scale: str = "token_head"

    @property
    def stores(self) -> bool:
        """True when K/V are stored at another precision than the model's (every dtype but `model`)."""
        return self.dtype != "model"

    @property
    def scaled(self) -> bool:
        """True when each vector stores its own float32 scale (fp8_e4m3 / int8 / int4 with token_head)."""
        return self.dtype in QMAX and self.scale == "token_head"

    @property
    def name(self) -> str:
        """"model", "bf16", or "<dtype>/<scale>" (e.g. "fp8_e4m3/token_head"): the wire's and MLflow's spelling."""
        return f"{self.dtype}/{self.scale}" if self.dtype in QMAX else self.dtype

    @classmethod
    def parse(cls, name: str) -> KVQuant:
        """The inverse of `name`. Raises ValueError for an unknown dtype or scale."""
        dtype, _, scale = str(name).partition("/")
        q = cls(dtype, scale or "token_head")
        q.check()
        return q

    def check(self, head_dim: int | None = None) -> None:
        """ValueError naming compressor.kv_dtype / compressor.kv_scale for an unknown or impossible pair (layer
        scale with another dtype than fp8_e4m3; int4 with an odd head_dim)."""
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"compressor.kv_dtype={self.dtype!r} is unknown: expected one of {KV_DTYPES}")
        if self.scale not in KV_SCALES:
            raise ValueError(f"compressor.kv_scale={self.scale!r} is unknown: expected one of {KV_SCALES}")
        if self.scale == "layer" and self.dtype != "fp8_e4m3":
            raise ValueError(f"compressor.kv_scale='layer' with compressor.kv_dtype={self.dtype!r}: a static "
                             "per-layer scale (1.0, SGLang's fp8 pool) is offered for fp8_e4m3 only, use token_head")
        if self.dtype == "int4" and head_dim is not None and head_dim % 2:
            raise ValueError(f"compressor.kv_dtype='int4' packs two values per byte: head_dim={head_dim} is odd")

    def code_shape(self, head_dim: int) -> int:
        """Stored elements per vector: head_dim (int4: head_dim / 2 bytes)."""
        return head_dim // 2 if self.dtype == "int4" else head_dim

    def code_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The storage dtype of the codes: the model's, bfloat16, uint8 (fp8 bits, int4 pairs) or int8."""
        return {"model": model_dtype, "bf16": torch.bfloat16, "fp8_e4m3": torch.uint8, "int8": torch.int8,
                "int4": torch.uint8}[self.dtype]

    def vector_bytes(self, head_dim: int, model_bytes: int) -> int:
        """Bytes one stored K or V vector takes, its scale included: model head_dim x model_bytes; bf16 2 head_dim;
        fp8_e4m3 / int8 head_dim (+ 4 with token_head); int4 head_dim / 2 (+ 4)."""
        codes = {"model": head_dim * model_bytes, "bf16": 2 * head_dim, "fp8_e4m3": head_dim, "int8": head_dim,
                 "int4": head_dim // 2}[self.dtype]
        return codes + SCALE_BYTES * self.scaled

    def token_bytes(self, layers: int, kv_heads: int, head_dim: int, model_bytes: int) -> int:
        """Bytes of one token's stored K and V over all layers and KV heads (the unit of compressor.kv_budget_bytes)."""
        return 2 * layers * kv_heads * self.vector_bytes(head_dim, model_bytes)


def to_code_units(x: torch.Tensor, q: KVQuant) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K or V vectors x [..., head_dim] in code units, the values the rounding to codes sees: fp8_e4m3 / int8 / int4
    u = x / scale in float32 with scale float32 [...] (token_head: amax / qmax, 1 for a zero vector) or None (layer:
    the static 1.0, u = x); bf16 (no scale) x itself, None. For a `q` that stores (not model)."""
    if q.dtype == "bf16":
        return x, None
    xf = x.float()
    if not q.scaled:
        return xf, None
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / QMAX[q.dtype], torch.ones_like(amax))
    return xf / scale[..., None], scale


def round_codes(u: torch.Tensor, q: KVQuant) -> torch.Tensor:
    """Each element's code, unpacked, from code units u [..., head_dim] (`to_code_units`): fp8_e4m3 the uint8 bits
    of u rounded to E4M3 (nearest even, saturating at +-448); int8 / int4 int8 round(u) (half to even) clamped to
    +-qmax; bf16 u as bfloat16. Same shape as u."""
    if q.dtype == "bf16":
        return u.to(torch.bfloat16)
    qmax = QMAX[q.dtype]
    if q.dtype == "fp8_e4m3":
        return u.clamp(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.round(u).clamp(-qmax, qmax).to(torch.int8)


def code_values(codes: torch.Tensor, q: KVQuant) -> torch.Tensor:
    """The values of unpacked codes (`round_codes`) in code units, float32, same shape."""
    if q.dtype == "fp8_e4m3":
        return codes.view(torch.float8_e4m3fn).float()
    return codes.float()


def quantize(x: torch.Tensor, q: KVQuant) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Store K or V vectors: x [..., head_dim], any float dtype -> (codes [..., head_dim] (int4: head_dim / 2) of
    `q.code_dtype(x.dtype)`, scale float32 [...] (token_head) or None). Module docstring: the rounding per dtype.
    Raises ValueError for a pair `KVQuant.check` refuses (layer scale with int8 / int4, int4 with an odd head_dim)."""
    q.check(x.shape[-1])
    if not q.stores:
        return x, None
    u, scale = to_code_units(x, q)
    codes = round_codes(u, q)
    if q.dtype == "int4":                                      # two's complement nibbles, element 2i low
        nib = codes.view(torch.uint8) & 0x0F
        codes = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor | None, q: KVQuant, dtype: torch.dtype) -> torch.Tensor:
    """Read stored vectors back: codes and scale as `quantize` returns them -> [..., head_dim] of `dtype`
    (code x scale in float32, then cast)."""
    if not q.stores:
        return codes.to(dtype)
    if q.dtype == "int4":                                      # sign-extend each nibble
        low, high = (codes & 0x0F).to(torch.int8), (codes >> 4).to(torch.int8)
        pairs = torch.stack([low, high], -1).flatten(-2)
        codes = torch.where(pairs > 7, pairs - 16, pairs)
    xf = code_values(codes, q)
    if scale is not None:
        xf = xf * scale[..., None]
    return xf.to(dtype)


def quantize_dequantize(x: torch.Tensor, q: KVQuant, hints: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype and shape: the values a query reads from a stored vector. With `hints`
    (index int64 [n] into x's elements in row-major order, bits int64 [n] in `code_bits`' form: the sampler's
    rounding hints) the codes at those elements are the sampler's, not x's own, read with x's own scale. Raises
    ValueError as `quantize` does."""
    q.check(x.shape[-1])
    if not q.stores:
        return x
    u, scale = to_code_units(x, q)
    codes = round_codes(u, q)
    if hints is not None and hints[0].numel():
        codes = codes.contiguous()
        codes.view(-1)[hints[0]] = codes_from_bits(hints[1], q)
    xf = code_values(codes, q)
    return (xf if scale is None else xf * scale[..., None]).to(x.dtype)


def straight_through(x: torch.Tensor, q: KVQuant, hints: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> torch.Tensor:
    """The learner's replayed K or V: forward `quantize_dequantize(x, q, hints)`, backward the identity
    (straight-through estimator, Bengio et al. 2013, arXiv 1308.3432): the gradient reaching x is the one an
    unquantized forward at the quantized values would give. x [..., head_dim], any float dtype; `hints` as
    `quantize_dequantize` takes them (the sampler's codes where its rounding was within noise of a boundary);
    returns x itself when q stores nothing."""
    if not q.stores:
        return x
    return x + (quantize_dequantize(x.detach(), q, hints) - x).detach()


def rounding_hints(x: torch.Tensor, q: KVQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the sampler's rounding of K or V vectors x [..., head_dim] (the model dtype, as computed) is within
    noise of a code boundary: (near bool [..., head_dim], codes [..., head_dim] unpacked as `round_codes` gives
    them). An element is near when its code units u (`to_code_units`) rounded at u - eps and at u + eps give codes
    of different values, eps = HINT_ULPS x finfo(x.dtype).eps x max |u| over its vector (code units). Nothing is
    near when q stores nothing or stores x's own dtype (bf16 K/V of a bf16 model)."""
    if not q.stores or (q.dtype == "bf16" and x.dtype == torch.bfloat16):
        return torch.zeros(x.shape, dtype=torch.bool, device=x.device), x
    u, _ = to_code_units(x, q)
    eps = HINT_ULPS * torch.finfo(x.dtype).eps * u.abs().amax(-1, keepdim=True)
    near = code_values(round_codes(u - eps, q), q) != code_values(round_codes(u + eps, q), q)
    return near, round_codes(u, q)


def code_bits(codes: torch.Tensor, q: KVQuant) -> torch.Tensor:
    """Unpacked codes (`round_codes`) as int64 in [0, 2^16): fp8_e4m3 the uint8 bits; int8 / int4 the code in 16-bit
    two's complement; bf16 its 16 bits. The inverse is `codes_from_bits`."""
    if q.dtype == "bf16":
        codes = codes.view(torch.int16)
    return codes.to(torch.int64) & (2 ** HINT_CODE_BITS - 1)


def codes_from_bits(bits: torch.Tensor, q: KVQuant) -> torch.Tensor:
    """int64 code bits (`code_bits`) -> unpacked codes of `round_codes`' dtype (uint8, int8 or bfloat16)."""
    signed = ((bits & 0xFFFF) ^ 0x8000) - 0x8000                # sign-extend 16 bits
    if q.dtype == "fp8_e4m3":
        return bits.to(torch.uint8)
    if q.dtype == "bf16":
        return signed.to(torch.int16).view(torch.bfloat16)
    return signed.to(torch.int8)


def pack_hints(index: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Rounding hints as one int64 array (`Sample.rounding_hints`): index << HINT_CODE_BITS | bits, ascending by index.
    index int64 [n] (an element's flat index, >= 0, < 2^47), bits int64 [n] (`code_bits`)."""
    return torch.sort((index << HINT_CODE_BITS) | bits).values


def unpack_hints(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_hints`: int64 [n] -> (index int64 [n], bits int64 [n])."""
    return packed >> HINT_CODE_BITS, packed & (2 ** HINT_CODE_BITS - 1)


def budget_tokens(kv_budget_bytes: int, token_bytes: int) -> int:
    """compressor.kv_budget_bytes as a token budget: floor(kv_budget_bytes / token_bytes), the tokens whose stored K
    and V (all layers and KV heads, scales included: `KVQuant.token_bytes`) fit the bytes."""
    return kv_budget_bytes // token_bytes
