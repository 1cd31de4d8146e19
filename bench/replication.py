"""The Sparse-RL paper's comparison as one command: dense vs naive sparse vs Sparse-RL rollouts (arXiv 2601.10079),
in the paper's regime (the prompt fits the KV budget; the cache is compressed while the response is decoded).

Every run is a real `sparse-rl train` (Ray, Redis, DeepSpeed, weight sync; one subprocess per run) on the same
config, prompts, seeds and settings, differing only in what the arm names:

    dense                 actors.engine.compressor.method=full (no compression: the reference; it does not depend
                          on the budget, so it runs once per seed and is compared with every budget)
    naive_sparse          the config's compressor, no correction (learner.correction=metrics_only: the update of
                          correction=off, plain GRPO that ignores the sparse sampler, the authors' baseline; the
                          mismatch is still measured and plotted)
    sparse_rl             the authors' mis.yaml: sequence veto (eps 1e-4) + token mask [0.5, 1.5] + truncated
                          importance weights (cap 1.5, normalised by the batch mean) (SPEC section 2)
    sparse_rl_geometric   the same with the length-normalised (geometric-mean) rejection (--geometric-budgets)

and, by --arms only, two ablations of sparse_rl (docs/results.md 6.11): sparse_rl_no_token_mask
(learner.token_mask=false) and sparse_rl_flat_tis (learner.tis_cap=1e-6: every importance weight 1 after the
normalisation, veto and token mask kept); and eviction replay (docs/results.md 6.12): sparse_replay
(learner.policy_target=sparse: the learner replays each rollout's evictions, the sparse_rl correction kept on
the replayed xi) and sparse_replay_distill (the same + learner.distill_coef=1.0, the dense-teacher KL); and KV
precision at equal bytes (docs/results.md section 11): fp8_replay_eqbytes and fp8_replay_halfbytes (sparse_replay
with K/V stored in fp8_e4m3, a float32 scale per token and KV head, under a byte budget: fp32 R-KV 48's stored bytes,
180 tokens, or half of them, 90 tokens; run at --budgets 48, the label of the bytes they stand for).
--only-seeds runs a subset of the seeds, e.g.

    python bench/replication.py --arms dense,naive_sparse,sparse_rl,sparse_rl_no_token_mask,sparse_rl_flat_tis \
        --budgets 48 --only-seeds 0,2 --records docs/results/replication-decode-ablations

Sparse arms run at each of --budgets (KV tokens per sequence, layer and head). Each run evaluates its model after
training (and dense / sparse_rl runs also before) on --eval-limit held-out items of the training task, sampled
as the config's `eval` says (smollm2-count-warm: temperature 1.0, top_p 1.0; greedy where it sets temperature 0), with
dense and with sparse inference; "sparse" is the same cache for every arm at a budget (the dense model is
evaluated under each budget's compressor: `eval.sparse_compressor` in its run for the first budget, `sparse-rl
eval`-equivalent calls for the others). All runs go to one MLflow experiment (`replication`, sqlite in --out).
The command is resumable: a finished run (its summary.json) is kept and skipped when the command is run again
(a run cut short restarts), and the plot and JSON are rebuilt from what exists.

    python bench/replication.py --quick        # tiny-decode: 2 seeds x 16 steps, one budget, a few minutes
    python bench/replication.py                # smollm2-count-warm, budgets 48 and 72, 3 seeds, 20 steps
                                               # (~7 h alone on 2 cores)
    python bench/replication.py --config qwen2.5-math --budgets 512 ray.address=auto   # a GPU cluster

Writes <out>/replication.png (per budget: reward, grad_norm, mismatch KL, rejection rate, response length,
entropy, token-mask fraction, xi_sym_p5, share of responses cut at the length limit per step; mean and
min-max over seeds), <out>/replication.md (every run's
figures, a row per run and budget, then the verdicts with every seed's numbers) and prints, as its last line, one
JSON object: regime (decode | prefill: is the longest prompt shorter than the smallest budget?),
prompt_tokens_max, kv_budget(s), kv_retained_ratio, per-arm and per-budget reward gains (mean of the last 3 steps
minus the first 3) and final rewards, evaluation rewards, grad-norm spikes, and the pre-registered verdicts h1, h2,
h3 per budget (docs/results.md section 6), steps, seeds, wall_s.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import numpy as np  # noqa: E402

ARMS = {
    "dense": ["actors.engine.compressor.method=full"],
    "naive_sparse": ["learner.correction=metrics_only"],
    "sparse_rl": ["learner.correction=on", "learner.rejection=veto", "learner.eps=1e-4", "learner.token_mask=true",
                  "learner.token_mask_bounds=[0.5,1.5]", "learner.tis_cap=1.5"],
    "sparse_rl_geometric": ["learner.correction=on", "learner.rejection=geometric", "learner.token_mask=true"],
}
MAIN_ARMS = tuple(ARMS)
"""The comparison's arms (the default of --arms)."""
ARMS.update({  # ablations of sparse_rl, one part of the correction off each (docs/results.md 6.11); by --arms only
    "sparse_rl_no_token_mask": [*ARMS["sparse_rl"], "learner.token_mask=false"],
    "sparse_rl_flat_tis": [*ARMS["sparse_rl"], "learner.tis_cap=1e-6"],
})
ARMS.update({  # eviction replay (docs/results.md 6.12): the policy that generates is trained; by --arms only
    "sparse_replay": [*ARMS["sparse_rl"], "learner.policy_target=sparse"],
    "sparse_replay_distill": [*ARMS["sparse_rl"], "learner.policy_target=sparse", "learner.distill_coef=1.0"],
})
PROTECT = ["actors.engine.compressor.protect_prompt=all", "actors.engine.compressor.sinks=4"]
ARMS.update({  # does the score matter under replay? (docs/results.md section 10); by --arms only
    "random_replay": [*ARMS["sparse_replay"], "actors.engine.compressor.method=random"],
    "streamingllm_replay": [*ARMS["sparse_replay"], "actors.engine.compressor.method=streamingllm"],
    "random_naive": [*ARMS["naive_sparse"], "actors.engine.compressor.method=random"],
    "rkv_protect_replay": [*ARMS["sparse_replay"], *PROTECT],
    "random_protect_replay": [*ARMS["sparse_replay"], "actors.engine.compressor.method=random", *PROTECT],
})
TOKEN_BYTES_FP32 = 46_080
"""K and V of one token over SmolLM2-135M's 30 layers and 3 KV heads at fp32 (head_dim 576 / 9 = 64): 2 x 30 x 3 x
64 x 4 B = `KVQuant("model").token_bytes(30, 3, 64, 4)`, 512 B per layer and KV head (tested against the model's
config in tests/bench/test_replication_verdicts.py)."""
FP32_48_BYTES = 48 * TOKEN_BYTES_FP32
"""The stored K/V bytes per sequence of fp32 R-KV 48 (`sparse_replay` at budget 48): 2,211,840 B. At fp8_e4m3 with a
float32 scale per token and KV head a token takes 12,240 B (136 B per layer and KV head), so these bytes keep
floor(2,211,840 / 12,240) = 180 tokens and half of them (1,105,920 B) 90 (compressors.kv_quant.budget_tokens)."""
FP8 = ["actors.engine.compressor.kv_dtype=fp8_e4m3", "actors.engine.compressor.kv_scale=token_head",
       "actors.engine.compressor.kv_budget=512"]   # kv_budget at its default: a byte budget refuses any other
ARMS.update({  # KV precision at equal bytes (docs/results.md section 11); by --arms only, at --budgets 48
    "fp8_replay_eqbytes": [*ARMS["sparse_replay"], *FP8, f"actors.engine.compressor.kv_budget_bytes={FP32_48_BYTES}"],
    "fp8_replay_halfbytes": [*ARMS["sparse_replay"], *FP8,
                             f"actors.engine.compressor.kv_budget_bytes={FP32_48_BYTES // 2}"],
})
LORA = ["learner.lora.rank=16", "learner.lora.alpha=32", "learner.lr=2e-4"]
"""Section 12's LoRA, chosen before its runs: rank 16 and alpha 32 on every linear module (LoraConfig's defaults), lr
10x the grid's full fine-tuning 2e-5 (Schulman et al., "LoRA Without Regret", 2025: with alpha / rank scaling the best
LoRA lr is about 10x full fine-tuning's, and rank 1 already matches full fine-tuning in RL)."""
ARMS.update({  # LoRA with adapter-only sync (docs/results.md section 12); by --arms only, at --budgets 48
    "lora_replay": [*ARMS["sparse_replay"], *LORA],
})
SPARSE_ARMS = tuple(a for a in ARMS if a != "dense")
EVAL_BEFORE = {"dense", "sparse_rl"}
"""Arms whose runs also score their model before training (the others share those models' starting point)."""
PLOTTED = ("reward_mean", "grad_norm", "mismatch_kl", "rejection_rate", "response_length_mean", "entropy",
           "token_mask_fraction", "xi_sym_p5", "response_truncated_fraction")
