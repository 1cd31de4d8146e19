"""Bare-GPU check of the torch engine (run by `bash bench/gpu_check.sh --bare`): needs only torch and
transformers (and numpy, which transformers needs), no SGLang, no package index, no network.

    bash bench/gpu_check.sh --bare              # one GPU: Qwen2.5-1.5B-shaped random model, batch 64, 4096 new tokens
    python bench/torch_gpu_check.py --tiny      # CPU smoke test of the same flow on a tiny model (seconds)

Steps, each measured in this run:
  1. build Qwen2.5-1.5B's architecture (28 layers, hidden 1536, 12 heads, 2 KV heads, head_dim 128, vocab 151936,
     tied embeddings) with random bf16 weights directly on the device, and a word-level tokenizer (EOS ignored);
  2. dense (method full) and R-KV (kv_budget 512, interval 128, window 8): the torch engine generates --batch
     prompts x 1 sample, --response-len new tokens, temperature 1; tokens/s, and the peak memory allocated
     during generation above what was allocated before it (`torch.cuda.max_memory_allocated`: K/V plus the
     activations and sampler buffers beside them);
  3. the preflight's prediction of the peak K/V bytes of the batch (actors/engines/kv_memory.py, the formula
     `sparse-rl preflight` uses) beside that measurement and beside the engine's own buffer count;
  4. the same R-KV with the cache stored at fp8_e4m3 with a float32 scale per token and KV head (compressor.kv_dtype,
     docs/kv_cache.md "Quantized KV"; the scale granularity of docs/results-log.md section 11): tokens/s and peak
     memory against R-KV at the model dtype (`fp8_vs_rkv_*`). The torch engine dequantizes on every read with no
     fused kernel, so this measures that path's cost, not what an fp8 attention kernel would give.
Prints each arm's figures as a JSON line when it ends (kept if `timeout` stops a later arm), a table, then ONE
JSON object as the last line. Budget: under 8 minutes on one H200 (not yet run on a
GPU: no GPU was lent when it was written).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# bench/compressors.py would hide the `compressors` package when run as a script: drop bench/ from sys.path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, not installed

import torch  # noqa: E402

QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
"""Qwen2.5-1.5B's architecture (its config.json), without its weights."""
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64, help="prompts per run (1 sample each)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=4096)
    p.add_argument("--kv-budget", type=int, default=512)
    p.add_argument("--interval", type=int, default=128)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU: checks the flow in seconds")
    if p.parse_known_args(argv)[0].tiny:  # tiny defaults; sizes given on the command line still win
        p.set_defaults(batch=4, prompt_len=24, response_len=96, kv_budget=32, interval=16, window=4, dtype="fp32")
    return p.parse_args(argv)


def build(args, device):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    spec = TINY if args.tiny else QWEN25_15B
    cfg = Qwen2Config(**spec, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"w0": 0, "w1": 1}, unk_token="w0")))
    return model, tokenizer, cfg


def main(argv=None) -> dict:
    args = parse_args(argv)
    from actors.engines.base import SamplingParams
    from actors.engines.kv_memory import ModelShape, kv_peak_bytes_per_sequence
    from actors.engines.torch_engine import TorchEngine
    from compressors import CompressorConfig

    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    t0 = time.perf_counter()
    model, tokenizer, cfg = build(args, device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.response_len, n=1, seed=0, ignore_eos=True)
    arms = {"dense": CompressorConfig(method="full"),
            "rkv": CompressorConfig(method="rkv", kv_budget=args.kv_budget, interval=args.interval, window=args.window),
            "rkv_fp8": CompressorConfig(method="rkv", kv_budget=args.kv_budget, interval=args.interval,
                                        window=args.window, kv_dtype="fp8_e4m3", kv_scale="token_head")}
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "batch": args.batch,
              "prompt_len": args.prompt_len, "response_len": args.response_len, "kv_budget": args.kv_budget,
              "interval": args.interval, "dtype": args.dtype, "model": "tiny" if args.tiny else "qwen2.5-1.5b-shape"}
    for name, comp in arms.items():
        engine = TorchEngine(model, tokenizer, comp, device=device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        samples = [s for grp in engine.generate(prompts, params) for s in grp]
        if cuda:
            torch.cuda.synchronize()
        secs = time.perf_counter() - start
        tokens = sum(len(s.response_ids) for s in samples)
        shape = ModelShape.from_hf_config(cfg, args.dtype, comp.kv_dtype, comp.kv_scale)
        predicted = args.batch * kv_peak_bytes_per_sequence(shape, args.prompt_len, args.response_len, args.kv_budget,
                                                            args.interval, compress=comp.method != "full")
        engine_bytes = sum(s.kv_peak_bytes for s in samples)
        measured = torch.cuda.max_memory_allocated() - base if cuda else None
        result[name] = {"tokens_per_s": round(tokens / secs, 1), "seconds": round(secs, 1), "tokens": tokens,
                        "peak_alloc_bytes": measured, "engine_kv_bytes": engine_bytes, "preflight_kv_bytes": predicted,
                        "preflight_vs_peak_alloc": round(predicted / measured, 4) if measured else None,
                        "preflight_vs_engine": round(predicted / engine_bytes, 4)}
        del engine, samples
        print(json.dumps({"arm": name, **result[name]}), flush=True)   # kept if a timeout ends the run later
    d, s, q = result["dense"], result["rkv"], result["rkv_fp8"]
    result["sparse_vs_dense_tokens_per_s"] = round(s["tokens_per_s"] / d["tokens_per_s"], 3)
    result["fp8_vs_rkv_tokens_per_s"] = round(q["tokens_per_s"] / s["tokens_per_s"], 3)
    result["fp8_vs_rkv_engine_kv_bytes"] = round(q["engine_kv_bytes"] / s["engine_kv_bytes"], 4)
    if cuda:
        result["sparse_vs_dense_peak_alloc"] = round(s["peak_alloc_bytes"] / d["peak_alloc_bytes"], 4)
        result["fp8_vs_rkv_peak_alloc"] = round(q["peak_alloc_bytes"] / s["peak_alloc_bytes"], 4)
    result["total_seconds"] = round(time.perf_counter() - t0, 1)
    print(f"torch engine on {result['device']}: {result['model']} {args.dtype}, batch {args.batch}, prompt "
          f"{args.prompt_len}, response {args.response_len}, R-KV budget {args.kv_budget} + interval {args.interval}")
    print(f"{'arm':<8} {'tok/s':>9} {'peak alloc B':>16} {'engine KV B':>16} {'preflight KV B':>16} {'pred/alloc':>10}")
    for name in arms:
        r = result[name]
        alloc = "n/a" if r["peak_alloc_bytes"] is None else f"{r['peak_alloc_bytes']:,}"
        ratio = "n/a" if r["preflight_vs_peak_alloc"] is None else f"{r['preflight_vs_peak_alloc']:.3f}"
        print(f"{name:<8} {r['tokens_per_s']:>9.1f} {alloc:>16} {r['engine_kv_bytes']:>16,} "
              f"{r['preflight_kv_bytes']:>16,} {ratio:>10}")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
