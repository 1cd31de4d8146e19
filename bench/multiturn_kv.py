"""Multi-turn KV memory and speed with the episode's cache kept across turns.

The lookup task's KV-stress variant on the shipped tiny Llama (tests' tiny-llama: SmolLM2's tokenizer and chat
template, random weights): each episode is a lookup item (actors/envs/lookup.py); every turn samples `--turn-tokens`
tokens (ignore_eos: the random model never calls the tool, so the turns are scripted), then the tool's answer
arrives as an observation rendered through the chat template (actors/envs/turns.py), the asked entry first
(`K7 = 42`) padded with `--pad-entries` more entries of the table, so that the whole episode exceeds the budget
and the answer's value sits turns back. Engines on the same model, batch and seeds, all measured in this run:

    dense       method full, cache kept across turns (one prefill of the new ids per turn)
    sparse      R-KV at --kv-budget / --interval, cache kept, compressor.protect_observation on (default)
    unprotected the same with protect_observation off (the observation compressed at its own prefill)
    reprefill   method full, every turn re-prefills the history (what actors/envs/episode.py used to do)

Peak KV bytes per episode after k = 1..N turns are the engine's measured buffers (Sample.kv_peak_bytes, max over
the first k turns), not counted tokens; `value_seen` is the fraction of (layer, KV head, value token) of the asked
entry that the first `interval` queries of the next turn see (the protection), `value_kept` those still visible
at the episode's last token. Prints a table, then ONE JSON object as the last line with the ratios:
  sparse_vs_dense_kv_at_N      sparse peak / dense peak after N turns
  sparse_kv_growth / dense_kv_growth   peak after N turns / after 2 turns (sparse stays 1.0: bounded)
  sparse_bound_ratio           sparse peak / the bound (kv_budget + interval + longest prefill slots + 1 layer's)
  sparse_vs_dense_tokens_per_s, dense_vs_reprefill_tokens_per_s

    python bench/multiturn_kv.py              # ~1 minute on 2 cores
    python bench/multiturn_kv.py --turns 10 --pad-entries 40
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from actors.engines.base import SamplingParams  # noqa: E402
from actors.engines.kv_memory import ModelShape, episode_kv_peak_bytes_per_sequence  # noqa: E402
from actors.engines.torch_engine import TorchEngine  # noqa: E402
from actors.envs.lookup import lookup_items  # noqa: E402
from actors.envs.turns import ChatTemplate  # noqa: E402
from compressors import CompressorConfig  # noqa: E402
from deploy.model_cache import TINY_LLAMA, resolve_model  # noqa: E402


def observations(template, item: dict, turns: int, pad_entries: int, seed: int) -> list[list[int]]:
    """The tool's answers after turns 1..turns-1 as ids (boundary, tool message, next header): turn 1 the asked
    entry first, every answer padded with `pad_entries` entries of a table of that many keys."""
    rng = random.Random(seed)
    target, answer = item["metadata"]["target"], item["answer"]
    out = []
    for k in range(1, turns):
        pad = "; ".join(f"K{rng.randint(1, 99)} = {rng.randint(10, 99)}" for _ in range(pad_entries))
        head = f"{target} = {answer}; " if k == 1 else ""
        out.append(template.observation_ids([{"role": "tool", "content": head + pad}], closed=False))
    return out


def value_span(template, item: dict, obs: list[int]) -> tuple[int, int]:
    """Where, in the first observation's ids, the asked entry's value tokens are: (start, end)."""
    tok = template.tokenizer
    for start in range(len(obs)):
        for end in range(start + 1, min(len(obs), start + 6) + 1):
            if (tok.decode(obs[start:end]).strip() == item["answer"]
                    and tok.decode(obs[max(0, start - 3):start]).rstrip().endswith("=")):
                return start, end
    raise RuntimeError("the value is not in the first observation")


def run(engine, prompts, obs, params, kept: bool) -> dict:
    """Every episode of the batch through all its turns: per turn the peak KV bytes (per episode), sampled tokens,
    seconds; the last turn's samples (their eviction records)."""
    keys = [f"e{i}" for i in range(len(prompts))]
    history = [list(p) for p in prompts]
    peaks, tokens, secs, starts, last = [], 0, 0.0, [], None
    for k in range(len(obs[0]) + 1):
        new = prompts if k == 0 else [o[k - 1] for o in obs]
        if k:
            history = [h + o for h, o in zip(history, new)]
        turn = dataclasses.replace(params, seed=params.seed + k)
        t = time.perf_counter()
        if kept:
            out = engine.generate(new, turn, episodes=keys)
        else:
            out = engine.generate(history, turn)
        secs += time.perf_counter() - t
        starts.append([len(h) for h in history])
        last = [s for (s,) in out]
        history = [h + s.response_ids for h, s in zip(history, last)]
        tokens += sum(len(s.response_ids) for s in last)
        peaks.append([s.kv_peak_bytes for s in last])
    if kept:
        engine.release_episodes(keys)
    return {"peaks": np.maximum.accumulate(np.array(peaks), axis=0).max(1), "tokens_per_s": tokens / secs,
            "last": last, "starts": starts, "length": [len(h) for h in history]}


