"""math_reward on a table of answer strings with their right verdicts (verdicts written by hand)."""
import threading

import pytest

from actors.tasks.reward import gold_answer, math_reward

TABLE = [
    # (response, gold, expected status)
    ("#### 72", "72", "correct"),
    ("Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "72", "correct"),
    ("The answer is \\boxed{72}.", "72", "correct"),
    ("#### 1,800", "1800", "correct"),                       # comma in the number
    ("So the total is 1,800 dollars.", "1800", "correct"),    # comma + unit, no marker
    ("#### $18.00", "18", "correct"),                         # currency + trailing zeros
    ("#### 18 dollars\nThanks for asking!", "18", "correct"),  # unit + trailing text
    ("#### 18\nNext question: 5 + 5 = 10", "18", "correct"),  # trailing text with another number
    ("#### -4", "-4", "correct"),                             # negative
    ("Calculate: 5 - 3 - 6 = -4. The answer is -4.", "-4", "correct"),
    ("#### -3.5", "-3.5", "correct"),                         # negative decimal
    ("\\boxed{0.25}", "0.25", "correct"),
    ("\\boxed{\\frac{36}{2}}", "18", "correct"),              # equal value, other form
    ("I think it is 18.0", "18", "correct"),
    ("#### 17", "18", "wrong"),
    ("18 is what I first thought, but the answer is 17", "18", "wrong"),  # last number counts
    ("#### 4", "-4", "wrong"),                                # sign matters
    ("\\boxed{18.5}", "18", "wrong"),
    ("#### 1,801", "1800", "wrong"),
    ("The answer is eighteen.", "18", "unparseable"),
    ("I don't know.", "18", "unparseable"),
    ("", "18", "unparseable"),
    ("####", "18", "unparseable"),                            # marker with nothing after it
]


@pytest.mark.parametrize("response,gold,status", TABLE)
def test_reward_table(response, gold, status):
    result = math_reward(response, gold)
    assert result.status == status
    assert result.reward == (1.0 if status == "correct" else 0.0)


def test_table_is_large_and_mixed():
    assert len(TABLE) >= 20 and {s for _, _, s in TABLE} == {"correct", "wrong", "unparseable"}


def test_gold_answer_from_gsm8k_field():
    assert gold_answer("She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7") == "7"
    assert gold_answer("... = 1,234\n#### 1,234") == "1234"
    with pytest.raises(ValueError, match="####"):
        gold_answer("no marker here, 42")


def test_bad_gold_is_a_data_error():
    with pytest.raises(ValueError, match="gold"):
        math_reward("#### 5", "")


def test_reward_works_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("#### 1,800", "1800")))
    t.start()
    t.join()
    assert out[0].status == "correct"
