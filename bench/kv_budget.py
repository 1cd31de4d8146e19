"""KV budget control (issue 13): preflight prediction vs measured KV bytes, and the closed-loop budget against a
fixed budget on the same prompts and the same number of steps.

    python bench/kv_budget.py --quick      # SmolLM2-135M on the copy task (smollm2-copy), CPU, a few minutes

1. Preflight: for several configs (tiny-llama and SmolLM2-135M, dense and R-KV / SnapKV, fp32 / bf16), the
   preflight's predicted peak KV bytes per sequence (deploy/preflight.py, actors/kv_memory.py) against the torch
   engine's measured peak (its cache buffers, `Sample.kv_peak_bytes`) on a batch holding the longest prompt.
2. Closed loop vs fixed: each step samples a batch (prompts_per_step prompts x G samples) with the real torch
   engine at the step's budget, scores it with the task's reward, recomputes the dense log-probs teacher-forced
   (pi_old; the weights are frozen in this bench, so the mismatch is compression only), and runs the learner's
   correction (learner/correction.py: rejection rate, xi_sym_p5). The fixed arm uses compressor.kv_budget at
   every step; the adaptive arm starts there and its budget comes from learner/budget_control.py fed with the
   measured quantile. Both arms see the same prompts and seeds at each step.

Prints a table, then ONE JSON object as the last line:
  preflight_vs_measured_kv_bytes   predicted / measured peak KV bytes, the config farthest from 1 (target 0.9-1.1)
  controller_target_met_fraction   adaptive arm: steps after warm-up whose measured quantile meets the target
                                   (target >= 0.8)
  fixed / adaptive                 mean budget, mean peak KV bytes per sequence, rejection rate, reward,
                                   target met fraction (after warm-up), over the same steps
`seconds` is the bench's wall time (no figure above depends on timing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Run as `python bench/kv_budget.py`, bench/ comes first on sys.path and bench/compressors.py would hide the
# `compressors` package: drop that folder.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

from actors.engine import SamplingParams  # noqa: E402
from actors.torch_engine import TorchEngine  # noqa: E402
from learner.budget_control import BudgetController  # noqa: E402
from learner.correction import sparse_correction  # noqa: E402


def dense_logp(model, samples, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced dense log-probs (pi_old) of every sample's response: (logp_old, logp_sparse, mask) [S, T]."""
    P = max(len(s.prompt_ids) for s in samples)
    T = max(len(s.response_ids) for s in samples)
    ids = torch.zeros(len(samples), P + T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        start = P - len(s.prompt_ids)
        ids[r, start:start + len(seq)] = torch.tensor(seq)
        mask[r, start:start + len(seq)] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    logp = (logits / temperature).log_softmax(-1)
    old = torch.zeros(len(samples), T)
    sparse = torch.zeros(len(samples), T)
    valid = torch.zeros(len(samples), T, dtype=torch.bool)
    for r, s in enumerate(samples):
        n = len(s.response_ids)
        cols = torch.arange(n) + P - 1
        old[r, :n] = logp[r, cols, torch.tensor(s.response_ids)]
        sparse[r, :n] = torch.from_numpy(s.logp_sparse)
        valid[r, :n] = True
    return old, sparse, valid


def preflight_checks() -> list[dict]:
    """Predicted vs measured peak KV bytes per sequence for several configs (module docstring, 1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.data import load_train_prompts
    from deploy.config import load_config
    from deploy.model_cache import SMOLLM2, TINY_LLAMA, resolve_model
    from deploy.preflight import preflight

    cases = [("tiny", TINY_LLAMA, ["actors.engine.compressor.kv_budget=48", "actors.sampling.max_new_tokens=32"]),
             ("tiny", TINY_LLAMA, ["actors.engine.compressor.method=snapkv", "actors.engine.compressor.kv_budget=24",
                                   "actors.engine.dtype=bf16", "actors.sampling.max_new_tokens=48"]),
             ("tiny", TINY_LLAMA, ["actors.engine.compressor.method=full", "actors.sampling.max_new_tokens=32"]),
             ("smollm2-copy", SMOLLM2, ["actors.sampling.max_new_tokens=24"]),
             ("smollm2-copy", SMOLLM2, ["actors.engine.compressor.method=full", "actors.sampling.max_new_tokens=24"])]
    rows = []
    for preset, model_name, overrides in cases:
        cfg = load_config(preset, overrides + ["preflight.kv_memory_gb=8"])
        path = resolve_model(model_name)
        report = preflight(cfg, model_path=path)
        tok = AutoTokenizer.from_pretrained(path)
        prompts = load_train_prompts(cfg.actors.data, tok, seed=cfg.seed)
        longest = max(prompts, key=lambda p: len(p.prompt_ids)).prompt_ids
        a = cfg.actors
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[a.engine.dtype]).eval()
        engine = TorchEngine(model, tok, a.engine.compressor)
        params = SamplingParams(temperature=1.0, max_new_tokens=a.sampling.max_new_tokens, n=2, seed=0, ignore_eos=True)
        measured = max(s.kv_peak_bytes for g in engine.generate([longest, prompts[0].prompt_ids], params) for s in g)
        sparse = a.engine.compressor.method != "full"
        predicted = report.sparse_per_seq if sparse else report.dense_per_seq
        rows.append({"model": model_name, "method": a.engine.compressor.method, "dtype": a.engine.dtype,
                     "budget": a.engine.compressor.kv_budget if sparse else None, "prompt": report.prompt_tokens,
                     "new": a.sampling.max_new_tokens, "predicted": predicted, "measured": measured,
                     "ratio": predicted / measured})
        del model, engine
    return rows


def run_arm(name, engine, model, prompts, reward, steps, prompts_per_step, G, max_new, temperature, controller,
            fixed_budget, metric, seed):
    """One arm of the closed-loop comparison; returns one dict per step."""
    out = []
    for step in range(steps):
        batch = [prompts[(step * prompts_per_step + i) % len(prompts)] for i in range(prompts_per_step)]
        budget = controller.budget if controller is not None else fixed_budget
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new, n=G, seed=seed + step)
        groups = engine.generate([p.prompt_ids for p in batch], params, kv_budgets=[budget] * len(batch))
        samples = [s for g in groups for s in g]
        rewards = [reward(engine.tokenizer.decode(s.response_ids, skip_special_tokens=True), s.response_ids, p).reward
                   for p, g in zip(batch, groups) for s in g]
        old, sparse, valid = dense_logp(model, samples, temperature)
        _, _, m = sparse_correction(old, sparse, valid)
        row = {"arm": name, "step": step, "kv_budget": budget, metric: m[metric], "rejection_rate": m["rejection_rate"],
               "reward": sum(rewards) / len(rewards), "kv_peak_bytes": sum(s.kv_peak_bytes for s in samples) / len(samples),
               "kv_retained_ratio": sum(s.kv_retained_tokens / (len(s.prompt_ids) + len(s.response_ids))
                                        for s in samples) / len(samples)}
        if controller is not None:
            row["decision"] = controller.update(m[metric]).reason
        out.append(row)
        print(f"  {name:<8} step {step:>2} budget {budget:>4} {metric} {m[metric]:.3f} rejection "
              f"{m['rejection_rate']:.3f} reward {row['reward']:.3f} KV B/seq {row['kv_peak_bytes']:,.0f}"
              + (f"  [{row['decision']}]" if controller is not None else ""), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 steps of 2 prompts x 4 samples per arm")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=0, help="steps not counted in the target fraction (0 = steps // 3)")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--kv-budget", type=int, default=64, help="the fixed arm's budget, the adaptive arm's start")
    ap.add_argument("--budget-min", type=int, default=32)
    ap.add_argument("--budget-max", type=int, default=160)
    ap.add_argument("--budget-step", type=int, default=32)
    ap.add_argument("--target", type=float, default=0.86)
    ap.add_argument("--metric", default="xi_sym_p5")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.prompts_per_step, args.samples = 16, 2, 4
    warmup = args.warmup or args.steps // 3
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    print("1. preflight: predicted vs measured peak KV bytes per sequence", flush=True)
    checks = preflight_checks()
    for r in checks:
        print(f"  {r['model']:<22} {r['method']:<7} {r['dtype']:<5} budget {str(r['budget']):>4} prompt {r['prompt']:>4} "
              f"new {r['new']:>3}: predicted {r['predicted']:>12,} measured {r['measured']:>12,} ratio {r['ratio']:.4f}")
    worst = max(checks, key=lambda r: abs(r["ratio"] - 1))["ratio"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.data import load_train_prompts
    from actors.reward import RewardScorer
    from deploy.config import load_config
    from deploy.model_cache import resolve_model

    cfg = load_config("smollm2-copy", [f"actors.engine.compressor.kv_budget={args.kv_budget}"])
    path = resolve_model(cfg.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    a = cfg.actors
    engine = TorchEngine(model, tok, a.engine.compressor)
    prompts = load_train_prompts(a.data, tok, seed=cfg.seed)
    reward = RewardScorer(a.reward)
    print(f"2. closed loop vs fixed: {cfg.model}, copy task, R-KV interval {a.engine.compressor.interval}, "
          f"{args.steps} steps x {args.prompts_per_step} prompts x {args.samples} samples, max_new "
          f"{a.sampling.max_new_tokens}; controller {args.metric} >= {args.target}, budget {args.budget_min}.."
          f"{args.budget_max} step {args.budget_step}, hysteresis {a.engine.compressor.budget_hysteresis}, patience "
          f"{a.engine.compressor.budget_patience}; warm-up {warmup} steps", flush=True)
    common = dict(engine=engine, model=model, prompts=prompts, reward=reward, steps=args.steps,
                  prompts_per_step=args.prompts_per_step, G=args.samples, max_new=a.sampling.max_new_tokens,
                  temperature=a.sampling.temperature, metric=args.metric, seed=cfg.seed * 1000)
    fixed = run_arm("fixed", controller=None, fixed_budget=args.kv_budget, **common)
    controller = BudgetController(args.kv_budget, args.budget_min, args.budget_max, metric=args.metric,
                                  target=args.target, hysteresis=a.engine.compressor.budget_hysteresis,
                                  patience=a.engine.compressor.budget_patience, step=args.budget_step)
    adaptive = run_arm("adaptive", controller=controller, fixed_budget=None, **common)

    def summary(rows):
        n = len(rows)
        after = rows[warmup:]
        return {"mean_kv_budget": round(sum(r["kv_budget"] for r in rows) / n, 2),
                "mean_kv_peak_bytes_per_seq": round(sum(r["kv_peak_bytes"] for r in rows) / n),
                "rejection_rate": round(sum(r["rejection_rate"] for r in rows) / n, 4),
                "reward": round(sum(r["reward"] for r in rows) / n, 4),
                f"mean_{args.metric}": round(sum(r[args.metric] for r in rows) / n, 4),
                "target_met_fraction": round(sum(r[args.metric] >= args.target for r in after) / len(after), 4),
                "kv_retained_ratio": round(sum(r["kv_retained_ratio"] for r in rows) / n, 4)}

    result = {"preflight_vs_measured_kv_bytes": round(worst, 4),
              "controller_target_met_fraction": summary(adaptive)["target_met_fraction"],
              "fixed": summary(fixed), "adaptive": summary(adaptive),
              "preflight_configs": len(checks), "steps": args.steps, "warmup_steps": warmup,
              "target": f"{args.metric} >= {args.target}", "fixed_kv_budget": args.kv_budget,
              "adaptive_final_kv_budget": controller.budget, "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
