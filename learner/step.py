"""The learner's step protocol, on rank 0, in one flat function (`LearnerStep.train_step`, CleanRL style):

    read groups (admission-aware, dynamic sampling: broker/admission.py)
    -> every rank: recompute pi_old (+pi_ref), correct (SPEC §2), loss (SPEC §3), optimizer step (Learner.step)
    -> KV budget controller (learner/budget_control.py) -> checkpoint when due -> admission capacity
    -> commit: acknowledge the groups and publish the new version in one transaction -> StepReport

`LearnerStep` also opens the run's broker state at start (consumed set, discarded queue and claims after a
resume, data position, KV budget, learner version, admission pool). It knows nothing of Ray: the fan-out over
learner ranks is the `Ranks` the caller passes (deploy/learner_worker.py; `OneRank` for one process).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from omegaconf import OmegaConf

from broker import run_state as rs
from broker.admission import Admission, StepCollector, step_capacity
from broker.config import BrokerConfig
from broker.prompts import DataPosition
from broker.schema import TrajectoryGroup
from broker.streams import Delivery, GroupConsumer, connect, discard_queue, queue_depth
from compressors import CompressorConfig
from learner.budget_control import BudgetController
from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.config import LearnerConfig
from learner.loss import zero_variance

if TYPE_CHECKING:  # the driver reads StepReport without importing the learner's model stack
    from learner.learner import Learner


REPORTS_KEPT = 4
"""Reports of the last committed steps a LearnerStep keeps for `close` (the driver is at most one step behind)."""


class StepAbandoned(RuntimeError):
    """A step that trained after the step protocol was closed (the run is stopping): nothing of it was saved or
    acknowledged, and the learner version stays the last committed one on the broker."""


@dataclass
class StepConfig:
    """What the step protocol needs of the run config (deploy/learner_worker.py composes it)."""
    broker: BrokerConfig
    learner: LearnerConfig
    compressor: CompressorConfig
    groups_per_step: int
    """train.groups_per_step: informative groups a step trains (more when admission requires)."""
    group_wait_s: float
    """train.group_wait_s: how long a step waits for its groups before it raises TimeoutError, seconds."""
    last_version: int
    """The last learner version whose step trains (train.steps - 1)."""
    seed: int
    data: dict
    """actors.data as a plain dict (with the seed, it fixes the prompt order: broker/prompts.py)."""

    @classmethod
    def of_run(cls, run) -> "StepConfig":
        """The step's part of a run config (deploy.config.RunConfig)."""
        return cls(broker=run.broker, learner=run.learner, compressor=run.actors.engine.compressor,
                   groups_per_step=run.train.groups_per_step, group_wait_s=run.train.group_wait_s,
                   last_version=run.train.steps - 1, seed=run.seed,
                   data=OmegaConf.to_container(OmegaConf.structured(run.actors.data)))


@dataclass
class Resume:
    """What this rank's checkpoint gave back (all empty at a fresh start)."""
    resumed: bool = False
    trained_ids: list[str] = field(default_factory=list)
    counters: dict = field(default_factory=dict)
    data_position: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @classmethod
    def load(cls, learner: Learner, ckpt_dir: str) -> "Resume":
        """Load the latest checkpoint of `ckpt_dir` into `learner` if there is one (every rank calls it):
        weights, optimizer, version, RNG (learner/checkpoint.py); else a fresh start."""
        if not (ckpt_dir and (Path(ckpt_dir) / "latest").exists()):
            return cls()
        trained_ids, counters = load_checkpoint(learner, ckpt_dir)
        state = learner.checkpoint_state
        return cls(True, list(trained_ids), dict(counters), dict(state.get("data_position") or {}),
                   dict(state.get("extra") or {}))

    def for_driver(self) -> dict:
        """What the driver needs of the checkpoint: {"data_position", "step_metrics": the learner metrics of the
        step that made its version, "trained_prompt_ids": that step's} (empty when fresh)."""
        return {"data_position": self.data_position, "step_metrics": self.extra.get("step_metrics", {}),
                "trained_prompt_ids": self.extra.get("trained_prompt_ids", [])}


class Ranks(Protocol):
    """Every learner rank at once (rank 0 included); a failed rank raises, naming it."""

    def step(self, groups: list[TrajectoryGroup], staleness: list[int]) -> dict[str, float]:
        """Learner.step on every rank; returns rank 0's metrics."""

    def checkpoint(self, state: dict) -> str:
        """save_checkpoint on every rank with `state` (consumed_group_ids, counters, data_position, extra)."""


