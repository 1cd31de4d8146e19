"""Synthetic tasks with verifiable rewards, for `actors.data.source: function` and `actors.reward.function`.

- `copy_numbers` / `copy_reward`: copy a list of two-digit numbers from the prompt, one per line. A long-context
  task in miniature: the answer is in the prompt, so a KV cache that evicts prompt tokens loses it, and the
  response is as long as the list (it cannot be shortened without losing reward). SmolLM2-135M-Instruct copies
  about half the time at the start, so GRPO has a signal (docs/results.md).
- `digits` / `digits_reward`: write as many digit characters as possible. Learnable by a tiny random model in
  a few dozen steps (tiny-char preset model): the learning test's task (tests/deploy/test_learning.py).

A task generator is `fn(size: int, seed: int, **options) -> list[dict]` with `question`, `answer`, `metadata`;
a reward is `fn(response: str, response_ids: list[int], item: actors.data.Prompt) -> float`.
"""
from __future__ import annotations

import random
import re
import string

_INT = re.compile(r"-?\d+")


def copy_numbers(size: int, seed: int, count: int = 12, low: int = 10, high: int = 99) -> list[dict]:
    """`size` problems "Copy these numbers in order, one per line: 47 56 ...", each of `count` integers drawn
    uniformly from [low, high] (deterministic in seed). metadata: {"numbers": [int, ...]}."""
    rng = random.Random(seed)
    out = []
    for _ in range(size):
        numbers = [rng.randint(low, high) for _ in range(count)]
        out.append({"question": "Copy these numbers in order, one per line: " + " ".join(map(str, numbers)),
                    "answer": "\n".join(map(str, numbers)), "metadata": {"numbers": numbers}})
    return out


def lcs_length(a: list, b: list) -> int:
    """Length of the longest common subsequence of `a` and `b` (dynamic programming, O(len(a) * len(b)))."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def copy_reward(response: str, response_ids, item) -> float:
    """LCS(numbers in the response, numbers to copy) / max(len of either), in [0, 1]: 1 only for the exact
    list; each missing, wrong, reordered or extra number costs. Integers are read with the regex -?\\d+."""
    want = list(item.metadata["numbers"])
    got = [int(x) for x in _INT.findall(response)]
    return lcs_length(got, want) / max(len(got), len(want))


def digits(size: int, seed: int, length: int = 48, letters: int = 6) -> list[dict]:
    """`size` prompts "digits: <letters random lowercase letters>" (distinct prompts, deterministic in seed).
    metadata: {"length": length}, the number of digit characters that earns reward 1."""
    rng = random.Random(seed)
    return [{"question": "digits: " + " ".join(rng.sample(string.ascii_lowercase, letters)), "answer": str(length),
             "metadata": {"length": length}} for _ in range(size)]


def digits_reward(response: str, response_ids, item) -> float:
    """min(1, digit characters in the response / metadata["length"])."""
    return min(1.0, sum(c.isdigit() for c in response) / item.metadata["length"])
