"""Rewards: the math reward for GSM8K-style answers, verified by `math-verify` (parse + verify, Apache-2.0),
and users' own reward functions (`RewardConfig.function`, loaded by `RewardScorer`). Both run in a worker process
with a time limit (`RewardConfig.timeout_s`, actors/user_code.py), so that a reward that never returns costs its
sample, not the actor.

Where the answer is: the text after the last `####` marker (GSM8K's format, up to the end of that line), else
whatever math-verify extracts from the whole response (`\\boxed{}` first, then the last number/expression).
math-verify handles `\\boxed{}`, commas in numbers, `$`, units, percentages, negative and decimal numbers.
"""
from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from actors.config import load_callable
from actors.user_code import UserCode, UserCodeError, UserCodeTimeout

STATUSES = ("correct", "wrong", "unparseable", "error")
_ANSWER_LINE = re.compile(r"####\s*([^\n]*)")


@dataclass(frozen=True)
class RewardResult:
    reward: float
    """Math reward: 1.0 if the extracted answer equals the gold answer, else 0.0; custom: the function's value."""
    status: str
    """correct | wrong | unparseable (no answer could be extracted; counted apart from wrong ones) | error (a
    custom reward function raised on this sample)."""
    extracted: str
    """The answer string math-verify extracted ('' if unparseable), for logs."""


def gold_answer(gsm8k_answer: str) -> str:
    """The final answer of a GSM8K `answer` field: the text after its last `####`, commas removed.

    Raises ValueError if there is no `#### <answer>` line."""
    found = _ANSWER_LINE.findall(gsm8k_answer)
    if not found or not found[-1].strip():
        raise ValueError(f"GSM8K answer has no '#### <answer>' line: {gsm8k_answer[-80:]!r}")
    return found[-1].strip().replace(",", "")


def math_reward(response: str, gold: str) -> RewardResult:
    """Score one response against a gold final answer (e.g. '72', '-3.5', '1800').

    Raises ValueError if the gold answer itself cannot be parsed (a data error, not a model error)."""
    from math_verify import parse, verify  # here: math-verify imports sympy (~0.4 s), which the driver and learner,
    # importing this module for its config, do not need

    # math-verify's timeout uses signal.alarm, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout)
    if not gold_parsed:
        raise ValueError(f"gold answer {gold!r} cannot be parsed by math-verify")
    marked = _ANSWER_LINE.findall(response)
    pred = parse(marked[-1] if marked else response, parsing_timeout=timeout)
    if not pred:
        return RewardResult(0.0, "unparseable", "")
    ok = verify(gold_parsed, pred, timeout_seconds=timeout)
    return RewardResult(1.0 if ok else 0.0, "correct" if ok else "wrong", str(pred[-1]))


# -- custom (user) reward functions ----------------------------------------------------------------------------
@dataclass
class RewardConfig:
    function: str = ""
    """The verifiable reward of training and evaluation. "" = the math reward (math-verify of the response's
    final answer against the item's `answer`). Otherwise "package.module:function", a user's own reward (as
    verl's `custom_reward_function.path`, slime's `--custom-rm-path`, TRL's `reward_funcs`), called once per
    sample as `function(response: str, response_ids: list[int], item: actors.tasks.data.Prompt) -> float`; `item`
    carries `question`, `answer`, `prompt_id` and the task's `metadata` dict. A value >= 1 counts as correct
    in `accuracy`. A function that raises on a sample scores that sample 0 and is counted in `reward_errors`."""
    truncated: Optional[float] = None
    """The reward of a response that ran to `max_new_tokens` (finish_reason "length") in training and
    evaluation, in place of the function's value; null = score it like any other. 0 is DAPO's overlong
    punishment without the soft buffer (verl `reward_model.overlong_buffer`): running past the answer costs the
    whole reward, so no policy can earn from responses that never stop."""
    timeout_s: float = 10.0
    """Longest the reward may take on one sample, seconds (the math reward too). The reward runs in a worker
    process of the actor (started once, reused for every sample); a sample that takes longer scores 0, is counted
    in `reward_errors`, and its worker is killed and replaced, so a reward that never returns costs its samples,
    not the actor. The actor's console says so once (which function, after how long). 0 = no limit: the
    function is called in the actor's own process, and one that never returns stops the actor's generation."""

    def __post_init__(self):
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s >= 0):
            raise ValueError(f"RewardConfig.timeout_s={self.timeout_s}: expected seconds >= 0 (0 = no limit)")