class OneRank:
    """`Ranks` of a learner in this process alone."""

    def __init__(self, learner: Learner, checkpoint_dir: str):
        self.learner, self.checkpoint_dir = learner, checkpoint_dir

    def step(self, groups: list[TrajectoryGroup], staleness: list[int]) -> dict[str, float]:
        return self.learner.step(groups, staleness)

    def checkpoint(self, state: dict) -> str:
        return save_checkpoint(self.learner, self.checkpoint_dir, **state)


@dataclass
class StepReport:
    """What one learner step did. Counts are groups; times seconds."""
    version: int
    """The weight version the step made (the only version key: MLflow's `version`, alias `weight_version`)."""
    metrics: dict[str, float]
    """The step's learner metrics (SPEC §4, Learner.step; kv_budget_control / kv_budget_change with a
    budget controller), the same on every rank."""
    trained_prompt_ids: list[str]
    """The prompt id of each trained group, in training order."""
    trained: int
    filtered: int
    """Zero-variance groups acknowledged but not trained (dynamic sampling)."""
    dropped_stale: int
    """Groups this step dropped as over max_staleness (the safety net; 0 under admission)."""
    reads: int
    """Groups taken off the stream in this step."""
    filter_shortfall: int
    groups_trained: int
    """Groups trained over the run (across resumes)."""
    step_capacity: int
    """C, the groups admitted per step, after this step."""
    queue_depth: int
    counts: dict[str, int]
    """The run's broker counters after the commit (broker.run_state.run_counts)."""
    rollout_utilization: float
    """broker.run_state.rollout_utilization(counts, queue_depth)."""
    wait_s: float
    """Time waiting for groups."""
    step_s: float
    idle_fraction_run: float
    """Time waiting for groups / time of all steps of this learner process."""

    def as_metrics(self) -> dict[str, float]:
        """The report under its internal names (SPEC §4; deploy/metric_names.py gives their MLflow names;
        `weight_version` kept as an alias of `version`)."""
        return {**self.metrics, "weight_version": self.version, "version": float(self.version),
                "learner_wait_s": self.wait_s, "groups_trained": float(self.groups_trained),
                "learner_idle_fraction": self.wait_s / self.step_s if self.step_s > 0 else 0.0,
                "learner_idle_fraction_run": self.idle_fraction_run, "groups_filtered": float(self.filtered),
                "dropped_stale": float(self.dropped_stale), "groups_read": float(self.reads),
                "filter_shortfall": float(self.filter_shortfall), "step_capacity": float(self.step_capacity),
                "rollout_utilization": self.rollout_utilization, "queue_depth": float(self.queue_depth),
                **{f"broker_{k}": float(v) for k, v in self.counts.items()}}


