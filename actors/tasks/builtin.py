"""Synthetic tasks with verifiable rewards, for `actors.data.source: function` and `actors.reward.function`.

- `copy_numbers` / `copy_reward`: copy a list of two-digit numbers from the prompt, one per line. A long-context
  task in miniature: the answer is in the prompt, so a KV cache that evicts prompt tokens loses it, and the
  response is as long as the list (it cannot be shortened without losing reward). SmolLM2-135M-Instruct copies
  about half the time at the start, so GRPO has a signal (docs/results.md).
- `count_numbers` / `count_reward`: list the numbers from a to b, one per line. The decode-regime task (the
  Sparse-RL paper's setting: the prompt, ~45 tokens with SmolLM2's chat template, fits the KV budget; the
  response, 3-4 tokens a number and 31-46 numbers, is 3-4x longer; 800 distinct problems): what the model must
  keep is two facts of the prompt (where to start, where to stop) and its own recent output, and what a decode-time
  eviction loses is the stopping number, so compressed rollouts overshoot. The reward reads the whole response: every
  missing, wrong, repeated or extra number and every word that is not a number costs.
- `digits` / `digits_reward`: write as many digit characters as possible. Learnable by a tiny random model in
  a few dozen steps (tiny-char preset model): the learning test's task (tests/deploy/test_learning.py).
- The multi-turn lookup task (a hidden key/value table read through a `<lookup>K7</lookup>` tool) lives in
  actors/envs/lookup.py: its generator `lookup_items` and its environment `LookupEnv` (actors/envs/env.py).

A task generator is `fn(size: int, seed: int, **options) -> list[dict]` with `question`, `answer`, `metadata`;
a reward is `fn(response: str, response_ids: list[int], item: actors.tasks.data.Prompt) -> float`.
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


def count_numbers(size: int, seed: int, start_low: int = 1, start_high: int = 50, span_low: int = 30,
                  span_high: int = 45) -> list[dict]:
    """`size` problems "List the numbers from a to b, one per line.", a uniform in [start_low, start_high] and
    b - a uniform in [span_low, span_high] (deterministic in seed). metadata: {"start": a, "stop": b}."""
    rng = random.Random(seed)
    out = []
    for _ in range(size):
        a = rng.randint(start_low, start_high)
        b = a + rng.randint(span_low, span_high)
        out.append({"question": f"List the numbers from {a} to {b}, one per line.",
                    "answer": "\n".join(map(str, range(a, b + 1))), "metadata": {"start": a, "stop": b}})
    return out


def count_demonstration(item: dict, restate: bool) -> str:
    """The right answer to a `count_numbers` problem, as the supervised warm-up writes it: the numbers a..b one
    per line, plain ("25\n26\n...") or restating the stop number on every line ("25 of 46\n26 of 46\n...").
    Under a decode-time KV budget the restating format keeps b in the recent window, so it survives eviction;
    the plain one relies on the prompt's b staying in the cache (docs/results.md 6.6)."""
    a, b = item["metadata"]["start"], item["metadata"]["stop"]
    return "\n".join(f"{n} of {b}" if restate else str(n) for n in range(a, b + 1))


def count_reward(response: str, response_ids, item) -> float:
    """LCS(words of the response, [a, a+1, ..., b]) / max(words, b - a + 1), in [0, 1]: 1 only for exactly
    the numbers a..b in order. Words are the response split on whitespace and commas, after removing " of b"
    after a number (the restating format of `count_demonstration`, "25 of 46"); a word that is not an integer
    counts as a wrong element, so stopping late, repeating, skipping or writing prose all cost."""
    stop = item.metadata["stop"]
    want = list(range(item.metadata["start"], stop + 1))
    response = re.sub(rf"(\d)[ \t]+of[ \t]+{stop}(?!\d)", r"\1", response)
    got = [int(w) if _INT.fullmatch(w) else w for w in re.split(r"[\s,]+", response) if w]
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