REPLAY_RECORDED = ("replay_logp_max_abs", "replay_logp_train_max_abs", "replay_dense_gap_max", "accept_exact_p5",
                   "distill_kl")
"""Recorded for the replay arms (empty for the others): the exactness checks of rule R4 (docs/results.md 6.12)."""
RECORDED = (*PLOTTED, "kv_retained_ratio", *REPLAY_RECORDED)
EDGE = 3
"""Steps averaged at each end of training for the reward gain and the final reward."""
SPIKE = 10.0
"""H2: a grad-norm spike is max / median of a run's grad_norm above this."""
ROOT = Path(__file__).resolve().parent.parent
CPU_DEFAULT = {"config": "smollm2-count-warm",
               "overrides": ["train.learner_num_cpus=2", "learner.norm_adv_by_std=true", "actors.prompts_per_batch=2",
                             "learner.fuse_logp_old=false", "learner.policy_target=dense"],
               "budgets": "48,72", "steps": 20, "seeds": 3, "eval_limit": 64}
"""The default (CPU-scale) comparison: the main job's decode-regime task and model (docs/results.md 6.2, amended
for 6.7, and a third time for the second budget); budgets 48 and 72 keep about 0.3 and 0.5 of the rollouts' KV
(72 replaced 96, measured to keep 0.56-0.87: docs/results.md 6.4); 20 steps (~22-30 min a run with its evaluations
alone on 2 cores, 18 runs ~7-9 h); a learner with 2 torch threads (with max_staleness 0 the actors are idle while
it steps). The last overrides keep the grid as pre-registered (commit b1c3cb8) after the main job's preset moved on
(advantages not divided by the group std, batches of 4 prompts: docs/results.md 6.8) and the learner's step gained
the single-pass on-policy step (the same update, other rounding: the runs started on the two-pass step stay on it),
and policy_target=dense keeps the arms the paper's after the preset switched to eviction replay (6.12). Overrides on
the command line follow."""
QUICK = {"config": "tiny-decode", "overrides": [], "budgets": "", "steps": 16, "seeds": 2, "eval_limit": 16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="preset or YAML (default smollm2-count-warm; tiny-decode with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny scale for regression checks (tiny-decode, 16 steps)")
    p.add_argument("--steps", type=int, default=None, help="learner steps per run (default 20; 16 with --quick)")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 per arm (default 3; 2 with --quick)")
    p.add_argument("--budgets", default=None, help="comma-separated kv_budget values of the sparse arms (default "
                                                   "48,72; the config's own budget with --quick or --config)")
    p.add_argument("--geometric-budgets", default=None,
                   help="budgets at which sparse_rl_geometric runs (default: the first of --budgets)")
    p.add_argument("--eval-limit", type=int, default=None, help="held-out items per evaluation (default 64; 16 "
                                                                "with --quick)")
    p.add_argument("--arms", default=",".join(MAIN_ARMS), help=f"comma-separated subset of {', '.join(ARMS)} "
                                                                 f"(default {', '.join(MAIN_ARMS)})")
    p.add_argument("--only-seeds", default=None, help="comma-separated seeds of 0..N-1 to run and report (default all)")
    p.add_argument("--max-staleness", type=int, default=0,
                   help="broker.max_staleness of every run (default 0: the paper's synchronous setting, so the "
                        "measured mismatch is compression alone)")
    p.add_argument("--out", default=None, help="results folder (default bench/results/replication-<config>)")
    p.add_argument("--records", default=None,
                   help="folder of finished-run records (summary + per-step metrics + evaluations, one JSON each) "
                        "to read and to add to: commit it, and a later checkout resumes the grid from it (default "
                        "docs/results/replication-decode for the CPU default, none otherwise)")
    p.add_argument("--only-report", action="store_true", help="rebuild the plot and JSON from finished runs only")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to every arm, e.g. ray.address=auto")
    args = p.parse_args(argv)
    named = {**CPU_DEFAULT, "config": args.config, "overrides": [], "budgets": ""}
    base = QUICK if args.quick else CPU_DEFAULT if args.config in (None, CPU_DEFAULT["config"]) else named
    args.config = args.config or base["config"]
    args.overrides = [*base["overrides"], *args.overrides]
    args.steps = args.steps or base["steps"]
    args.seeds = args.seeds or base["seeds"]
    args.eval_limit = args.eval_limit or base["eval_limit"]
    from deploy.config import load_config
    cfg = load_config(args.config, args.overrides, check_files=False)
    budgets = args.budgets if args.budgets is not None else base["budgets"]
    args.budgets = [int(b) for b in budgets.split(",") if b] or [cfg.actors.engine.compressor.kv_budget]
    geo = args.geometric_budgets
    args.geometric_budgets = [int(b) for b in geo.split(",") if b] if geo else args.budgets[:1]
    args.arms = [a for a in args.arms.split(",") if a]
    args.only_seeds = [int(x) for x in args.only_seeds.split(",") if x] if args.only_seeds else list(range(args.seeds))
    if not set(args.only_seeds) <= set(range(args.seeds)):
        p.error(f"--only-seeds: {args.only_seeds} not all in 0..{args.seeds - 1} (--seeds {args.seeds})")
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        p.error(f"--arms: unknown {unknown}; expected a subset of {list(ARMS)}")
    default_grid = not args.quick and args.config == CPU_DEFAULT["config"]
    args.records = Path(args.records) if args.records else ROOT / "docs" / "results" / "replication-decode" \
        if default_grid else None
    name = Path(args.config).stem + ("-quick" if args.quick else "")
    args.out = Path(args.out or ROOT / "bench" / "results" / f"replication-{name}").resolve()
    return args


def grid(args) -> list[tuple[str, int | None, int]]:
    """(arm, budget or None for dense, seed) of every run, seed-major (an interrupted bench has every arm of the
    first seeds)."""
    runs = []
    for seed in args.only_seeds:
        for arm in args.arms:
            budgets = [None] if arm == "dense" else args.geometric_budgets if arm == "sparse_rl_geometric" \
                else args.budgets
            runs += [(arm, b, seed) for b in budgets if b is None or b in args.budgets]
    return runs


def run_name(arm: str, budget: int | None, seed: int) -> str:
    return f"{arm}-s{seed}" if budget is None else f"{arm}-b{budget}-s{seed}"


def finished(args, name: str) -> dict | None:
    """The record of the finished run `name` ({"summary", "history", "evals"}), from <out>/records or --records,
    or None."""
    for folder in (args.out / "records", args.records):
        if folder is not None and (folder / f"{name}.json").exists():
            return with_dense_evals(args, name, json.loads((folder / f"{name}.json").read_text()))
    return record_of_run(args, name)


def missing_budgets(name: str, record: dict, budgets: list[int]) -> list[int]:
    """The budgets at which a dense run's record has no score of its model under the sparse cache (a record made
    before the grid's budgets changed); [] for the other arms."""
    return [b for b in budgets if str(b) not in record.get("evals", {})] if name.startswith("dense-") else []


def with_dense_evals(args, name: str, record: dict) -> dict:
    """`record`, with the dense model scored at any budget it lacks, from its final weights (kept in <out>/runs);
    where those are gone (a record made on another machine), from a replicate: the same dense run trained again
    here as `<name>-replicate` (recorded under record["replicate"], with its own score at the record's budgets so
    the two models can be compared). With --only-report nothing is trained or scored: a budget stays missing."""
    missing = missing_budgets(name, record, args.budgets)
    if missing and not args.only_report:
        seed = int(name.rsplit("-s", 1)[1])
        summary = record["summary"]
        if not (Path(summary["run_dir"]) / "final").is_dir():
            summary = replicate_summary(args, seed)
            scored = sorted(int(b) for b in record["evals"])
            record["replicate"] = {
                "name": f"{name}-replicate", "run_dir": summary["run_dir"],
                "why": "the original's final weights are absent (trained on another machine)",
                "final_reward": summary.get("final_reward"),
                "evals": {str(b): dense_sparse_eval(args, seed, b, summary) for b in scored}}
        record["evals"].update({str(b): dense_sparse_eval(args, seed, b, summary) for b in missing})
        save_record(args, name, record)
    return record


