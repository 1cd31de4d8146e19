"""The rollout actors of a run, as the driver sees them: start, scale, tell starting from dead, replace the
dead, weight-sync rounds, evaluation (deploy/driver.py uses one ActorPool per run)."""
from __future__ import annotations

import re
import time

import ray

from broker import run_state as rs
from broker.fingerprint import max_abs, tolerance
from broker.streams import connect, oldest_unread_s
from deploy.config import RunConfig, rollout_config, to_dict
from deploy.rank_calls import RANK_FAILURE_WAIT_S, LearnerRankError

WAIT_POLL_S = 2.0
"""While the learner waits for groups, the driver checks the actors (replacing the dead) this often, seconds."""
MAX_START_FAILURES = 3
"""Rollout actors in a row that die while starting (each after Ray's own restarts) before the run fails:
no actor can ever produce."""
FINGERPRINT_VERSIONS = 64
"""The learner's fingerprints the pool keeps (the latest versions): an actor's is compared at the first sync round
after it swapped that version in, within max_staleness of the learner's."""
BATCH_TIMEOUT_SYNCS = 5
"""An actor told to stop (scale-down, end of training) may take this many weight-sync timeouts to finish its
batch before it is killed."""
CLOSE_TIMEOUT_S = 10.0
"""At the run's end the actors end the processes they started (RolloutWorker.close) within this many seconds,
all together, before Ray kills them."""


PROCESS_LOST = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.OutOfMemoryError,
                ray.exceptions.NodeDiedError)
"""Ray's errors for a call whose actor process is gone: it died, Ray's OOM monitor killed it, its node was lost."""


class RunFailed(RuntimeError):
    """The run cannot go on for a reason the driver diagnosed (e.g. no rollout actor can start); str() is the
    one line to print. The MLflow run is FAILED and everything is shut down."""


