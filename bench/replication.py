"""The Sparse-RL paper's comparison as one command: dense vs naive sparse vs Sparse-RL rollouts (arXiv 2601.10079).

Every arm is a real `sparse-rl train` run (Ray, Redis, DeepSpeed, weight sync; one subprocess per run) on the
same config, prompts, seeds and settings, differing only in what the arm names:

    dense                 actors.engine.compressor.method=full (no compression: the reference)
    naive_sparse          the config's compressor, no correction (learner.correction=metrics_only: the same update
                          as correction=off, weights 1 and no mask, but the mismatch is still measured and plotted)
    sparse_rl             the config's compressor, sequence veto + token mask + truncated importance weights (SPEC §2)
    sparse_rl_geometric   the same with the length-normalised (geometric-mean) rejection

Each run evaluates its model before and after training on held-out items of the training task, with dense and
with sparse inference (seed 002 §5.1); the dense arm's sparse inference uses the sparse arms' compressor
(`eval.sparse_compressor`), so the "sparse" column means the same cache for every arm. All runs go to one MLflow experiment (`replication`, sqlite in --out),
one run per arm and seed. The command is resumable: a finished (arm, seed) run (its summary.json) is kept and
skipped when the command is run again, and the plot and JSON are rebuilt from what exists.

    python bench/replication.py --quick                       # tiny-learn, 16 steps x 2 seeds, ~5 min on 2 cores
    python bench/replication.py                               # smollm2-copy at budget 48, 20 steps x 2 seeds (hours)
    python bench/replication.py --config qwen2.5-math ray.address=auto   # a GPU cluster, the paper's setting

Writes <out>/replication.png (reward per step, mean and min-max over seeds, per arm; rejection rate; mismatch
KL; KV retained ratio; response length; entropy) and prints, as its last line, one JSON object: per-arm reward
gains (mean reward of the last 3 steps minus the first 3), final-reward ratios to dense, the sparse arms' KV
retained ratio, the evaluation rewards and accuracies, steps, seeds, wall_s.
"""
from __future__ import annotations

import argparse
import json
import os
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
    "sparse_rl": ["learner.correction=on", "learner.rejection=veto", "learner.token_mask=true"],
    "sparse_rl_geometric": ["learner.correction=on", "learner.rejection=geometric", "learner.token_mask=true"],
}
SPARSE_ARMS = ("naive_sparse", "sparse_rl", "sparse_rl_geometric")
PLOTTED = ("reward_mean", "rejection_rate", "mismatch_kl", "kv_retained_ratio", "response_length_mean", "entropy")
EDGE = 3
"""Steps averaged at each end of training for the reward gain and the final reward."""
ROOT = Path(__file__).resolve().parent.parent
CPU_DEFAULT = ("smollm2-copy", ["actors.engine.compressor.kv_budget=48", "train.learner_num_cpus=2"])
"""The default (CPU-scale) comparison: the main job's task and model with a 48-token budget, so the sparse arms'
training rollouts keep under half of their KV (kv_retained_ratio ~0.4), and a learner with 2 torch threads
(with max_staleness 0 the actors are idle while it steps); overrides on the command line follow."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="preset or YAML (default smollm2-copy; tiny-learn with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny scale for regression checks (tiny-learn, 16 steps)")
    p.add_argument("--steps", type=int, default=None, help="learner steps per run (default 20; 16 with --quick)")
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 per arm")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    p.add_argument("--max-staleness", type=int, default=0,
                   help="broker.max_staleness of every run (default 0: the paper's synchronous setting, so the "
                        "measured mismatch is compression alone)")
    p.add_argument("--out", default=None, help="results folder (default bench/results/replication-<config>)")
    p.add_argument("--only-report", action="store_true", help="rebuild the plot and JSON from finished runs only")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to every arm, e.g. ray.address=auto")
    args = p.parse_args(argv)
    if args.config is None and not args.quick:
        args.config, args.overrides = CPU_DEFAULT[0], [*CPU_DEFAULT[1], *args.overrides]
    args.config = args.config or "tiny-learn"
    args.steps = args.steps or (16 if args.quick else 20)
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        p.error(f"--arms: unknown {unknown}; expected a subset of {list(ARMS)}")
    name = Path(args.config).stem + ("-quick" if args.quick else "")
    args.out = Path(args.out or ROOT / "bench" / "results" / f"replication-{name}").resolve()
    return args


def finished(out: Path, arm: str, seed: int) -> dict | None:
    """The summary.json of the finished run of (arm, seed), or None."""
    done = sorted((out / "runs").glob(f"{arm}-s{seed}-*/summary.json"))
    return json.loads(done[-1].read_text()) if done else None


def run_one(args, arm: str, seed: int) -> None:
    """One `sparse-rl train` in a subprocess (a fresh Ray and Redis per run); its console goes to a log file."""
    out = args.out
    overrides = [*args.overrides, *ARMS[arm], f"seed={seed}", f"learner.seed={seed}", f"name={arm}-s{seed}",
                 f"run_dir={out / 'runs'}", f"mlflow.tracking_uri=sqlite:///{out / 'mlflow.db'}",
                 "mlflow.experiment=replication", f"train.steps={args.steps}", "eval.enabled=true",
                 "eval.before=true", "eval.data=train_task", f"broker.max_staleness={args.max_staleness}"]
    if arm == "dense":  # its sparse evaluation under the sparse arms' compressor (its own rollouts use none)
        from dataclasses import asdict

        from deploy.config import load_config
        sparse = load_config(args.config, args.overrides, check_files=False).actors.engine.compressor
        overrides += [f"eval.sparse_compressor.{k}={v}" for k, v in asdict(sparse).items()]
    log = out / "logs" / f"{arm}-s{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{time.strftime('%H:%M:%S')}] {arm} seed {seed}: running (log {log})", flush=True)
    start = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.run([sys.executable, "-m", "deploy.cli", "train", "--config", args.config, *overrides],
                              cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{arm} seed {seed} failed (exit {proc.returncode}); see {log}")
    walls = out / "wall_s.json"
    record = json.loads(walls.read_text()) if walls.exists() else {}
    record[f"{arm}-s{seed}"] = wall
    walls.write_text(json.dumps(record, indent=1))
    print(f"[{time.strftime('%H:%M:%S')}] {arm} seed {seed}: done in {wall:.0f} s", flush=True)


def histories(out: Path, summary: dict) -> dict[str, np.ndarray]:
    """Per-step values of the PLOTTED metrics of one run, from its MLflow run (ordered by step)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    result = {}
    for name in PLOTTED:
        points = sorted(client.get_metric_history(summary["mlflow_run_id"], name), key=lambda m: m.step)
        result[name] = np.array([m.value for m in points], dtype=float)
    return result