def replicate_summary(args, seed: int) -> dict:
    """The summary of dense seed `seed` trained again in <out>/runs (run now unless a replicate finished earlier)."""
    name = f"dense-s{seed}-replicate"
    done = sorted((args.out / "runs").glob(f"{name}-2*/summary.json"))
    if not done:
        run_one(args, "dense", None, seed, name=name)
        done = sorted((args.out / "runs").glob(f"{name}-2*/summary.json"))
    return json.loads(done[-1].read_text())


def record_of_run(args, name: str) -> dict | None:
    """The record of a finished run in <out>/runs that has none yet (a run of an earlier version of this script),
    made and saved now; None when the run has no summary.json."""
    done = sorted((args.out / "runs").glob(f"{name}-2*/summary.json"))
    if not done:
        return None
    summary = json.loads(done[-1].read_text())
    walls = json.loads((args.out / "wall_s.json").read_text()) if (args.out / "wall_s.json").exists() else {}
    record = {"summary": summary, "history": histories(args.out, summary), "wall_s": walls.get(name, 0.0),
              "evals": {}}
    if name.startswith("dense-"):  # the dense model under every budget's cache, while its final weights exist
        seed = int(name.rsplit("-s", 1)[1])
        record["evals"] = {str(b): dense_sparse_eval(args, seed, b, summary) for b in args.budgets}
    save_record(args, name, record)
    return record


def save_record(args, name: str, record: dict) -> None:
    """Write a finished run's record to <out>/records and to --records (the committed copy)."""
    for folder in (args.out / "records", args.records):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))


def compressor_overrides(args, budget: int) -> list[str]:
    """eval.sparse_compressor.* = the config's compressor at `budget` (the sparse arms' cache)."""
    from dataclasses import asdict

    from deploy.config import load_config
    sparse = load_config(args.config, [*args.overrides, f"actors.engine.compressor.kv_budget={budget}"],
                         check_files=False).actors.engine.compressor
    return [f"eval.sparse_compressor.{k}={v}" for k, v in asdict(sparse).items()]


def run_one(args, arm: str, budget: int | None, seed: int, name: str | None = None) -> None:
    """One `sparse-rl train` in a subprocess (a fresh Ray and Redis per run); its console goes to a log file. A
    `name` other than the run's (a replicate) is trained and timed but gets no record."""
    out, replicate, name = args.out, name is not None, name or run_name(arm, budget, seed)
    overrides = train_overrides(args, arm, budget, seed, name)
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: running (log {log})", flush=True)
    start = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.run([sys.executable, "-m", "deploy.cli", "train", "--config", args.config, *overrides],
                              cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}); see {log}")
    record_wall(out, name, wall)
    if not replicate:
        record_of_run(args, name)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: done in {wall:.0f} s", flush=True)


def train_overrides(args, arm: str, budget: int | None, seed: int, name: str) -> list[str]:
    """The dotted overrides of one run's `sparse-rl train`. The budget comes before the arm's own overrides, so an
    arm that sizes its cache in bytes (kv_budget_bytes beside kv_budget=512) keeps them: its budget is the grid's
    label, the bytes it stands for (FP32_48_BYTES)."""
    out = args.out
    overrides = [*args.overrides, *([] if budget is None else [f"actors.engine.compressor.kv_budget={budget}"]),
                 *ARMS[arm], f"seed={seed}", f"learner.seed={seed}", f"name={name}",
                 f"run_dir={out / 'runs'}", f"mlflow.tracking_uri=sqlite:///{out / 'mlflow.db'}",
                 "mlflow.experiment=replication", f"train.steps={args.steps}", "eval.enabled=true",
                 f"eval.before={str(arm in EVAL_BEFORE).lower()}", "eval.data=train_task",
                 # eval.draw=1: the held-out draw the committed records were scored on (repeated questions kept:
                 # 56-60 distinct of the grid's 64); the default draw 2 (distinct) would score other items
                 f"eval.limit={args.eval_limit}", "eval.draw=1", f"broker.max_staleness={args.max_staleness}"]
    if budget is None:  # its sparse evaluation under the first budget's compressor (its own rollouts use none)
        overrides += compressor_overrides(args, args.budgets[0])
    return overrides


def record_wall(out: Path, name: str, wall: float) -> None:
    walls = out / "wall_s.json"
    record = json.loads(walls.read_text()) if walls.exists() else {}
    record[name] = wall
    walls.write_text(json.dumps(record, indent=1))


def dense_sparse_eval(args, seed: int, budget: int, summary: dict) -> dict:
    """The dense-trained model of `seed` scored with sparse inference at `budget`: {"sparse/reward": ...}. The
    score at the budget of the run's own sparse evaluation (its config's eval.sparse_compressor) is in the run's
    summary; the others are scored here, from the run's final model, in this process."""
    if budget == own_eval_budget(summary):
        return {k[len("eval/"):]: v for k, v in summary.items() if k.startswith("eval/sparse/")}
    from deploy.config import load_config
    from deploy.evaluate import evaluate_model
    cfg = load_config(args.config, [*args.overrides, f"seed={seed}", "eval.data=train_task", "eval.draw=1",
                                    f"eval.limit={args.eval_limit}", *compressor_overrides(args, budget)])
    start = time.monotonic()
    scores = evaluate_model(cfg, str(Path(summary["run_dir"]) / "final"), ["sparse"])
    record_wall(args.out, f"eval-{Path(summary['run_dir']).name}-b{budget}", time.monotonic() - start)
    return {k[len("eval/"):]: v for k, v in scores.items()}


def own_eval_budget(summary: dict) -> int | None:
    """The kv_budget of a run's own sparse evaluation, from the config.yaml in its run_dir (None when absent)."""
    from omegaconf import OmegaConf

    config = Path(summary["run_dir"]) / "config.yaml"
    if not config.exists():
        return None
    sparse = OmegaConf.load(config).get("eval", {}).get("sparse_compressor")
    return None if sparse is None else int(sparse["kv_budget"])


def histories(out: Path, summary: dict) -> dict[str, list[float]]:
    """Per-step values of the RECORDED metrics of one run, from its MLflow run (ordered by step)."""
    from mlflow.tracking import MlflowClient

    from deploy.metric_names import metric_history  # MLflow names; old records: their internal names

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    result = {}
    for name in RECORDED:
        points = sorted(metric_history(client, summary["mlflow_run_id"], name), key=lambda m: m.step)
        result[name] = [m.value for m in points]
    return result


def run_stats(h: dict[str, np.ndarray], summary: dict) -> dict:
    """One run's figures: reward gain and final reward (EDGE steps), peak, collapse, grad-norm spike ratio,
    evaluation rewards (after; before where measured)."""
    r, g = h["reward_mean"], h["grad_norm"][np.isfinite(h["grad_norm"])]
    final = float(r[-EDGE:].mean())
    stats = {"reward_gain": float(r[-EDGE:].mean() - r[:EDGE].mean()), "final_reward": final,
             "peak_reward": float(r.max()), "collapse": bool(final < 0.5 * r.max()),
             "grad_norm_spike": spike_ratio(g),
             # not pre-registered, reported beside it: a step whose groups all have equal rewards has no policy
             # gradient (norm 0), and such steps pull the median down (docs/results.md 6.4)
             "grad_norm_spike_with_gradient": spike_ratio(g[g > 0]), "steps_without_gradient": int((g == 0).sum()),
             "kv_retained_ratio": float(h["kv_retained_ratio"].mean()),
             "response_truncated_fraction": float(h["response_truncated_fraction"].mean()),
             "mismatch_kl": float(np.nanmean(h["mismatch_kl"])),
             "rejection_rate": float(np.nanmean(h["rejection_rate"]))}
    for name in ("replay_logp_max_abs", "replay_dense_gap_max"):   # rule R4 (docs/results.md 6.12): replay arms
        values = h.get(name, np.array([]))
        if len(values):
            stats[f"{name}_max"] = float(np.max(values))   # NaN (no fresh rows in a step) propagates: not exact
            stats[f"{name}_steps"] = int(len(values))
    for key, value in summary.items():
        if (key.startswith(("eval/", "eval_before/"))
                and key.rsplit("/", 1)[-1] in ("reward", "accuracy", "kv_peak_bytes")):
            stats[key] = value
    return stats


def spike_ratio(g: np.ndarray) -> float | str | None:
    """max / median of per-step grad norms (6.2's spike rule); "inf" when the median is 0 and the max is not
    (a string, so the JSON stays strict); None without steps or without any gradient."""
    if not len(g) or g.max() == 0:
        return None
    median = float(np.median(g))
    return float(g.max() / median) if median > 0 else "inf"


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def spiked(ratio) -> bool:
    """6.2's rule: max / median grad norm above SPIKE ("inf" counts; None does not)."""
    return ratio == "inf" or (ratio is not None and ratio > SPIKE)