class LearnerStep:
    """Rank 0's step protocol over the broker. Opening it (at learner start) sets up the run's broker state:
    after a resume the consumed ids are restored, the previous life's queue discarded (counted dropped_stale)
    and its claims released (those versions are trained again, on the prompts the data position says were not
    trained); the KV budget (budget_control mismatch) and the learner version are published and the admission
    pool is opened."""

    def __init__(self, cfg: StepConfig, run_id: str, learner: Learner, resume: Resume, phase=None):
        """`phase`: records what the step does, for the driver's console (broker.run_state.PhaseBoard; None: not
        recorded)."""
        self.cfg, self.run_id, self.learner = cfg, run_id, learner
        self.phase = phase or (lambda phase, starts_step=False: None)
        self.redis = connect(cfg.broker)
        self.consumer = GroupConsumer(self.redis, cfg.broker, run_id, "learner-0",
                                      require_eviction_record=cfg.learner.replays(cfg.compressor.method),
                                      kv_quant=cfg.compressor.kv_quant().name)
        self.counters = {"groups_trained": 0, **resume.counters}
        self.trained_ids = list(resume.trained_ids)  # the last step's groups: skipped as duplicates after a resume
        rs.mark_consumed(self.redis, run_id, self.trained_ids)  # (the set survives a Redis that lost its data)
        if resume.resumed:  # its queue was sampled for versions after the checkpoint, which are trained again
            discard_queue(self.redis, cfg.broker, run_id)
            rs.reset_claims(self.redis, run_id)
        self.position = DataPosition(seed=cfg.seed, data=cfg.data)
        if resume.data_position:  # checked against the config when the run record was opened (deploy/record.py)
            self.position = DataPosition.from_dict(resume.data_position)
            rs.restore_prompt_stream(self.redis, run_id, *self.position.untrained())
        self.controller = None
        if cfg.compressor.budget_control == "mismatch":  # SPEC §5.1: the learner owns the budget, actors read it
            self.controller = BudgetController.from_config(cfg.compressor)
            if resume.extra.get("budget_controller"):  # a resume continues where the controller was
                self.controller.restore(resume.extra["budget_controller"])
            rs.publish_kv_budget(self.redis, run_id, self.controller.budget)
        rs.publish_learner_version(self.redis, run_id, learner.version)
        self._open_admission()
        self.idle = {"wait_s": 0.0, "step_s": 0.0}  # over this process's steps, for learner_idle_fraction_run
        self.saved_version = learner.version  # of the latest checkpoint (or the start)
        self.committed: tuple[int, dict] | None = None  # (version, checkpoint state) of the last committed step
        self.reports: dict[int, StepReport] = {}  # of the last REPORTS_KEPT committed steps, by version
        self.commit_lock = threading.Lock()  # held from a step's checkpoint to its report; `close` takes it
        self.closed = False  # set by `close`: no step saves or commits after it

    def _open_admission(self) -> None:
        """Which groups a step trains (admission-aware, with DAPO's dynamic sampling) and C, from the
        zero-variance share seen so far (after a resume: the run's counters)."""
        cfg, lcfg = self.cfg, self.cfg.learner
        informative = None
        if lcfg.filter_groups == "zero_variance":
            informative = lambda group: not zero_variance([s.reward for s in group.samples])  # noqa: E731
        admission = Admission(self.redis, cfg.broker, self.run_id) if cfg.broker.admission else None
        self.collector = StepCollector(self.consumer, admission, cfg.groups_per_step, informative,
                                       lcfg.max_extra_reads)
        counts = rs.run_counts(self.redis, self.run_id)
        # zero-variance groups among those consumed (filtered, or trained when a step had nothing else)
        self.zero_variance = {"zero": counts["groups_filtered"], "seen": counts["consumed"] + counts["groups_filtered"]}
        self.capacity = self._capacity()
        rs.open_pool(self.redis, self.run_id, cfg.last_version, self.capacity)

    def _capacity(self) -> int:
        if self.collector.informative is None:
            return self.cfg.groups_per_step
        return step_capacity(self.cfg.groups_per_step, self.zero_variance["zero"], self.zero_variance["seen"],
                             self.cfg.learner.max_extra_reads)

    def train_step(self, ranks: Ranks) -> StepReport:
        """One learner step: wait for its groups (train.groups_per_step informative groups, plus those admission
        says this step must take), train every rank on them, run the budget controller, write the checkpoint
        when due (with the data position), then acknowledge the groups and publish the new version in one
        transaction: a group is acknowledged only after every rank finished the step.
        Raises TimeoutError after train.group_wait_s without the step's groups; whatever `ranks` raises for a
        failed rank; StepAbandoned when `close` came first. Nothing of the step is acknowledged then."""
        start, learner = time.monotonic(), self.learner
        self.phase("reading groups")
        stale_before = self.consumer.counters["dropped_stale"]
        train, filtered, stale, stats = self.collector.collect(learner.version, self.capacity, self.cfg.group_wait_s)
        wait_s = time.monotonic() - start
        groups = [d.group for d in train]
        metrics = ranks.step(groups, [d.staleness for d in train])  # recompute -> correct -> loss -> step
        self.counters["groups_trained"] += len(train)
        self.trained_ids = [d.group.group_id for d in train + filtered]  # filtered groups count as consumed
        self.position.add([d.group.prompt_index for d in train + filtered])
        if self.controller is not None:  # before the version: actors with these weights read this budget or newer
            metrics.update(self._control_budget(metrics, groups))
        with self.commit_lock:  # a stopping driver's `close` waits for this part, and no step enters it after
            if self.closed:
                raise StepAbandoned(f"the step to version {learner.version} was abandoned: the run is stopping "
                                    "(nothing of it was saved or acknowledged)")
            state = self._checkpoint_state(metrics, groups)
            if self.cfg.learner.checkpoint_dir and learner.version % self.cfg.learner.checkpoint_interval == 0:
                self.phase("checkpoint")
                ranks.checkpoint(state)
                self.saved_version = learner.version
            self._count_zero_variance(train, filtered)
            self.phase("commit")
            # acknowledged only now that every rank finished; the new version in the same transaction
            self.consumer.commit(train, filtered, stale, learner_version=learner.version, step_capacity=self.capacity)
            self.committed = (learner.version, state)  # what checkpoint_now writes
            counts = rs.run_counts(self.redis, self.run_id)
            depth = queue_depth(self.redis, self.cfg.broker, self.run_id)
            step_s = time.monotonic() - start
            self.idle["wait_s"] += wait_s
            self.idle["step_s"] += step_s
            report = StepReport(
                version=learner.version, metrics=metrics, trained_prompt_ids=[g.prompt_id for g in groups],
                trained=len(train), filtered=len(filtered),
                dropped_stale=self.consumer.counters["dropped_stale"] - stale_before, reads=stats["reads"],
                filter_shortfall=stats["filter_shortfall"], groups_trained=self.counters["groups_trained"],
                step_capacity=self.capacity, queue_depth=depth, counts=counts,
                rollout_utilization=rs.rollout_utilization(counts, depth), wait_s=wait_s, step_s=step_s,
                idle_fraction_run=self.idle["wait_s"] / max(1e-9, self.idle["step_s"]))
            self.reports = {v: r for v, r in self.reports.items() if v > report.version - REPORTS_KEPT}
            self.reports[report.version] = report
        return report

    def close(self) -> list[StepReport]:
        """Close the step protocol (the driver's last call on a stop: Ctrl-C, SIGTERM, a failure): a step in the
        middle of its checkpoint and commit finishes them first; a step still training is abandoned before it
        saves or commits anything (StepAbandoned). Returns the reports of the last committed steps (at most
        REPORTS_KEPT, by version), from which the driver logs those it has not logged yet, so that every version a
        checkpoint holds has its line in trained_prompts.jsonl and its metrics in MLflow."""
        with self.commit_lock:
            self.closed = True
            return [self.reports[v] for v in sorted(self.reports)]

    def checkpoint_now(self, ranks: Ranks) -> int | None:
        """Write the checkpoint of the last committed step now unless it is written already (SIGTERM: the driver
        asks through deploy/learner_worker.py, which holds off the steps meanwhile). Returns its version, or None
        while the current version's step has not committed yet (its weights are ahead of its commit: ask again)."""
        if self.learner.version == self.saved_version:
            return self.saved_version
        if self.committed is None or self.committed[0] != self.learner.version:
            return None
        ranks.checkpoint(self.committed[1])
        self.saved_version = self.learner.version
        return self.saved_version

    def _count_zero_variance(self, train: list[Delivery], filtered: list[Delivery]) -> None:
        """Admission's C for the next step, from the zero-variance share seen so far (dynamic sampling)."""
        informative = self.collector.informative
        if informative is not None:
            self.zero_variance["seen"] += len(train) + len(filtered)
            self.zero_variance["zero"] += len(filtered) + sum(not informative(d.group) for d in train)
            self.capacity = self._capacity()

    def _checkpoint_state(self, metrics: dict, groups: list[TrajectoryGroup]) -> dict:
        """save_checkpoint's arguments besides the learner: the groups that can still be re-delivered, the
        counters, the data position, and in `extra` the step's learner metrics and trained prompt ids (a resumed
        run logs them if the interrupted one had not: the driver may stop between this step and its logging)
        and the budget controller's state."""
        extra = {"step_metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
                 "trained_prompt_ids": [g.prompt_id for g in groups]}
        if self.controller is not None:
            extra["budget_controller"] = self.controller.state()
        return {"consumed_group_ids": self.trained_ids, "counters": dict(self.counters),
                "data_position": self.position.to_dict(), "extra": extra}

    def _control_budget(self, metrics: dict, groups: list[TrajectoryGroup]) -> dict:
        """One controller update on this step's ratio tail (compressor.budget_metric): publish the budget,
        append the step's record (version, budget, change and reason, each trained group's weight version /
        budget / tier) to the run's budget log, print changes. Returns kv_budget_control (tokens) and
        kv_budget_change (new - old, tokens)."""
        c, version = self.controller, self.learner.version
        change = c.update(metrics.get(c.metric, float("nan")))
        rs.publish_kv_budget(self.redis, self.run_id, c.budget)
        rs.append_budget_log(self.redis, self.run_id, {
            "version": version, "kv_budget": c.budget, "old": change.old, c.metric: change.metric,
            "changed": change.changed, "reason": change.reason,
            "groups": [[g.weight_version, g.kv_budget, g.budget_tier] for g in groups]})
        if change.changed:
            print(f"kv budget at version {version}: {change.reason}", flush=True)
        return {"kv_budget_control": float(c.budget), "kv_budget_change": float(change.new - change.old)}
