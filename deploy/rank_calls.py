"""Rank 0's calls on every learner rank at once (Ray), and the error that names the rank that failed.

Used by deploy/learner_worker.py: the peers' calls join the collectives of rank 0's own call; ranks never call
rank 0. A rank that died, raised or hung is named in the LearnerRankError; nothing of that call is committed.
"""
from __future__ import annotations

import ray

RANK_FAILURE_WAIT_S = 30.0
"""After a failed call, how long rank 0 waits for Ray to report which peer ranks died, seconds."""


class LearnerRankError(RuntimeError):
    """A learner step failed because a rank died, hung or raised; the message names the rank(s). Nothing of
    the step was acknowledged: its groups are re-delivered or, after a resume, their prompts trained again."""


def on_all_ranks(peers: list, method: str, args: tuple, local, timeout_s: float, version: int):
    """Call `method(*args)` on every peer (Ray handles of ranks 1..N-1) and `local(*args)` here (rank 0) at once.
    Returns rank 0's result once every rank finished (with no peers: `local`'s result or error as they are).
    Raises LearnerRankError naming the rank(s) that died, raised or did not finish within `timeout_s` (the
    collectives' own timeout); `version`: the learner version, for the message."""
    if not peers:
        return local(*args)
    refs, what = [getattr(p, method).remote(*args) for p in peers], f"{method} at learner version {version}"
    try:
        result = local(*args)
    except Exception as e:  # named after the rank(s) that failed
        raise rank_failure(what, refs, e, timeout_s) from e
    wait_ranks(what, refs, timeout_s)
    return result


def wait_ranks(what: str, refs: list, timeout_s: float) -> None:
    """Wait for the peers' calls `refs` of group call `what`; raises LearnerRankError naming a failed rank."""
    try:
        ray.get(refs, timeout=timeout_s)
    except Exception as e:  # named after the rank(s) that failed
        raise rank_failure(what, refs, e, timeout_s) from e


def rank_failure(what: str, refs: list, error: Exception, timeout_s: float) -> LearnerRankError:
    """The error of a failed group call `what`, naming each peer rank that died or raised, or else the ranks that
    had not finished (and rank 0's own error)."""
    ray.wait(refs, num_returns=len(refs), timeout=min(RANK_FAILURE_WAIT_S, timeout_s))
    dead, unfinished = [], []
    for rank, ref in enumerate(refs, start=1):
        if not ray.wait([ref], timeout=0)[0]:
            unfinished.append(rank)
            continue
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:  # the rank's process is gone
            dead.append(f"learner rank {rank} died ({str(e).splitlines()[0][:200]})")
        except Exception as e:  # the rank raised: its last line says why
            dead.append(f"learner rank {rank} raised {type(e).__name__}: {str(e).splitlines()[-1][:300]}")
    first = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    if dead:
        reason = "; ".join(dead)
    elif unfinished:
        reason = (f"learner rank(s) {unfinished} did not finish within learner.collective_timeout_s="
                  f"{timeout_s:g} s; rank 0: {first}")
    else:
        reason = f"learner rank 0 raised {first}"
    return LearnerRankError(f"{what} failed: {reason}")


class AllRanks:
    """learner.step.Ranks over the learner group of `worker` (a deploy.learner_worker.LearnerWorker on rank 0):
    its calls fanned out to every rank, a failed rank named."""

    def __init__(self, worker):
        self.worker = worker

    def step(self, groups: list, staleness: list[int]) -> dict:
        return self.worker.step_groups(groups, staleness)

    def checkpoint(self, state: dict) -> str:
        return self.worker._on_all_ranks("checkpoint", state)