def verdicts(arms: dict[str, dict[int, dict]], dense: dict[int, dict], dense_sparse: dict[int, dict]) -> dict:
    """H1-H3 of docs/results.md section 6 at one budget. arms: {arm: {seed: run_stats}}; dense: {seed: run_stats}
    of the dense arm; dense_sparse: {seed: the dense model's sparse evaluation at this budget}."""
    srl, naive = arms.get("sparse_rl", {}), arms.get("naive_sparse", {})
    out = {}
    if srl and dense:
        d_final, s_final = (mean(x["final_reward"] for x in dense.values()),
                            mean(x["final_reward"] for x in srl.values()))
        d_eval = mean(x.get("eval/dense/reward") for x in dense.values())
        s_eval = mean(x.get("eval/dense/reward") for x in srl.values())
        ok = s_final >= 0.95 * d_final and s_eval is not None and d_eval is not None and s_eval >= 0.95 * d_eval
        out["h1"] = {"confirmed": bool(ok), "sparse_rl_final_reward": s_final, "dense_final_reward": d_final,
                     "sparse_rl_eval_dense_reward": s_eval, "dense_eval_dense_reward": d_eval,
                     "per_seed": {s: {"sparse_rl_final": srl[s]["final_reward"],
                                      "dense_final": dense[s]["final_reward"],
                                      "sparse_rl_eval": srl[s].get("eval/dense/reward"),
                                      "dense_eval": dense[s].get("eval/dense/reward")}
                                  for s in sorted(set(srl) & set(dense))}}
    if srl and naive:
        finals = {a: [x["final_reward"] for x in arms[a].values()] for a in ("sparse_rl", "naive_sparse")}
        spread = max(max(v) - min(v) for v in finals.values())
        lower = mean(finals["sparse_rl"]) - mean(finals["naive_sparse"]) > spread
        seeds = sorted(set(srl) & set(naive))
        spikes = [s for s in seeds if spiked(naive[s]["grad_norm_spike"]) and not spiked(srl[s]["grad_norm_spike"])]
        collapses = [s for s in seeds if naive[s]["collapse"] and not srl[s]["collapse"]]
        majority = len(seeds) // 2 + 1
        out["h2"] = {"confirmed": bool(lower or len(spikes) >= majority or len(collapses) >= majority),
                     "naive_final_reward": mean(finals["naive_sparse"]),
                     "sparse_rl_final_reward": mean(finals["sparse_rl"]),
                     "seed_spread": spread, "final_reward_lower_by_more_than_spread": bool(lower),
                     "seeds_with_naive_only_grad_spike": spikes, "seeds_with_naive_only_collapse": collapses,
                     "per_seed": {s: {"naive_final": naive[s]["final_reward"],
                                      "sparse_rl_final": srl[s]["final_reward"],
                                      "naive_grad_norm_spike": naive[s]["grad_norm_spike"],
                                      "sparse_rl_grad_norm_spike": srl[s]["grad_norm_spike"],
                                      "naive_grad_norm_spike_with_gradient":
                                          naive[s].get("grad_norm_spike_with_gradient"),
                                      "sparse_rl_grad_norm_spike_with_gradient":
                                          srl[s].get("grad_norm_spike_with_gradient"),
                                      "naive_collapse": naive[s]["collapse"], "sparse_rl_collapse": srl[s]["collapse"]}
                                  for s in seeds}}
    if srl and dense_sparse:
        seeds = sorted(set(srl) & set(dense_sparse))
        s_sp = mean(srl[s].get("eval/sparse/reward") for s in seeds)
        d_sp = mean(dense_sparse[s].get("sparse/reward") for s in seeds)
        out["h3"] = {"confirmed": bool(s_sp is not None and d_sp is not None and s_sp > d_sp),
                     "sparse_rl_eval_sparse_reward": s_sp, "dense_model_eval_sparse_reward": d_sp,
                     "per_seed": {s: {"sparse_rl": srl[s].get("eval/sparse/reward"),
                                      "dense_model": dense_sparse[s].get("sparse/reward")} for s in seeds}}
    return out


SPREAD = 0.046
"""The evaluation's own spread of a held-out mean (64 items, one model, 3 seeds; docs/results.md 6.10)."""
REPLAY_ARMS = ("sparse_replay", "sparse_replay_distill")


def replay_verdicts(arms: dict[str, dict[int, dict]], dense: dict[int, dict], dense_sparse: dict[int, dict],
                    steps: int) -> dict:
    """R1-R4 of docs/results.md 6.12 for each replay arm at one budget (arguments as `verdicts`; `steps` per run).
    {arm: {"r1": {...}, "r2": ..., "r3": ..., "r4": ..., "switch": R1 and R3 and R4 and R2 not refuted against
    naive}}; a rule whose runs are missing is None."""
    naive, srl = arms.get("naive_sparse", {}), arms.get("sparse_rl", {})
    out = {}
    for arm in REPLAY_ARMS:
        runs = arms.get(arm, {})
        if not runs:
            continue
        seeds = sorted(runs)
        final = mean(runs[s]["final_reward"] for s in seeds)
        r = {}
        if dense and naive:
            d, n = mean(dense[s]["final_reward"] for s in seeds), mean(naive[s]["final_reward"] for s in seeds)
            per_seed = {s: {"final": runs[s]["final_reward"], "naive_final": naive[s]["final_reward"],
                            "dense_final": dense[s]["final_reward"]} for s in seeds}
            near = sum(runs[s]["final_reward"] >= naive[s]["final_reward"] - 0.05 for s in seeds)
            r["r1"] = {"holds": bool(final >= 0.95 * d and final >= n - 0.05 and near >= 2), "final_reward": final,
                       "dense_final_reward": d, "naive_final_reward": n, "seeds_within_0.05_of_naive": int(near),
                       "per_seed": per_seed}
        if dense_sparse and srl and naive:
            own = mean(runs[s].get("eval/sparse/reward") for s in seeds)
            others = {"dense_model": mean(dense_sparse[s].get("sparse/reward") for s in seeds),
                      "sparse_rl": mean(srl[s].get("eval/sparse/reward") for s in seeds),
                      "naive_sparse": mean(naive[s].get("eval/sparse/reward") for s in seeds)}
            above = own - max(others["dense_model"], others["sparse_rl"]) > SPREAD
            below_naive = others["naive_sparse"] - own > SPREAD
            r["r2"] = {"holds": bool(above and not below_naive), "refuted_against_naive": bool(below_naive),
                       "eval_sparse_reward": own, **{f"{k}_eval_sparse_reward": v for k, v in others.items()},
                       "spread": SPREAD, "per_seed": {s: runs[s].get("eval/sparse/reward") for s in seeds}}
        if dense:
            own, ref = (mean(runs[s].get("eval/dense/reward") for s in seeds),
                        mean(dense[s].get("eval/dense/reward") for s in seeds))
            r["r3"] = {"holds": bool(own is not None and ref is not None and own >= 0.95 * ref),
                       "eval_dense_reward": own, "dense_eval_dense_reward": ref,
                       "per_seed": {s: runs[s].get("eval/dense/reward") for s in seeds}}
        r["r4"] = replay_exact(runs, steps)
        decided = all(k in r for k in ("r1", "r2", "r3", "r4"))
        r["switch"] = bool(decided and r["r1"]["holds"] and r["r3"]["holds"] and r["r4"]["holds"]
                           and not r["r2"]["refuted_against_naive"]) if decided else None
        out[arm] = r
    return out


def replay_exact(runs: dict[int, dict], steps: int, bound: float = 1e-4) -> dict:
    """R4 of docs/results.md 6.12 over one arm's runs {seed: run_stats}: `replay_logp_max_abs` <= `bound` (1e-4;
    1e-3 for a quantized cache, section 11) on every step of every run and each run's largest
    `replay_dense_gap_max` > 1e-2."""
    seeds = sorted(runs)
    worst = [runs[s].get("replay_logp_max_abs_max") for s in seeds]
    gaps = [runs[s].get("replay_dense_gap_max_max") for s in seeds]
    every_step = all(runs[s].get("replay_logp_max_abs_steps") == steps for s in seeds)
    return {"holds": bool(every_step and all(w is not None and w <= bound for w in worst)
                          and all(g is not None and g > 1e-2 for g in gaps)),
            "replay_logp_max_abs": dict(zip(seeds, worst)), "replay_dense_gap_max": dict(zip(seeds, gaps)),
            "measured_on_every_step": bool(every_step)}


