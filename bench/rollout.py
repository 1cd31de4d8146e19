"""Rollout throughput and KV memory: our torch engine (dense and R-KV) against `transformers` generate.

    python bench/rollout.py --quick      # tiny random Llama, batch 8, response lengths 512/1024/2048

Every number is measured in this run on the same model, batch and lengths. Prints a table, then ONE JSON
object as the last line:
  dense_vs_hf_generate  our dense tokens/s / HF generate tokens/s, summed over all lengths
  sparse_vs_dense       R-KV tokens/s / our dense tokens/s at the longest length
  kv_bytes_ratio        R-KV peak KV bytes per sequence / dense, at the longest length
  kv_bytes_ratio_bound  (kv_budget + interval) / (prompt + length)
Targets: dense_vs_hf_generate >= 1.0, sparse_vs_dense >= 1.0 at 2048, kv_bytes_ratio <= 1.1 x bound.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Run as `python bench/rollout.py`, bench/ comes first on sys.path and bench/compressors.py would hide the
# `compressors` package: drop that folder.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from actors.engines.base import SamplingParams  # noqa: E402
from actors.engines.torch_engine import TorchEngine  # noqa: E402
from compressors import CompressorConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, lengths 512/1024/2048 (a few minutes on CPU)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-budget", type=int, default=256)
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    vocab = 512
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=True)).eval()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {f"w{i}": i for i in range(vocab)}, unk_token="w0")))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (int(n),), generator=g).tolist()
               for n in torch.linspace(8, 32, args.batch).round()]
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, P - len(p):], mask[r, P - len(p):] = torch.tensor(p), 1

    dense = TorchEngine(model, tokenizer, CompressorConfig(method="full"))
    sparse = TorchEngine(model, tokenizer, CompressorConfig(method="rkv", kv_budget=args.kv_budget,
                                                            interval=args.interval))
    rows, totals = [], {"hf": [0, 0.0], "dense": [0, 0.0], "rkv": [0, 0.0]}
    for length in args.lengths:
        params = SamplingParams(temperature=1.0, max_new_tokens=length, n=1, seed=0, ignore_eos=True)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=length, min_new_tokens=length,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        hf_s, hf_tokens = time.perf_counter() - t, (out.shape[1] - P) * len(prompts)
        result = {"length": length, "hf_generate": hf_tokens / hf_s}
        totals["hf"][0] += hf_tokens
        totals["hf"][1] += hf_s
        for name, engine in (("dense", dense), ("rkv", sparse)):
            t = time.perf_counter()
            samples = [s for grp in engine.generate(prompts, params) for s in grp]
            secs = time.perf_counter() - t
            tokens = sum(len(s.response_ids) for s in samples)
            totals[name][0] += tokens
            totals[name][1] += secs
            result[name] = tokens / secs
            result[f"{name}_kv_bytes"] = max(s.kv_peak_bytes for s in samples)
        result["kv_bytes_ratio"] = result["rkv_kv_bytes"] / result["dense_kv_bytes"]
        result["kv_bytes_ratio_bound"] = (args.kv_budget + args.interval) / (P + length)
        rows.append(result)

    print(f"tiny Llama: {args.layers} layers, hidden 128, 4 heads / 2 KV heads; batch {len(prompts)}, prompts "
          f"{min(map(len, prompts))}-{P} tokens; R-KV budget {args.kv_budget}, interval {args.interval}; "
          f"{args.threads} thread(s)")
    print(f"{'length':>6} {'HF gen tok/s':>12} {'dense tok/s':>11} {'R-KV tok/s':>10} {'dense KV B/seq':>14} "
          f"{'R-KV KV B/seq':>13} {'ratio':>6} {'bound':>6}")
    for r in rows:
        print(f"{r['length']:>6} {r['hf_generate']:>12.0f} {r['dense']:>11.0f} {r['rkv']:>10.0f} "
              f"{r['dense_kv_bytes']:>14,} {r['rkv_kv_bytes']:>13,} {r['kv_bytes_ratio']:>6.3f} "
              f"{r['kv_bytes_ratio_bound']:>6.3f}")
    last = rows[-1]
    rate = {k: v[0] / v[1] for k, v in totals.items()}
    print(json.dumps({
        "dense_vs_hf_generate": round(rate["dense"] / rate["hf"], 3),
        "sparse_vs_dense": round(last["rkv"] / last["dense"], 3),
        "kv_bytes_ratio": round(last["kv_bytes_ratio"], 4),
        "kv_bytes_ratio_bound": round(last["kv_bytes_ratio_bound"], 4),
        "length": last["length"], "batch": len(prompts),
        "tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
    }))


if __name__ == "__main__":
    main()