def root_cause(error: Exception) -> str:
    """The innermost exception line of a Ray error (for an actor that died in its constructor, the error its
    constructor raised, e.g. "OSError: ... model ..."), else its type and first line; ANSI colours removed."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    raised = [line.strip() for line in text.splitlines()
              if re.match(r"^\s*[\w.]+(Error|Exception|Exit|Interrupt)\b.*:", line)]
    return raised[-1] if raised else f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


class ActorPool:
    """The rollout actors of a run: start, scale, replace the dead, weight sync rounds, evaluation."""

    def __init__(self, cfg: RunConfig, run_id: str, learner, learners=None):
        """`learner`: rank 0's handle; `learners`: the LearnerGroup, watched wherever the pool waits (a rank
        that dies fails the run at once, naming it and what the pool waited for)."""
        self.cfg, self.run_id, self.learner, self.learners = cfg, run_id, learner, learners
        self.actors: dict[int, object] = {}  # actor index -> handle
        self.next_index = 0
        self.generation = 0  # weight-sync group generation; bumped whenever membership changes
        self.members: list[tuple[int, str]] = []  # (actor index, incarnation) of the current sync group
        self.incarnations: dict[int, str] = {}
        self.starting: dict[int, tuple[float, object]] = {}  # actor index -> (start time, its first ping)
        self.start_failures = 0  # actors in a row that died before they were ready
        self.target = cfg.actors.count
        self.replaced = 0
        self.redis = connect(cfg.broker)
        self.counted = rs.actor_counts(self.redis, run_id)  # the run's actor counters at the last metrics()
        self.reported = time.monotonic()  # the last wait line (the learner's step, or a call on the learner)
        self.late_said = False  # a "learner step ... slow" line was printed in the current step
        if learners is not None:
            learners.on_wait = self.learner_waiting
        self.sync_address = None  # (host, port) of the learner's TCPStore: asked at the first sync (the
        # learner may still be starting while the actors start)
        self.expected: dict[int, list] = {}  # weight version -> the learner's fingerprint (broker/fingerprint.py)

    def _start(self):
        from actors.rollout_actor import RolloutWorker

        index, self.next_index = self.next_index, self.next_index + 1
        a = self.cfg.actors
        resources = {self.cfg.ray.actor_resource: 1} if self.cfg.ray.actor_resource else None
        handle = ray.remote(RolloutWorker).options(
            name=f"{self.run_id}-actor-{index}", num_cpus=a.num_cpus, num_gpus=a.num_gpus, resources=resources,
            max_restarts=a.max_restarts, max_task_retries=0, max_concurrency=4,
        ).remote(to_dict(rollout_config(self.cfg)), self.run_id, f"actor-{index}")
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
                self._drop(i, reason, "replacing it")
                self.replaced += 1
                self.start_failures += 1
                if self.start_failures >= MAX_START_FAILURES:
                    raise RunFailed(f"no rollout actor can start: {self.start_failures} in a row failed, "
                                       f"the last one {reason}")

    def _drop(self, i: int, why: str, then: str) -> None:
        """Kill actor `i` (no Ray restart) and forget it, saying so in one console line:
        "rollout actor <i> <why>; <then>"."""
        print(f"rollout actor {i} {why}; {then}", flush=True)
        ray.kill(self.actors.pop(i), no_restart=True)

    def _batch_timeout_s(self) -> float:
        """How long an actor told to stop may take to finish and publish its current batch, seconds:
        BATCH_TIMEOUT_SYNCS x learner.weight_sync_timeout_s."""
        return BATCH_TIMEOUT_SYNCS * self.cfg.learner.weight_sync_timeout_s

    def wait_ready(self, console) -> None:
        """Wait until every actor started so far is ready (or replaced), saying what it waits for."""
        since = reported = time.monotonic()
        while self.starting:
            ray.wait([ref for _, ref in self.starting.values()], num_returns=len(self.starting), timeout=WAIT_POLL_S)
            self.check_learner("the actors were loading")
            self._check_starting()
            self.scale(self.target)
            if self.starting and time.monotonic() - reported >= self.cfg.train.wait_report_s:
                reported = time.monotonic()
                console.waiting(0, reported - since,
                                f"{len(self.starting)} rollout actor(s) starting (loading the model)")

    def wait_for(self, done, step: int, target, console, depth, hint) -> dict:
        """The learner's result `done` for `step`. While it waits for groups, dead actors are replaced (target():
        the actor count wanted), actors that became ready get the weights at once, and the console says why it
        waits every train.wait_report_s. Raises RunFailed when the learner gave up after train.group_wait_s, or
        when a learner rank died, hung or raised (naming the rank; nothing of the step was acknowledged; the
        message ends with hint(): how to go on, the resume command or, without a checkpoint, the start again)."""
        waited = self.reported = time.monotonic()
        self.late_said = False
        while not ray.wait([done], timeout=WAIT_POLL_S)[0]:
            dead = self.learners.dead_rank() if self.learners is not None else None
            if dead:  # rank 0's own error names the step and every dead rank: wait for it as rank 0 waits for Ray
                if ray.wait([done], timeout=RANK_FAILURE_WAIT_S + WAIT_POLL_S)[0]:
                    break
                raise RunFailed(f"learner step {step} failed: learner rank {dead[0]} died ({dead[1]}); nothing of "
                                f"this step was acknowledged; {hint()}")
            self.scale(target())
            if self.membership_changed():  # an actor became ready: weights now (it cannot sample without)
                self.sync_weights()
            self._report(step, waited, console, depth)
        try:
            return ray.get(done)
        except PROCESS_LOST as e:
            raise RunFailed(f"learner step {step} failed: learner rank 0 died "
                            f"({str(e).strip().splitlines()[0][:200]}); "
                            f"nothing of this step was acknowledged; {hint()}") from None
        except LearnerRankError as e:  # Ray's error is also a LearnerRankError; its cause holds the message
            raise RunFailed(f"learner step {step} failed: {getattr(e, 'cause', None) or e}; nothing of this step "
                            f"was acknowledged; {hint()}") from None
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, TimeoutError):  # waited train.group_wait_s for groups: say so in one line
                why = self.why_waiting(depth(), self.board())
                raise RunFailed(f"{e.cause}" + (f" ({why})" if why else "")) from None
            raise RunFailed(f"learner step {step} failed: learner rank 0 raised {root_cause(e)}; nothing of this "
                            f"step was acknowledged; {hint()}") from None  # (one rank: no LearnerRankError)

    def check_learner(self, phase: str) -> None:
        """Raise RunFailed when a learner rank has died (LearnerGroup.check)."""
        if self.learners is not None:
            self.learners.check(phase)

    def membership_changed(self) -> bool:
        """The ready actors differ from the current weight-sync group (one started, restarted or left)."""
        return [(i, self.incarnations.get(i)) for i in self.ready()] != self.members

    def _report(self, step: int, waited: float, console, depth) -> None:
        """The console while the driver waits for `step` (asked for at `waited`, monotonic), at most one line every
        train.wait_report_s: "learner step <step> slow: ..." as soon as the learner is late (learner_late), else,
        once it has waited train.wait_report_s for the groups, why (why_waiting). Nothing while all is on time."""
        board, limit = self.board(), self.cfg.train.wait_report_s
        late = self.learner_late(step, board, time.monotonic() - waited)
        due = time.monotonic() - self.reported >= limit
        if late and (due or not self.late_said):
            self.reported, self.late_said = time.monotonic(), True
            print(late, flush=True)
        elif due and not late:
            self.reported = time.monotonic()
            why = self.why_waiting(depth(), board)
            if why:  # (nothing to say while the learner computes its step in time)
                console.waiting(step, self.reported - waited, why)

    def board(self) -> dict[str, rs.Phase]:
        """What each part of the run is doing now (run_state.read_phases); {} when Redis does not answer (the
        lines then say less, nothing fails)."""
        try:
            return rs.read_phases(self.redis, self.run_id)
        except Exception:
            return {}

    def why_waiting(self, depth: int, board: dict[str, rs.Phase] | None = None) -> str:
        """Why the learner has no groups yet, in words for the console: what each live actor is doing and since
        when ("queue empty: actor-0 scoring for 95 s, actor-1 generating for 12 s"); "" when the learner is not
        waiting for groups (its phase is not "reading groups"; without its phase: groups are queued)."""
        board = board or {}
        ready, starting = self.ready(), len(self.starting)
        loading = f", {starting} starting (loading the model)" if starting else ""
        if not ready:
            return f"no live rollout actor{loading}"
        lead = board.get("learner-0")
        if lead is not None and lead.phase != "reading groups":
            return ""  # the learner computes its step (learner_late says when it is slow)
        actors = ", ".join(f"actor-{i} {board[f'actor-{i}'].phase} for {board[f'actor-{i}'].for_s:.0f} s"
                           if f"actor-{i}" in board else f"actor-{i} (phase not known)" for i in ready)
        if depth == 0:
            return f"queue empty: {actors}{loading}"
        if lead is not None:  # it holds groups of the step (read, not yet trained) and waits for more
            return f"queue holds {depth} group(s), the step needs more: {actors}{loading}"
        return ""

    def learner_late(self, step: int, board: dict[str, rs.Phase], asked_s: float) -> str:
        """"learner step <step> slow: learner-0 backward for 33 s, learner-1 ... (<how late>)" when rank 0's step
        has been at work train.wait_report_s since it had its groups, or has left a group in the queue unread that
        long (it is not reading), or has not started that long after the driver asked for it (`asked_s` ago);
        "" while it is on time or waits for groups (or its phase is not known)."""
        lead, limit = board.get("learner-0"), self.cfg.train.wait_report_s
        if lead is None:
            return ""
        if lead.phase == "reading groups":
            unread = self.unread_s()
            took = min(unread, lead.for_s) if unread is not None else 0.0
            detail = f"the oldest group in the queue unread for {took:.0f} s"
        elif lead.phase in rs.STEP_PHASES and lead.step_s is not None:
            took, detail = lead.step_s, f"{lead.step_s:.0f} s since it had its groups"
        else:  # idle (the step has not started), a weight sync, ...
            took = min(lead.for_s, asked_s)
            detail = f"{took:.0f} s since the driver asked for the step"
        if took < limit:
            return ""
        return f"learner step {step} slow: {self.learner_phases(board)} ({detail})"

    def learner_phases(self, board: dict[str, rs.Phase]) -> str:
        """Each learner rank's phase: "learner-0 backward for 33 s, learner-1 backward for 33 s"."""
        parts = [f"learner-{r}" for r in range(self.cfg.learner.ranks)]
        return ", ".join(f"{p} {board[p].phase} for {board[p].for_s:.0f} s" if p in board else f"{p} (phase not known)"
                         for p in parts)

    def learner_waiting(self, what: str, seconds: float) -> None:
        """Called by LearnerGroup.get at every poll of a call on the learner (`what`: "it sent the weights", ...)
        that has run `seconds`: once it has run train.wait_report_s, a line every train.wait_report_s naming each
        rank's phase ("waiting for the learner for 31 s (it sent the weights): learner-0 weight sync for 31 s")."""
        limit = self.cfg.train.wait_report_s
        if seconds >= limit and time.monotonic() - self.reported >= limit:
            self.reported = time.monotonic()
            print(f"waiting for the learner for {seconds:.0f} s ({what}): {self.learner_phases(self.board())}",
                  flush=True)

    def unread_s(self) -> float | None:
        """How long the oldest group the learner has not read has been queued (streams.oldest_unread_s), seconds;
        None when none is unread or Redis does not answer."""
        try:
            return oldest_unread_s(self.redis, self.cfg.broker, self.run_id)
        except Exception:
            return None

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
                self._drop(i, f"is gone ({root_cause(e)})", "replacing it")
                self.replaced += 1
        return ok

    def scale(self, target: int) -> None:
        """Start or stop actors to reach `target` (started and starting ones count); never waits for a start."""
        if target != self.target:
            print(f"rollout actors {self.target} -> {target} (sparse-rl scale)", flush=True)
        self.target = target
        live = sorted(self.alive() + list(self.starting))
        while len(live) > target:  # remove the newest: finish the current batch, then stop
            index = live.pop()
            handle = self.actors.pop(index)
            if self.starting.pop(index, None):  # has produced nothing yet
                ray.kill(handle, no_restart=True)
                continue
            try:
                ray.get(handle.stop.remote(), timeout=self._batch_timeout_s())
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # it exited (stop() ends the process) or hangs: make sure it is gone
            ray.kill(handle, no_restart=True)
        for _ in range(target - len(live)):
            self._start()

    def _learner_get(self, ref, phase: str):
        """ray.get of a call on the learner, through the learner group when the pool has one (a dead rank fails
        it at once, naming `phase`)."""
        return self.learners.get(ref, phase) if self.learners else ray.get(ref)

    def sync_weights(self) -> dict:
        """One sync round: the learner broadcasts its weights to every live actor over the sync group, rebuilt
        (new generation) when membership changed. An actor that fails the round is dropped and replaced at
        the next scale(); the learner never waits longer than the collective timeout. Then the weight-sync
        fingerprints (check_fingerprints: raises RunFailed under learner.weight_sync_fingerprint=error). Returns the
        round's metrics (the learner's send stats, weight_sync_failed_actors, actors_live, actors_replaced and, where
        an actor's fingerprint was compared, weight_sync_fingerprint_max_abs)."""
        self.alive()
        members = self.ready()  # actors still starting join the round after they are ready
        if self.membership_changed():
            self.generation += 1
            self.members = [(i, self.incarnations.get(i)) for i in members]
        world = len(members) + 1
        if self.sync_address is None:
            address = self.learner.sync_address.remote()
            self.sync_address = self._learner_get(address, "it sent the weights")
        sends = self.learner.send_weights.remote(self.generation, world)
        recvs = {i: self.actors[i].receive_weights.remote(self.sync_address, self.generation, rank, world)
                 for rank, i in enumerate(members, start=1)}
        failed = 0
        try:
            stats = self._learner_get(sends, "it sent the weights")
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ValueError):  # manifest mismatch: learner and actor models differ
                raise e.cause from e
            stats = {"weight_sync_error": 1.0}  # a peer died mid-round: the collective timed out
            print(f"weight sync failed, membership will be rebuilt: {e}")
        if "fingerprint" in stats:  # the learner's probe log-probs at the version it sent
            version, logps = stats.pop("fingerprint")
            self.expected[version] = logps
            self.expected = {v: e for v, e in self.expected.items() if v > version - FINGERPRINT_VERSIONS}
        for _i, ref in recvs.items():
            try:
                ray.get(ref, timeout=self.cfg.learner.weight_sync_timeout_s)
            except Exception:
                failed += 1
                self.members = []  # force a new generation next round
        return {**stats, "weight_sync_failed_actors": float(failed), "actors_live": float(len(members)),
                "actors_replaced": float(self.replaced), **self.check_fingerprints()}

    def check_fingerprints(self) -> dict:
        """Compare the weight-sync fingerprints each ready actor took since the last call (its engine's log-probs of
        the probe right after each swap) with the learner's of the same version (broker/fingerprint.py), under the
        tolerance of the sync dtype (learner.dtype). Returns {"weight_sync_fingerprint_max_abs": the largest
        difference, nats}, or {} when nothing was compared (off, or no actor swapped a version the pool knows: with
        learner.weight_sync_fingerprint_every = k, only multiples of k are scored).
        Raises RunFailed with one line naming the first actor and version over the tolerance under
        learner.weight_sync_fingerprint=error; prints that line for each under warn."""
        mode, dtype = self.cfg.learner.weight_sync_fingerprint, self.cfg.learner.dtype
        if mode == "off":
            return {}
        refs = {i: self.actors[i].fingerprints.remote() for i in self.ready()}
        worst, lines = None, []
        for i, ref in refs.items():
            try:
                scored = ray.get(ref, timeout=self.cfg.learner.weight_sync_timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue  # a lost actor: alive() replaces it at the next round
            for version, logps in scored:
                if version not in self.expected:
                    continue  # (a version sent before this pool's first sync round)
                diff = max_abs(self.expected[version], logps)
                worst = diff if worst is None else max(worst, diff)
                if diff > tolerance(dtype):
                    lines.append(f"weight sync fingerprint: actor-{i} at weight version {version}: its engine's "
                                 f"log-probs of the probe differ from the learner's by {diff:.3g} nats (tolerance "
                                 f"{tolerance(dtype):g} at {dtype}): the engine does not hold the weights it reports")
        if lines and mode == "error":
            raise RunFailed(f"{lines[0]} (learner.weight_sync_fingerprint=warn goes on past it)")
        for line in lines:
            print(line, flush=True)
        return {} if worst is None else {"weight_sync_fingerprint_max_abs": worst}

    def metrics(self) -> dict:
        """The rollout metrics since the last call: the counts (rollout_groups, reward_errors, claims_lost,
        tier/<tier>/groups) from the run's actor_counts in Redis, so summed over every actor and every process
        of it, a killed one's included; of the live actors' own metrics, the KV peak per sequence the largest
        (bytes), the others (tokens/s, fractions, waits in seconds) the mean over the actors."""
        counts = rs.actor_counts(self.redis, self.run_id)
        out = {k: float(n - self.counted.get(k, 0)) for k, n in counts.items()}
        self.counted = counts
        results = []
        for h in (self.actors[i] for i in self.ready()):
            try:
                results.append(ray.get(h.metrics.remote(), timeout=30))
            except Exception:
                pass
        for k in {k for r in results for k in r}:
            values = [r[k] for r in results if k in r]
            out[k] = max(values) if k == "kv_peak_bytes_per_seq" else sum(values) / len(values)
        return out

    def stop_generation(self) -> None:
        """Every actor finishes and publishes its current batch, then stops generating; actors still starting
        (which have produced nothing) are stopped. An actor lost meanwhile (killed, or being restarted by Ray)
        is ended and forgotten, as alive() does: its unpublished batch is left to its claim's expiry."""
        for index in list(self.starting):
            del self.starting[index]
            ray.kill(self.actors.pop(index), no_restart=True)
        calls = {i: h.stop_generation.remote() for i, h in self.actors.items()}
        for i, ref in calls.items():
            try:
                ray.get(ref, timeout=self._batch_timeout_s())
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                self._drop(i, f"is gone ({root_cause(e)})", "its last batch is not counted")

    def versions(self) -> dict[str, int]:
        """Weight version each live actor samples with (after its staged weights are swapped in)."""
        return {f"actor-{i}": ray.get(self.actors[i].ping.remote())["weight_version"] for i in self.ready()}

    def evaluate(self) -> dict:
        """Evaluation split over the live actors (generation stopped): each mode's items are sharded."""
        handles = [self.actors[i] for i in self.ready()]
        from actors.tasks.data import load_eval_items

        items = load_eval_items(self.cfg.eval.data, self.cfg.eval.limit, train=self.cfg.actors.data, seed=self.cfg.seed,
                                draw=self.cfg.eval.draw)
        scores = {}
        for mode in self.cfg.eval.modes:
            shards = [items[i::len(handles)] for i in range(len(handles))]
            parts = ray.get([h.evaluate.remote(shard, mode) for h, shard in zip(handles, shards) if shard])
            n = sum(p["n"] for p in parts)
            for name in ("reward", "accuracy", "unparseable", "response_length", "kv_peak_bytes", "turns",
                         "tool_calls"):
                if all(name in p for p in parts):   # turns, tool_calls: multi-turn episodes only
                    scores[f"eval/{mode}/{name}"] = sum(p[name] * p["n"] for p in parts) / max(n, 1)
            scores[f"eval/{mode}/reward_errors"] = sum(p["reward_errors"] for p in parts)
            if any("env_errors" in p for p in parts):   # multi-turn: episodes the environment failed
                scores[f"eval/{mode}/env_errors"] = sum(p.get("env_errors", 0.0) for p in parts)
            scores[f"eval/{mode}/n"] = float(n)
        return scores

    def shutdown(self) -> None:
        """End every actor: each first ends the processes it started, in order (RolloutWorker.close: SGLang's
        subprocesses included; CLOSE_TIMEOUT_S for all of them together), then Ray kills it."""
        closing = [h.close.remote() for h in self.actors.values()]
        try:
            ray.wait(closing, num_returns=len(closing), timeout=CLOSE_TIMEOUT_S)
        except Exception:
            pass  # an actor already gone: Ray's kill below is all it needs
        for h in self.actors.values():
            try:
                ray.kill(h, no_restart=True)
            except Exception:
                pass
        self.actors.clear()