SCORER_PAIRS = {"random_replay": "sparse_replay", "streamingllm_replay": "sparse_replay",
                "random_protect_replay": "rkv_protect_replay"}
"""docs/results.md section 10: each no-score arm and the R-KV arm with the same protection it is compared with."""


def paired(arms: dict[str, dict[int, dict]], arm: str, ref: str) -> tuple[dict, dict, list[int]]:
    """An arm's runs, its reference arm's and the seeds both ran ({seed: run_stats} each; [] if either is missing)."""
    runs, base = arms.get(arm, {}), arms.get(ref, {})
    return runs, base, sorted(set(runs) & set(base))


def scorer_verdicts(arms: dict[str, dict[int, dict]], steps: int) -> dict:
    """The rules of docs/results.md section 10 at one budget (arms: {arm: {seed: run_stats}}; means over the seeds
    both arms ran). `matches_rkv` per no-score arm: held-out under its own cache >= the R-KV arm's - SPREAD and final
    training reward >= the R-KV arm's - 0.05; `exact` (R4 of 6.12) for every replay arm that ran; `rescue`: replay
    rescues random iff random_replay's held-out under its own cache > random_naive's + SPREAD and higher in >= 2 of
    the seeds. A rule whose runs are missing is left out."""
    out: dict = {}
    for arm, ref in SCORER_PAIRS.items():
        runs, base, seeds = paired(arms, arm, ref)
        if not seeds:
            continue
        own, rkv = (mean(r[s].get("eval/sparse/reward") for s in seeds) for r in (runs, base))
        final, rkv_final = (mean(r[s]["final_reward"] for s in seeds) for r in (runs, base))
        out[arm] = {"matches_rkv": {
            "holds": bool(own >= rkv - SPREAD and final >= rkv_final - 0.05), "against": ref,
            "eval_sparse_reward": own, "rkv_eval_sparse_reward": rkv, "final_reward": final,
            "rkv_final_reward": rkv_final, "per_seed": {s: {"eval_sparse": runs[s].get("eval/sparse/reward"),
                                                            "rkv_eval_sparse": base[s].get("eval/sparse/reward"),
                                                            "final": runs[s]["final_reward"],
                                                            "rkv_final": base[s]["final_reward"]} for s in seeds}}}
    for arm in ("random_replay", "streamingllm_replay", "rkv_protect_replay", "random_protect_replay"):
        if arms.get(arm):
            out.setdefault(arm, {})["exact"] = replay_exact(arms[arm], steps)
    replay, naive = arms.get("random_replay", {}), arms.get("random_naive", {})
    seeds = sorted(set(replay) & set(naive))
    if seeds:
        per_seed = {s: {"replay": replay[s].get("eval/sparse/reward"), "naive": naive[s].get("eval/sparse/reward")}
                    for s in seeds}
        own, other = mean(v["replay"] for v in per_seed.values()), mean(v["naive"] for v in per_seed.values())
        higher = sum(v["replay"] > v["naive"] for v in per_seed.values())
        out["rescue"] = {"holds": bool(own > other + SPREAD and higher >= 2), "random_replay_eval_sparse_reward": own,
                         "random_naive_eval_sparse_reward": other, "seeds_higher": int(higher), "spread": SPREAD,
                         "per_seed": per_seed}
    return out


EQUAL_BYTES = {"fp8_replay_eqbytes": ("sparse_replay", 1.0), "fp8_replay_halfbytes": ("sparse_replay", 0.5)}
"""docs/results.md section 11: each quantized arm, the fp32 R-KV arm it is compared with, and the share of that
arm's measured KV bytes per sequence it is meant to use."""
FINAL_MARGIN = 0.05
"""Training reward: how far below the reference's final reward an arm may end (sections 10 and 11)."""
BYTES_TOLERANCE = 0.05
"""Section 11: a run is at its stated bytes iff its measured KV peak per sequence is within 5 % of its target."""


def equal_bytes_verdicts(arms: dict[str, dict[int, dict]], steps: int) -> dict:
    """The rules of docs/results.md section 11 at one budget (arms: {arm: {seed: run_stats}}; means over the seeds
    both the arm and its reference ran), per arm of EQUAL_BYTES whose reference ran:
    - target: the reference's measured `eval/sparse/kv_peak_bytes` (per sequence, the held-out items under its
      cache; mean over the seeds) times the arm's share; `at_stated_bytes` iff every seed of the arm measured within
      BYTES_TOLERANCE of it (a seed without the figure is not);
    - `reward_verdict`: "better" iff the held-out reward under its own cache > the reference's + SPREAD, the final
      training reward >= the reference's - FINAL_MARGIN and the held-out reward is higher in >= 2 seeds; else "no
      worse" iff held-out >= the reference's - SPREAD and final >= the reference's - FINAL_MARGIN; else "worse";
    - `verdict`: the reward verdict, or "not at the stated bytes" where `at_stated_bytes` fails;
    - reported beside them: held-out dense, kv_retained_ratio per seed and `exact` (replay_logp_max_abs <= 1e-3 on
      every step, `replay_exact`)."""
    out: dict = {}
    for arm, (ref, share) in EQUAL_BYTES.items():
        runs, base, seeds = paired(arms, arm, ref)
        if not seeds:
            continue
        own, ref_eval = (mean(r[s].get("eval/sparse/reward") for s in seeds) for r in (runs, base))
        final, ref_final = (mean(r[s]["final_reward"] for s in seeds) for r in (runs, base))
        higher = sum(runs[s].get("eval/sparse/reward") > base[s].get("eval/sparse/reward") for s in seeds)
        if own > ref_eval + SPREAD and final >= ref_final - FINAL_MARGIN and higher >= 2:
            reward = "better"
        elif own >= ref_eval - SPREAD and final >= ref_final - FINAL_MARGIN:
            reward = "no worse"
        else:
            reward = "worse"
        ref_bytes = mean(base[s].get("eval/sparse/kv_peak_bytes") for s in seeds)
        target = None if ref_bytes is None else share * ref_bytes
        measured = {s: runs[s].get("eval/sparse/kv_peak_bytes") for s in seeds}
        at_bytes = target is not None and all(m is not None and abs(m / target - 1) <= BYTES_TOLERANCE
                                              for m in measured.values())
        out[arm] = {
            "verdict": reward if at_bytes else "not at the stated bytes", "reward_verdict": reward,
            "against": ref, "at_stated_bytes": bool(at_bytes), "target_kv_peak_bytes": target, "share": share,
            "kv_peak_bytes": measured, "eval_sparse_reward": own, "ref_eval_sparse_reward": ref_eval,
            "final_reward": final, "ref_final_reward": ref_final, "seeds_higher": int(higher),
            "eval_dense_reward": mean(runs[s].get("eval/dense/reward") for s in seeds),
            "ref_eval_dense_reward": mean(base[s].get("eval/dense/reward") for s in seeds),
            "kv_retained_ratio": {s: runs[s].get("kv_retained_ratio") for s in seeds},
            "exact": replay_exact({s: runs[s] for s in seeds}, steps, bound=1e-3),
            "per_seed": {s: {"eval_sparse": runs[s].get("eval/sparse/reward"),
                             "ref_eval_sparse": base[s].get("eval/sparse/reward"), "final": runs[s]["final_reward"],
                             "ref_final": base[s]["final_reward"]} for s in seeds}}
    return out


LORA_PAIR = ("lora_replay", "sparse_replay")
"""docs/results.md section 12: the LoRA arm and the full fine-tuning arm it is compared with."""


