"""One learner rank as a Ray actor. The step lives in learner/ (step.py: the protocol, learner.py: the math); rank 0
runs LearnerStep.train_step over every rank (deploy/rank_calls.py), placed by deploy/learner_group.py."""
from __future__ import annotations

import os
import threading
import time

import ray
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from broker import faults
from broker import run_state as rs
from broker.fingerprint import fingerprinted, probe
from broker.lora import save_merged
from broker.streams import connect
from broker.weight_sync import WeightSender
from deploy.config import RunConfig, fingerprint_tokens
from deploy.rank_calls import AllRanks, on_all_ranks, wait_ranks
from learner.step import LearnerStep, OneRank, Resume, StepConfig, StepReport


class LearnerWorker:
    def __init__(self, cfg: dict, run_id: str, rank: int = 0, world_size: int = 1,
                 master: tuple[str, int] | None = None):
        """One learner rank. `master` = (address, port) of rank 0's store for the learner group (None with one
        rank). Every rank loads its checkpoint shards; rank 0 also opens the step protocol over the broker
        (learner/step.py) and hosts the weight-sync store."""
        faults.wrap(lambda: None, "learner.init", rank)()  # a test's fault (broker/faults.py): dies while it starts
        self.cfg: RunConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))
        lcfg = self.cfg.learner
        self.phase = rs.PhaseBoard(connect(self.cfg.broker), run_id, f"learner-{rank}")  # for the driver's console
        self.phase("loading")
        # here, not at the top: the driver imports this class to start the rank, and the learner's model stack
        # (transformers' modeling code, DeepSpeed) costs it seconds on the run's start path
        from learner.distributed import init_distributed
        from learner.learner import Learner

        if world_size > 1:
            init_distributed(rank, world_size, master[0], master[1], timeout_s=lcfg.collective_timeout_s)
        # Learner.step reports its parts (learner.learner.PHASES) to the board as each starts
        self.learner = Learner(self.cfg.model, lcfg, phase=self.phase)
        self.rank, self.peers = rank, []  # rank 0: Ray handles of ranks 1..N-1
        self.local, version = OneRank(self.learner, lcfg.checkpoint_dir), lambda: self.learner.version
        self.local.step = faults.wrap(self.local.step, "learner.step", rank, when=version)  # a test's faults, or not
        self.resume = Resume.load(self.learner, lcfg.resume_from or lcfg.checkpoint_dir)  # resume_from: a fork
        if rank:
            self.phase("idle")
            return
        self.protocol = LearnerStep(StepConfig.of_run(self.cfg), run_id, self.learner, self.resume, phase=self.phase)
        host = ray.util.get_node_ip_address() if self.cfg.ray.address else "127.0.0.1"  # actors reach the node
        self.sender = WeightSender(host=host, port=0, backend=lcfg.weight_sync_backend,
                                   timeout_s=lcfg.weight_sync_timeout_s, bucket_mb=lcfg.weight_sync_bucket_mb,
                                   verify=lcfg.weight_sync_verify)
        self.generation = -1
        # the weight-sync fingerprint's probe (broker/fingerprint.py); None with learner.weight_sync_fingerprint=off
        tokens = fingerprint_tokens(self.cfg)
        self.probe = probe(self.learner.engine.module.config.vocab_size, tokens) if tokens else None
        self.updating = threading.Lock()  # a weight broadcast never reads weights the optimizer is changing
        self.fault = {n: faults.wrap(lambda: None, f"learner.{n}", rank, when=version)
                      for n in ("send_weights", "save_final", "committed")}
        self.phase("idle")

    # -- the learner group: rank 0's calls on every rank -------------------------------------------------------
    def watch(self) -> None:
        """Never returns: the driver's call on each rank fails as soon as its process dies (deploy/learner_group.py)."""
        threading.Event().wait()

    def set_peers(self, peers: list) -> None:
        """Rank 0: the Ray handles of ranks 1..N-1, in rank order."""
        self.peers = list(peers)

    def pid(self) -> int:
        return os.getpid()  # for tests that kill a rank

    def _on_all_ranks(self, method: str, *args):
        """`method(*args)` on every rank at once (deploy/rank_calls.py); raises LearnerRankError naming a failed
        rank."""
        return on_all_ranks(self.peers, method, args, getattr(self, method), self.cfg.learner.collective_timeout_s,
                            self.learner.version)

    def step(self, groups: list, staleness: list[int]) -> dict:
        """This rank's Learner.step (every rank gets all the groups)."""
        self.phase("recompute", starts_step=True)  # then the learner's own phases (learner.learner.PHASES)
        metrics = self.local.step(groups, staleness)
        if self.rank:  # (rank 0 goes on with the step protocol, learner/step.py)
            self.phase("idle")
        return metrics

    def checkpoint(self, state: dict) -> str:
        """This rank's part of the checkpoint of the current version (learner.step.OneRank.checkpoint)."""
        self.phase("checkpoint")
        path = self.local.checkpoint(state)
        if self.rank:
            self.phase("idle")
        return path

    def gather_weights(self, passes: int, keep: bool) -> dict[str, torch.Tensor]:
        """Learner.gather_buckets over the weight-sync buckets (a collective with rank 0's send or gather)."""
        return self.learner.gather_buckets(self.cfg.learner.weight_sync_bucket_mb, passes, keep)

    def gradients(self, groups: list) -> dict:
        """Full gradients of `groups` as one minibatch (Learner.gradients), CPU tensors; every rank."""
        return {n: g.cpu() for n, g in self.learner.gradients(groups).items()}

    def state_bytes(self) -> dict:
        """Learner.state_bytes of this rank (no collective: any rank may be asked directly)."""
        return self.learner.state_bytes()

    # -- rank 0: what the driver calls ---------------------------------------------------------------------------
    def version(self) -> int:
        return self.learner.version  # the weight version: 0 at start, the checkpoint's after a resume

    def sync_address(self) -> tuple[str, int]:
        return self.sender.host, self.sender.port  # of the weight-sync TCPStore the actors connect to

    def resume_state(self) -> dict:
        """What the checkpoint this learner resumed from says (learner.step.Resume.for_driver)."""
        return self.resume.for_driver()

    def train_step(self) -> StepReport:
        """One step of the step protocol (learner.step.LearnerStep.train_step) with every rank; raises
        LearnerRankError naming a rank that died or hung (nothing of the step is acknowledged then). A weight
        broadcast may run while it waits for groups (a new actor gets the weights at once), not while it trains."""
        report = self.protocol.train_step(AllRanks(self))
        self.fault["committed"]()  # a test's fault: the learner slow to answer for a step it has committed
        self.phase("idle")
        return report

    def checkpoint_now(self) -> int:
        """The checkpoint of the last committed step, written now unless it is already (the driver calls it on
        SIGTERM; LearnerStep.checkpoint_now); waits for a step in progress to commit. Returns its version."""
        while True:
            with self.updating:  # no step computes meanwhile
                version = self.protocol.checkpoint_now(AllRanks(self))
            if version is not None:
                return version
            time.sleep(0.05)  # the step's weights are ahead of its commit: a moment

    def close_record(self) -> list[StepReport]:
        """The driver's last call on a stop (in its own concurrency group, so a step and a weight broadcast in
        flight do not hold it up): no step saves or commits after it; returns the reports of the last committed
        steps, for the driver to log those it has not (LearnerStep.close)."""
        return self.protocol.close()

    def step_groups(self, groups: list, staleness: list[int]) -> dict:
        """One step of every rank on `groups` (no broker); raises LearnerRankError naming a failed rank."""
        with self.updating:
            return self._on_all_ranks("step", groups, staleness)

    def send_weights(self, generation: int, world_size: int) -> dict:
        """Learner.send_weights to ranks 1..world_size-1 (actors) of sync group `generation` (rebuilt when it changes);
        ZeRO-3 over several ranks: the peers enter the same per-bucket gathers. Never during the optimizer step.
        Returns the send's stats (WeightSender.send) and, with learner.weight_sync_fingerprint on and a version it
        fingerprints (learner.weight_sync_fingerprint_every), "fingerprint":
        (the version sent, the probe's log-probs at it: per sequence float32 [tokens - 1]), which the driver keeps
        to compare with the actors'."""
        with self.phase.during("weight sync"), self.updating:
            self.fault["send_weights"]()  # (a test's fault: a weight sync that stalls or dies)
            if generation != self.generation:
                self.sender.open_group(generation, world_size)
                self.generation = generation
            if not (self.peers and self.cfg.learner.zero_stage == 3):
                stats = self.learner.send_weights(self.sender)
            else:
                refs = [p.gather_weights.remote(2 if self.sender.verify else 1, False) for p in self.peers]
                stats = self.learner.send_weights(self.sender, peers_gather=True)  # its own errors as they are
                wait_ranks(f"send_weights at learner version {self.learner.version}", refs,
                           self.cfg.learner.collective_timeout_s)
            every = self.cfg.learner.weight_sync_fingerprint_every
            if self.probe is not None and fingerprinted(self.learner.version, every):  # the lock is still held
                stats["fingerprint"] = (self.learner.version, self._score_probe())
            return stats

    def _score_probe(self) -> list:
        """Learner.score of the probe (rank 0); ZeRO-3 over several ranks every rank runs the forward with it."""
        if self.peers and self.cfg.learner.zero_stage == 3:
            return self._on_all_ranks("score", self.probe)
        return self.learner.score(self.probe)

    def score(self, token_ids: list[list[int]]) -> list:
        """Learner.score on this rank (ZeRO-3: a collective with rank 0's call)."""
        return self.learner.score(token_ids)

    def save_final(self, path: str) -> str:
        """The trained weights as a Hugging Face directory (with the tokenizer), for `sparse-rl eval`; with
        learner.lora the adapter alone in peft's format (Learner.save_adapter: adapter_config.json naming the base,
        adapter_model.safetensors), with the tokenizer, and with learner.lora.save_merged `merged/` beside it (the
        base with the adapter merged: broker.lora.save_merged)."""
        self.fault["save_final"]()
        self.phase("saving the final weights")
        tokenizer = AutoTokenizer.from_pretrained(self.cfg.model)
        if self.learner.peft is not None:
            self.learner.save_adapter(path, self.full_weights())   # full_weights: the adapter's (its manifest)
            if self.cfg.learner.lora.save_merged:
                save_merged(path, os.path.join(path, "merged"))
                tokenizer.save_pretrained(os.path.join(path, "merged"))
        else:
            self.learner.engine.module.save_pretrained(path, state_dict=self.full_weights())
        tokenizer.save_pretrained(path)
        return path

    def parameter_counts(self) -> dict:
        """Learner.parameter_counts (trainable, total) and learner.lora's rank (0: full fine-tuning), for the
        console's start line."""
        return {**self.learner.parameter_counts(), "lora_rank": self.cfg.learner.lora.rank}

    def full_weights(self) -> dict:
        """Every parameter's full value (CPU, by name), gathered over the ranks: the weight sync's manifest (with
        learner.lora, the adapter's tensors only)."""
        with self.updating:
            return self._on_all_ranks("gather_weights", 1, True)

    def full_gradients(self, groups: list) -> dict:
        """Learner.gradients over every rank (tests of split invariance)."""
        with self.updating:
            return self._on_all_ranks("gradients", groups)

