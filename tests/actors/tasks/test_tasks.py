"""The count task's reward and demonstrations (actors/tasks/builtin.py), on hand-written responses whose values were
worked out by hand: LCS(words, a..b) / max(len(words), b - a + 1)."""
import pytest

from actors.tasks.builtin import count_demonstration, count_numbers, count_reward
from actors.tasks.data import Prompt


def item(a: int, b: int) -> Prompt:
    return Prompt(prompt_id="p", question=f"List the numbers from {a} to {b}, one per line.", answer="",
                  metadata={"start": a, "stop": b})


@pytest.mark.parametrize("response, value", [
    ("3\n4\n5\n6", 1.0),                   # exact
    ("3 of 6\n4 of 6\n5 of 6\n6 of 6", 1.0),  # restating the stop on every line: the same numbers
    ("3 of 6\n4\n5 of 6\n6", 1.0),          # the two formats mixed
    ("3\n4\n5\n6\n7\n8", 4 / 6),            # ran on past b: 2 extra numbers
    ("3 of 6\n4 of 6\n5 of 6\n6 of 6\n7 of 6", 4 / 5),  # ran on past b while restating it
    ("3 of 9\n4 of 9\n5 of 9\n6 of 9", 4 / 12),  # restating a wrong stop: "of" and 9 stay words (12)
    ("3\n4\n6", 3 / 4),                     # skipped 5
    ("Here: 3 4 5 6", 4 / 5),               # a word of prose
    ("3 of 66\n4\n5\n6", 4 / 6),             # "of 66" is not "of 6": two wrong words
])
def test_count_reward(response, value):
    assert count_reward(response, [], item(3, 6)) == pytest.approx(value)


def test_demonstrations_score_one_in_both_formats():
    for problem in count_numbers(8, seed=5):
        prompt = item(problem["metadata"]["start"], problem["metadata"]["stop"])
        plain, restating = count_demonstration(problem, False), count_demonstration(problem, True)
        assert plain == problem["answer"]
        assert restating.splitlines()[0] == f"{problem['metadata']['start']} of {problem['metadata']['stop']}"
        assert count_reward(plain, [], prompt) == 1.0 and count_reward(restating, [], prompt) == 1.0
