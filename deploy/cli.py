"""`sparse-rl` command line: train, eval, scale, preflight.

    sparse-rl train [--config smollm2-count-warm] [dotted.key=value ...]
    sparse-rl train --resume runs/<run id> [dotted.key=value ...]   (the same record; e.g. train.steps=N to go further)
    sparse-rl eval --model runs/<run id>/final [--mode dense|sparse] [--config ...] [dotted.key=value ...]
    sparse-rl scale --run <run id> --actors N [--run-dir runs] [--redis redis://127.0.0.1:6379/0]
    sparse-rl preflight [--config smollm2-count-warm] [dotted.key=value ...]
        # will the KV cache fit? (also run by train)
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep local Ray on 127.0.0.1

MAIN_JOB = "smollm2-count-warm"
"""The preset `sparse-rl train` (and eval, preflight) uses without --config: the count task in the Sparse-RL paper's
regime (the prompt fits the KV budget, the response is compressed while it is decoded) on the warm-up model
(docs/results.md 6.7). `smollm2-copy`, the main job before, compresses its prompt at prefill."""


def main(argv: list[str] | None = None) -> int:
    """The `sparse-rl` entry point; returns the exit code (0, 1 run failed, 2 bad input, 130 interrupted by Ctrl-C,
    143 stopped by SIGTERM)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while Python is still importing, before a run exists: nothing to clean up
        print("sparse-rl: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    """The command line: train | eval | scale | preflight."""
    parser = argparse.ArgumentParser(prog="sparse-rl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run the actor-learner training job")
    train.add_argument("--config", default=None, help="preset name in deploy/configs/ or a YAML path "
                                                      f"(default {MAIN_JOB})")
    train.add_argument("--resume", default="", metavar="RUN_DIR",
                       help="continue this run (runs/<run id>) from its latest checkpoint: same directory, MLflow run "
                            "and counters; its config.yaml with the overrides applied")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actors.count=3 learner.lr=2e-6")

    ev = sub.add_parser("eval", help="score a model or checkpoint on a prompt set, dense or sparse")
    ev.add_argument("--model", required=True, help="Hugging Face directory (e.g. runs/<run id>/final) or preset model")
    ev.add_argument("--mode", choices=["dense", "sparse"], action="append",
                    help="KV cache mode; repeat for both (default: the config's eval.modes)")
    ev.add_argument("--config", default=MAIN_JOB, help="preset or YAML giving the compressor and eval settings "
                                                       f"(default {MAIN_JOB})")
    ev.add_argument("overrides", nargs="*")

    scale = sub.add_parser("scale", help="change the number of rollout actors of a running job")
    scale.add_argument("--run", required=True, help="run id printed by `sparse-rl train`")
    scale.add_argument("--actors", type=int, required=True, help="target number of rollout actors (>= 1)")
    scale.add_argument("--redis", default="", help="Redis URL of the run (default: the one recorded in "
                                                   "<run dir>/<run id>/run.json)")
    scale.add_argument("--run-dir", default="runs", help="parent of the run directories (the config's run_dir)")

    pre = sub.add_parser("preflight", help="predict the run's KV memory per sequence and batch, check that it fits")
    pre.add_argument("--config", default=MAIN_JOB,
                     help=f"preset name in deploy/configs/ or a YAML path (default {MAIN_JOB})")
    pre.add_argument("overrides", nargs="*")
    return parser


def _main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "scale":  # light: no Ray, no torch, no config
        from deploy.scale import ScaleError, request_scale
        try:
            request_scale(args.run, args.actors, args.redis, args.run_dir)
        except ScaleError as e:
            print(f"sparse-rl scale: {e}", file=sys.stderr)
            return 2
        return 0
    from deploy.config import ConfigError, check_eval_data, check_eval_items, check_model, load_config  # (torch)

    try:
        if args.command == "preflight":
            from deploy.preflight import preflight  # each command imports what it runs: `scale` stays light
            print(preflight(load_config(args.config, args.overrides)).table())
        elif args.command == "train":
            if args.resume:
                if args.config:
                    raise ConfigError(f"--config {args.config} with --resume: a resumed run keeps its own config "
                                      f"({args.resume}/config.yaml); give changes as overrides")
                from deploy.record import resume_config  # (with the driver's imports: train only)
                cfg = resume_config(args.resume, args.overrides)
                command = ["sparse-rl", "train", "--resume", args.resume, *args.overrides]
            else:
                cfg = load_config(args.config or MAIN_JOB, args.overrides)
                command = ["sparse-rl", "train", "--config", args.config or MAIN_JOB, *args.overrides]
            # Ray, DeepSpeed: only for `train`, and only once the config is checked (bad input exits 2 sooner)
            from deploy.driver import Interrupted, RunFailed, ignore_stops_after_finish
            from deploy.driver import train as run_train
            try:
                run_train(cfg, command, resume=args.resume)
                ignore_stops_after_finish()   # the run finished: a stop during the process's exit changes nothing
            except Interrupted as e:
                print(f"sparse-rl: {e}", file=sys.stderr)
                return e.exit_code
            except RunFailed as e:
                print(f"sparse-rl: run failed: {e}", file=sys.stderr)
                return 1
        else:  # eval
            from broker.lora import is_adapter_dir
            from deploy.evaluate import evaluate_model  # only for `eval`
            cfg = load_config(args.config, args.overrides, check_files=False)  # the model is --model
            cfg.model = os.path.expanduser(args.model)
            if not is_adapter_dir(cfg.model):   # a LoRA run's final directory: the adapter names its base
                check_model(cfg.model)
            check_eval_data(cfg)
            check_eval_items(cfg)
            evaluate_model(cfg, cfg.model, args.mode or list(cfg.eval.modes))
    except ConfigError as e:
        bad = "" if str(e).startswith("preflight:") else "bad config: "  # a PreflightError says what it is
        print(f"sparse-rl: {bad}{e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a run started, or in eval: nothing to clean up
        print("sparse-rl: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
