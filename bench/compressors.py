"""What one KV compression event costs next to the decode steps it is amortised over (docs/SPEC.md §5).

For one decoder layer (transformers' Qwen2DecoderLayer / LlamaDecoderLayer, random weights, fp32, CPU),
batch 8, kv_budget 512, interval 128:

    compress_overhead_ratio = time of one compression event of that layer (scoring + gather_kv of K and V
                              over the 512 + 128 = 640 cached slots)
                              / time of the 128 decode steps of that layer (attention + MLP)

Shapes: Qwen2.5-7B (hidden 3584, 28 q heads, 4 KV heads, head_dim 128, MLP 18944) and SmolLM2-135M (576,
9, 3, 64, 1536). The decode baseline is measured in the same run with a preallocated KV buffer (no
per-step concatenation), over steps centred on the mean cache length 576 (`--quick`: 32 steps, scaled
to 128; otherwise the 128 steps 512 -> 640 are all run). H2O also pays, on every decode step, the
softmax probabilities it accumulates (the sdpa kernel does not return them) plus `accumulate_attention`;
that per-step cost x 128 is added to its event. `rkv shared` scores once (layer 0) for all layers, so its
scoring is divided by the layer count while every layer still gathers.

Per method also: `tokens_per_s`, the layer's decode rate with its events amortised (interval tokens over the
interval's decode time + one event), and `event_peak_bytes`, the CPU allocator's peak during one event (torch.profiler
memory events: the event's transient tensors, the kept K/V included). `random` (Random Attention, arXiv 2609.03430
§3) and `streamingllm` read no queries and no attention mass: the JSON gives their event time, rate and peak as
ratios to R-KV's and SnapKV's (`vs_rkv`, `vs_snapkv`), and the bytes the SGLang backend's query ring takes per
request row at the Qwen2.5-1.5B shape, which a compressor that reads no queries does not allocate
(`sglang_ring_bytes_per_row`, actors.engines.kv_memory.query_ring_bytes; docs/sglang.md).

Prints a table per shape and, as the very last line, one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

# Run as `python bench/compressors.py`, this file's folder comes first on sys.path and its name would hide
# the `compressors` package: drop that folder.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
from transformers import LlamaConfig, Qwen2Config  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding  # noqa: E402

from actors.engines.kv_memory import query_ring_bytes  # noqa: E402
from compressors import CompressorConfig, SelectContext, accumulate_attention, build_compressor, gather_kv  # noqa: E402

SHAPES = {
    "qwen2.5-7b": (Qwen2Config, Qwen2DecoderLayer, Qwen2RotaryEmbedding,
                   dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                        intermediate_size=18944, num_hidden_layers=28)),
    "smollm2-135m": (LlamaConfig, LlamaDecoderLayer, LlamaRotaryEmbedding,
                     dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                          intermediate_size=1536, num_hidden_layers=30)),
}
METHODS = ("rkv", "snapkv", "h2o", "streamingllm", "random")
NO_SCORE = ("streamingllm", "random")   # the methods that read neither queries nor attention mass
QWEN_1_5B = dict(layers=28, window=8, q_heads=12, head_dim=128, dtype_bytes=2)  # bf16; the SGLang ring's shape


class PreallocatedKV:
    """The layer's cache: K/V buffers [batch, kv_heads, capacity, head_dim]; `update` writes the new slots at
    the fill `n` and returns views of slots [0, n) (duck-types transformers' `Cache.update`)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, n: int):
        self.keys, self.values, self.n = keys, values, n

    def update(self, k, v, layer_idx, *args, **kwargs):
        q = k.shape[2]
        self.keys[:, :, self.n:self.n + q] = k
        self.values[:, :, self.n:self.n + q] = v
        self.n += q
        return self.keys[:, :, :self.n], self.values[:, :, :self.n]


def best_seconds(fn, repeats: int) -> float:
    """Fastest of `repeats` timed calls after one warm-up (the machine is shared: the minimum is the least
    disturbed measurement; numerator and denominator are timed the same way)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def allocator_peak_bytes(fn) -> int:
    """Peak of the bytes torch's CPU allocator holds beyond what it held before, while fn() runs (torch.profiler's
    memory events; numpy-backed tensors are not seen)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


