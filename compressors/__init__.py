"""KV compression policies for sparse rollouts (docs/SPEC.md §5): pure torch, no model code."""
from compressors.compressor import Compressor, SelectContext, accumulate_attention, build_compressor, gather_kv
from compressors.config import METHODS, SELECTIONS, CompressorConfig

__all__ = ["Compressor", "CompressorConfig", "METHODS", "SELECTIONS", "SelectContext",
           "accumulate_attention", "build_compressor", "gather_kv"]
