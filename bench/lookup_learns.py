"""Does the multi-turn lookup preset learn? docs/results.md section 8 as one command: the preset
(`smollm2-lookup`, eviction replay, R-KV 48 across the turns of each episode) and its lr=0 control, seeds 0-2,
decided by round 3's rule as it is written there.

    python bench/lookup_learns.py                  # 6 runs (~4 min each alone on 2 cores, the warm-up cached)
    python bench/lookup_learns.py --only-report    # the table, plot and verdict from the finished runs

Every run is a real `sparse-rl train --config smollm2-lookup` (2 actors, Redis, DeepSpeed learner, weight sync;
one subprocess per run, through bench/replication.py's runner) with `seed=k learner.seed=k`, the preset's own
settings (broker.max_staleness 1, 8 steps, 32 held-out items scored before and after with dense and sparse
inference; held-out draw 1). The control is the same run with `learner.lr=0`. The command resumes: a finished
run's record is kept and skipped.

The rule (round 3, docs/results.md 8): gain = mean training reward of the last 3 steps minus the first 3; the
preset passes iff its mean gain over seeds 0-2 is >= 0.3 with every seed's >= 0.2, the mean of the three controls'
gains is within +-0.1, and every run's wall time is <= 15 minutes (the warm-up model cached: it is built before
the first run and not timed). Last line: one JSON object with every seed's figures and the verdict.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replication as rep  # noqa: E402

ARMS = {"preset": [], "preset_lr0": ["learner.lr=0"]}
"""The preset as it is, and the same run with a learning rate of 0 (the control: rewards move by sampling alone)."""
SEEDS = (0, 1, 2)
MIN_MEAN_GAIN, MIN_SEED_GAIN, CONTROL_BAND, MAX_WALL_S = 0.3, 0.2, 0.1, 900.0
"""Round 3's thresholds (docs/results.md 8)."""
RECORDS = rep.ROOT / "docs" / "results" / "lookup-learns"


def verdict(gains: dict[int, float], control_gains: dict[int, float], walls: dict[str, float]) -> dict:
    """Round 3's rule on per-seed gains (preset and control) and every run's wall time (s): {"passes": bool,
    and each clause's figure and outcome}. Raises ValueError when a seed of SEEDS is missing from either arm."""
    missing = [s for s in SEEDS if s not in gains or s not in control_gains]
    if missing:
        raise ValueError(f"seeds {missing} have no finished run in both arms")
    mean_gain = sum(gains[s] for s in SEEDS) / len(SEEDS)
    control_mean = sum(control_gains[s] for s in SEEDS) / len(SEEDS)
    clauses = {"mean_gain": (mean_gain, mean_gain >= MIN_MEAN_GAIN),
               "min_seed_gain": (min(gains[s] for s in SEEDS), min(gains[s] for s in SEEDS) >= MIN_SEED_GAIN),
               "control_mean_gain": (control_mean, abs(control_mean) <= CONTROL_BAND),
               "max_wall_s": (max(walls.values()), max(walls.values()) <= MAX_WALL_S)}
    out = {name: {"value": value, "holds": bool(holds)} for name, (value, holds) in clauses.items()}
    out["passes"] = all(c["holds"] for c in out.values())
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(rep.ROOT / "bench" / "results" / "lookup-learns"), help="results folder")
    p.add_argument("--records", default=str(RECORDS), help="where each finished run's record is committed")
    p.add_argument("--only-report", action="store_true", help="report the finished runs; run nothing")
    args = p.parse_args(argv)
    rep.ARMS.update(ARMS)
    rep.EVAL_BEFORE.update(ARMS)
    run_args = rep.parse_args(["--config", "smollm2-lookup", "--steps", "8", "--eval-limit", "32",
                               "--max-staleness", "1", "--seeds", str(len(SEEDS)), "--budgets", "",
                               "--records", args.records, "--out", args.out]
                              + (["--only-report"] if args.only_report else []))
    return run_args


def run_all(args) -> None:
    """Every missing run, seed-major (the warm-up model built first, outside the timed runs)."""
    from deploy.config import load_config
    from deploy.model_cache import resolve_model

    resolve_model(load_config(args.config, check_files=False).model)
    for seed in SEEDS:
        for arm in ARMS:
            name = f"{arm}-s{seed}"
            if rep.finished(args, name):
                print(f"{name}: finished earlier, kept", flush=True)
            else:
                rep.run_one(args, arm, None, seed)


def report(args) -> dict:
    """Per-seed rewards, gains, walls and held-out scores of the finished runs, and the verdict when complete."""
    runs = {}
    for seed in SEEDS:
        for arm in ARMS:
            record = rep.finished(args, f"{arm}-s{seed}")
            if record:
                runs[f"{arm}-s{seed}"] = record
    result: dict = {"config": args.config, "steps": args.steps, "seeds": list(SEEDS), "runs": {}}
    gains: dict[str, dict[int, float]] = {arm: {} for arm in ARMS}
    for name, record in runs.items():
        arm, seed = name.rsplit("-s", 1)
        rewards = [float(x) for x in record["history"]["reward_mean"]]
        gain = sum(rewards[-rep.EDGE:]) / rep.EDGE - sum(rewards[:rep.EDGE]) / rep.EDGE
        gains[arm][int(seed)] = gain
        summary = record["summary"]
        result["runs"][name] = {
            "reward_mean": rewards, "gain": gain, "wall_s": record["wall_s"],
            **{k: summary.get(k) for k in ("eval_before/dense/reward", "eval/dense/reward",
                                            "eval_before/sparse/reward", "eval/sparse/reward")}}
    walls = {name: r["wall_s"] for name, r in result["runs"].items()}
    result["complete"] = len(runs) == len(ARMS) * len(SEEDS)
    if result["complete"]:
        result["verdict"] = verdict(gains["preset"], gains["preset_lr0"], walls)
    return result


def table(result: dict) -> str:
    """The Markdown table: a row per run, then the verdict's clauses."""
    def f(x):
        return "n/a" if x is None else f"{x:.3f}"
    lines = ["| run | training reward, steps 1 .. 8 | gain | wall (s) | held-out dense before -> after | "
             "held-out under R-KV 48 before -> after |", "|---|---|---|---|---|---|"]
    for name, r in result["runs"].items():
        lines.append(f"| {name} | {' '.join(f(x) for x in r['reward_mean'])} | {r['gain']:+.3f} | {r['wall_s']:.0f} | "
                     f"{f(r['eval_before/dense/reward'])} -> {f(r['eval/dense/reward'])} | "
                     f"{f(r['eval_before/sparse/reward'])} -> {f(r['eval/sparse/reward'])} |")
    for clause, c in result.get("verdict", {}).items():
        if clause != "passes":
            lines.append(f"- {clause}: {c['value']:.3f} ({'holds' if c['holds'] else 'fails'})")
    if "verdict" in result:
        lines.append(f"- **the preset {'passes' if result['verdict']['passes'] else 'does not pass'}** round 3's rule")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Training reward per step, a line per run (the controls dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in result["runs"].items():
        steps = range(1, len(r["reward_mean"]) + 1)
        ax.plot(steps, r["reward_mean"], "--" if "lr0" in name else "-", marker="o", label=name)
    ax.set(xlabel="learner step", ylabel="training reward (16 episodes)", title="smollm2-lookup: preset vs lr=0")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.only_report:
        run_all(args)
    result = report(args)
    (args.records.with_suffix(".md")).write_text(table(result))
    plot(result, args.records.parent.parent / f"{args.records.name}.png")   # docs/lookup-learns.png
    args.records.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
