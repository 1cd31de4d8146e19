"""User code that hangs, for tests/actors/test_user_code.py: importable as `hanging_user_code:<function>`
(tests/actors/conftest.py puts this folder on sys.path; a run started by a test gets it on PYTHONPATH). The hangs
busy-loop (`while True: pass`, a CPU core at 100 %), they do not sleep: what a user's runaway code does."""
from __future__ import annotations

import os


def spin_reward(response, response_ids, item):
    """Never returns for a response containing "spin"; else len(response_ids) / item.metadata["target"]."""
    if "spin" in response:
        while True:
            pass
    return len(response_ids) / item.metadata["target"]


def forever(*args, **kwargs):
    """Never returns, whatever it is given."""
    while True:
        pass


def generate_forever(size, seed, **options):
    """A task generator that never returns."""
    while True:
        pass


def yielding_generator(size, seed, **options):
    """A task generator written with `yield`."""
    for i in range(size):
        yield {"question": f"Say {seed + i}", "answer": str(seed + i)}


def pid_and(value=None):
    """(this process's id, value): which process ran the call."""
    return os.getpid(), value


def fails(message):
    raise KeyError(message)


def unpicklable_result():
    return lambda: None
