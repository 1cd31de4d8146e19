"""Fault injection for tests: the one seam through which a test makes a part of a run slow, fail or die.

A test names faults in the environment variable SPARSE_RL_FAULTS (the driver's environment, which every Ray
worker inherits; or Ray's `runtime_env={"env_vars": {...}}`), a comma-separated list of

    <point>:<who>[@<when>]=<action>

  point   where the fault fires: `learner.step` (a learner rank's step; who = rank, when = learner version at
          the start of the step), `actor.start` (a rollout actor's start, before its model loads; who = actor
          id), `actor.generate` (inside every batch of an actor, after its claim, before the engine runs; who =
          actor id, when = the actor's weight version), `actor.published` (after a batch was published or
          refused, before the next one; who = actor id, when = the actor's weight version), `actor.stop` (when
          the driver stops an actor's generation at the end of the run; who = actor id), `actor.load_weights` (an
          actor swapping received weights into its engine; who = actor id, when = the version being loaded; the
          one point with a `stale` stand-in), `learner.committed`
          (learner rank 0 after a step's commit, before its report goes back to the driver; who = 0, when = the
          version committed), `driver.log` (the driver after it got a step's report, before it logs it; who =
          `driver`, when = the step's version). Other points: whatever a caller passes to `wrap`.
  who     the rank or actor id, or `*` for every one
  when    optional: fire only when the point's `when` value equals it (e.g. the learner version)
  action  `sleep:<seconds>` (a stall, then go on) | `fail` (raise FaultInjectedError) | `exit` (the process dies at
          once, as on a crash: os._exit(1)) | `stale` (the call does not happen: the point's stand-in runs instead;
          at `actor.load_weights` the engine reports the version being loaded and keeps its old weights, a weight
          sync that never reached the engine; a point without a stand-in refuses it at `wrap`) |
          `kill_child:<title>` (SIGKILL this process's child processes whose title, as ps shows it, starts with
          <title>, e.g. `sglang::scheduler`: an engine subprocess that fails; then go on)

e.g. `learner.step:1@2=sleep:120` stalls learner rank 1 for 120 s at its step from version 2,
`actor.generate:actor-2=sleep:3` makes actor-2 a slow one, `actor.start:*=fail` makes every actor fail to start,
`actor.load_weights:actor-0@2=stale` leaves actor-0's engine on version 1's weights while it reports version 2.

Production code calls `wrap` once per process where a fault can fire (never on every step): with nothing
named for that point and process, `wrap` returns the function itself, so a run without faults runs no hook.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Callable

FAULTS_ENV = "SPARSE_RL_FAULTS"
"""The environment variable that names the faults (format: the module docstring)."""


ACTIONS = ("sleep", "fail", "exit", "stale", "kill_child")
"""What a fault can do (the module docstring)."""


class FaultInjectedError(RuntimeError):
    """Raised by a `fail` fault. (Its name ends in Error: deploy.actor_pool.root_cause finds the line that says
    why an actor died by that suffix.)"""


@dataclass(frozen=True)
class Fault:
    """One named fault: at `point`, for `who` ("*" = any), when the point's value equals `when` (None = always),
    do `action` (ACTIONS), sleeping `seconds` / killing the children titled `arg`."""
    point: str
    who: str
    when: int | None
    action: str
    seconds: float = 0.0
    arg: str = ""


def parse(spec: str) -> list[Fault]:
    """The faults of a SPARSE_RL_FAULTS value. Raises ValueError naming an item that does not parse."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, eq, action = item.partition("=")
        point, colon, target = where.partition(":")
        who, at, when = target.partition("@")
        kind, _, arg = action.partition(":")
        if not (eq and colon and point and who) or kind not in ACTIONS or \
                (kind in ("sleep", "kill_child")) != bool(arg) or (at and not when.strip().lstrip("-").isdigit()):
            raise ValueError(f"{FAULTS_ENV}: {item!r}: expected "
                             "<point>:<who>[@<when>]=sleep:<s>|fail|exit|stale|kill_child:<title>")
        faults.append(Fault(point.strip(), who.strip(), int(when) if at else None, kind,
                            float(arg) if kind == "sleep" else 0.0, arg if kind == "kill_child" else ""))
    return faults


def active(point: str, who: str | int) -> list[Fault]:
    """The faults SPARSE_RL_FAULTS names for `point` and `who` in this process (read now)."""
    return [f for f in parse(os.environ.get(FAULTS_ENV, "")) if f.point == point and f.who in (str(who), "*")]


def fire(fault: Fault) -> None:
    """Do what `fault` says: sleep, raise FaultInjectedError, kill child processes, or end the process (`stale`
    is `wrap`'s: nothing here)."""
    if fault.action == "sleep":
        time.sleep(fault.seconds)
    elif fault.action == "stale":
        return
    elif fault.action == "kill_child":
        import psutil
        for child in psutil.Process().children(recursive=True):
            try:
                if " ".join(child.cmdline()).startswith(fault.arg):
                    child.kill()
            except psutil.NoSuchProcess:
                pass
    elif fault.action == "fail":
        raise FaultInjectedError(f"{FAULTS_ENV}: {fault.point} of {fault.who} fails (injected fault)")
    else:
        os._exit(1)


def wrap(fn: Callable, point: str, who: str | int, when: Callable[[], int] | None = None,
         stale: Callable | None = None) -> Callable:
    """`fn`, or, when SPARSE_RL_FAULTS names faults for `point` and `who`, `fn` preceded by them: each fires
    before the call if it has no `when`, or if `when()` (e.g. the learner version) equals its `when` then. A `stale`
    fault that fires replaces the call: `stale(*args, **kwargs)` runs instead of `fn` and its result is returned.
    Raises ValueError when a `stale` fault is named for a point that passes no `stale` stand-in."""
    faults = active(point, who)
    if not faults:
        return fn
    if stale is None and any(f.action == "stale" for f in faults):
        raise ValueError(f"{FAULTS_ENV}: `stale` at {point}: that point has no stand-in (actor.load_weights has)")

    @functools.wraps(fn)
    def with_faults(*args, **kwargs):
        value = when() if when is not None else None
        for fault in faults:
            if fault.when is None or fault.when == value:
                if fault.action == "stale":
                    return stale(*args, **kwargs)
                fire(fault)
        return fn(*args, **kwargs)
    return with_faults
