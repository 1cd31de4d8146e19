"""A task generator for the held-out draw's tests (tests/actors/tasks/test_held_out.py, tests/deploy/test_eval_draw.py):
12 distinct questions per seed, none shared between seeds, so a held-out draw (another seed) finds exactly 12
distinct problems that are not training prompts, each repeated. Imported as `held_out_tasks:twelve` with this
folder on sys.path (PYTHONPATH for a subprocess)."""
from __future__ import annotations


def twelve(size: int, seed: int) -> list[dict]:
    """`size` items cycling through 12 questions "What is <seed> + <k>?" (k = 0..11)."""
    return [{"question": f"What is {seed} + {i % 12}?", "answer": str(seed + i % 12)} for i in range(size)]
