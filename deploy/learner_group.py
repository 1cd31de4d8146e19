"""Placement of the learner: `learner.ranks` Ray actors (deploy.learner_worker.LearnerWorker) in one placement
group, wired into one torch.distributed group (NCCL on GPUs, gloo on CPUs) whose rendezvous is rank 0's store.

    group = LearnerGroup(cfg, run_id)      # the ranks start together and load their shards
    learner = group.rank0                  # the driver talks to rank 0 only; rank 0 calls the others
    ...
    group.shutdown()

Bundles: one per rank, {"CPU": train.learner_num_cpus, "GPU": train.learner_num_gpus} (+ the custom
`ray.learner_resource`), strategy `learner.placement` (PACK by default: as few nodes as possible; SPREAD or
STRICT_SPREAD to put ranks on different nodes). The rendezvous address is 127.0.0.1 on a local Ray, rank 0's
node address on a cluster; its port is picked on rank 0's node.
"""
from __future__ import annotations

import socket
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from broker.redis_server import free_port
from deploy.actor_pool import PROCESS_LOST, RunFailed, root_cause
from deploy.config import RunConfig, to_dict
from deploy.learner_worker import LearnerWorker

PLACEMENT_TIMEOUT_S = 600.0
"""How long to wait for the cluster to offer the learner's bundles before failing, seconds."""


@ray.remote(num_cpus=0)
def _rendezvous_address(loopback: bool) -> tuple[str, int]:
    """On rank 0's node: (its address, or 127.0.0.1 on a local Ray; a port free there now)."""
    host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
    if loopback:
        return host, free_port()
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


class LearnerGroup:
    """The learner ranks of a run. `rank0`: the handle the driver uses (train_step, send_weights, version,
    sync_address, save_final, ...); `ranks`: every rank's handle, in rank order.

    `hint`: () -> how to go on (the driver's resume or start-again command), appended to a death's line.
    Every rank holds a `watch` call that returns only when the rank dies: `check(phase)` and `get(ref, phase)`
    turn a dead rank into RunFailed at once, wherever the driver waits.

    Raises TimeoutError when the cluster cannot offer the bundles within PLACEMENT_TIMEOUT_S (naming them);
    RunFailed when a rank dies while starting (its constructor's error). `wait=False`: return as soon as the ranks
    are created, their constructors running (the driver starts the rollout actors meanwhile), and call
    `wait_started()` before the first call that needs them started."""

    def __init__(self, cfg: RunConfig, run_id: str, hint=None, wait: bool = True):
        n = cfg.learner.ranks
        bundle = {"CPU": cfg.train.learner_num_cpus}
        if cfg.train.learner_num_gpus:
            bundle["GPU"] = cfg.train.learner_num_gpus
        if cfg.ray.learner_resource:
            bundle[cfg.ray.learner_resource] = 1
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy=cfg.learner.placement,
                                  name=f"{run_id}-learner")
        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(self.pg)
            raise TimeoutError(f"the cluster did not offer {n} learner bundle(s) of {bundle} "
                               f"(learner.ranks={n}, learner.placement={cfg.learner.placement}) within "
                               f"{PLACEMENT_TIMEOUT_S:.0f} s")

        def on(rank: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=rank)

        master = None
        if n > 1:
            master = ray.get(_rendezvous_address.options(scheduling_strategy=on(0)).remote(not cfg.ray.address))
        plain = to_dict(cfg)
        self.ranks = [
            ray.remote(concurrency_groups={"watch": 1, "record": 1})(LearnerWorker).options(
                name=f"{run_id}-learner-{rank}", num_cpus=cfg.train.learner_num_cpus,
                num_gpus=cfg.train.learner_num_gpus,
                resources={cfg.ray.learner_resource: 1} if cfg.ray.learner_resource else None,
                scheduling_strategy=on(rank), max_concurrency=2 if rank == 0 else 1, max_restarts=0,
            ).remote(plain, run_id, rank, n, master)
            for rank in range(n)]
        self.rank0 = self.ranks[0]
        self.watch = {r.watch.options(concurrency_group="watch").remote(): rank for rank, r in enumerate(self.ranks)}
        self.hint = hint  # () -> how to go on, appappended to a death's line
        self.on_wait = None  # (what, seconds) at every poll of get(): the driver's console (ActorPool.learner_waiting)
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Return once every rank has started (its constructor ran: model loaded, group joined) and rank 0 holds
        its peers. Raises RunFailed ("... died while starting") at once when a rank fails to start, after
        shutting the group down."""
        started = [r.pid.remote() for r in self.ranks]  # answered once a rank has started (joined the group)
        try:
            for ref in started:  # get() fails at once when any rank dies meanwhile, and says that it waits
                self.get(ref, "starting")
            self.get(self.rank0.set_peers.remote(self.ranks[1:]), "starting")
        except BaseException:
            self.shutdown()
            raise

    def check(self, phase: str) -> None:
        """Raise RunFailed ("learner rank R died while <phase>: <cause>") if a rank has died."""
        dead = self.dead_rank()
        if dead:
            rank, cause = dead
            self.died(rank, phase, cause)

    def dead_rank(self) -> tuple[int, str] | None:
        """(rank, cause) of a rank that has died, or None while every rank lives."""
        done, _ = ray.wait(list(self.watch), num_returns=1, timeout=0)
        if not done:
            return None
        try:
            ray.get(done[0])
            return self.watch[done[0]], "its watch returned"
        except ray.exceptions.RayError as e:
            return self.watch[done[0]], root_cause(e)

    def died(self, rank: int, phase: str, cause: str):
        """Raise RunFailed: the one line of a rank's death, with how to go on."""
        raise RunFailed(f"learner rank {rank} died while {phase}: {cause}" + (f"; {self.hint()}" if self.hint else ""))

    def get(self, ref, phase: str, poll_s: float = 1.0):
        """ray.get(ref) of a learner call, failing with RunFailed (naming the rank and `phase`) as soon as any
        rank dies meanwhile, instead of waiting on a call a dead peer can never finish."""
        since = time.monotonic()
        while not ray.wait([ref], timeout=poll_s)[0]:
            self.check(phase)
            if self.on_wait is not None:
                self.on_wait(phase, time.monotonic() - since)
        try:
            return ray.get(ref)
        except PROCESS_LOST as e:
            time.sleep(poll_s)  # Ray reports the death to the watch calls a moment later
            self.check(phase)
            self.died(0, phase, root_cause(e))

    def shutdown(self) -> None:
        """Kill every rank and free the placement group."""
        for handle in self.ranks:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass
