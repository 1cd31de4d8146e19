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


def quantize(x: torch.Tensor, q: KVQuant) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Store K or V vectors: x [..., head_dim], any float dtype -> (codes [..., head_dim] (int4: head_dim / 2) of
    `q.code_dtype(x.dtype)`, scale float32 [...] (token_head) or None). Module docstring: the rounding per dtype.
    Raises ValueError for a pair `KVQuant.check` refuses (layer scale with int8 / int4, int4 with an odd head_dim)."""
    q.check(x.shape[-1])
    if not q.stores:
        return x, None
    if q.dtype == "bf16":
        return x.to(torch.bfloat16), None
    xf = x.float()
    qmax = QMAX[q.dtype]
    if q.scaled:
        amax = xf.abs().amax(-1)
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        xf = xf / scale[..., None]
    else:
        scale = None
    if q.dtype == "fp8_e4m3":
        return xf.clamp(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8), scale
    codes = torch.round(xf).clamp(-qmax, qmax).to(torch.int8)
    if q.dtype == "int4":
        nib = codes.view(torch.uint8) & 0x0F
        codes = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor | None, q: KVQuant, dtype: torch.dtype) -> torch.Tensor:
    """Read stored vectors back: codes and scale as `quantize` returns them -> [..., head_dim] of `dtype`
    (code x scale in float32, then cast)."""
    if not q.stores or q.dtype == "bf16":
        return codes.to(dtype)
    if q.dtype == "fp8_e4m3":
        xf = codes.view(torch.float8_e4m3fn).float()
    elif q.dtype == "int8":
        xf = codes.float()
    else:                                                      # int4: sign-extend each nibble
        low, high = (codes & 0x0F).to(torch.int8), (codes >> 4).to(torch.int8)
        pairs = torch.stack([low, high], -1).flatten(-2)
        xf = torch.where(pairs > 7, pairs - 16, pairs).float()
    if scale is not None:
        xf = xf * scale[..., None]
    return xf.to(dtype)


def quantize_dequantize(x: torch.Tensor, q: KVQuant) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype and shape: the values a query reads from a stored vector."""
    return dequantize(*quantize(x, q), q, x.dtype)


def straight_through(x: torch.Tensor, q: KVQuant) -> torch.Tensor:
    """The learner's replayed K or V: forward `quantize_dequantize(x, q)`, backward the identity (straight-through
    estimator, Bengio et al. 2013, arXiv 1308.3432): the gradient reaching x is the one an unquantized forward at
    the quantized values would give. x [..., head_dim], any float dtype; returns x itself when q stores nothing."""
    if not q.stores:
        return x
    return x + (quantize_dequantize(x, q) - x).detach()


def budget_tokens(kv_budget_bytes: int, token_bytes: int) -> int:
    """compressor.kv_budget_bytes as a token budget: floor(kv_budget_bytes / token_bytes), the tokens whose stored K
    and V (all layers and KV heads, scales included: `KVQuant.token_bytes`) fit the bytes."""
    return kv_budget_bytes // token_bytes