def bench_shape(name: str, batch: int, kv_budget: int, interval: int, window: int, steps: int, repeats: int):
    config_cls, layer_cls, rotary_cls, dims = SHAPES[name]
    config = config_cls(**dims, attn_implementation="sdpa")
    torch.manual_seed(0)
    layer = layer_cls(config, layer_idx=0).eval()
    rotary = rotary_cls(config)
    kv_heads, head_dim, q_heads = config.num_key_value_heads, config.head_dim, config.num_attention_heads
    seq = kv_budget + interval

    # Decode baseline: `steps` single-token steps of the layer centred on the mean cache length.
    start = kv_budget + interval // 2 - steps // 2
    kbuf = torch.randn(batch, kv_heads, seq, head_dim)
    vbuf = torch.randn(batch, kv_heads, seq, head_dim)
    hidden = torch.randn(batch, 1, config.hidden_size)

    def decode_steps():
        cache = PreallocatedKV(kbuf, vbuf, start)
        with torch.inference_mode():
            for i in range(steps):
                pos = torch.full((batch, 1), start + i)
                layer(hidden, position_ids=pos, cache=cache, use_cache=True,
                      position_embeddings=rotary(hidden, pos))

    step_s = best_seconds(decode_steps, repeats) / steps
    decode_interval_s = step_s * interval

    # One compression event over `seq` cached slots.
    keys = torch.randn(batch, kv_heads, seq, head_dim)
    values = torch.randn(batch, kv_heads, seq, head_dim)
    queries = torch.randn(batch, q_heads, window, head_dim)
    valid = torch.ones(batch, kv_heads, seq, dtype=torch.bool)
    attn_mass = torch.rand(batch, kv_heads, seq)
    ctx = SelectContext(attn_mass=attn_mass, positions=torch.arange(seq).expand(batch, seq),
                        seed=torch.arange(batch), event=torch.full((batch,), seq))
    rows = {}
    for method in METHODS:
        compressor = build_compressor(CompressorConfig(method=method, kv_budget=kv_budget, window=window,
                                                       interval=interval))

        def event(compressor=compressor):  # bound: timed in this iteration
            with torch.inference_mode():
                keep_idx = compressor.select(keys, queries, valid, ctx)
                out = [gather_kv(t, keep_idx) for t in (keys, values, valid)]
                if compressor.needs_attention_mass:
                    out.append(gather_kv(attn_mass, keep_idx))
            return out

        event_s = best_seconds(event, repeats)
        extra = {}
        if method == "h2o":
            q1 = torch.randn(batch, q_heads, 1, head_dim)
            k576 = keys[:, :, :kv_budget + interval // 2]
            mass576 = attn_mass[:, :, :kv_budget + interval // 2 - 1]

            # the probabilities sdpa does not return, and their accumulation (defaults bind this iteration's tensors)
            def h2o_step(q1=q1, k576=k576, mass576=mass576):
                with torch.inference_mode():
                    logits = torch.matmul(q1.view(batch, kv_heads, -1, head_dim), k576.transpose(-1, -2))
                    probs = (logits / math.sqrt(head_dim)).softmax(-1).view(batch, q_heads, 1, -1)
                    return accumulate_attention(mass576, probs)

            per_step_s = best_seconds(lambda: [h2o_step() for _ in range(16)], repeats) / 16
            extra = {"per_step_ms": per_step_s * 1e3}
            event_s += per_step_s * interval
        rows[method] = {"event_ms": event_s * 1e3, "ratio": event_s / decode_interval_s,
                        "tokens_per_s": interval / (decode_interval_s + event_s),
                        "event_peak_bytes": allocator_peak_bytes(event), **extra}

    # Shared selection: layer 0 scores once for every layer; each layer still gathers its K, V and validity.
    shared = build_compressor(CompressorConfig(method="rkv", kv_budget=kv_budget, window=window, selection="shared"))
    with torch.inference_mode():
        idx = shared.select(keys, queries, valid)
        score_s = best_seconds(lambda: shared.select(keys, queries, valid), repeats)
        gather_s = best_seconds(lambda: [gather_kv(t, idx) for t in (keys, values, valid)], repeats)
    shared_s = score_s / config.num_hidden_layers + gather_s
    rows["rkv shared"] = {"event_ms": shared_s * 1e3, "ratio": shared_s / decode_interval_s,
                          "tokens_per_s": interval / (decode_interval_s + shared_s),
                          "score_ms": score_s * 1e3, "gather_ms": gather_s * 1e3}
    return {"decode_step_ms": step_s * 1e3, "decode_interval_ms": decode_interval_s * 1e3,
            "layers": config.num_hidden_layers, "methods": rows}


def no_score_ratios(methods: dict) -> dict:
    """For each method in NO_SCORE: its event time, decode rate and event peak bytes over R-KV's and SnapKV's."""
    keys = ("event_ms", "tokens_per_s", "event_peak_bytes")
    return {m: {f"vs_{ref}": {k: round(methods[m][k] / methods[ref][k], 4) for k in keys}
                for ref in ("rkv", "snapkv")} for m in NO_SCORE}


def ring_saved_per_row() -> dict:
    """Bytes per request row of the SGLang backend's per-row buffers at the Qwen2.5-1.5B shape (bf16, window 8), with
    the query ring (rkv, snapkv) and without it (streamingllm, random), and their difference."""
    s = QWEN_1_5B
    with_ring = query_ring_bytes(1, s["layers"], s["window"], s["q_heads"], s["head_dim"], s["dtype_bytes"])
    without = query_ring_bytes(1, s["layers"], 0, s["q_heads"], s["head_dim"], s["dtype_bytes"])
    return {"with_queries": with_ring, "no_queries": without, "saved": with_ring - without,
            "saved_at_4097_rows": 4097 * (with_ring - without)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 decode steps scaled to 128, 3 repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--kv-budget", type=int, default=512)
    parser.add_argument("--interval", type=int, default=128)
    parser.add_argument("--window", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps = 32 if args.quick else args.interval
    repeats = 3 if args.quick else 5

    results = {}
    for name in SHAPES:
        r = bench_shape(name, args.batch, args.kv_budget, args.interval, args.window, steps, repeats)
        results[name] = r
        print(f"\n{name}: batch {args.batch}, kv_budget {args.kv_budget}, interval {args.interval}, "
              f"{args.threads} thread(s); decode step {r['decode_step_ms']:.2f} ms "
              f"({steps} steps measured), {args.interval} steps {r['decode_interval_ms']:.1f} ms")
        print(f"  {'method':<14}{'event ms':>10}{'ratio':>10}{'tokens/s':>10}{'event peak MB':>15}")
        for method, row in r["methods"].items():
            peak = f"{row['event_peak_bytes'] / 2**20:>15.2f}" if "event_peak_bytes" in row else f"{'':>15}"
            print(f"  {method:<14}{row['event_ms']:>10.2f}{row['ratio']:>10.4f}{row['tokens_per_s']:>10.1f}{peak}")

    summary = {
        "compress_overhead_ratio": results["qwen2.5-7b"]["methods"]["rkv"]["ratio"],
        "target": 0.05,
        "threads": args.threads, "quick": args.quick, "decode_steps_measured": steps,
        "shapes": {name: {"decode_step_ms": round(r["decode_step_ms"], 3),
                          **{f"{m}_ratio": round(row["ratio"], 5) for m, row in r["methods"].items()},
                          **{f"{m}_event_ms": round(row["event_ms"], 3) for m, row in r["methods"].items()},
                          **{f"{m}_tokens_per_s": round(row["tokens_per_s"], 1) for m, row in r["methods"].items()},
                          **{f"{m}_event_peak_bytes": row["event_peak_bytes"]
                             for m, row in r["methods"].items() if "event_peak_bytes" in row},
                          "no_score": no_score_ratios(r["methods"])}
                   for name, r in results.items()},
        "sglang_ring_bytes_per_row": ring_saved_per_row(),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
