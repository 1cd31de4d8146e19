"""Eviction replay's CUDA path on one GPU (docs/SPEC.md §2.4): FlexAttention with a block mask from the eviction record
against the SDPA reference (a dense boolean mask), on a random Qwen2.5-1.5B-shaped model (28 layers, hidden 1536,
12 query / 2 KV heads, vocab 151936; `--small` for a 4-layer one), batch 8, prompt 256 + response 2048 tokens, a
StreamingLLM-like record (budget 512, interval 128: at every compression the cache keeps 4 sinks and the most recent
keys, jittered by a few keys per row, layer and head), so that most blocks far behind the diagonal are empty.

Checks: replayed log-probs of the two paths equal (max |diff| <= 2e-3 in bf16, 1e-4 in fp32), gradients of the
sum of log-probs equal (relative norm <= 2e-2 in bf16, 1e-4 in fp32), and times forward+backward of each:
flex_vs_sdpa_time_ratio (goal < 1 at 2k tokens: the block mask skips the evicted blocks). Prints one JSON object
as the last line.

    python bench/replay_gpu_check.py                 # on a GPU node
    python bench/replay_gpu_check.py --device cpu --small --no-grad --response 128   # the script itself, on a CPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from learner.replay import ATTN_IMPLEMENTATION, NEVER_INDEX  # noqa: E402


def record(B: int, layers: int, heads: int, P: int, T: int, budget: int, interval: int, sinks: int = 4) -> torch.Tensor:
    """replay_evicted_at int32 [B, layers, heads, P + T]: at each compression step s (every `interval` generated
    tokens) the cache keeps the sinks and the most recent budget - sinks keys; a key dropped at step s is unseen by
    queries from P + s on. Heads and rows jitter the kept window by a few keys, so heads differ."""
    L = P + T
    out = torch.full((B, layers, heads, L), NEVER_INDEX, dtype=torch.int32)
    jitter = torch.randint(0, 8, (B, layers, heads))
    for s in range(interval, T, interval):
        col = P + s                        # first query of the step that no longer sees what this step drops
        keep_from = col - (budget - sinks) + jitter             # [B, layers, heads]
        k = torch.arange(L)
        drop = (k[None, None, None] >= sinks) & (k[None, None, None] < keep_from[..., None]) & (out == NEVER_INDEX)
        out[drop] = col
    return out


def run(model, ids, evicted, backend: str, grad: bool):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize() if ids.is_cuda else None
    start = time.perf_counter()
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, replay_evicted_at=evicted, replay_backend=backend).logits.float()
        logp = logits[:, :-1].log_softmax(-1).gather(2, ids[:, 1:, None])[..., 0]
        if grad:
            logp.sum().backward()
    torch.cuda.synchronize() if ids.is_cuda else None
    elapsed = time.perf_counter() - start
    grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None]) if grad else None
    return logp.detach(), grads, elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--small", action="store_true", help="4 layers instead of 28")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=2048)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--interval", type=int, default=128)
    p.add_argument("--no-grad", action="store_true", help="forwards only (FlexAttention has no CPU backward)")
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    cfg = Qwen2Config(vocab_size=151936 if not args.small else 4096, hidden_size=1536 if not args.small else 256,
                      intermediate_size=8960 if not args.small else 512, num_hidden_layers=28 if not args.small else 4,
                      num_attention_heads=12 if not args.small else 4, num_key_value_heads=2,
                      max_position_embeddings=32768, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).to(args.device, dtype)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    B, P, T = args.batch, args.prompt, args.response
    ids = torch.randint(0, cfg.vocab_size, (B, P + T), device=args.device)
    evicted = record(B, cfg.num_hidden_layers, 2, P, T, args.budget, args.interval).to(args.device)
    grad = not args.no_grad
    run(model, ids, evicted, "flex", grad)                         # warm-up: compiles the kernel
    ref, ref_g, sdpa_s = run(model, ids, evicted, "sdpa", grad)
    got, got_g, flex_s = run(model, ids, evicted, "flex", grad)
    logp_tol, grad_tol = (2e-3, 2e-2) if dtype == torch.bfloat16 else (1e-4, 1e-4)
    logp_gap = float((got - ref).abs().max())
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "dtype": args.dtype,
              "layers": cfg.num_hidden_layers, "batch": B, "tokens": P + T, "budget": args.budget,
              "replay_logp_max_abs_flex_vs_sdpa": logp_gap, "logp_ok": logp_gap <= logp_tol,
              "sdpa_s": round(sdpa_s, 4), "flex_s": round(flex_s, 4),
              "flex_vs_sdpa_time_ratio": round(flex_s / sdpa_s, 3),
              "grad": grad}
    if grad:
        rel = float((got_g - ref_g).norm() / ref_g.norm())
        result.update(grad_relative_norm_gap=rel, grad_ok=rel <= grad_tol)
    for k, v in result.items():
        print(f"{k:36s} {v}")
    print(json.dumps(result))
    if not (result["logp_ok"] and result.get("grad_ok", True)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
