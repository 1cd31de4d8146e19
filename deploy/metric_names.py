"""The MLflow name of every metric (docs/SPEC.md §4): one table, used where the driver logs to MLflow
(deploy/tracking.py) and where MLflow histories are read back (the tracker at a resume, bench/replication.py,
the system tests).

Inside the code a metric keeps its one internal name (`rejection_rate`, `xi_sym_p5`, `broker_produced`: the
dict keys of Learner.step, StepReport.as_metrics, the actor pool, the console, summary.json, the budget
controller). In MLflow it is logged as `<section>/<name>`: the MLflow UI draws one section per prefix, as verl
groups its metrics (`actor/`, `rollout_corr/`). docs/SPEC.md §4 lists the sections.

Runs logged before this table keep the internal names in their MLflow store: `metric_history` reads the MLflow
name and, at the steps it has none, the internal one, so old records still report (and a run resumed across the
change reads as one history).
"""
from __future__ import annotations

SECTIONS = ("correction", "accept", "replay", "rollout", "kv", "learner", "weight_sync", "broker", "eval", "tier",
            "actor")
"""The MLflow sections (the part of a name before its first `/`), in the order docs/SPEC.md §4 lists them."""

_BY_SECTION: dict[str, dict[str, str]] = {
    # the off-policy correction of pi_sparse -> pi_old (SPEC §2): what the user looks for first
    "correction": {
        "rejection_rate": "rejection_rate", "mismatch_kl": "mismatch_kl", "mismatch_kl_k1": "mismatch_kl_k1",
        "token_mask_fraction": "token_mask_fraction", "truncate_fraction": "truncate_fraction",
        "catastrophic_token_fraction": "catastrophic_token_fraction", "tis_weight_mean": "tis_weight_mean",
        "xi_mean": "xi_mean", "xi_max": "xi_max", "xi_p1": "xi_p1", "xi_p5": "xi_p5", "xi_p50": "xi_p50",
        "xi_sym_p1": "xi_sym_p1", "xi_sym_p5": "xi_sym_p5", "xi_sym_p50": "xi_sym_p50",
    },
    # Sparrow's per-token acceptance rate (learner/acceptance.py; exact_*: from the replayed forward)
    "accept": {
        "accept_mean": "mean", "accept_p1": "p1", "accept_p5": "p5", "accept_p50": "p50",
        "accept_upper_mean": "upper_mean", "accept_upper_p5": "upper_p5",
        "accept_topk_mass_outside": "topk_mass_outside",
        "accept_exact_mean": "exact_mean", "accept_exact_p5": "exact_p5", "accept_exact_min": "exact_min",
    },
    # eviction replay (SPEC §2.4, learner/replay.py replay_metrics)
    "replay": {
        "replay_logp_old_max_abs": "logp_old_max_abs", "replay_logp_train_max_abs": "logp_train_max_abs",
        "replay_logp_max_abs": "logp_max_abs", "replay_dense_gap_max": "dense_gap_max",
        "replay_rejection_rate": "rejection_rate", "replay_token_mask_fraction": "token_mask_fraction",
        "replay_tis_weight_mean": "tis_weight_mean", "replay_mismatch_kl": "mismatch_kl",
        "replay_quant_gap": "quant_gap", "replay_quant_hints": "quant_hints",
    },
    # what the rollouts were and what the actors did
    "rollout": {
        "reward_mean": "reward_mean", "accuracy": "accuracy", "response_length_mean": "response_length_mean",
        "response_truncated_fraction": "response_truncated_fraction",
        "unparseable_fraction": "unparseable_fraction", "reward_errors": "reward_errors",
        "rollout_groups": "groups", "rollout_tokens_per_s": "tokens_per_s", "claims_lost": "claims_lost",
        "actor_idle_fraction": "actor_idle_fraction", "actor_staleness_wait_s": "actor_staleness_wait_s",
        "actor_queue_wait_s": "actor_queue_wait_s", "actor_admission_wait_s": "actor_admission_wait_s",
        "producer_backpressure_wait_s": "producer_backpressure_wait_s",
        "actors_live": "actors_live", "actors_replaced": "actors_replaced",
        # multi-turn episodes (actors/envs/episode.py): per episode, and the environment's failures (counts)
        "turns_per_episode": "turns_per_episode", "tool_calls_per_episode": "tool_calls_per_episode",
        "env_token_fraction": "env_token_fraction", "env_errors": "env_errors", "env_timeouts": "env_timeouts",
        "env_lost": "env_lost",
    },
    # the KV cache: retained share, bytes, budget (SPEC §5.1)
    "kv": {
        "kv_retained_ratio": "retained_ratio", "kv_protected_fraction": "protected_fraction",
        "kv_peak_bytes_mean": "peak_bytes_mean",
        "kv_peak_bytes_per_seq": "peak_bytes_per_seq", "kv_budget": "budget",
        "kv_budget_control": "budget_control", "kv_budget_change": "budget_change",
        "actor_kv_budget": "actor_budget",
    },
    # the learner's step: losses, optimizer, time, version
    "learner": {
        "pg_loss": "pg_loss", "kl_loss": "kl_loss", "distill_kl": "distill_kl", "entropy": "entropy",
        "clip_fraction": "clip_fraction", "ppo_kl": "ppo_kl", "ratio_mean": "ratio_mean",
        "grad_norm": "grad_norm", "optimizer_steps": "optimizer_steps", "num_sequences": "num_sequences",
        "learner_ranks": "ranks", "logp_old_fused": "logp_old_fused", "learner_step_s": "step_s",
        "learner_tokens_per_s": "tokens_per_s", "learner_wait_s": "wait_s",
        "learner_idle_fraction": "idle_fraction", "learner_idle_fraction_run": "idle_fraction_run",
        "groups_trained": "groups_trained", "version": "version", "weight_version": "weight_version",
    },
    # the learner -> actors weight broadcast (deploy/actor_pool.py sync_weights)
    "weight_sync": {
        "weight_sync_s": "seconds", "weight_sync_bytes": "bytes", "weight_sync_buckets": "buckets",
        "weight_sync_failed_actors": "failed_actors", "weight_sync_error": "error",
        "weight_sync_fingerprint_max_abs": "fingerprint_max_abs",
    },
    # the pipeline between them: queue, staleness, admission, dynamic sampling; broker_<count>: families below
    "broker": {
        "queue_depth": "queue_depth", "staleness_mean": "staleness_mean", "staleness_max": "staleness_max",
        "dropped_stale": "dropped_stale", "groups_filtered": "groups_filtered", "groups_read": "groups_read",
        "filter_shortfall": "filter_shortfall", "step_capacity": "step_capacity",
        "rollout_utilization": "rollout_utilization",
    },
}

