"""Custom rewards and task generators (actors.reward.function, actors.data.source=function) and the synthetic
tasks of actors/tasks/builtin.py. Expected values are worked out by hand in the comments."""
from __future__ import annotations

import math
import sys

import pytest

from actors.config import DataConfig
from actors.tasks.builtin import copy_numbers, copy_reward, digits, digits_reward, lcs_length
from actors.tasks.data import Prompt, held_out_problems, load_eval_items, task_problems
from actors.tasks.reward import RewardConfig, RewardResult, RewardScorer, load_reward_function

USER_REWARDS = """
def length_reward(response, response_ids, item):
    return len(response_ids) / item.metadata["target"]

def flaky(response, response_ids, item):
    if "boom" in response:
        raise RuntimeError("cannot score")
    return 1.0

def nan(*args):
    return float("nan")

not_callable = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's reward module, importable by name, as `pip install`ed code would be (a file on sys.path: the
    reward runs in a worker process, which imports it too)."""
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("user_rewards", None)


def item(**metadata) -> Prompt:
    return Prompt("p-0", "q", "7", metadata=metadata)


def test_custom_function_is_called_per_sample_with_text_ids_and_item(user_module):
    scorer = RewardScorer(RewardConfig(function="user_rewards:length_reward"))
    result = scorer("abc", [5, 6, 7], item(target=4))
    assert (result.reward, result.status) == (0.75, "wrong")      # 3 ids / 4
    assert scorer("abcd", [1, 2, 3, 4], item(target=4)).status == "correct"  # 4 / 4 = 1 counts as correct


def test_a_raising_or_non_finite_function_scores_zero_and_is_counted(user_module):
    scorer = RewardScorer(RewardConfig(function="user_rewards:flaky"))
    assert scorer("fine", [1], item()).reward == 1.0
    bad = scorer("boom", [1], item())
    assert (bad.reward, bad.status) == (0.0, "error")
    assert "RuntimeError: cannot score" in scorer.last_error and "p-0" in scorer.last_error
    assert RewardScorer(RewardConfig(function="user_rewards:nan"))("x", [1], item()).status == "error"


def test_truncated_responses_score_the_configured_reward(user_module):
    plain = RewardScorer(RewardConfig(function="user_rewards:length_reward"))
    assert plain("abc", [5, 6, 7], item(target=4), "length").reward == 0.75   # unset: scored like any other
    overlong = RewardScorer(RewardConfig(function="user_rewards:length_reward", truncated=-0.5))
    assert overlong("abc", [5, 6, 7], item(target=4), "length") == RewardResult(-0.5, "wrong", "")
    assert overlong("abc", [5, 6, 7], item(target=4), "stop").reward == 0.75
    assert RewardScorer(RewardConfig(truncated=0.0))("#### 7", [1], item(), "length").reward == 0.0  # math too


def test_default_is_the_math_reward():
    scorer = RewardScorer(RewardConfig())
    assert scorer("#### 7", [1], item()).status == "correct"
    assert scorer("no number", [1], item()).status == "unparseable"


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("user_rewards:missing", "has no callable 'missing'"),
    ("user_rewards:not_callable", "has no callable 'not_callable'"),
    ("user_rewards.length_reward", "expected 'package.module:function'"),
])
def test_unloadable_function_names_the_field(user_module, spec, message):
    with pytest.raises(ValueError, match=r"^reward\.function=") as e:
        load_reward_function(spec)
    assert message in str(e.value)


def test_config_check_fails_at_start_naming_the_dotted_field():
    from deploy.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"^actors\.reward\.function='nope_xyz:f': cannot import"):
        load_config("tiny", ["actors.reward.function=nope_xyz:f"])
    with pytest.raises(ConfigError, match=r"^actors\.data\.function='actors\.tasks:nothing': .*no callable"):
        load_config("tiny", ["actors.data.source=function", "actors.data.function=actors.tasks:nothing"])


def test_lcs_by_hand():
    assert lcs_length([1, 2, 3, 4], [1, 3, 4]) == 3
    assert lcs_length([4, 3, 2, 1], [1, 2, 3, 4]) == 1
    assert lcs_length([], [1]) == 0
    assert lcs_length([1, 9, 2, 9, 3], [1, 2, 3]) == 3


@pytest.mark.parametrize("response, expected", [
    ("11\n22\n33\n44", 1.0),              # exact
    ("11\n22\n44", 3 / 4),                # one missing: LCS 3, longer list 4
    ("11\n22\n33\n44\n55\n66", 4 / 6),    # two extra: LCS 4, longer list 6
    ("44\n33\n22\n11", 1 / 4),            # reversed: LCS 1
    ("Sure! 11, 22, 33 and 44.", 1.0),    # any separators
    ("I cannot do that.", 0.0),
])
def test_copy_reward_by_hand(response, expected):
    assert math.isclose(copy_reward(response, [], item(numbers=[11, 22, 33, 44])), expected)


def test_digits_reward_by_hand():
    assert digits_reward("a1b2c3", [], item(length=4)) == 0.75
    assert digits_reward("123456", [], item(length=4)) == 1.0


def test_task_generators_are_deterministic_and_shaped():
    a, b = copy_numbers(5, seed=3, count=4), copy_numbers(5, seed=3, count=4)
    assert a == b and a != copy_numbers(5, seed=4, count=4)
    assert all(len(x["metadata"]["numbers"]) == 4 and all(10 <= n <= 99 for n in x["metadata"]["numbers"]) for x in a)
    assert a[0]["question"].endswith(" ".join(map(str, a[0]["metadata"]["numbers"])))
    assert len({x["question"] for x in digits(20, seed=0)}) == 20


def test_function_source_and_held_out_items():
    cfg = DataConfig(source="function", function="actors.tasks:copy_numbers", function_options={"count": 3}, size=40)
    train = task_problems(cfg.function, cfg.size, 0, cfg.function_options)
    assert len(train) == 40 and train[0].metadata["numbers"] and train[0].prompt_id == "copy_numbers-s0-0000"
    held = held_out_problems(cfg, 10, seed=0)
    assert len(held) == 10 and not {p.question for p in held} & {p.question for p in train}
    assert [p.question for p in load_eval_items("train_task", 10, train=cfg, seed=0)] == [p.question for p in held]
    tiny_space = DataConfig(source="function", function="actors.tasks:copy_numbers",
                            function_options={"count": 1, "low": 1, "high": 3}, size=40)
    with pytest.raises(ValueError, match="held-out problems are not training prompts"):
        held_out_problems(tiny_space, 5, seed=0)   # only 3 distinct questions exist, all used in training
