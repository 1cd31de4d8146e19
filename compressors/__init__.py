"""KV compression policies for sparse rollouts (docs/SPEC.md §5): pure torch, no model code."""
from compressors.compressor import Compressor, accumulate_attention, build_compressor, gather_kv
from compressors.config import METHODS, SELECTIONS, CompressorConfig

__all__ = ["Compressor", "CompressorConfig", "METHODS", "SELECTIONS", "accumulate_attention",
           "build_compressor", "gather_kv"]
