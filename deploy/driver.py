"""The driver: the whole system on one screen (slime's train.py style).

    the run's record (new, resumed or forked: deploy/record.py) -> services (Ray, Redis, MLflow)
    -> learner + N rollout actors (Ray actors)
    for step: learner consumes groups and steps -> actors rescaled/replaced -> weights broadcast -> log
    (evaluation of the initial weights first, if eval.before) -> evaluation dense and sparse -> plot and artifacts -> everything shut down (also on Ctrl-C / error)
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import threading
import time
from contextlib import ExitStack
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from broker.redis_server import LocalRedis, RedisInUse  # noqa: E402
from broker.streams import PAUSED, connect, key, queue_depth, run_counts  # noqa: E402
from deploy.config import RunConfig, to_dict  # noqa: E402
from deploy.console import Console  # noqa: E402
from deploy.model_cache import resolve_model  # noqa: E402
from deploy.record import open_record  # noqa: E402
from deploy.scale import SCALE_KEY, write_run_info  # noqa: E402
from deploy.tracking import Tracker  # noqa: E402

WAIT_POLL_S = 2.0
"""While the learner waits for groups, the driver checks the actors (replacing the dead) this often, seconds."""
MAX_START_FAILURES = 3
"""Rollout actors in a row that die while starting (each after Ray's own restarts) before the run fails:
no actor can ever produce."""
MAX_LOCAL_ACTORS = 16
"""A local Ray is given enough logical CPUs for the learner and this many actors (to scale up at run time)."""


class RunFailed(RuntimeError):
    """The run cannot go on for a reason the driver diagnosed (e.g. no rollout actor can start); str() is the
    one line to print. The MLflow run is FAILED and everything is shut down."""


class Interrupted(Exception):
    """Ctrl-C stopped the run: the MLflow run is KILLED and everything is shut down; str() is the one line
    to print (step reached, last checkpoint, how to resume)."""


def train(cfg: RunConfig, command: tuple[str, ...] = ("sparse-rl", "train"), resume: str = "") -> dict:
    """Run one training job end to end; returns the last step's metrics and the evaluation scores.
    `command` is how the run was started (argv words), for the hint printed on Ctrl-C; `resume`: the directory
    of a run to continue as the same record (deploy/record.py; cfg is then that run's config, see resume_config).
    Raises Interrupted on Ctrl-C (SIGINT), after shutting everything down; ConfigError (nothing started) when the
    record cannot be opened."""
    progress = {"step": 0, "run_dir": None}
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupt)
    try:
        return _train(cfg, progress, resume)
    except KeyboardInterrupt:
        raise Interrupted(interrupted_line(cfg, progress, command)) from None
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)


def _interrupt(signum, frame):
    """The first Ctrl-C stops the run; further ones are ignored so that the shutdown is not cut short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def interrupted_line(cfg: RunConfig, progress: dict, command: tuple[str, ...]) -> str:
    """One line: how far the run got, its last checkpoint, and the command that resumes it."""
    ckpt_dir = Path(cfg.learner.checkpoint_dir)
    latest = ckpt_dir / "latest"
    head = f"interrupted at step {progress['step']} of {cfg.train.steps}"
    if progress["run_dir"] is None or not latest.is_file():
        return (f"{head}; last checkpoint: none (one every learner.checkpoint_interval="
                f"{cfg.learner.checkpoint_interval} versions); start again with: {shlex.join(command)}")
    return (f"{head}; last checkpoint: {ckpt_dir / latest.read_text().strip()}; "
            f"resume with: sparse-rl train --resume {progress['run_dir']}")


def _train(cfg: RunConfig, progress: dict, resume: str) -> dict:
    record = open_record(cfg, resume)  # new (directory created atomically), resumed, or forked from a checkpoint
    run_id, run_dir = record.run_id, record.run_dir
    progress["run_dir"] = run_dir
    cfg.model = resolve_model(cfg.model)  # build/convert preset model files once, before any worker starts
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # what --resume loads
    console = Console()
    with ExitStack() as stack:
        if not cfg.broker.url:  # embedded default: a private redis-server on 127.0.0.1, its data in the run directory
            try:  # (append-only file: a resume finds queue and counters)
                cfg.broker.url = stack.enter_context(LocalRedis(
                    password=os.environ.get(cfg.broker.password_env) or None, data_dir=run_dir / "redis",
                    appendonly=True, appendfsync="everysec")).url
            except RedisInUse as e:
                raise RunFailed(str(e)) from None
        start_ray(cfg)
        stack.callback(ray.shutdown)
        tracker = Tracker(cfg.mlflow.tracking_uri, cfg.mlflow.experiment, run_id, run_dir,
                          resume_run_id=record.mlflow_run_id, tags={f"parent_{k}": v for k, v in record.parent.items()})
        # KILLED on Ctrl-C, FAILED on an error; a no-op once the run ended FINISHED
        stack.push(lambda kind, *_: tracker.end("KILLED" if kind is KeyboardInterrupt else "FAILED"))
        # how `sparse-rl scale --run <id>` finds the broker, and `--resume` the MLflow run and checkpoints
        write_run_info(run_dir, run_id, cfg.broker, mlflow_uri=tracker.uri, mlflow_run_id=tracker.run_id,
                       checkpoint_dir=cfg.learner.checkpoint_dir)
        changed = tracker.log_params(to_dict(cfg))
        if record.resumed:
            tracker.record_resume(record.start_version, changed)
        tracker.log_artifact(run_dir / "config.yaml")
        console.start(run_id, run_dir, cfg.broker.url, tracker.where(), record)

        redis = connect(cfg.broker)
        redis.set(key(run_id, SCALE_KEY), cfg.actors.count)
        learner = start_learner(cfg, run_id)
        before = cfg.eval.enabled and cfg.eval.before and not record.resumed  # a resumed run evaluated at its start
        if before:
            redis.set(key(run_id, PAUSED), 1)  # actors start, load weights, and wait for the first evaluation
        else:
            redis.delete(key(run_id, PAUSED))  # (left set by a run interrupted while it evaluated)
        pool = ActorPool(cfg, run_id, learner)
        stack.callback(pool.shutdown)
        pool.scale(cfg.actors.count)
        pool.wait_ready(console)  # nothing to train or evaluate with before the first actors have started
        pool.sync_weights()  # initial weights to everyone: one code path for initial and later weights
        version = int(ray.get(learner.version.remote()))
        scores_before = tracker.first_values("eval/") if record.resumed else {}
        if before:
            scores_before = pool.evaluate()
            tracker.log_metrics(scores_before, version)  # eval/* at the initial version, again at the last
            redis.delete(key(run_id, PAUSED))

        def target() -> int:
            return int(redis.get(key(run_id, SCALE_KEY)) or cfg.actors.count)

        actor_idle = []  # actor_idle_fraction of every step, for the run's figure
        for step in range(version + 1, cfg.train.steps + 1):  # step = the weight version it makes
            # returns once groups_per_step groups are trained; meanwhile actors are replaced and joined
            metrics = pool.wait_for(learner.train_step.remote(), step, target, console,
                                    lambda: queue_depth(redis, cfg.broker, run_id))
            pool.scale(target())
            metrics.update(pool.sync_weights())
            metrics.update(pool.metrics())
            actor_idle.append(metrics.get("actor_idle_fraction", 0.0))
            version = int(metrics["version"])  # MLflow step = weight version: continues after a resume
            tracker.log_metrics(metrics, version)
            progress["step"] = step  # done and logged (before its console line, which a Ctrl-C may follow at once)
            console.step(step, cfg.train.steps, version, metrics)
        ray.get(learner.save_final.remote(str(run_dir / "final")))
        pool.stop_generation()  # the last batches are published; from here the counts are final
        accounting = {**run_counts(redis, run_id), "left_in_queue": queue_depth(redis, cfg.broker, run_id),
                      "learner_version": int(metrics["version"]), "actor_versions": pool.versions()}
        accounting.update(  # groups trained or filtered / groups produced; idle shares over the whole run
            rollout_utilization=(accounting["consumed"] + accounting["groups_filtered"])
            / max(1, accounting["produced"]),
            learner_idle_fraction=metrics.get("learner_idle_fraction_run", 0.0),
            actor_idle_fraction=sum(actor_idle) / max(1, len(actor_idle)))
        console.accounting(accounting)

        scores = pool.evaluate() if cfg.eval.enabled else {}
        tracker.log_metrics(scores, version)
        console.eval(scores, scores_before)
        tracker.log_artifact(tracker.plot(run_dir / "training.png"))
        summary = {"run_id": run_id, "run_dir": str(run_dir), "mlflow_uri": tracker.uri,
                   "mlflow_run_id": tracker.run_id, **metrics, **scores,
                   **{k.replace("eval/", "eval_before/", 1): v for k, v in scores_before.items()},
                   "accounting": accounting}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        tracker.end("FINISHED")
        console.finish(run_dir, tracker.where())
    return summary


def start_ray(cfg: RunConfig) -> None:
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, log_to_driver=True)
    else:
        # Logical CPUs only: local processes share the machine's cores (torch threads are set per process).
        need = cfg.train.learner_num_cpus + cfg.actors.num_cpus * max(cfg.actors.count, MAX_LOCAL_ACTORS)
        ray.init(num_cpus=cfg.ray.num_cpus or max(os.cpu_count() or 1, int(need + 0.999)),
                 include_dashboard=False, log_to_driver=True)


def start_learner(cfg: RunConfig, run_id: str):
    from deploy.learner_worker import LearnerWorker

    resources = {cfg.ray.learner_resource: 1} if cfg.ray.learner_resource else None
    return ray.remote(LearnerWorker).options(
        num_cpus=cfg.train.learner_num_cpus, num_gpus=cfg.train.learner_num_gpus, resources=resources,
        max_concurrency=2,
    ).remote(to_dict(cfg), run_id)


def root_cause(error: Exception) -> str:
    """The innermost exception line of a Ray error (for an actor that died in its constructor, the error its
    constructor raised, e.g. "OSError: ... model ..."), else its type and first line; ANSI colours removed."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    raised = [line.strip() for line in text.splitlines() if re.match(r"^\s*[\w.]+(Error|Exception|Exit|Interrupt)\b.*:", line)]
    return raised[-1] if raised else f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


class ActorPool:
    """The rollout actors of a run: start, scale, replace the dead, weight sync rounds, evaluation."""

    def __init__(self, cfg: RunConfig, run_id: str, learner):
        self.cfg, self.run_id, self.learner = cfg, run_id, learner
        self.actors: dict[int, object] = {}  # actor index -> handle
        self.next_index = 0
        self.generation = 0  # weight-sync group generation; bumped whenever membership changes
        self.members: list[tuple[int, str]] = []  # (actor index, incarnation) of the current sync group
        self.incarnations: dict[int, str] = {}
        self.starting: dict[int, tuple[float, object]] = {}  # actor index -> (start time, its first ping)
        self.start_failures = 0  # actors in a row that died before they were ready
        self.target = cfg.actors.count
        self.replaced = 0
        self.sync_address = ray.get(learner.sync_address.remote())  # (host, port) of the learner's TCPStore

    def _start(self):
        from actors.rollout_actor import RolloutWorker

        index, self.next_index = self.next_index, self.next_index + 1
        a = self.cfg.actors
        resources = {self.cfg.ray.actor_resource: 1} if self.cfg.ray.actor_resource else None
        handle = ray.remote(RolloutWorker).options(
            name=f"{self.run_id}-actor-{index}", num_cpus=a.num_cpus, num_gpus=a.num_gpus, resources=resources,
            max_restarts=a.max_restarts, max_task_retries=0, max_concurrency=4,
        ).remote(to_dict(self.cfg), self.run_id, f"actor-{index}")
        self.actors[index] = handle  # its generate -> score -> publish loop starts with the process
        self.starting[index] = (time.monotonic(), handle.ping.remote())  # answered once its model is loaded

    def ready(self) -> list[int]:
        """Indices of the actors that have started (the others are loading their model)."""
        return sorted(i for i in self.actors if i not in self.starting)

    def _check_starting(self) -> None:
        """Actors still starting are left alone until actors.start_timeout_s (not pinged with the weight sync
        timeout); one that died while starting, or did not start in time, is killed and forgotten, and
        scale() starts a replacement. Raises RuntimeError after MAX_START_FAILURES such deaths in a row."""
        for i, (since, first_ping) in list(self.starting.items()):
            reason = ""
            if ray.wait([first_ping], timeout=0)[0]:
                del self.starting[i]
                try:
                    self.incarnations[i] = ray.get(first_ping)["incarnation"]
                    self.start_failures = 0
                except ray.exceptions.RayActorError as e:
                    reason = f"died while starting ({root_cause(e)})"
            elif time.monotonic() - since > self.cfg.actors.start_timeout_s:
                del self.starting[i]
                reason = f"did not start within actors.start_timeout_s={self.cfg.actors.start_timeout_s:g} s"
            if reason:
                print(f"rollout actor {i} {reason}; replacing it")
                ray.kill(self.actors.pop(i), no_restart=True)
                self.replaced += 1
                self.start_failures += 1
                if self.start_failures >= MAX_START_FAILURES:
                    raise RunFailed(f"no rollout actor can start: {self.start_failures} in a row failed, "
                                       f"the last one {reason}")

    def wait_ready(self, console) -> None:
        """Wait until every actor started so far is ready (or replaced), saying what it waits for."""
        since = reported = time.monotonic()
        while self.starting:
            ray.wait([ref for _, ref in self.starting.values()], num_returns=len(self.starting), timeout=WAIT_POLL_S)
            self._check_starting()
            self.scale(self.target)
            if self.starting and time.monotonic() - reported >= self.cfg.train.wait_report_s:
                reported = time.monotonic()
                console.waiting(0, reported - since, f"{len(self.starting)} rollout actor(s) starting (loading the model)")

    def wait_for(self, done, step: int, target, console, depth) -> dict:
        """The learner's result `done` for `step`. While it waits for groups, dead actors are replaced (target():
        the actor count wanted), actors that became ready get the weights at once, and the console says why it
        waits every train.wait_report_s. Raises RunFailed when the learner gave up after train.group_wait_s."""
        waited = reported = time.monotonic()
        while not ray.wait([done], timeout=WAIT_POLL_S)[0]:
            self.scale(target())
            if self.membership_changed():  # an actor became ready: weights now (it cannot sample without)
                self.sync_weights()
            if time.monotonic() - reported >= self.cfg.train.wait_report_s:
                reported = time.monotonic()
                console.waiting(step, reported - waited, self.why_waiting(depth()))
        try:
            return ray.get(done)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, TimeoutError):  # waited train.group_wait_s for groups: say so in one line
                raise RunFailed(f"{e.cause} ({self.why_waiting(depth())})") from None
            raise

    def membership_changed(self) -> bool:
        """The ready actors differ from the current weight-sync group (one started, restarted or left)."""
        return [(i, self.incarnations.get(i)) for i in self.ready()] != self.members

    def why_waiting(self, depth: int) -> str:
        """Why the learner has no groups yet, in words for the console."""
        ready, starting = len(self.ready()), len(self.starting)
        loading = f", {starting} starting (loading the model)" if starting else ""
        if not ready:
            return f"no live rollout actor{loading}"
        if depth == 0:
            return f"queue empty: {ready} live rollout actor(s) still generating{loading}"
        return f"{depth} group(s) in the queue, {ready} live rollout actor(s){loading}"

    def alive(self) -> list[int]:
        """Indices of started actors that answer a ping with a running loop (one restarted by Ray answers once
        it is back, with a new incarnation); the others are killed and forgotten, and scale() starts
        replacements. Actors still starting are checked by _check_starting, not pinged."""
        self._check_starting()
        pings = {i: self.actors[i].ping.remote() for i in self.ready()}
        ok = []
        for i, ref in pings.items():
            try:
                state = ray.get(ref, timeout=self.cfg.learner.weight_sync_timeout_s)
                if not state["loop_alive"]:
                    raise RuntimeError(state["error"] or "generation loop stopped")
                if self.incarnations.get(i, state["incarnation"]) != state["incarnation"]:
                    print(f"rollout actor {i} was restarted by Ray (new process); it rejoins at this weight sync")
                self.incarnations[i] = state["incarnation"]
                ok.append(i)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, RuntimeError) as e:
                print(f"rollout actor {i} is gone ({type(e).__name__}: {e}); replacing it")
                ray.kill(self.actors.pop(i), no_restart=True)
                self.replaced += 1
        return ok

    def scale(self, target: int) -> None:
        """Start or stop actors to reach `target` (started and starting ones count); never waits for a start."""
        self.target = target
        live = sorted(self.alive() + list(self.starting))
        while len(live) > target:  # remove the newest: finish the current batch, then stop
            index = live.pop()
            handle = self.actors.pop(index)
            if self.starting.pop(index, None):  # has produced nothing yet
                ray.kill(handle, no_restart=True)
                continue
            try:
                ray.get(handle.stop.remote(), timeout=self.cfg.learner.weight_sync_timeout_s * 5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # it exited (stop() ends the process) or hangs: make sure it is gone
            ray.kill(handle, no_restart=True)
        for _ in range(target - len(live)):
            self._start()

    def sync_weights(self) -> dict:
        """One sync round: the learner broadcasts its weights to every live actor over the sync group, rebuilt
        (new generation) when membership changed. An actor that fails the round is dropped and replaced at
        the next scale(); the learner never waits longer than the collective timeout."""
        self.alive()
        members = self.ready()  # actors still starting join the round after they are ready
        if self.membership_changed():
            self.generation += 1
            self.members = [(i, self.incarnations.get(i)) for i in members]
        world = len(members) + 1
        sends = self.learner.send_weights.remote(self.generation, world)
        recvs = {i: self.actors[i].receive_weights.remote(self.sync_address, self.generation, rank, world)
                 for rank, i in enumerate(members, start=1)}
        failed = 0
        try:
            stats = ray.get(sends)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ValueError):  # manifest mismatch: learner and actor models differ
                raise e.cause
            stats = {"weight_sync_error": 1.0}  # a peer died mid-round: the collective timed out
            print(f"weight sync failed, membership will be rebuilt: {e}")
        for i, ref in recvs.items():
            try:
                ray.get(ref, timeout=self.cfg.learner.weight_sync_timeout_s)
            except Exception:
                failed += 1
                self.members = []  # force a new generation next round
        return {**stats, "weight_sync_failed_actors": float(failed), "actors_live": float(len(members)),
                "actors_replaced": float(self.replaced)}

    def metrics(self) -> dict:
        """Mean of the live actors' rollout metrics (tokens/s, KV bytes, queue waits) since the last call."""
        results = []
        for h in (self.actors[i] for i in self.ready()):
            try:
                results.append(ray.get(h.metrics.remote(), timeout=30))
            except Exception:
                pass
        keys = {k for r in results for k in r}
        return {k: sum(r.get(k, 0.0) for r in results) / len(results) for k in keys} if results else {}

    def stop_generation(self) -> None:
        """Every actor finishes and publishes its current batch, then stops generating; actors still starting
        (which have produced nothing) are stopped."""
        for index in list(self.starting):
            del self.starting[index]
            ray.kill(self.actors.pop(index), no_restart=True)
        ray.get([h.stop_generation.remote() for h in self.actors.values()])

    def versions(self) -> dict[str, int]:
        """Weight version each live actor samples with (after its staged weights are swapped in)."""
        return {f"actor-{i}": ray.get(self.actors[i].ping.remote())["weight_version"] for i in self.ready()}

    def evaluate(self) -> dict:
        """Evaluation split over the live actors (generation stopped): each mode's items are sharded."""
        handles = [self.actors[i] for i in self.ready()]
        from actors.data import load_eval_items

        items = load_eval_items(self.cfg.eval.data, self.cfg.eval.limit, train=self.cfg.actors.data, seed=self.cfg.seed)
        scores = {}
        for mode in self.cfg.eval.modes:
            shards = [items[i::len(handles)] for i in range(len(handles))]
            parts = ray.get([h.evaluate.remote(shard, mode) for h, shard in zip(handles, shards) if shard])
            n = sum(p["n"] for p in parts)
            for name in ("reward", "accuracy", "unparseable", "response_length", "kv_peak_bytes"):
                scores[f"eval/{mode}/{name}"] = sum(p[name] * p["n"] for p in parts) / max(n, 1)
            scores[f"eval/{mode}/n"] = float(n)
        return scores

    def shutdown(self) -> None:
        for h in self.actors.values():
            try:
                ray.kill(h, no_restart=True)
            except Exception:
                pass
        self.actors.clear()
