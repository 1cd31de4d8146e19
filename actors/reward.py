"""Math reward for GSM8K-style answers, verified by `math-verify` (parse + verify, Apache-2.0).

Where the answer is: the text after the last `####` marker (GSM8K's format, up to the end of that line), else
whatever math-verify extracts from the whole response (`\\boxed{}` first, then the last number/expression).
math-verify handles `\\boxed{}`, commas in numbers, `$`, units, percentages, negative and decimal numbers.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from math_verify import parse, verify

STATUSES = ("correct", "wrong", "unparseable")
_ANSWER_LINE = re.compile(r"####\s*([^\n]*)")


@dataclass(frozen=True)
class RewardResult:
    reward: float
    """1.0 if the extracted answer equals the gold answer, else 0.0."""
    status: str
    """correct | wrong | unparseable (no answer could be extracted; counted apart from wrong ones)."""
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