def lora_verdicts(arms: dict[str, dict[int, dict]], steps: int) -> dict:
    """The rules of docs/results.md section 12 at one budget (arms: {arm: {seed: run_stats}}; means over the seeds
    both ran; {} if either arm is missing). "gain" = `reward_gain` (mean training reward of the last EDGE steps minus
    the first EDGE), "final" = the last EDGE steps' mean:
    - `r1`: LoRA's gain >= 0.8 x full fine-tuning's, LoRA's final >= full's - FINAL_MARGIN, and no seed's LoRA gain
      below half of full fine-tuning's mean gain;
    - `r3`: held-out reward under the run's own cache and dense, each >= full fine-tuning's - SPREAD;
    - `r4`: `replay_exact` (replay_logp_max_abs <= 1e-4 on every step, replay_dense_gap_max > 1e-2);
    - `decided`: "trains as full fine-tuning" iff r1, r3 and r4 hold, else "does not"."""
    arm, ref = LORA_PAIR
    runs, base, seeds = paired(arms, arm, ref)
    if not seeds:
        return {}
    gain, ref_gain = (mean(r[s]["reward_gain"] for s in seeds) for r in (runs, base))
    final, ref_final = (mean(r[s]["final_reward"] for s in seeds) for r in (runs, base))
    low = [s for s in seeds if runs[s]["reward_gain"] < 0.5 * ref_gain]
    r1 = {"holds": bool(gain >= 0.8 * ref_gain and final >= ref_final - FINAL_MARGIN and not low), "gain": gain,
          "full_gain": ref_gain, "final_reward": final, "full_final_reward": ref_final, "seeds_below_half": low}
    held = {m: tuple(mean(r[s].get(f"eval/{m}/reward") for s in seeds) for r in (runs, base))
            for m in ("sparse", "dense")}
    r3 = {"holds": all(own is not None and full is not None and own >= full - SPREAD for own, full in held.values()),
          **{f"eval_{m}_reward": own for m, (own, _) in held.items()},
          **{f"full_eval_{m}_reward": full for m, (_, full) in held.items()}}
    r4 = replay_exact({s: runs[s] for s in seeds}, steps)
    per_seed = {s: {"gain": runs[s]["reward_gain"], "full_gain": base[s]["reward_gain"],
                    "final": runs[s]["final_reward"], "full_final": base[s]["final_reward"],
                    "eval_sparse": runs[s].get("eval/sparse/reward"), "eval_dense": runs[s].get("eval/dense/reward"),
                    "full_eval_sparse": base[s].get("eval/sparse/reward"),
                    "full_eval_dense": base[s].get("eval/dense/reward")} for s in seeds}
    ok = r1["holds"] and r3["holds"] and r4["holds"]
    return {arm: {"against": ref, "r1": r1, "r3": r3, "r4": r4, "per_seed": per_seed,
                  "decided": "trains as full fine-tuning" if ok else "does not"}}


def lora_text(v: dict, budget: int) -> list[str]:
    """Section 12's verdicts at `budget` in markdown: one line with each rule's numbers and every seed's."""
    lines = []
    for arm, r in v.items():
        r1, r3 = r["r1"], r["r3"]
        lines.append(
            f"- budget {budget}, {arm}: **{r['decided']}** against {r['against']}: R1 "
            f"{'holds' if r1['holds'] else 'fails'} (gain {num(r1['gain'])} vs 0.8 x {num(r1['full_gain'])}; final "
            f"{num(r1['final_reward'])} vs {num(r1['full_final_reward'])} - {FINAL_MARGIN}; seeds below half of the "
            f"full gain: {r1['seeds_below_half'] or 'none'}); R3 {'holds' if r3['holds'] else 'fails'} (held-out "
            f"under its cache {num(r3['eval_sparse_reward'])} vs {num(r3['full_eval_sparse_reward'])}, dense "
            f"{num(r3['eval_dense_reward'])} vs {num(r3['full_eval_dense_reward'])}, -{SPREAD}); R4 "
            f"{'holds' if r['r4']['holds'] else 'fails'} (replay |dlogp| max "
            + ", ".join(num(x) for x in r["r4"]["replay_logp_max_abs"].values()) + "); "
            + "; ".join(f"seed {s}: gain {num(x['gain'])} (full {num(x['full_gain'])}), final {num(x['final'])} "
                        f"(full {num(x['full_final'])}), held-out {num(x['eval_sparse'])} / {num(x['eval_dense'])} "
                        f"(full {num(x['full_eval_sparse'])} / {num(x['full_eval_dense'])})"
                        for s, x in r["per_seed"].items()))
    return lines


def num(x) -> str:
    """A verdict table's number: "n/a" for None, 3 significant digits below 1e-2, else 3 decimals."""
    return "n/a" if x is None else f"{x:.3g}" if isinstance(x, float) and abs(x) < 1e-2 else f"{x:.3f}" \
        if isinstance(x, float) else str(x)


def equal_bytes_text(v: dict, budget: int) -> list[str]:
    """Section 11's verdicts at `budget` in markdown, one line per arm with its rule's numbers and every seed's."""
    lines = []
    for arm, r in v.items():
        target = r["target_kv_peak_bytes"]
        lines.append(
            f"- budget {budget}, {arm}: **{r['verdict']}** (rewards: {r['reward_verdict']}): held-out under its cache "
            f"{num(r['eval_sparse_reward'])} vs {r['against']} {num(r['ref_eval_sparse_reward'])} (+-{SPREAD}), higher "
            f"in {r['seeds_higher']} seeds; final {num(r['final_reward'])} vs {num(r['ref_final_reward'])} "
            f"(-{FINAL_MARGIN}); held-out dense {num(r['eval_dense_reward'])} vs {num(r['ref_eval_dense_reward'])}; KV "
            f"peak B per sequence " + ", ".join(f"seed {s}: {'n/a' if m is None else f'{m:,.0f}'}"
                                                for s, m in r["kv_peak_bytes"].items())
            + f" vs target {'n/a' if target is None else f'{target:,.0f}'} ({r['share']} x {r['against']}'s, "
            f"+-{BYTES_TOLERANCE:.0%}); kv kept " + ", ".join(num(x) for x in r["kv_retained_ratio"].values())
            + f"; replay exact (<= 1e-3 every step): {'yes' if r['exact']['holds'] else 'no'}; "
            + "; ".join(f"seed {s}: held-out {num(x['eval_sparse'])} (ref {num(x['ref_eval_sparse'])}), final "
                        f"{num(x['final'])} (ref {num(x['ref_final'])})" for s, x in r["per_seed"].items()))
    return lines


MARGIN = 0.1
"""Section 9's margin (docs/results.md): above the spread of a difference of two 64-item held-out means."""


def episode_verdicts(arms: dict[str, dict[int, dict]], dense: dict[int, dict], dense_sparse: dict[int, dict],
                     steps: int) -> dict:
    """S1-S5 of docs/results.md section 9 (multi-turn KV-stress comparison) for sparse_replay at one budget
    (arguments as `verdicts`): {"s1".."s5": {"holds" or "verdict", the rule's numbers, "per_seed"}, "switch": S1 and
    S2 and S5}; {} without the replay arm; a rule whose runs are missing is absent and the switch None."""
    runs, srl, naive = arms.get("sparse_replay", {}), arms.get("sparse_rl", {}), arms.get("naive_sparse", {})
    if not runs:
        return {}
    seeds = sorted(runs)
    final, own = mean(runs[s]["final_reward"] for s in seeds), mean(runs[s].get("eval/sparse/reward") for s in seeds)
    per_seed = {s: runs[s].get("eval/sparse/reward") for s in seeds}
    v: dict = {}
    if dense:
        d_final, d_eval = (mean(dense[s]["final_reward"] for s in seeds),
                           mean(dense[s].get("eval/dense/reward") for s in seeds))
        v["s1"] = {"holds": bool(final >= d_final - MARGIN and own >= d_eval - MARGIN), "final_reward": final,
                   "dense_final_reward": d_final, "eval_sparse_reward": own, "dense_eval_dense_reward": d_eval,
                   "per_seed": {s: {"final": runs[s]["final_reward"], "dense_final": dense[s]["final_reward"],
                                    "eval_sparse": per_seed[s], "dense_eval_dense": dense[s].get("eval/dense/reward")}
                                for s in seeds}}
    if srl:
        other = {s: srl[s].get("eval/sparse/reward") for s in seeds}
        above = sum(per_seed[s] > other[s] for s in seeds)
        v["s2"] = {"holds": bool(own > mean(other.values()) + MARGIN and above >= 2), "eval_sparse_reward": own,
                   "sparse_rl_eval_sparse_reward": mean(other.values()), "seeds_above": int(above),
                   "per_seed": {s: {"replay": per_seed[s], "sparse_rl": other[s]} for s in seeds}}
    if naive:
        n = mean(naive[s].get("eval/sparse/reward") for s in seeds)
        v["s3"] = {"verdict": "above" if own > n + MARGIN else "below" if own < n - MARGIN else "within",
                   "eval_sparse_reward": own, "naive_sparse_eval_sparse_reward": n,
                   "per_seed": {s: {"replay": per_seed[s], "naive": naive[s].get("eval/sparse/reward")} for s in seeds}}
    if dense_sparse:
        dm = mean(dense_sparse[s].get("sparse/reward") for s in seeds)
        v["s4"] = {"holds": bool(own > dm + MARGIN), "eval_sparse_reward": own, "dense_model_eval_sparse_reward": dm,
                   "per_seed": {s: {"replay": per_seed[s], "dense_model": dense_sparse[s].get("sparse/reward")}
                                for s in seeds}}
    worst = {s: runs[s].get("replay_logp_max_abs_max") for s in seeds}
    every_step = all(runs[s].get("replay_logp_max_abs_steps") == steps for s in seeds)
    v["s5"] = {"holds": bool(every_step and all(w is not None and w <= 1e-4 for w in worst.values())),
               "replay_logp_max_abs": worst, "measured_on_every_step": bool(every_step)}
    v["switch"] = bool(v["s1"]["holds"] and v["s2"]["holds"] and v["s5"]["holds"]) \
        if all(k in v for k in ("s1", "s2")) else None
    return v


