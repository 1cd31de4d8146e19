"""What the driver prints while a run goes on (rich): one line per learner step, and where MLflow is."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console as RichConsole
from rich.table import Table

from learner.config import LearnerConfig

COLUMNS = (("reward", "reward_mean", "{:.3f}"), ("rejection", "rejection_rate", "{:.3f}"),
           ("mismatch_kl", "mismatch_kl", "{:.2e}"), ("replay |dlogp|", "replay_logp_max_abs", "{:.1e}"),
           ("accept p5", "accept_p5", "{:.3f}"),
           ("accept up p5", "accept_upper_p5", "{:.3f}"),
           ("kv kept", "kv_retained_ratio", "{:.2f}"), ("length-cut", "response_truncated_fraction", "{:.2f}"),
           ("staleness", "staleness_mean", "{:.2f}"),
           ("learner tok/s", "learner_tokens_per_s", "{:.0f}"), ("rollout tok/s", "rollout_tokens_per_s", "{:.0f}"),
           ("actors", "actors_live", "{:.0f}"), ("utilization", "rollout_utilization", "{:.2f}"),
           ("stale", "dropped_stale", "{:.0f}"), ("filtered", "groups_filtered", "{:.0f}"),
           ("learner idle", "learner_idle_fraction", "{:.2f}"), ("actor idle", "actor_idle_fraction", "{:.2f}"))


def training_target(learner: LearnerConfig, compressor_method: str) -> str:
    """One line: which policy the learner trains (docs/SPEC.md 2.4) and what the step line's columns compare."""
    correction = f"the Sparse-RL correction {learner.correction} (learner.correction)"
    if not learner.replays(compressor_method):
        why = " (compressor full: nothing evicted, nothing to replay)" if learner.policy_target == "sparse" else ""
        return f"training target: the dense policy{why}, {correction}"
    teacher = (f", plus the dense-teacher term x {learner.distill_coef:g} (learner.distill_coef)"
               if learner.distill_coef > 0 else "")
    return ("training target: the compressed sampler's policy (learner.policy_target=sparse: each rollout's evictions "
            f"replayed){teacher}, {correction}; rejection and mismatch_kl compare the sampler with the dense policy, "
            "replay |dlogp| is the replay's exactness (max |replayed logp - logp_sparse|, fresh tokens)")


class Console:
    def __init__(self):
        self.out = RichConsole(soft_wrap=True)  # long URIs and commands stay on one line (copy-pasteable)

    def start(self, run_id, run_dir, redis_url, mlflow_where, record=None, target: str = "") -> None:
        self.out.rule(f"sparse-rl run [bold]{run_id}[/]")
        if record is not None and record.resumed:
            self.out.print(f"resumed at weight version {record.start_version}: same run directory, MLflow run and "
                           "broker counters; steps after that checkpoint are trained again")
        elif record is not None and record.parent:
            self.out.print(f"forked from {record.parent['checkpoint']} (weight version {record.start_version}); "
                           f"parent run {record.parent['run_id'] or '(unknown)'}")
        self.out.print(f"run directory: {run_dir}\nredis: {redis_url}\nMLflow: {mlflow_where}")
        if target:
            self.out.print(target)
        self.out.print(f"scale actors while it runs: sparse-rl scale --run {run_id} --actors N "
                       f"--run-dir {Path(run_dir).parent}")

    def learner(self, counts: dict) -> None:
        """The learner's parameters at start (LearnerWorker.parameter_counts): what it trains of how many."""
        share = counts["trainable"] / max(counts["total"], 1)
        what = f"LoRA rank {counts['lora_rank']}" if counts.get("lora_rank") else "full fine-tuning"
        self.out.print(f"learner: {what}: {counts['trainable']:,} trainable parameters of {counts['total']:,} "
                       f"({share:.2%})")

    def step(self, step: int, total: int, version: int, metrics: dict) -> None:
        parts = [f"[bold]step {step}/{total}[/] (version {version})"]
        for label, name, fmt in COLUMNS:
            if name in metrics:   # NaN: nothing measured it this step (replay exactness on all-stale rows)
                value = metrics[name]
                parts.append(f"{label} {'n/a' if value != value else fmt.format(value)}")
        self.out.print("  ".join(parts))

    def waiting(self, step: int, seconds: float, why: str) -> None:
        """Why the run is not moving: the learner waits for groups of `step` (0: actors are starting)."""
        what = f"learner waiting for the groups of step {step}" if step else "waiting for the rollout actors"
        self.out.print(f"{what} for {seconds:.0f} s: {why}")

    def eval(self, scores: dict, before: dict | None = None) -> None:
        """The evaluation as a table: one row per mode and metric, with the initial weights' score beside the
        final one when `before` (same keys, eval/<mode>/<metric>) is given."""
        if not scores:
            return
        table = Table(title="evaluation (held-out items)" if before else "evaluation")
        for column in ("mode", "metric", *(("before",) if before else ()), "after"):
            table.add_column(column, justify="left" if column in ("mode", "metric") else "right")
        for name, value in sorted(scores.items()):
            _, mode, metric = name.split("/", 2)
            row = [mode, metric] + ([f"{before[name]:.4g}" if name in before else "-"] if before else [])
            table.add_row(*row, f"{value:.4g}")
        self.out.print(table)

    def accounting(self, acc: dict) -> None:
        """Where the groups went (broker counts at stop) and how busy the run kept its two halves."""
        self.out.print(f"groups produced {acc['produced']}: trained {acc['consumed']}, "
                       f"filtered {acc['groups_filtered']}, dropped stale {acc['dropped_stale']}, "
                       f"dead-lettered {acc['dead_lettered']}, "
                       f"left in queue {acc['left_in_queue']}; rollout_utilization {acc['rollout_utilization']:.2f}, "
                       f"learner idle {acc['learner_idle_fraction']:.2f}, actor idle {acc['actor_idle_fraction']:.2f}; "
                       f"reward errors {acc.get('reward_errors', 0)}")

    def finish(self, run_dir, mlflow_where) -> None:
        self.out.rule("done")
        self.out.print(f"plot: {run_dir}/training.png\nopen MLflow: {mlflow_where}")