TABLE: dict[str, str] = {name: f"{section}/{short}"
                         for section, names in _BY_SECTION.items() for name, short in names.items()}
"""Internal name -> MLflow name, for every fixed name."""

FAMILIES = (("broker_", "broker/", "_total"), ("eval/", "eval/", ""), ("tier/", "tier/", ""),
            ("kv_bytes_turn_", "kv/bytes_turn_", ""), ("actor/", "actor/", ""))
"""Names made at run time, (internal prefix, MLflow prefix, MLflow suffix): the run's broker counters
`broker_<count>` (cumulative, broker/run_state.py run_counts) -> `broker/<count>_total` (beside the step's own
`broker/dropped_stale`, `broker/groups_filtered`); `eval/<mode>/<score>` and `tier/<tier>/<metric>` are
already in their sections, as are an engine's own counters per actor, `actor/<actor id>/<name>`
(RolloutEngine.engine_stats: SGLang's measured KV pool and retractions); `kv_bytes_turn_<k>` (a multi-turn
episode's KV bytes at the end of its turn k, mean over the episodes that reached it) -> `kv/bytes_turn_<k>`."""

_INVERSE = {mlflow: name for name, mlflow in TABLE.items()}


def mlflow_name(name: str) -> str:
    """The MLflow name of internal metric `name`; a name in neither TABLE nor FAMILIES is logged as it is (no
    section: tests/deploy/test_metric_names.py fails on it)."""
    if name in TABLE:
        return TABLE[name]
    for prefix, to, suffix in FAMILIES:
        if name.startswith(prefix):
            return f"{to}{name[len(prefix):]}{suffix}"
    return name


def internal_name(mlflow: str) -> str:
    """The internal name of MLflow metric `mlflow` (the inverse of mlflow_name); an old run's name, logged
    before this table, is its own internal name."""
    if mlflow in _INVERSE:
        return _INVERSE[mlflow]
    for prefix, to, suffix in FAMILIES:
        if mlflow.startswith(to) and mlflow.endswith(suffix) and len(mlflow) > len(to) + len(suffix):
            return f"{prefix}{mlflow[len(to):len(mlflow) - len(suffix)]}"
    return mlflow


def metric_history(client, run_id: str, name: str) -> list:
    """MLflow's history of internal metric `name` in run `run_id` (an MlflowClient's Metric list): the points
    under its MLflow name, and those under the internal name (a run logged before the table; one resumed across
    it has both) at the steps the MLflow name has none."""
    points = client.get_metric_history(run_id, mlflow_name(name))
    if mlflow_name(name) != name:
        steps = {m.step for m in points}
        points = [m for m in client.get_metric_history(run_id, name) if m.step not in steps] + list(points)
    return points