RewardFn = Callable[[str, Sequence[int], Any], float]


def load_reward_function(spec: str) -> RewardFn | None:
    """The callable named by `spec` ("package.module:function"), or None for "" (the math reward).

    Raises ValueError starting with `reward.function=<spec>:` when the module cannot be imported, the
    attribute does not exist or is not callable, or `spec` is not of the form module:function."""
    return load_callable(spec, "reward.function") if spec else None


MATH_REWARD = "actors.tasks.reward:math_reward"
"""The math reward's spec, as the worker process calls it: math_reward(response, gold)."""


class RewardScorer:
    """Scores samples with the configured reward: `scorer(text, response_ids, item) -> RewardResult`.

    Math reward: status correct | wrong | unparseable. Custom function: status correct (value >= 1) | wrong,
    or error when it raised or returned something that is not a finite number (reward 0; `last_error` keeps
    the message). Either one taking longer than `RewardConfig.timeout_s` on a sample: status error, reward 0,
    `timeouts` counts it and `last_error` says which function and how long. The reward runs in one worker
    process (actors/user_code.py), started on the first sample and reused; `close()` stops it. Raises
    ValueError at construction for a function that cannot be loaded (see `load_reward_function`), and, for the
    math reward, the ValueError of a gold answer that cannot be parsed (a data error)."""

    def __init__(self, cfg: RewardConfig):
        self.fn = load_reward_function(cfg.function)  # imported here too: a bad spec fails at construction
        self.truncated = cfg.truncated
        self.name = cfg.function or "math"
        self.timeout_s = cfg.timeout_s
        # an actors.tasks.data.Prompt argument: its module is imported when the worker starts, not in a sample's time
        self.code = UserCode(cfg.function or MATH_REWARD, cfg.timeout_s, name=f"reward function {self.name}",
                             setting="actors.reward.timeout_s", preload=("actors.tasks.data",) if cfg.function else ())
        self.last_error = ""

    @property
    def timeouts(self) -> int:
        """Samples whose reward timed out so far."""
        return self.code.timeouts

    def __call__(self, text: str, response_ids: Sequence[int], item, finish_reason: str = "stop") -> RewardResult:
        """`finish_reason` "length" scores `RewardConfig.truncated` (status wrong) when that is set."""
        if self.truncated is not None and finish_reason == "length":
            return RewardResult(float(self.truncated), "wrong", "")
        if self.fn is None:
            return self._math(text, item)
        try:
            value = float(self.code(text, list(response_ids), item))
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
        except UserCodeTimeout as e:
            return self._timed_out(e, item)
        except Exception as e:  # a user's function failing on one sample must not stop the actor
            return self._failed(e, item)
        return RewardResult(value, "correct" if value >= 1.0 else "wrong", "")

    def _math(self, text: str, item) -> RewardResult:
        try:
            return self.code(text, item.answer)
        except UserCodeTimeout as e:
            return self._timed_out(e, item)
        except UserCodeError as e:
            if e.kind == "ValueError":  # a gold answer math-verify cannot parse: a data error, raised as before
                raise ValueError(e.message) from None
            return self._failed(e, item)

    def _timed_out(self, e: UserCodeTimeout, item) -> RewardResult:
        self.last_error = (f"reward function {self.name} timed out after {e.timeout_s:g} s on "
                           f"{getattr(item, 'prompt_id', '?')} (actors.reward.timeout_s; the sample scored 0, "
                           "counted in reward_errors)")
        return RewardResult(0.0, "error", "")

    def _failed(self, e: Exception, item) -> RewardResult:
        what = str(e) if isinstance(e, UserCodeError) else f"{type(e).__name__}: {e}"  # the worker's: "<type>: <text>"
        self.last_error = f"{self.name} on {getattr(item, 'prompt_id', '?')}: {what}"
        return RewardResult(0.0, "error", "")

    def close(self) -> None:
        """Stop the reward's worker process (a later sample starts a new one)."""
        self.code.close()
