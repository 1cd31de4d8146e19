"""The learner process (one Ray actor): take groups off the broker, run the Sparse-RL learner step, commit
(ack) the groups, publish the new version, checkpoint, and broadcast weights to the actors on request.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch


class LearnerWorker:
    def __init__(self, cfg: dict, run_id: str):
        from omegaconf import OmegaConf

        from deploy.config import RunConfig
        self.cfg: RunConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from broker.admission import Admission, StepCollector, open_pool, step_capacity
        from broker.streams import GroupConsumer, connect, key, publish_learner_version, run_counts
        from broker.weight_sync import WeightSender
        from learner.checkpoint import load_checkpoint
        from learner.learner import Learner
        from learner.loss import zero_variance

        self.run_id = run_id
        self.learner = Learner(self.cfg.model, self.cfg.learner)
        self.redis = connect(self.cfg.broker)
        self.consumer = GroupConsumer(self.redis, self.cfg.broker, run_id, "learner-0")
        self.counters = {"groups_trained": 0}
        self.trained_ids: list[str] = []
        ckpt_dir = self.cfg.learner.resume_from or self.cfg.learner.checkpoint_dir
        if ckpt_dir and (Path(ckpt_dir) / "latest").exists():  # resume: version, counters and RNG continue
            self.trained_ids, counters = load_checkpoint(self.learner, ckpt_dir)
            self.counters.update(counters)
            if self.trained_ids:  # the consumed set also survives a Redis that lost its data
                self.redis.sadd(key(run_id, "consumed"), *self.trained_ids)
        publish_learner_version(self.redis, run_id, self.learner.version)
        # which groups a step trains: admission-aware (broker/admission.py), with DAPO's dynamic sampling
        l, want = self.cfg.learner, self.cfg.train.groups_per_step
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
        # the driver trains up to weight version train.steps: the last step runs at learner version steps - 1
        open_pool(self.redis, run_id, self.cfg.train.steps - 1, self.capacity)
        self.idle = {"wait_s": 0.0, "step_s": 0.0}  # over the run, for learner_idle_fraction_run
        host = "127.0.0.1"
        if self.cfg.ray.address:  # on a cluster the actors reach the learner's node address
            import ray
            host = ray.util.get_node_ip_address()
        self.sender = WeightSender(host=host, port=0, backend=self.cfg.learner.weight_sync_backend,
                                   timeout_s=self.cfg.learner.weight_sync_timeout_s,
                                   bucket_mb=self.cfg.learner.weight_sync_bucket_mb,
                                   verify=self.cfg.learner.weight_sync_verify)
        self.generation = -1
        self.updating = threading.Lock()  # a weight broadcast never reads weights the optimizer is changing

    def version(self) -> int:
        """The learner's weight version (0 at start, the checkpoint's after a resume)."""
        return self.learner.version

    def sync_address(self) -> tuple[str, int]:
        """(host, port) of the weight-sync TCPStore the actors connect to."""
        return self.sender.host, self.sender.port

    def train_step(self) -> dict:
        """Wait for the groups of one step (train.groups_per_step informative groups, plus those admission
        control says this step must take: broker/admission.py), train one step, then commit them and publish
        the version. Returns the step's metrics (SPEC §4) plus broker counters and queue depth; per step:
        groups_filtered, dropped_stale, groups_read, filter_shortfall, learner_idle_fraction (time waiting for
        groups / time of the whole step); cumulative: rollout_utilization ((consumed + groups_filtered) /
        groups that left the queue so far: produced - queue depth; the run's summary divides by everything
        produced), learner_idle_fraction_run."""
        from broker.admission import step_capacity
        from broker.streams import queue_depth, run_counts
        from learner.checkpoint import save_checkpoint

        l, want = self.cfg.learner, self.cfg.train.groups_per_step
        start = time.monotonic()
        stale_before = self.consumer.counters["dropped_stale"]
        train, filtered, stale, stats = self.collector.collect(self.learner.version, self.capacity,
                                                               self.cfg.train.group_wait_s)
        wait_s = time.monotonic() - start
        with self.updating:
            metrics = self.learner.step([d.group for d in train], [d.staleness for d in train])
        self.counters["groups_trained"] += len(train)
        self.trained_ids += [d.group.group_id for d in train + filtered]  # filtered ones count as consumed
        if l.checkpoint_dir and self.learner.version % l.checkpoint_interval == 0:
            save_checkpoint(self.learner, l.checkpoint_dir, self.trained_ids, self.counters)
        if self.collector.informative is not None:
            self.zero_variance["seen"] += len(train) + len(filtered)
            self.zero_variance["zero"] += len(filtered) + sum(not self.collector.informative(d.group) for d in train)
            self.capacity = step_capacity(want, self.zero_variance["zero"], self.zero_variance["seen"],
                                          l.max_extra_reads)
        # acked only once the step that used them is done; the new version in the same transaction
        self.consumer.commit(train, filtered, stale, learner_version=self.learner.version, step_capacity=self.capacity)
        counts, depth = run_counts(self.redis, self.run_id), queue_depth(self.redis, self.cfg.broker, self.run_id)
        step_s = time.monotonic() - start
        self.idle["wait_s"] += wait_s
        self.idle["step_s"] += step_s
        return {**metrics, "version": float(self.learner.version), "learner_wait_s": wait_s,
                "learner_idle_fraction": wait_s / step_s if step_s > 0 else 0.0,
                "learner_idle_fraction_run": self.idle["wait_s"] / max(1e-9, self.idle["step_s"]),
                "groups_filtered": float(len(filtered)),
                "dropped_stale": float(self.consumer.counters["dropped_stale"] - stale_before),
                "groups_read": float(stats["reads"]), "filter_shortfall": float(stats["filter_shortfall"]),
                "step_capacity": float(self.capacity),
                "rollout_utilization": (counts["consumed"] + counts["groups_filtered"])
                / max(1, counts["produced"] - depth),
                "groups_trained": float(self.counters["groups_trained"]),
                "queue_depth": float(depth),
                **{f"broker_{k}": float(v) for k, v in counts.items()}}

    def send_weights(self, generation: int, world_size: int) -> dict:
        """One broadcast of the current weights to ranks 1..world_size-1 (the actors) of sync group
        `generation`, rebuilt when the generation changes. May run while train_step waits for groups (an
        actor that became ready then gets the weights at once); never during the optimizer step."""
        with self.updating:
            if generation != self.generation:
                self.sender.open_group(generation, world_size)
                self.generation = generation
            return self.sender.send(self.learner.named_weights(), self.learner.version, self.learner.dtype)

    def save_final(self, path: str) -> str:
        """The trained weights as a Hugging Face directory (with the tokenizer), for `sparse-rl eval`."""
        from transformers import AutoTokenizer
        model = self.learner.engine.module
        state = dict(self.learner.named_weights())
        model.save_pretrained(path, state_dict=state)
        AutoTokenizer.from_pretrained(self.cfg.model).save_pretrained(path)
        return path
