"""GPU check of the SGLang rollout engine (run by bench/gpu_check.sh; docs/sglang.md, "GPU check"): dense vs sparse
(R-KV) on a randomly initialised Qwen2.5-1.5B-shaped model, plus the equivalence check against the torch engine.

    bash bench/gpu_check.sh                 # one H200, no network, < 8 minutes
    python bench/sglang_gpu_check.py --dry-run    # CPU: parse args, build + save the tiny model, print the plan
    python bench/sglang_gpu_check.py --tiny       # CPU, SGLang lane venv: the whole flow on a tiny model

Steps (each measured in this run, nothing downloaded):
  1. build Qwen2.5-1.5B's config (28 layers, hidden 1536, 12 heads, 2 KV heads, head_dim 128, vocab 151936,
     tied embeddings), random weights (bf16) and a word-level tokenizer, saved to --model-dir;
  2. dense: SGLangEngine (SGLang's default GPU attention backend, CUDA graphs, prefix cache), batch
     --batch prompts x 1 sample, --response-len new tokens (ignore_eos), temperature 1: tokens/s and KV bytes;
     dense_triton: the same on SGLang's Triton backend under the sparse engine's scheduler settings (overlap
     scheduling off, no radix cache, no chunked prefill, page size 1: `SPARSE_REQUIRED`), so sparse vs
     dense_triton compares the KV handling alone, with the kernels and the scheduler held fixed;
  3. sparse: the same with R-KV (kv_budget --kv-budget, interval 128, window 8) inside SGLang
     (`sparse_rl_kv` backend: SGLang's Triton kernels, CUDA graphs on): tokens/s and the peak of KV slots
     held, measured from SGLang's allocator; then again at the largest batch whose bounded caches fit in the
     dense run's KV pool (same memory: max_total_tokens = batch x (prompt + response));
  4. equivalence: fp32, --eq-prompts prompts (default 3: an odd batch, padded by SGLang's graph runner to its
     capture bucket 4, so a padded graph lane runs beside live rows), greedy, --eq-len tokens: SGLang sparse
     vs TorchEngine with the same compressor (token agreement and max |logp_sparse difference| over the common prefix).
Prints a table, then ONE JSON object as the last line, with the ratios (`sparse_vs_dense*`, targets: same
batch >= 1.0, same memory >= 2.0) against both dense rows, each sparse run's `graph_replays` (the backend's count
of SGLang CUDA-graph replays) and `checks`; it prints what it measured whether or not a target is met. Then it
exits 1 (after the JSON) naming each failed check: on a GPU every sparse run must have replayed its CUDA graph
(`graph_replays` > 0), and the equivalence run must reach a compression before the engines' tokens diverge
(`compression_reached_before_divergence`). Needs only the `gpu` extra (`pip install -e .[gpu]`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# bench/compressors.py would hide the `compressors` package when run as a script: drop bench/ from sys.path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
"""Qwen2.5-1.5B's architecture (its config.json), without its weights."""
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
            initializer_range=0.2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir",
                   default=os.environ.get("SPARSE_RL_GPU_CHECK_MODEL", "/tmp/sparse-rl-qwen2.5-1.5b-random"))
    p.add_argument("--batch", type=int, default=64, help="prompts per run (1 sample each)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=4096)
    p.add_argument("--kv-budget", type=int, default=512)
    p.add_argument("--interval", type=int, default=128)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--eq-prompts", type=int, default=3, help="odd: a padded CUDA-graph lane in the check")
    p.add_argument("--eq-len", type=int, default=768, help="equivalence response length (> kv_budget)")
    p.add_argument("--mem-fraction", type=float, default=0.6)
    p.add_argument("--skip-equivalence", action="store_true")
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (SGLang CPU lane): checks the flow")
    p.add_argument("--dry-run", action="store_true", help="build the model files and print the plan; no SGLang")
    args = p.parse_args(argv)
    if args.tiny:
        # CPU smoke sizes: SGLang's Triton kernels run in Triton's numpy interpreter (~1 s per decode step), so
        # 4 engines x 32-token responses fit the script's timeout on 2 CPU cores (64 did not: 470 s passed).
        # Prompt 20 > budget 16: prefill compression, then decode compressions every 8 steps.
        args.batch, args.prompt_len, args.response_len = 4, 20, 32
        args.kv_budget, args.interval, args.window, args.eq_prompts, args.eq_len = 16, 8, 4, 3, 24
        if args.model_dir.startswith("/tmp/sparse-rl-qwen2.5"):
            args.model_dir = "/tmp/sparse-rl-gpu-check-tiny"
    if args.eq_len <= args.kv_budget and not args.skip_equivalence:
        p.error(f"--eq-len={args.eq_len} must exceed --kv-budget={args.kv_budget} so compression happens")
    return args


def model_info(tiny: bool) -> dict:
    """{"params": parameter count, "kv_bytes_per_token_bf16": K and V bytes of one token over all layers} of
    the Qwen2.5-1.5B-shaped (or TINY) config, computed on the meta device (no memory)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**(TINY if tiny else QWEN25_15B))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    with torch.device("meta"):
        params = sum(p.numel() for p in Qwen2ForCausalLM(cfg).parameters())
    return {"params": params, "layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
            "kv_bytes_per_token_bf16": 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2}


def build_model(model_dir: Path, tiny: bool, device: str) -> None:
    """Save a random Qwen2 (Qwen2.5-1.5B-shaped bf16, or TINY fp32) + word-level tokenizer to model_dir, once
    (a directory whose config.json exists is reused only if its layer count matches)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    # initializer_range 0.1 (Qwen's is 0.02): peaked next-token distributions (median top-1 prob ~0.13 instead of
    # ~2e-4, measured on CPU for this shape, logits finite in bf16), so greedy paths are stable enough to compare
    # engines over hundreds of tokens and eviction visibly matters.
    cfg = Qwen2Config(**(TINY if tiny else dict(QWEN25_15B, initializer_range=0.1)), eos_token_id=0,
                      bos_token_id=None, pad_token_id=None)
    if (model_dir / "config.json").exists():
        saved = json.loads((model_dir / "config.json").read_text())
        if saved.get("num_hidden_layers") != cfg.num_hidden_layers or saved.get("hidden_size") != cfg.hidden_size:
            raise ValueError(f"--model-dir {model_dir} holds a different model ({saved.get('num_hidden_layers')} "
                             f"layers, hidden {saved.get('hidden_size')}); pass another --model-dir")
        return
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.float32 if tiny else torch.bfloat16)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(cfg.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w0").save_pretrained(model_dir)
    del model


def capture_sizes(batch: int) -> list[int]:
    """Decode CUDA-graph batch sizes to capture for a run of `batch` requests: the powers of two below it and
    `batch` rounded up to even (10 graphs at 421 instead of SGLang's ~40, to keep the check short). An odd batch
    (the equivalence run's 3, the same-memory run's 421) then replays a graph one lane larger: SGLang's runner
    pads it, and the padded lane runs beside the live rows."""
    top = batch + batch % 2
    return sorted({1 << i for i in range(top.bit_length()) if 1 << i < top} | {top})


def engine_kwargs(args, dtype: str, dense: bool, batch: int, pool_tokens: int | None = None,
                  triton: bool = False) -> dict:
    """sglang.Engine settings of one run: `batch` concurrent requests; `pool_tokens` fixes the KV pool size
    (the same-memory run), with an eager admission (schedule_conservativeness 0.05) so SGLang, which budgets
    max_new_tokens of growth per request, admits what the bounded cache really needs. `triton` (dense only):
    SGLang's Triton attention backend under the sparse engine's scheduler settings (`SPARSE_REQUIRED`:
    overlap scheduling off, no radix cache, no chunked prefill, page size 1, no prefill graph)."""
    from actors.engines.sglang.engine import SPARSE_REQUIRED

    if args.tiny:
        kw = dict(device="cpu", max_total_tokens=pool_tokens or 4096, mem_fraction_static=0.5,
                  disable_cuda_graph=True, max_running_requests=batch)
        if dense and not triton:
            kw.update(attention_backend="torch_native", disable_overlap_schedule=True)
    else:
        sizes = capture_sizes(batch)       # SGLang captures up to its request pool: max_running_requests
        kw = dict(mem_fraction_static=args.mem_fraction, max_running_requests=sizes[-1],
                  cuda_graph_max_bs_decode=sizes[-1], cuda_graph_bs_decode=sizes)
        if pool_tokens is not None:
            kw.update(max_total_tokens=pool_tokens, schedule_conservativeness=0.05)
    if triton:
        kw.update(SPARSE_REQUIRED, attention_backend="triton")
    return dict(kw, dtype=dtype, random_seed=0, log_level="error")


def run_engine(args, compressor, dtype: str, prompts, params, pool_tokens: int | None = None, triton: bool = False,
               record: bool = False, probe: list | None = None):
    """Start an SGLangEngine, generate once (timed), shut it down. Returns (samples, seconds, pool stats of the
    sparse backend or None, KV bytes per token); with `record` the samples carry their eviction records
    (`SGLangEngine(record_evictions=True)`); with `probe` (token-id sequences) also (the engine's `score` of it after
    the generate, its seconds): the weight-sync fingerprint's engine side."""
    from actors.engines.sglang.engine import KV_STATS_ENV, SGLangEngine

    stats_path = Path(args.model_dir) / f"kv_stats_{os.getpid()}.json"
    if stats_path.exists():
        stats_path.unlink()
    os.environ[KV_STATS_ENV] = str(stats_path)
    eng = SGLangEngine(args.model_dir, compressor, timeout_s=400, record_evictions=record,
                       **engine_kwargs(args, dtype, dense=compressor.method == "full", batch=len(prompts),
                                       pool_tokens=pool_tokens, triton=triton))
    try:
        t0 = time.perf_counter()
        out = eng.generate(prompts, params)
        seconds = time.perf_counter() - t0
        result = ([g[0] for g in out], seconds, eng.kv_pool_stats(), eng.kv_bytes_per_token)
        if probe is None:
            return result
        t0 = time.perf_counter()
        scored = eng.score(probe)
        return (*result, scored, time.perf_counter() - t0)
    finally:
        eng.shutdown()


def records_differing(got: list, want: list, agree: list[int], eq_len: int) -> tuple[int, int]:
    """(rows compared, entries differing) between SGLang's and the torch engine's eviction records (uint16 [layers,
    heads or 1, tokens], 65535 = never) on the rows whose tokens agree throughout, heads broadcast to the larger
    count, steps >= T - 1 read as never on both sides (a compression due in the forward of the last token: SGLang
    frees the row first; no query of the sample follows it; docs/sglang.md, "Eviction records and replay")."""
    import numpy as np

    rows, differing = 0, 0
    for a, b, n in zip(got, want, agree):
        if n < eq_len:
            continue
        T = len(a.response_ids)
        tokens, heads = len(a.prompt_ids) + T, max(a.eviction_steps.shape[1], b.eviction_steps.shape[1])
        ca, cb = (np.broadcast_to(s.eviction_steps[:, :, :tokens], (s.eviction_steps.shape[0], heads, tokens))
                  .astype(np.int64) for s in (a, b))
        ca, cb = (np.where(c >= T - 1, 65535, c) for c in (ca, cb))
        rows, differing = rows + 1, differing + int((ca != cb).sum())
    return rows, differing


def main(argv=None) -> dict:
    args = parse_args(argv)
    from actors.engines.base import SamplingParams
    from compressors import CompressorConfig

    device = "cpu" if (args.tiny or args.dry_run or not torch.cuda.is_available()) else "cuda"
    info = model_info(tiny=args.tiny)
    t0 = time.perf_counter()
    if args.dry_run:    # the full-size plan, checked on a tiny model saved to a scratch directory
        import tempfile
        build_model(Path(tempfile.mkdtemp(prefix="gpu-check-dry-")), tiny=True, device="cpu")
    else:
        build_model(Path(args.model_dir), args.tiny, device)
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    vocab = TINY["vocab_size"] if args.tiny else QWEN25_15B["vocab_size"]
    prompts = torch.randint(1, vocab, (args.batch, args.prompt_len), generator=g).tolist()
    rkv = CompressorConfig(method="rkv", kv_budget=args.kv_budget, interval=args.interval, window=args.window)
    plan = {"model_dir": args.model_dir, "params": info["params"], "batch": args.batch,
            "kv_bytes_per_token_bf16": info["kv_bytes_per_token_bf16"],
            "prompt_len": args.prompt_len, "response_len": args.response_len, "kv_budget": args.kv_budget,
            "interval": args.interval, "equivalence": None if args.skip_equivalence else
            {"prompts": args.eq_prompts, "response_len": args.eq_len, "dtype": "float32"}}
    if args.dry_run:
        print(json.dumps({"dry_run": True, "build_s": round(build_s, 2), **plan}))
        return plan

    dtype = "float32" if args.tiny else "bfloat16"
    params = SamplingParams(temperature=1.0, max_new_tokens=args.response_len, ignore_eos=True, seed=0)
    # Same memory: the KV pool of the dense run at --batch (prompt + response tokens per sequence) holds
    # `same_memory_batch` sparse sequences (budget + interval + 1 slots each at their peak).
    pool_tokens = args.batch * (args.prompt_len + args.response_len)
    same_memory_batch = pool_tokens // (max(args.prompt_len, args.kv_budget) + args.interval + 1)
    big = torch.randint(1, vocab, (same_memory_batch, args.prompt_len), generator=g).tolist()
    rows = {}
    full = CompressorConfig(method="full")
    for name, comp, batch_prompts, pool, triton in (("dense", full, prompts, pool_tokens, False),
                                                    ("dense_triton", full, prompts, pool_tokens, True),
                                                    ("sparse_rkv", rkv, prompts, None, False),
                                                    ("sparse_rkv_same_memory", rkv, big, pool_tokens, False)):
        samples, seconds, stats, bytes_per_token = run_engine(args, comp, dtype, batch_prompts, params, pool,
                                                              triton=triton)
        tokens = sum(len(s.response_ids) for s in samples)
        if stats is None:   # dense: no eviction, every sequence holds all its tokens at the end (slot counts)
            kv_peak, how = sum(s.kv_peak_bytes for s in samples), "slots held (prompt + response - 1), counted"
        else:               # sparse: peak slots in use in SGLang's allocator, measured by the backend
            kv_peak, how = stats["peak_used_slots"] * bytes_per_token, "allocator peak used slots, measured"
        rows[name] = {"batch": len(batch_prompts), "kv_pool_tokens": pool, "tokens": tokens,
                      "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
                      "kv_peak_bytes": int(kv_peak), "kv_peak_how": how,
                      "freed_slots": None if stats is None else stats["freed_slots"],
                      "graph_replays": None if stats is None else stats["graph_replays"]}

    eq = None
    if not args.skip_equivalence:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from actors.engines.torch_engine import TorchEngine

        eq_prompts = prompts[:args.eq_prompts]
        eq_params = SamplingParams(temperature=0.0, max_new_tokens=args.eq_len, ignore_eos=True)
        from actors.engines.kv_memory import record_bytes_per_request
        from broker.fingerprint import max_abs, probe, probe_tokens

        probe_ids = probe(vocab, probe_tokens(args.kv_budget))
        got, _, eq_stats, _, scored, score_s = run_engine(args, rkv, "float32", eq_prompts, eq_params, record=True,
                                                          probe=probe_ids)
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to(device).eval()
        reference = TorchEngine(model, AutoTokenizer.from_pretrained(args.model_dir), rkv, device=device,
                                record_evictions=True)
        want = [g[0] for g in reference.generate(eq_prompts, eq_params)]
        agree, max_diff = [], 0.0
        for a, b in zip(got, want):
            n = next((i for i, (x, y) in enumerate(zip(a.response_ids, b.response_ids)) if x != y), args.eq_len)
            agree.append(n)
            # logp of the first differing token is still computed on the same prefix: include it
            m = min(n + 1, args.eq_len)
            max_diff = max(max_diff, float(abs(a.logp_sparse[:m] - b.logp_sparse[:m]).max()))
        # decode step of the first compression (0: the prompt itself is compressed at prefill)
        first = 0 if args.prompt_len > args.kv_budget else \
            ((args.kv_budget - args.prompt_len) // args.interval + 1) * args.interval
        compared, differing = records_differing(got, want, agree, args.eq_len)
        eq = {"tokens_agreeing_before_divergence": agree, "eq_len": args.eq_len, "max_abs_logp_diff": max_diff,
              "first_compression_step": first, "compression_reached_before_divergence": min(agree) > first,
              "batch": len(eq_prompts), "graph_replays": eq_stats["graph_replays"],
              # eviction replay's input: SGLang's records against the torch engine's, and their device bytes per
              # request at the check's shape (records.py; outside mem_fraction_static)
              "records_rows_compared": compared, "records_entries_differing": differing,
              "record_bytes_per_request": record_bytes_per_request(
                  info["layers"], info["kv_heads"], args.kv_budget, args.prompt_len + args.response_len),
              # the weight-sync fingerprint: SGLang's score of the probe against the torch engine's, same weights
              "fingerprint_max_abs": max_abs(reference.score(probe_ids), scored),
              "fingerprint_score_s": round(score_s, 3)}
        del model

    print(f"{'run':<24}{'batch':>6}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}{'KV peak MiB':>14}"
          f"{'graph replays':>15}  how")
    for name, r in rows.items():
        print(f"{name:<24}{r['batch']:>6}{r['tokens']:>10}{r['seconds']:>10}{r['tokens_per_s']:>12}"
              f"{r['kv_peak_bytes'] / 2**20:>14.1f}{str(r['graph_replays']):>15}  {r['kv_peak_how']}")
    if eq is not None:
        print(f"equivalence (fp32, greedy, {args.eq_prompts} prompts x {args.eq_len}): tokens agreeing "
              f"{eq['tokens_agreeing_before_divergence']}, max |dlogp| {eq['max_abs_logp_diff']:.2e}")
    ratio = lambda a, b: round(rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"], 3)  # noqa: E731
    graphs = device == "cuda"
    checks = {"graph_replays_sparse_rkv": rows["sparse_rkv"]["graph_replays"] > 0 if graphs else None,
              "graph_replays_sparse_rkv_same_memory":
                  rows["sparse_rkv_same_memory"]["graph_replays"] > 0 if graphs else None,
              "graph_replays_equivalence_odd_batch": (eq["graph_replays"] > 0 if graphs else None) if eq else None,
              "compression_reached_before_divergence": eq["compression_reached_before_divergence"] if eq else None}
    result = {"bench": "sglang_gpu_check", **plan, "build_s": round(build_s, 1), **rows,
              "sparse_vs_dense_tokens_per_s_same_batch": ratio("sparse_rkv", "dense"),
              "sparse_vs_dense_tokens_per_s_same_memory": ratio("sparse_rkv_same_memory", "dense"),
              "sparse_vs_dense_triton_tokens_per_s_same_batch": ratio("sparse_rkv", "dense_triton"),
              "sparse_vs_dense_triton_tokens_per_s_same_memory": ratio("sparse_rkv_same_memory", "dense_triton"),
              "dense_triton_vs_dense_tokens_per_s": ratio("dense_triton", "dense"),
              "targets": {"same_batch": ">= 1.0", "same_memory": ">= 2.0"},
              "kv_peak_ratio": round(rows["sparse_rkv"]["kv_peak_bytes"] / rows["dense"]["kv_peak_bytes"], 4),
              "equivalence": eq, "checks": checks}
    print(json.dumps(result))
    failed = [k for k, ok in checks.items() if ok is False]
    if failed:
        raise SystemExit(f"sglang_gpu_check: failed checks {failed} (null = not applicable here; see docs/sglang.md)")
    return result


if __name__ == "__main__":
    main()
