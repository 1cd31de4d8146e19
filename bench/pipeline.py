"""Pipeline utilization: how much of what the rollout actors generate is trained, with admission control
(broker.admission=true, the default: actors claim a batch in Redis only if it can be trained within
broker.max_staleness) against the baseline measured in the same run (broker.admission=false: actors wait only
while their weights are too old, stale groups are dropped at dequeue, actors generate until they are stopped).

Both arms are whole runs of the real system (`deploy.driver.train`: Ray, redis-server, DeepSpeed, MLflow),
same config and seed, evaluation off.

    python bench/pipeline.py --quick            # tiny preset, 2 actors, 8 learner steps, max_staleness=1
    python bench/pipeline.py --config smollm2-copy --steps 8

Prints one line per arm, then as its last line one JSON object: rollout_utilization ((trained + filtered) /
produced, groups left in the queue at stop count as unused), dropped_stale, left_in_queue, produced,
learner_idle_fraction (time the learner waited for groups / its step time, over the run),
actor_idle_fraction (1 - time actors spent on batches / wall time, mean over steps), wall_s, the same with the
suffix _off for the baseline, and utilization_ratio = rollout_utilization / rollout_utilization_off.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# Run as `python bench/pipeline.py`, this file's folder comes first on sys.path and bench/broker.py would
# shadow the `broker` package.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from deploy.config import load_config  # noqa: E402
from deploy.driver import train  # noqa: E402

KEYS = ("rollout_utilization", "dropped_stale", "left_in_queue", "produced", "consumed", "groups_filtered",
        "learner_idle_fraction", "actor_idle_fraction")


def run_arm(config: str, overrides: list[str], admission: bool, run_dir: str) -> dict:
    """One whole run; returns the KEYS of its final accounting plus wall_s."""
    cfg = load_config(config, [*overrides, f"run_dir={run_dir}", f"broker.admission={str(admission).lower()}",
                               f"name=pipeline-{'admission' if admission else 'baseline'}"])
    t0 = time.perf_counter()
    summary = train(cfg)
    acc = summary["accounting"]
    return {**{k: acc[k] for k in KEYS}, "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny preset, 2 actors, 8 steps, max_staleness=1")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for both arms")
    args = ap.parse_args()
    if args.quick:
        args.config, args.steps, args.actors, args.max_staleness = "tiny", 8, 2, 1
    overrides = [f"train.steps={args.steps}", f"actors.count={args.actors}",
                 f"broker.max_staleness={args.max_staleness}", "eval.enabled=false", *args.overrides]
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as run_dir:
        on = run_arm(args.config, overrides, True, run_dir)
        off = run_arm(args.config, overrides, False, run_dir)
    for name, r in (("admission", on), ("baseline", off)):
        print(f"{name:>9}: produced {r['produced']}, trained {r['consumed']}, filtered {r['groups_filtered']}, "
              f"dropped stale {r['dropped_stale']}, left {r['left_in_queue']}; utilization "
              f"{r['rollout_utilization']:.3f}, learner idle {r['learner_idle_fraction']:.3f}, actor idle "
              f"{r['actor_idle_fraction']:.3f}, {r['wall_s']:.0f} s")
    result = {"config": args.config, "steps": args.steps, "actors": args.actors, "max_staleness": args.max_staleness,
              **{k: round(v, 4) if isinstance(v, float) else v for k, v in on.items()},
              **{f"{k}_off": round(v, 4) if isinstance(v, float) else v for k, v in off.items()},
              "utilization_ratio": round(on["rollout_utilization"] / max(off["rollout_utilization"], 1e-9), 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
