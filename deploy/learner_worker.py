"""A learner process (one Ray actor per rank). Rank 0 takes groups off the broker, has every rank run the
Sparse-RL learner step on them, commits (acks) the groups once every rank finished, publishes the new version,
checkpoints (every rank writes its DeepSpeed shards), and broadcasts weights to the actors on request (ZeRO-3
parameters gathered bucket by bucket with the other ranks). Ranks 1..N-1 only follow rank 0's calls; they never
call another rank. deploy/learner_group.py places the ranks and wires them together. Which groups a step
trains is decided with admission control and dynamic sampling (broker/admission.py); the KV budget controller
(learner/budget_control.py) runs on rank 0 after each step.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

from broker import faults

RANK_FAILURE_WAIT_S = 30.0
"""After a failed step, how long rank 0 waits for Ray to report which peer ranks died, seconds."""


STALL_ENV = "SPARSE_RL_TEST_STALL_RANK"
"""Test hook: "1@2=60" makes learner rank 1 wait 60 s at the start of its step from weight version 2, so a test
can kill it mid-step. Read from the environment the rank processes inherit from the driver."""


def stall_s(rank: int, version: int) -> float:
    """The stall of `rank` at the step from `version`, from STALL_ENV (0 when not named)."""
    for item in filter(None, os.environ.get(STALL_ENV, "").split(",")):
        where, _, seconds = item.partition("=")
        if where.strip() == f"{rank}@{version}":
            return float(seconds)
    return 0.0


class LearnerRankError(RuntimeError):
    """A learner step failed because a rank died, hung or raised; the message names the rank(s). Nothing of
    the step was acknowledged: its groups are re-delivered or, after a resume, their prompts trained again."""


class LearnerWorker:
    def __init__(self, cfg: dict, run_id: str, rank: int = 0, world_size: int = 1,
                 master: tuple[str, int] | None = None):
        """One learner rank. `master` = (address, port) of rank 0's store for the learner group (None with
        one rank). Rank 0 also connects to the broker and hosts the weight-sync store."""
        from omegaconf import OmegaConf

        from deploy.config import RunConfig
        faults.wrap(lambda: None, "learner.init", rank)()  # a test's fault: this rank dies while it starts
        self.cfg: RunConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from learner.checkpoint import load_checkpoint
        from learner.learner import Learner, init_distributed

        self.run_id, self.rank, self.world_size = run_id, rank, world_size
        l = self.cfg.learner
        if world_size > 1:
            init_distributed(rank, world_size, master[0], master[1], timeout_s=l.collective_timeout_s)
        self.learner = Learner(self.cfg.model, l)
        self.peers: list = []  # rank 0: Ray handles of ranks 1..N-1
        self.counters = {"groups_trained": 0}
        self.trained_ids: list[str] = []  # ids of the last step's groups (acked after the checkpoint is written)
        self.data_position: dict = {}
        self.resumed_extra: dict = {}  # what the checkpoint adds for the driver and rank 0 (see _checkpoint_extra)
        ckpt_dir = l.resume_from or l.checkpoint_dir  # resume_from: a fork, loaded from another run's checkpoints
        resumed = bool(ckpt_dir and (Path(ckpt_dir) / "latest").exists())
        if resumed:  # every rank loads its shards; version, counters and RNG continue
            self.trained_ids, counters = load_checkpoint(self.learner, ckpt_dir)
            self.counters.update(counters)
            self.data_position = dict(self.learner.checkpoint_state.get("data_position") or {})
            self.resumed_extra = dict(self.learner.checkpoint_state.get("extra") or {})
        if rank:
            return
        from omegaconf import OmegaConf

        from broker.admission import Admission, StepCollector, open_pool, reset_claims, step_capacity
        from broker.prompts import DataPosition, restore_prompt_position
        from broker.streams import GroupConsumer, connect, discard_queue, key, publish_learner_version, run_counts
        from broker.weight_sync import WeightSender
        from learner.loss import zero_variance

        self.redis = connect(self.cfg.broker)
        self.consumer = GroupConsumer(self.redis, self.cfg.broker, run_id, "learner-0")
        if self.trained_ids:  # the consumed set also survives a Redis that lost its data
            self.redis.sadd(key(run_id, "consumed"), *self.trained_ids)
        if resumed:  # the queue a resumed record left was sampled for versions after the checkpoint, which are
            # trained again now (on the same prompts, below): its groups are discarded, counted as dropped_stale,
            # and the claims of its actors (all gone) released
            discard_queue(self.redis, self.cfg.broker, run_id)
            reset_claims(self.redis, run_id)
        data = OmegaConf.to_container(OmegaConf.structured(self.cfg.actors.data))
        self.position = DataPosition(seed=self.cfg.seed, data=data)
        if self.data_position:  # the prompts continue where the checkpoint's run stopped, in the same order
            saved = DataPosition.from_dict(self.data_position)
            changed = [f"seed={self.cfg.seed} (checkpoint: {saved.seed})"] if saved.seed != self.cfg.seed else []
            changed += [f"actors.data.{k}={data.get(k)!r} (checkpoint: {saved.data.get(k)!r})"
                        for k in sorted(set(data) | set(saved.data)) if data.get(k) != saved.data.get(k)]
            if changed:
                raise ValueError("resume: the prompt order differs from the checkpoint's: " + "; ".join(changed)
                                 + ". Resume with the checkpoint's values, or start a new run")
            self.position = saved
            restore_prompt_position(self.redis, run_id, saved)
        self.controller = None
        compressor = self.cfg.actors.engine.compressor
        if compressor.budget_control == "mismatch":  # issue 13: the learner owns the budget, actors read it
            from broker.streams import publish_kv_budget
            from learner.budget_control import BudgetController
            self.controller = BudgetController.from_config(compressor)
            if self.resumed_extra.get("budget_controller"):  # a resume continues where the controller was
                self.controller.restore(self.resumed_extra["budget_controller"])
            publish_kv_budget(self.redis, run_id, self.controller.budget)
        publish_learner_version(self.redis, run_id, self.learner.version)
        # which groups a step trains: admission-aware (broker/admission.py), with DAPO's dynamic sampling
        want = self.cfg.train.groups_per_step
        informative = None
        if l.filter_groups == "zero_variance":
            informative = lambda group: not zero_variance([s.reward for s in group.samples])  # noqa: E731
        admission = Admission(self.redis, self.cfg.broker, run_id) if self.cfg.broker.admission else None
        self.collector = StepCollector(self.consumer, admission, want, informative, l.max_extra_reads)
        counts = run_counts(self.redis, run_id)  # after a resume: the filtered share seen so far
        # zero-variance groups among those consumed (filtered, or trained when a step had nothing else)
        self.zero_variance = {"zero": counts["groups_filtered"], "seen": counts["consumed"] + counts["groups_filtered"]}
        self.capacity = want if informative is None else step_capacity(
            want, self.zero_variance["zero"], self.zero_variance["seen"], l.max_extra_reads)
        # the last step is the one from version train.steps - 1 (train.steps counts the record's versions)
        open_pool(self.redis, run_id, self.cfg.train.steps - 1, self.capacity)
        self.idle = {"wait_s": 0.0, "step_s": 0.0}  # over the run, for learner_idle_fraction_run
        host = "127.0.0.1"
        if self.cfg.ray.address:  # on a cluster the actors reach the learner's node address
            import ray
            host = ray.util.get_node_ip_address()
        self.sender = WeightSender(host=host, port=0, backend=l.weight_sync_backend,
                                   timeout_s=l.weight_sync_timeout_s, bucket_mb=l.weight_sync_bucket_mb,
                                   verify=l.weight_sync_verify)
        self.generation = -1
        self.updating = threading.Lock()  # a weight broadcast never reads weights the optimizer is changing
        self.fault = {name: faults.wrap(lambda: None, f"learner.{name}", rank, when=lambda: self.learner.version)
                      for name in ("send_weights", "save_final")}  # a test's faults; no-ops otherwise
        self.saved_version = self.learner.version  # of the latest checkpoint (or the start)
        self.committed: tuple[int, dict] | None = None  # (version, checkpoint state) of the last committed step

    # -- the learner group ---------------------------------------------------------------------------------
    def watch(self) -> None:
        """Never returns: the driver holds one call per rank (in the `watch` concurrency group), which fails as
        soon as the rank's process dies (deploy/learner_group.py)."""
        threading.Event().wait()

    def set_peers(self, peers: list) -> None:
        """Rank 0: the Ray handles of ranks 1..N-1, in rank order."""
        self.peers = list(peers)

    def pid(self) -> int:
        """This rank's process id (for tests that kill a rank)."""
        return os.getpid()

    def _on_all_ranks(self, method: str, *args):
        """Call `method(*args)` on every peer and on this rank (rank 0) at once: the peers' calls join the
        collectives of this rank's. Returns this rank's result once every rank finished.
        Raises LearnerRankError naming the rank(s) that died, raised or did not finish (within the collective
        timeout, as the collectives themselves time out)."""
        import ray

        if not self.peers:  # one rank: its own errors as they are
            return getattr(self, "_" + method)(*args)
        refs = [getattr(p, method).remote(*args) for p in self.peers]
        try:
            result = getattr(self, "_" + method)(*args)
        except Exception as e:
            raise self._rank_failure(method, refs, e) from e
        try:
            ray.get(refs, timeout=self.cfg.learner.collective_timeout_s)
        except Exception as e:
            raise self._rank_failure(method, refs, e) from e
        return result

    def _rank_failure(self, method: str, refs: list, error: Exception) -> LearnerRankError:
        """The error of a failed group call, naming each peer rank that died or raised, or else the ranks that
        had not finished (and rank 0's own error)."""
        import ray

        ray.wait(refs, num_returns=len(refs), timeout=min(RANK_FAILURE_WAIT_S, self.cfg.learner.collective_timeout_s))
        dead, unfinished = [], []
        for rank, ref in enumerate(refs, start=1):
            if not ray.wait([ref], timeout=0)[0]:
                unfinished.append(rank)
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                dead.append(f"learner rank {rank} died ({str(e).splitlines()[0][:200]})")
            except Exception as e:
                dead.append(f"learner rank {rank} raised {type(e).__name__}: {str(e).splitlines()[-1][:300]}")
        if dead:
            reason = "; ".join(dead)
        elif unfinished:
            reason = (f"learner rank(s) {unfinished} did not finish within learner.collective_timeout_s="
                      f"{self.cfg.learner.collective_timeout_s:g} s; rank 0: {type(error).__name__}: "
                      f"{str(error).splitlines()[0][:300]}")
        else:
            reason = f"learner rank 0 raised {type(error).__name__}: {str(error).splitlines()[0][:300]}"
        return LearnerRankError(f"{method} at learner version {self.learner.version} failed: {reason}")

    # -- what every rank runs (rank 0 through _on_all_ranks, peers called by rank 0) ------------------------
    def step(self, groups: list, staleness: list[int]) -> dict:
        """One learner step on the step's groups (every rank gets all of them); see Learner.step."""
        time.sleep(stall_s(self.rank, self.learner.version))  # a test hook, 0 unless STALL_ENV names this step
        return self.learner.step(groups, staleness)

    _step = step

    def checkpoint(self, state: dict) -> str:
        """Write this rank's part of the checkpoint of the current version (DeepSpeed: every rank calls it);
        `state`: save_checkpoint's data_position and extra, from rank 0."""
        from learner.checkpoint import save_checkpoint
        return save_checkpoint(self.learner, self.cfg.learner.checkpoint_dir, self.trained_ids, self.counters,
                               **state)

    _checkpoint = checkpoint

    def gather_weights(self, passes: int, keep: bool) -> list[tuple[str, torch.Tensor]]:
        """Enter the ZeRO-3 gathers of the weight sync's bucket layout `passes` times, in order (rank 0 packs
        each bucket inside them); with `keep`, return CPU copies of the gathered weights (by name, tied names
        sharing one tensor). Without ZeRO-3 nothing is collective."""
        from broker.weight_sync import bucket_layout

        named = self.learner.sync_parameters()
        itemsize = torch.empty((), dtype=self.learner.dtype).element_size()
        unique, tied, buckets = bucket_layout(named, self.cfg.learner.weight_sync_bucket_mb, itemsize,
                                              self.learner.full_shape)
        out = {}
        for _ in range(passes):
            for bucket in buckets:
                params = [unique[i][1] for i in bucket]
                with self.learner.gathered(params):
                    if keep:
                        out.update({unique[i][0]: unique[i][1].detach().to("cpu", self.learner.dtype, copy=True)
                                    for i in bucket})
        out.update({alias: out[target] for alias, target in tied.items() if target in out})
        return [(name, out[name]) for name, _ in named] if keep else []

    _gather_weights = gather_weights

    def gradients(self, groups: list) -> dict:
        """Full gradients of `groups` as one minibatch (Learner.gradients), CPU tensors; every rank."""
        return {n: g.cpu() for n, g in self.learner.gradients(groups).items()}

    _gradients = gradients

    def state_bytes(self) -> dict:
        """Learner.state_bytes of this rank (no collective: any rank may be asked directly)."""
        return self.learner.state_bytes()

    # -- rank 0 ----------------------------------------------------------------------------------------------
    def version(self) -> int:
        """The learner's weight version (0 at start, the checkpoint's after a resume)."""
        return self.learner.version

    def sync_address(self) -> tuple[str, int]:
        """(host, port) of the weight-sync TCPStore the actors connect to."""
        return self.sender.host, self.sender.port

    def resume_state(self) -> dict:
        """What the checkpoint this learner resumed from says: {"data_position": ..., "step_metrics": the
        learner metrics of the step that made the checkpoint's version, "trained_prompt_ids": that step's prompt
        ids} (empty values when it started fresh)."""
        return {"data_position": self.data_position, "step_metrics": self.resumed_extra.get("step_metrics", {}),
                "trained_prompt_ids": self.resumed_extra.get("trained_prompt_ids", [])}

    def step_groups(self, groups: list, staleness: list[int]) -> dict:
        """Rank 0: one step of every rank on `groups` (no broker); raises LearnerRankError naming a failed rank."""
        with self.updating:
            return self._on_all_ranks("step", groups, staleness)

    def train_step(self) -> dict:
        """Wait for the groups of one step (train.groups_per_step informative groups, plus those admission
        control says this step must take: broker/admission.py), have every rank train one step on them, write
        the checkpoint when due (with the data position: which prompts were trained, broker.prompts.DataPosition),
        then commit them and publish the version in one transaction: a group is acknowledged only after every
        rank finished the step. Returns the step's metrics (SPEC §4) plus broker counters and queue depth; per
        step: groups_filtered, dropped_stale, groups_read, filter_shortfall, learner_idle_fraction (time waiting
        for groups / time of the whole step); cumulative: groups_trained, rollout_utilization ((consumed +
        groups_filtered) / groups that left the queue so far), learner_idle_fraction_run; and
        `trained_prompt_ids` (the prompt id of each trained group, in order).
        Raises LearnerRankError naming a rank that died or hung; nothing of the step is acknowledged then."""
        from broker.admission import step_capacity
        from broker.streams import queue_depth, run_counts

        l, want = self.cfg.learner, self.cfg.train.groups_per_step
        start = time.monotonic()
        stale_before = self.consumer.counters["dropped_stale"]
        train, filtered, stale, stats = self.collector.collect(self.learner.version, self.capacity,
                                                               self.cfg.train.group_wait_s)
        wait_s = time.monotonic() - start
        groups = [d.group for d in train]
        with self.updating:
            metrics = self._on_all_ranks("step", groups, [d.staleness for d in train])
        self.counters["groups_trained"] += len(train)
        # only these can still be re-delivered (earlier groups are acked and deleted): the list stays bounded;
        # filtered groups count as consumed
        self.trained_ids = [d.group.group_id for d in train + filtered]
        self.position.add([d.group.prompt_index for d in train + filtered])
        if self.controller is not None:  # before the version: actors with these weights read this budget or newer
            metrics.update(self._control_budget(metrics, groups))
        state = {"data_position": self.position.to_dict(), "extra": self._checkpoint_extra(metrics, groups)}
        if l.checkpoint_dir and self.learner.version % l.checkpoint_interval == 0:
            self._on_all_ranks("checkpoint", state)
            self.saved_version = self.learner.version
        if self.collector.informative is not None:
            self.zero_variance["seen"] += len(train) + len(filtered)
            self.zero_variance["zero"] += len(filtered) + sum(not self.collector.informative(d.group) for d in train)
            self.capacity = step_capacity(want, self.zero_variance["zero"], self.zero_variance["seen"],
                                          l.max_extra_reads)
        # acked only once every rank finished the step that used them; the new version in the same transaction
        self.consumer.commit(train, filtered, stale, learner_version=self.learner.version, step_capacity=self.capacity)
        self.committed = (self.learner.version, state)  # what checkpoint_now writes
        counts, depth = run_counts(self.redis, self.run_id), queue_depth(self.redis, self.cfg.broker, self.run_id)
        step_s = time.monotonic() - start
        self.idle["wait_s"] += wait_s
        self.idle["step_s"] += step_s
        return {**metrics, "version": float(self.learner.version), "learner_wait_s": wait_s,
                "groups_trained": float(self.counters["groups_trained"]),
                "learner_idle_fraction": wait_s / step_s if step_s > 0 else 0.0,
                "learner_idle_fraction_run": self.idle["wait_s"] / max(1e-9, self.idle["step_s"]),
                "groups_filtered": float(len(filtered)),
                "dropped_stale": float(self.consumer.counters["dropped_stale"] - stale_before),
                "groups_read": float(stats["reads"]), "filter_shortfall": float(stats["filter_shortfall"]),
                "step_capacity": float(self.capacity),
                "rollout_utilization": (counts["consumed"] + counts["groups_filtered"])
                / max(1, counts["produced"] - depth),
                "queue_depth": float(depth),
                "trained_prompt_ids": [g.prompt_id for g in groups],
                **{f"broker_{k}": float(v) for k, v in counts.items()}}

    def _checkpoint_extra(self, metrics: dict, groups: list) -> dict:
        """Rank 0's part of a checkpoint besides the data position: the step's learner metrics and trained prompt
        ids (a resumed run logs them if the interrupted one had not: the driver may stop between this step and
        its logging) and the budget controller's state."""
        extra = {"step_metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
                 "trained_prompt_ids": [g.prompt_id for g in groups]}
        if self.controller is not None:
            extra["budget_controller"] = self.controller.state()
        return extra

    def _control_budget(self, metrics: dict, groups: list) -> dict:
        """One controller update on this step's ratio tail (compressor.budget_metric): publish the budget in
        Redis, append the step's record (version, budget, change and reason, each trained group's weight
        version / budget / tier) to the run's budget log, print changes. Returns kv_budget_control (tokens)
        and kv_budget_change (new - old, tokens)."""
        import json

        from broker.streams import BUDGET_LOG, key, publish_kv_budget
        c = self.controller
        change = c.update(metrics.get(c.metric, float("nan")))
        publish_kv_budget(self.redis, self.run_id, c.budget)
        record = {"version": self.learner.version, "kv_budget": c.budget, "old": change.old,
                  c.metric: change.metric, "changed": change.changed, "reason": change.reason,
                  "groups": [[g.weight_version, g.kv_budget, g.budget_tier] for g in groups]}
        self.redis.rpush(key(self.run_id, BUDGET_LOG), json.dumps(record))
        if change.changed:
            print(f"kv budget at version {self.learner.version}: {change.reason}", flush=True)
        return {"kv_budget_control": float(c.budget), "kv_budget_change": float(change.new - change.old)}

    def send_weights(self, generation: int, world_size: int) -> dict:
        """One broadcast of the current weights to ranks 1..world_size-1 (the actors) of sync group
        `generation`, rebuilt when the generation changes. May run while train_step waits for groups (an
        actor that became ready then gets the weights at once); never during the optimizer step. ZeRO-3 over
        several learner ranks: the peers enter the same per-bucket gathers while rank 0 packs each bucket."""
        import ray

        from broker.weight_sync import bucket_layout
        self.fault["send_weights"]()
        with self.updating:
            if generation != self.generation:
                self.sender.open_group(generation, world_size)
                self.generation = generation
            if not (self.peers and self.cfg.learner.zero_stage == 3):
                return self.sender.send(self.learner.sync_parameters(), self.learner.version, self.learner.dtype,
                                        shape_of=self.learner.full_shape, gather=self.learner.gathered)
            passes = 2 if self.sender.verify else 1
            refs = [p.gather_weights.remote(passes, False) for p in self.peers]
            named = self.learner.sync_parameters()
            itemsize = torch.empty((), dtype=self.learner.dtype).element_size()
            unique, _, buckets = bucket_layout(named, self.sender.bucket_mb, itemsize, self.learner.full_shape)
            entered = []

            def gather(params):
                entered.append(1)
                return self.learner.gathered(params)
            try:
                stats = self.sender.send(named, self.learner.version, self.learner.dtype,
                                         shape_of=self.learner.full_shape, gather=gather)
            finally:  # a failed send still enters every gather, so that the peers never wait on rank 0
                flat = [b for _ in range(passes) for b in buckets]
                for bucket in flat[len(entered):]:
                    with self.learner.gathered([unique[i][1] for i in bucket]):
                        pass
            try:
                ray.get(refs, timeout=self.cfg.learner.collective_timeout_s)
            except Exception as e:
                raise self._rank_failure("send_weights", refs, e) from e
            return stats

    def checkpoint_now(self) -> int:
        """Rank 0: write the checkpoint of the last completed (committed) step now, unless it is written already
        (the driver calls it on SIGTERM). Waits for a step in progress to commit. Returns its version."""
        while True:
            with self.updating:  # no step computes meanwhile
                if self.learner.version == self.saved_version:
                    return self.saved_version
                if self.committed is not None and self.committed[0] == self.learner.version:
                    self._on_all_ranks("checkpoint", self.committed[1])
                    self.saved_version = self.learner.version
                    return self.saved_version
            time.sleep(0.05)  # the step's weights are ahead of its commit: a moment

    def save_final(self, path: str) -> str:
        """The trained weights as a Hugging Face directory (with the tokenizer), for `sparse-rl eval`."""
        from transformers import AutoTokenizer
        self.fault["save_final"]()
        with self.updating:
            state = dict(self._on_all_ranks("gather_weights", 1, True))
        self.learner.engine.module.save_pretrained(path, state_dict=state)
        AutoTokenizer.from_pretrained(self.cfg.model).save_pretrained(path)
        return path

    def full_weights(self) -> dict:
        """Every parameter's full value (CPU, by name), gathered over the ranks."""
        with self.updating:
            return dict(self._on_all_ranks("gather_weights", 1, True))

    def full_gradients(self, groups: list) -> dict:
        """Learner.gradients over every rank (tests of split invariance)."""
        with self.updating:
            return self._on_all_ranks("gradients", groups)
