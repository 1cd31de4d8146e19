"""A learner process (one Ray actor per rank). Rank 0 takes groups off the broker, has every rank run the
Sparse-RL learner step on them, commits (acks) the groups once every rank finished, publishes the new version,
checkpoints (every rank writes its DeepSpeed shards), and broadcasts weights to the actors on request (ZeRO-3
parameters gathered bucket by bucket with the other ranks). Ranks 1..N-1 only follow rank 0's calls; they never
call another rank. deploy/learner_group.py places the ranks and wires them together.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

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
        ckpt_dir = l.checkpoint_dir
        resumed = bool(ckpt_dir and (Path(ckpt_dir) / "latest").exists())
        if resumed:  # every rank loads its shards; version, counters and RNG continue
            self.trained_ids, counters = load_checkpoint(self.learner, ckpt_dir)
            self.counters.update(counters)
            self.data_position = dict(self.learner.checkpoint_state.get("data_position") or {})
        if rank:
            return
        from omegaconf import OmegaConf

        from broker.prompts import DataPosition, restore_prompt_position
        from broker.streams import GroupConsumer, connect, key, publish_learner_version
        from broker.weight_sync import WeightSender

        self.redis = connect(self.cfg.broker)
        self.consumer = GroupConsumer(self.redis, self.cfg.broker, run_id, "learner-0")
        if self.trained_ids:  # the consumed set also survives a Redis that lost its data
            self.redis.sadd(key(run_id, "consumed"), *self.trained_ids)
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
        publish_learner_version(self.redis, run_id, self.learner.version)
        host = "127.0.0.1"
        if self.cfg.ray.address:  # on a cluster the actors reach the learner's node address
            import ray
            host = ray.util.get_node_ip_address()
        self.sender = WeightSender(host=host, port=0, backend=l.weight_sync_backend,
                                   timeout_s=l.weight_sync_timeout_s, bucket_mb=l.weight_sync_bucket_mb,
                                   verify=l.weight_sync_verify)
        self.generation = -1
        self.updating = threading.Lock()  # a weight broadcast never reads weights the optimizer is changing

    # -- the learner group ---------------------------------------------------------------------------------
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

    def checkpoint(self, extra: dict) -> str:
        """Write this rank's part of the checkpoint of the current version (DeepSpeed: every rank calls it)."""
        from learner.checkpoint import save_checkpoint
        return save_checkpoint(self.learner, self.cfg.learner.checkpoint_dir, self.trained_ids, self.counters,
                               **extra)

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
        """What the checkpoint this learner resumed from says about the data: {"data_position": ...} ({} when
        it started fresh)."""
        return {"data_position": self.data_position}

    def step_groups(self, groups: list, staleness: list[int]) -> dict:
        """Rank 0: one step of every rank on `groups` (no broker); raises LearnerRankError naming a failed rank."""
        with self.updating:
            return self._on_all_ranks("step", groups, staleness)

    def train_step(self) -> dict:
        """Wait for `train.groups_per_step` groups, have every rank train one step on them, write the checkpoint
        when due (with the data position: which prompts were trained, broker.prompts.DataPosition), then
        commit them and publish the version: a group is acknowledged only after every rank finished the step. Returns the step's metrics (SPEC §4) plus broker counters and queue
        depth, and `trained_prompt_ids` (the prompt id of each trained group, in order).
        Raises LearnerRankError naming a rank that died or hung; nothing of the step is acknowledged then."""
        from broker.streams import publish_learner_version, queue_depth, run_counts

        want, deliveries = self.cfg.train.groups_per_step, []
        start = time.monotonic()
        while len(deliveries) < want:
            deliveries += self.consumer.read(want - len(deliveries), block_ms=1000)
            if time.monotonic() - start > self.cfg.train.group_wait_s:
                raise TimeoutError(f"learner waited {self.cfg.train.group_wait_s:.0f} s (train.group_wait_s) and "
                                   f"got {len(deliveries)} of {want} groups: are the rollout actors alive?")
        wait_s = time.monotonic() - start
        groups = [d.group for d in deliveries]
        with self.updating:
            metrics = self._on_all_ranks("step", groups, [d.staleness for d in deliveries])
        self.counters["groups_trained"] += len(deliveries)
        # only these can still be re-delivered (earlier groups are acked and deleted): the list stays bounded
        self.trained_ids = [d.group.group_id for d in deliveries]
        self.position.add([g.prompt_index for g in groups])
        l = self.cfg.learner
        if l.checkpoint_dir and self.learner.version % l.checkpoint_interval == 0:
            self._on_all_ranks("checkpoint", {"data_position": self.position.to_dict()})
        self.consumer.commit(deliveries)  # acked only once every rank finished the step that used them
        publish_learner_version(self.redis, self.run_id, self.learner.version)
        counts = run_counts(self.redis, self.run_id)
        return {**metrics, "version": float(self.learner.version), "learner_wait_s": wait_s,
                "queue_depth": float(queue_depth(self.redis, self.cfg.broker, self.run_id)),
                "trained_prompt_ids": [g.prompt_id for g in groups],
                **{f"broker_{k}": float(v) for k, v in counts.items()}}

    def send_weights(self, generation: int, world_size: int) -> dict:
        """One broadcast of the current weights to ranks 1..world_size-1 (the actors) of sync group
        `generation`, rebuilt when the generation changes. May run while train_step waits for groups (an
        actor that became ready then gets the weights at once); never during the optimizer step. ZeRO-3 over
        several learner ranks: the peers enter the same per-bucket gathers while rank 0 packs each bucket."""
        import ray

        from broker.weight_sync import bucket_layout
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

    def save_final(self, path: str) -> str:
        """The trained weights as a Hugging Face directory (with the tokenizer), for `sparse-rl eval`."""
        from transformers import AutoTokenizer
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