def report(args) -> dict:
    """Gather the finished runs; write the plot; return the JSON object."""
    runs = {arm: {s: finished(args.out, arm, s) for s in range(args.seeds)} for arm in args.arms}
    runs = {arm: {s: v for s, v in seeds.items() if v} for arm, seeds in runs.items()}
    hist = {arm: {s: histories(args.out, v) for s, v in seeds.items()} for arm, seeds in runs.items()}
    walls = json.loads((args.out / "wall_s.json").read_text()) if (args.out / "wall_s.json").exists() else {}
    result: dict = {"config": args.config, "overrides": args.overrides, "steps": args.steps, "seeds": args.seeds,
                    "runs_finished": {arm: sorted(seeds) for arm, seeds in runs.items()},
                    "complete": all(len(s) == args.seeds for s in runs.values())}

    def per_seed(arm, fn):
        return [fn(h["reward_mean"]) for h in hist[arm].values() if len(h["reward_mean"])]

    final = {}
    for arm in args.arms:
        gains = per_seed(arm, lambda r: r[-EDGE:].mean() - r[:EDGE].mean())
        finals = per_seed(arm, lambda r: r[-EDGE:].mean())
        result[f"{arm}_reward_gain"] = float(np.mean(gains)) if gains else None
        result[f"{arm}_reward_gain_per_seed"] = [round(g, 4) for g in gains]
        final[arm] = float(np.mean(finals)) if finals else None
        result[f"{arm}_final_reward"] = final[arm]
    for arm in SPARSE_ARMS:
        if arm in final and final[arm] is not None and final.get("dense"):
            result[f"{arm}_vs_dense"] = final[arm] / final["dense"]
    kv = [h["kv_retained_ratio"].mean() for arm in SPARSE_ARMS if arm in hist for h in hist[arm].values()]
    result["kv_retained_ratio"] = float(np.mean(kv)) if kv else None
    kv_max = [h["kv_retained_ratio"].max() for arm in SPARSE_ARMS if arm in hist for h in hist[arm].values()]
    result["kv_retained_ratio_max_step"] = float(np.max(kv_max)) if kv_max else None
    for arm in SPARSE_ARMS:
        if hist.get(arm):
            result[f"{arm}_rejection_rate"] = float(np.mean([h["rejection_rate"].mean() for h in hist[arm].values()
                                                             if len(h["rejection_rate"])] or [np.nan]))
            result[f"{arm}_mismatch_kl"] = float(np.mean([h["mismatch_kl"].mean() for h in hist[arm].values()
                                                          if len(h["mismatch_kl"])] or [np.nan]))
    result["eval"] = {arm: {f"{when}_{mode}_{metric}": float(np.mean([v[f"{key}/{mode}/{metric}"] for v in seeds.values()]))
                            for when, key in (("before", "eval_before"), ("after", "eval"))
                            for mode in ("dense", "sparse") for metric in ("reward", "accuracy")}
                      for arm, seeds in runs.items() if seeds}
    result["wall_s"] = round(sum(walls.get(f"{arm}-s{s}", 0.0) for arm in runs for s in runs[arm]), 1)
    plot(args, hist, args.out / "replication.png")
    result["plot"] = str(args.out / "replication.png")
    return result


def plot(args, hist, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    for ax, name in zip(axes.flat, PLOTTED):
        for arm in args.arms:
            series = [h[name] for h in hist.get(arm, {}).values() if len(h[name])]
            if not series:
                continue
            n = min(len(s) for s in series)
            stack = np.stack([s[:n] for s in series])
            steps = np.arange(1, n + 1)
            line, = ax.plot(steps, stack.mean(0), label=f"{arm} ({len(series)} seed{'s' * (len(series) > 1)})")
            if len(series) > 1:
                ax.fill_between(steps, stack.min(0), stack.max(0), color=line.get_color(), alpha=0.15)
        ax.set_title(f"{name} (mean; band: min-max over seeds)", fontsize=10)
        ax.set_xlabel("learner step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"bench/replication.py --config {args.config}: {args.steps} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.only_report:
        for seed in range(args.seeds):   # seed-major: an interrupted bench has every arm of the first seeds
            for arm in args.arms:
                if finished(args.out, arm, seed):
                    print(f"{arm} seed {seed}: finished earlier, kept", flush=True)
                else:
                    run_one(args, arm, seed)
    result = report(args)
    for arm in args.arms:
        print(f"{arm:>20}: reward gain {result[f'{arm}_reward_gain']}, final {result[f'{arm}_final_reward']}, "
              f"eval {result['eval'].get(arm)}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