def report(args) -> dict:
    """Gather the finished runs; write the plot; return the JSON object."""
    from deploy.config import load_config
    from deploy.model_cache import resolve_model
    from deploy.preflight import longest_prompt

    cfg = load_config(args.config, args.overrides, check_files=False)
    prompt_max = longest_prompt(cfg, resolve_model(cfg.model))
    records = {(arm, b, seed): finished(args, run_name(arm, b, seed)) for arm, b, seed in grid(args)}
    records = {k: v for k, v in records.items() if v}
    hist = {k: {m: np.array(v["history"].get(m, []), dtype=float) for m in RECORDED} for k, v in records.items()}
    stats = {k: run_stats(hist[k], v["summary"]) for k, v in records.items() if len(hist[k]["reward_mean"])}
    done = records
    result: dict = {"config": args.config, "overrides": args.overrides, "steps": args.steps,
                    "seeds": len(args.only_seeds),
                    "seed_list": args.only_seeds,
                    "regime": "decode" if prompt_max < min(args.budgets) else "prefill",
                    "prompt_tokens_max": prompt_max, "kv_budget": args.budgets[0], "kv_budgets": args.budgets,
                    "eval_limit": args.eval_limit, "max_staleness": args.max_staleness,
                    "runs_finished": sorted(run_name(*k) for k in done),
                    "runs_planned": len(grid(args)), "complete": len(done) == len(grid(args))}
    dense = {seed: st for (arm, b, seed), st in stats.items() if arm == "dense"}
    if dense:
        result["dense"] = summarize(dense)
    for b in args.budgets:
        arms = {arm: {seed: st for (a, bb, seed), st in stats.items() if a == arm and bb == b} for arm in SPARSE_ARMS}
        arms = {a: v for a, v in arms.items() if v}
        dense_sparse = {seed: records[("dense", None, seed)]["evals"].get(str(b), {}) for seed in dense}
        block = {arm: summarize(v) for arm, v in arms.items()}
        block["dense_model_eval_sparse_reward"] = {s: v.get("sparse/reward") for s, v in dense_sparse.items()}
        block.update(verdicts(arms, dense, dense_sparse))
        replay = replay_verdicts(arms, dense, dense_sparse, args.steps)
        if replay:
            block["replay"] = replay
        scorer = scorer_verdicts(arms, args.steps)
        if scorer:
            block["scorer"] = scorer
        equal_bytes = equal_bytes_verdicts(arms, args.steps)
        if equal_bytes:
            block["equal_bytes"] = equal_bytes
        lora = lora_verdicts(arms, args.steps)
        if lora:
            block["lora"] = lora
        if cfg.actors.env.factory:   # a multi-turn config: section 9's rules
            block["episodes"] = episode_verdicts(arms, dense, dense_sparse, args.steps)
        result[f"budget_{b}"] = block
    for arm, short in (("dense", "dense"), ("sparse_rl", "sparse_rl"), ("naive_sparse", "naive_sparse")):
        gains = [st["reward_gain"] for (a, bb, _), st in stats.items() if a == arm and bb in (None, args.budgets[0])]
        result[f"{short}_reward_gain"] = mean(gains)
    kv = [st["kv_retained_ratio"] for (a, b, _), st in stats.items() if a != "dense" and b == args.budgets[0]]
    result["kv_retained_ratio"] = mean(kv)
    result["wall_s"] = round(sum(v.get("wall_s", 0.0) for v in records.values()), 1)
    plot(args, hist, args.out / "replication.png")
    result["plot"] = str(args.out / "replication.png")
    dense_sparse = {(seed, b): records[("dense", None, seed)]["evals"].get(str(b), {}).get("sparse/reward")
                    for seed in dense for b in args.budgets}
    (args.out / "replication.md").write_text(runs_table(stats, dense_sparse, args.budgets) + "\n"
                                             + verdicts_text(result, args.budgets))
    result["table"] = str(args.out / "replication.md")
    return result


def runs_table(stats: dict[tuple, dict], dense_sparse: dict[tuple[int, int], float | None], budgets) -> str:
    """Every finished run's figures as one markdown table, a row per (arm, budget, seed); a dense run has a row per
    budget, its model scored under that budget's cache. stats: {(arm, budget or None, seed): run_stats};
    dense_sparse: {(seed, budget): the dense model's held-out reward under that budget's cache}."""
    def f(x, digits=3):
        return "" if x is None else x if isinstance(x, str) else f"{x:.{digits}f}"

    head = ["arm", "budget", "seed", "final reward", "peak", "cut", "kv kept", "mismatch KL", "rejection",
            "grad-norm max/median (with gradient; steps without)", "held-out dense before -> after",
            "held-out sparse before -> after"]
    rows = []
    for (arm, b, seed), st in sorted(stats.items(),
                                     key=lambda kv: (kv[0][2], list(ARMS).index(kv[0][0]), kv[0][1] or 0)):
        for budget in budgets if b is None else [b]:
            sparse_after = dense_sparse.get((seed, budget)) if b is None else st.get("eval/sparse/reward")
            sparse_before = st.get("eval_before/sparse/reward") if b is not None or budget == budgets[0] else None
            rows.append([arm, str(budget), str(seed), f(st["final_reward"]), f(st["peak_reward"]),
                         f(st["response_truncated_fraction"], 2), "" if b is None else f(st["kv_retained_ratio"], 2),
                         "" if b is None else f(st["mismatch_kl"], 4), "" if b is None else f(st["rejection_rate"], 3),
                         f"{f(st['grad_norm_spike'], 1)} ({f(st['grad_norm_spike_with_gradient'], 1)}; "
                         f"{st['steps_without_gradient']})",
                         f"{f(st.get('eval_before/dense/reward'))} -> {f(st.get('eval/dense/reward'))}".lstrip(" ->"),
                         f"{f(sparse_before)} -> {f(sparse_after)}".lstrip(" ->")])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def verdicts_text(result: dict, budgets) -> str:
    """The verdicts H1-H3 of every budget in markdown, each with its rule's numbers and every seed's."""
    def f(x):
        return "n/a" if x is None else x if isinstance(x, str) else f"{x:.3f}"

    def seeds(per_seed: dict, fields: dict[str, str]) -> str:
        return "; ".join(f"seed {s}: " + ", ".join(f"{label} {f(v.get(k))}" for k, label in fields.items())
                         for s, v in per_seed.items())

    lines = []
    for b in budgets:
        block = result.get(f"budget_{b}", {})
        for name in ("h1", "h2", "h3"):
            v = block.get(name)
            if v is None:
                lines.append(f"- budget {b}, {name.upper()}: not decided (runs missing)")
                continue
            verdict = "confirmed" if v["confirmed"] else "refuted"
            if name == "h1":
                why = (f"Sparse-RL final {f(v['sparse_rl_final_reward'])} vs 0.95 x dense {f(v['dense_final_reward'])}"
                       f"; held-out (dense inference) {f(v['sparse_rl_eval_dense_reward'])} vs 0.95 x "
                       f"{f(v['dense_eval_dense_reward'])}. " + seeds(v["per_seed"], {
                           "sparse_rl_final": "Sparse-RL final", "dense_final": "dense final",
                           "sparse_rl_eval": "Sparse-RL held-out", "dense_eval": "dense held-out"}))
            elif name == "h2":
                why = (f"(a) naive final {f(v['naive_final_reward'])} vs Sparse-RL {f(v['sparse_rl_final_reward'])}, "
                       f"seed spread {f(v['seed_spread'])}: lower by more than the spread "
                       f"{'yes' if v['final_reward_lower_by_more_than_spread'] else 'no'}; (b) seeds with a naive-only "
                       f"grad-norm spike {v['seeds_with_naive_only_grad_spike']}; (c) seeds with a naive-only collapse "
                       f"{v['seeds_with_naive_only_collapse']}. " + seeds(v["per_seed"], {
                           "naive_final": "naive final", "sparse_rl_final": "Sparse-RL final",
                           "naive_grad_norm_spike": "naive spike", "sparse_rl_grad_norm_spike": "Sparse-RL spike"}))
            else:
                why = (f"held-out under the budget-{b} cache: Sparse-RL {f(v['sparse_rl_eval_sparse_reward'])} vs the "
                       f"dense-trained model {f(v['dense_model_eval_sparse_reward'])}. " + seeds(v["per_seed"], {
                           "sparse_rl": "Sparse-RL", "dense_model": "dense-trained"}))
            lines.append(f"- budget {b}, {name.upper()}: **{verdict}**: {why}")
        lines += replay_verdicts_text(block.get("replay", {}), b)
        lines += [f"- budget {b}, {name}: {json.dumps(v)}" for name, v in block.get("scorer", {}).items()]
        lines += equal_bytes_text(block.get("equal_bytes", {}), b)
        lines += lora_text(block.get("lora", {}), b)
        lines += episode_verdicts_text(block.get("episodes", {}), b)
    return "\n".join(lines) + "\n"