def value_visibility(result, spans, prompt_lens, interval: int) -> tuple[float, float]:
    """(seen, kept): over the batch, the fraction of (layer, KV head, value token) of the asked entry visible to the
    first `interval` queries of turn 2, and to the episode's last query."""
    seen, kept = [], []
    for r, s in enumerate(result["last"]):
        rec = s.eviction_steps.astype(np.int64)                       # [layers, heads, L], steps after the prompt
        P = prompt_lens[r]
        start = result["starts"][1][r]                                # turn 2's first sampled id, episode index
        obs_start = start - spans[r][2]                               # the first observation's first id
        a, b = obs_start + spans[r][0], obs_start + spans[r][1]
        steps = rec[:, :, a:b]
        seen.append(float((steps >= start - P + interval).mean()))
        kept.append(float((steps == np.iinfo(np.uint16).max).mean()))
    return float(np.mean(seen)), float(np.mean(kept))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=8, help="N: turns per episode (>= 6)")
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--pad-entries", type=int, default=24, help="table entries padding each observation")
    ap.add_argument("--kv-budget", type=int, default=128)
    ap.add_argument("--interval", type=int, default=16)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path = resolve_model(TINY_LLAMA)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    template = ChatTemplate.build(tok)
    items = lookup_items(args.episodes, seed=7, keys=8)
    prompts = [template.prompt_ids([{"role": "user", "content": it["question"]}]) for it in items]
    obs = [observations(template, it, args.turns, args.pad_entries, seed=i) for i, it in enumerate(items)]
    spans = [(*value_span(template, it, o[0]), len(o[0])) for it, o in zip(items, obs)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.turn_tokens, seed=0, ignore_eos=True)
    rkv = dict(method="rkv", kv_budget=args.kv_budget, interval=args.interval, window=args.window)
    engines = {"dense": (CompressorConfig(method="full"), True),
               "sparse": (CompressorConfig(**rkv), True),
               "unprotected": (CompressorConfig(**rkv, protect_observation=False), True),
               "reprefill": (CompressorConfig(method="full"), False)}
    results = {}
    for name, (cfg, kept) in engines.items():
        engine = TorchEngine(model, tok, cfg, record_evictions=name in ("sparse", "unprotected"))
        results[name] = run(engine, prompts, obs, params, kept)

    shape = ModelShape.from_hf_config(model.config, "fp32")
    longest = 1 + max(len(o) for ep in obs for o in ep)
    total = max(results["dense"]["length"]) - min(map(len, prompts))
    bound = episode_kv_peak_bytes_per_sequence(shape, max(map(len, prompts)), args.turn_tokens, total, longest,
                                               args.kv_budget, args.interval, compress=True)
    lens = [len(p) for p in prompts]
    vis = {name: value_visibility(results[name], spans, lens, args.interval) for name in ("sparse", "unprotected")}
    N = args.turns
    print(f"tiny-llama (2 layers, 2 KV heads x 32, fp32); {args.episodes} lookup episodes, {N} turns of "
          f"{args.turn_tokens} tokens, observations of {min(len(o) for ep in obs for o in ep)}-{longest - 1} ids, "
          f"prompts {min(lens)}-{max(lens)}; episode {min(results['dense']['length'])}-"
          f"{max(results['dense']['length'])} tokens; R-KV budget {args.kv_budget}, interval {args.interval}, "
          f"window {args.window}; {args.threads} thread(s)")
    print(f"{'turns':>5} {'dense KV B/ep':>13} {'sparse KV B/ep':>14} {'unprot. KV B/ep':>15} {'reprefill B/ep':>14}")
    for k in range(N):
        print(f"{k + 1:>5} {results['dense']['peaks'][k]:>13,} {results['sparse']['peaks'][k]:>14,} "
              f"{results['unprotected']['peaks'][k]:>15,} {results['reprefill']['peaks'][k]:>14,}")
    print(f"sparse bound (budget + interval + longest prefill {longest}, + one layer's): {bound:,} B")
    for name in results:
        print(f"{name:>12}: {results[name]['tokens_per_s']:8.1f} sampled tokens/s")
    for name, (seen, kept) in vis.items():
        print(f"{name:>12}: value tokens seen by turn 2's first {args.interval} queries {seen:.3f}, "
              f"still visible at the "
              f"end {kept:.3f}")
    d, s = results["dense"]["peaks"], results["sparse"]["peaks"]
    print(json.dumps({
        "turns": N, "episodes": args.episodes, "kv_budget": args.kv_budget, "interval": args.interval,
        "sparse_vs_dense_kv_at_N": round(float(s[-1] / d[-1]), 4),
        "sparse_kv_growth": round(float(s[-1] / s[1]), 4), "dense_kv_growth": round(float(d[-1] / d[1]), 4),
        "sparse_bound_ratio": round(float(s.max() / bound), 4),
        "sparse_vs_dense_tokens_per_s": round(results["sparse"]["tokens_per_s"] / results["dense"]["tokens_per_s"], 3),
        "dense_vs_reprefill_tokens_per_s": round(results["dense"]["tokens_per_s"]
                                                 / results["reprefill"]["tokens_per_s"], 3),
        "value_seen": {k: round(v[0], 4) for k, v in vis.items()},
        "value_kept_at_end": {k: round(v[1], 4) for k, v in vis.items()},
        "kv_peak_bytes": {name: [int(x) for x in r["peaks"]] for name, r in results.items()},
        "tokens_per_s": {name: round(r["tokens_per_s"], 1) for name, r in results.items()},
    }))


if __name__ == "__main__":
    main()
