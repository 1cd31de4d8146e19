"""Where the Sparse-RL token mask falls on a counting answer: the stop decision (docs/results.md 6.11, M1).

    python bench/stop_decision.py                      # the warm-up model, 32 training prompts x 4, R-KV 48
    python bench/stop_decision.py --budget 72 --prompts 16

Samples rollouts as step 1 of every run of the comparison grid does (preset smollm2-count-warm: its model,
sampling and R-KV compressor), recomputes logp_old with a dense forward of prompt + response (fp32, as the
learner does with one PPO epoch) and, per token, xi = exp(logp_old - logp_sparse). Each response is classed
by what follows b's line ("b" or "b of b"): *run_on* (more digits follow), *stops_at_b* (nothing but whitespace
and EOS, finish 'stop') or *other* (b never written, or cut right after it). Its *decision tokens* run from the
first token after b's line through the first token that is not whitespace: the newline-or-EOS choice and what
follows it. Per class: how often the token mask (xi outside [0.5, 1.5], the authors' `mis.yaml`) removes a
decision token against any other token, and the mean of mask x min(xi, 1.5) at each (the TIS weight before
the batch-mean normalisation). The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402

MASK_BOUNDS = (0.5, 1.5)
TIS_CAP = 1.5
CLASSES = ("run_on", "stops_at_b", "other")


def decision_tokens(text: str, ends: list[int], stop: int, finish_reason: str) -> tuple[str, list[int]]:
    """Class and decision tokens of one counting answer.

    text: the decoded response; ends[k]: the length of the decoded response up to and including token k
    (non-decreasing, ends[-1] == len(text)); stop: b, the problem's last number; finish_reason: 'stop' | 'length'.
    Returns (class, token indices): class in CLASSES; the indices of the tokens from the first one that adds a
    character after b's line through the first one whose characters are not all whitespace ([] for 'other')."""
    m = re.search(rf"(?m)^[ \t]*{stop}(?:[ \t]+of[ \t]+{stop})?(?!\d)", text)
    if m is None:
        return "other", []
    after = text[m.end():]
    kind = "run_on" if re.search(r"\d", after) else "stops_at_b" if finish_reason == "stop" else "other"
    first = next((k for k, e in enumerate(ends) if e > m.end()), None)
    if kind == "other" or first is None:
        return "other", []
    out = []
    for k in range(first, len(ends)):
        out.append(k)
        if text[(ends[k - 1] if k else 0):ends[k]].strip():
            break
    return kind, out


def mask_and_weight(xi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token: masked (bool, xi outside MASK_BOUNDS) and the weight mask x min(xi, TIS_CAP) (float)."""
    masked = (xi < MASK_BOUNDS[0]) | (xi > MASK_BOUNDS[1])
    return masked, np.where(masked, 0.0, np.minimum(xi, TIS_CAP))


def summarize(tokens: dict[str, dict[str, list]]) -> dict:
    """tokens[class]["decision"|"other"]: lists of (xi, masked, weight) triples -> rates, means and counts."""
    out = {}
    for kind, parts in tokens.items():
        row = {"responses": parts["responses"]}
        for part in ("decision", "other"):
            xi, masked, weight = (np.array(v, dtype=float) for v in zip(*parts[part])) if parts[part] else ([],) * 3
            row[f"{part}_tokens"] = len(xi)
            row[f"{part}_mask_rate"] = float(np.mean(masked)) if len(xi) else None
            row[f"{part}_weight_mean"] = float(np.mean(weight)) if len(xi) else None
            row[f"{part}_xi_quartiles"] = [float(q) for q in np.quantile(xi, [0.25, 0.5, 0.75])] if len(xi) else None
        row["decision_xi_below_low"] = int(sum(x < MASK_BOUNDS[0] for x, *_ in parts["decision"]))
        row["decision_xi_above_high"] = int(sum(x > MASK_BOUNDS[1] for x, *_ in parts["decision"]))
        out[kind] = row
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="smollm2-count-warm")
    p.add_argument("--budget", type=int, default=48, help="R-KV kv_budget of the rollouts (default 48)")
    p.add_argument("--prompts", type=int, default=32, help="training prompts, the first of the seed's order")
    p.add_argument("--seed", type=int, default=0, help="prompt order and sampling seed")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from actors.engines.base import SamplingParams
    from actors.rollout_actor import build_engine
    from actors.tasks.data import load_train_prompts
    from deploy.config import load_config
    from deploy.model_cache import resolve_model

    start = time.monotonic()
    cfg = load_config(args.config, [f"actors.engine.compressor.kv_budget={args.budget}"], check_files=False)
    path = resolve_model(cfg.model)
    engine = build_engine(cfg.actors.engine, path, cfg.actors.engine.compressor, cfg.actors.torch_threads)
    tok = engine.tokenizer
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = load_train_prompts(cfg.actors.data, tok, seed=args.seed)[:args.prompts]
    s = cfg.actors.sampling
    params = SamplingParams(temperature=s.temperature, max_new_tokens=s.max_new_tokens, n=s.samples_per_prompt,
                            seed=args.seed)
    tokens = {kind: {"responses": 0, "decision": [], "other": []} for kind in CLASSES}
    kv_kept = []
    for i in range(0, len(prompts), 8):
        chunk = prompts[i:i + 8]
        for prompt, group in zip(chunk, engine.generate([q.prompt_ids for q in chunk], params)):
            for smp in group:
                ids = smp.prompt_ids + smp.response_ids
                with torch.no_grad():
                    logits = dense(torch.tensor([ids])).logits[0, len(smp.prompt_ids) - 1:-1].float()
                logp_old = torch.log_softmax(logits / s.temperature, -1).gather(
                    1, torch.tensor(smp.response_ids)[:, None])[:, 0].numpy()
                xi = np.exp(np.clip(logp_old - smp.logp_sparse, -20, 20))
                masked, weight = mask_and_weight(xi)
                ends = [len(tok.decode(smp.response_ids[:k + 1])) for k in range(len(smp.response_ids))]
                kind, decision = decision_tokens(tok.decode(smp.response_ids), ends, prompt.metadata["stop"],
                                                 smp.finish_reason)
                tokens[kind]["responses"] += 1
                for k in range(len(xi)):
                    tokens[kind]["decision" if k in decision else "other"].append((xi[k], masked[k], weight[k]))
                kv_kept.append(smp.kv_retained_tokens / len(ids))
        print(f"{i + len(chunk)} of {len(prompts)} prompts, {time.monotonic() - start:.0f} s", file=sys.stderr,
              flush=True)
    result = {"config": args.config, "kv_budget": args.budget, "seed": args.seed, "prompts": len(prompts),
              "samples_per_prompt": s.samples_per_prompt, "kv_retained_ratio": float(np.mean(kv_kept)),
              **summarize(tokens), "wall_s": round(time.monotonic() - start)}
    for kind in CLASSES:
        print(kind, json.dumps(result[kind]))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