def replay_verdicts_text(replay: dict, budget: int) -> list[str]:
    """R1-R4 of docs/results.md 6.12 for each replay arm at `budget`, in markdown, with every seed's numbers."""
    lines = []
    for arm, r in replay.items():
        for name, why in (
                ("r1", lambda v: f"final {num(v['final_reward'])} vs 0.95 x dense {num(v['dense_final_reward'])} "
                                 f"and naive {num(v['naive_final_reward'])} - 0.05; seeds within 0.05 of naive "
                                 f"{v['seeds_within_0.05_of_naive']}; " + "; ".join(
                                     f"seed {s}: {num(x['final'])} (naive {num(x['naive_final'])}, dense "
                                     f"{num(x['dense_final'])})" for s, x in v["per_seed"].items())),
                ("r2", lambda v: f"held-out under the cache {num(v['eval_sparse_reward'])} vs dense-trained "
                                 f"{num(v['dense_model_eval_sparse_reward'])}, Sparse-RL "
                                 f"{num(v['sparse_rl_eval_sparse_reward'])}"
                                 f", naive {num(v['naive_sparse_eval_sparse_reward'])} (spread {v['spread']}); refuted "
                                 f"against naive: {'yes' if v['refuted_against_naive'] else 'no'}; per seed "
                                 + ", ".join(num(x) for x in v["per_seed"].values())),
                ("r3", lambda v: f"held-out dense {num(v['eval_dense_reward'])} vs 0.95 x "
                                 f"{num(v['dense_eval_dense_reward'])}"
                                 "; per seed " + ", ".join(num(x) for x in v["per_seed"].values())),
                ("r4", lambda v: "max replay_logp_max_abs per seed " + ", ".join(
                                     num(x) for x in v["replay_logp_max_abs"].values()) + "; max replay_dense_gap_max "
                                 + ", ".join(num(x) for x in v["replay_dense_gap_max"].values())
                                 + f"; measured on every step: {'yes' if v['measured_on_every_step'] else 'no'}")):
            v = r.get(name)
            if v is None:
                lines.append(f"- budget {budget}, {arm}, {name.upper()}: not decided (runs missing)")
            else:
                lines.append(f"- budget {budget}, {arm}, {name.upper()}: **{'holds' if v['holds'] else 'fails'}**: "
                             f"{why(v)}")
        switch = r.get("switch")
        lines.append(f"- budget {budget}, {arm}: preset switch rule (R1, R3, R4, R2 not refuted against naive; the "
                     f"preset reads budget 48's) {'not decided' if switch is None else switch}")
    return lines


def episode_verdicts_text(v: dict, budget: int) -> list[str]:
    """S1-S5 of docs/results.md section 9 for sparse_replay at `budget`, in markdown, with every seed's numbers."""
    def seeds(per_seed: dict) -> str:
        return "; ".join(f"seed {s}: " + ", ".join(f"{k} {num(x)}" for k, x in d.items()) for s, d in per_seed.items())

    texts = {
        "s1": lambda r: f"final {num(r['final_reward'])} vs dense {num(r['dense_final_reward'])} - {MARGIN}; held-out "
                        f"under the cache {num(r['eval_sparse_reward'])} vs the dense arm's held-out dense "
                        f"{num(r['dense_eval_dense_reward'])} - {MARGIN}. " + seeds(r["per_seed"]),
        "s2": lambda r: f"held-out under the cache {num(r['eval_sparse_reward'])} vs Sparse-RL "
                        f"{num(r['sparse_rl_eval_sparse_reward'])} + {MARGIN}; seeds above {r['seeds_above']} of "
                        f"{len(r['per_seed'])}. " + seeds(r["per_seed"]),
        "s3": lambda r: f"held-out under the cache {num(r['eval_sparse_reward'])} vs naive "
                        f"{num(r['naive_sparse_eval_sparse_reward'])} +- {MARGIN}. " + seeds(r["per_seed"]),
        "s4": lambda r: f"held-out under the cache {num(r['eval_sparse_reward'])} vs the dense-trained models "
                        f"{num(r['dense_model_eval_sparse_reward'])} + {MARGIN}. " + seeds(r["per_seed"]),
        "s5": lambda r: "max replay_logp_max_abs per seed "
                        + ", ".join(num(x) for x in r["replay_logp_max_abs"].values())
                        + f"; measured on every step: {'yes' if r['measured_on_every_step'] else 'no'}"}
    if not v:
        return []
    lines = []
    for name, why in texts.items():
        r = v.get(name)
        verdict = "not decided (runs missing)" if r is None else f"**{r['verdict']}**" if "verdict" in r \
            else f"**{'holds' if r['holds'] else 'fails'}**"
        lines.append(f"- budget {budget}, sparse_replay, {name.upper()}: {verdict}"
                     + ("" if r is None else f": {why(r)}"))
    switch = v.get("switch")
    lines.append(f"- budget {budget}, sparse_replay: preset switch rule (S1, S2 and S5) "
                 f"{'not decided' if switch is None else switch}")
    return lines


def summarize(per_seed: dict[int, dict]) -> dict:
    """Means over seeds of every figure of run_stats ("inf" where a seed's is: spike_ratio's infinite ratio), and
    the per-seed values."""
    keys = sorted({k for st in per_seed.values() for k in st})
    out = {k: "inf" if any(st.get(k) == "inf" for st in per_seed.values())
           else mean(st.get(k) for st in per_seed.values())
           for k in keys if k != "collapse"}
    out["per_seed"] = {s: st for s, st in sorted(per_seed.items())}
    return out


def plot(args, hist, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    per_budget = -(-len(PLOTTED) // 4)  # rows of 4 panels
    fig, axes = plt.subplots(per_budget * len(args.budgets), 4, figsize=(18, 3.25 * per_budget * len(args.budgets)),
                             squeeze=False)
    for row, b in enumerate(args.budgets):
        panels = list(axes[per_budget * row:per_budget * (row + 1)].flat)
        for ax, name in zip(panels, PLOTTED):
            for arm in args.arms:
                series = [h[name] for (a, bb, _), h in sorted(hist.items(), key=lambda kv: kv[0][2])
                          if a == arm and bb in (None, b) and len(h[name])]
                if not series:
                    continue
                n = min(len(s) for s in series)
                stack = np.stack([s[:n] for s in series])
                steps = np.arange(1, n + 1)
                line, = ax.plot(steps, stack.mean(0), label=f"{arm} ({len(series)} seed{'s' * (len(series) > 1)})")
                if len(series) > 1:
                    ax.fill_between(steps, stack.min(0), stack.max(0), color=line.get_color(), alpha=0.15)
            ax.set_title(f"budget {b}: {name}", fontsize=10)
            ax.set_xlabel("learner step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for ax in panels[len(PLOTTED):]:
            ax.set_visible(False)
        axes[per_budget * row][0].legend(fontsize=8)
    fig.suptitle(f"bench/replication.py --config {args.config}: {args.steps} steps; mean and min-max over seeds; "
                 "dense (budget-free) drawn in every row")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # room for the title
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.only_report:
        for arm, budget, seed in grid(args):
            name = run_name(arm, budget, seed)
            if finished(args, name):
                print(f"{name}: finished earlier, kept", flush=True)
            else:
                run_one(args, arm, budget, seed)
    result = report(args)
    for key in ("dense", *[f"budget_{b}" for b in args.budgets]):
        print(f"{key}: "
              f"{json.dumps({k: v for k, v in result.get(key, {}).items() if k != 'per_seed'}, default=str)[:600]}")
    if args.records is not None:  # the committed copies: the JSON, plot and table beside the records
        copies = {"plot": args.records.parent.parent / f"{args.records.name}.png",
                  "table": args.records.with_suffix(".md")}
        for key, path in copies.items():
            shutil.copy(result[key], path)
        committed = {**result, **{key: str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
                                  for key, path in copies.items()}}
        args.records.with_suffix(".json").write_text(json.dumps(committed, indent=1, default=str) + "\n")
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
