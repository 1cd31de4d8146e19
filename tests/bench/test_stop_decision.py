"""bench/stop_decision.py's classing of counting answers and its token statistics, on hand-made responses."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("stop_decision",
                                               Path(__file__).parents[2] / "bench" / "stop_decision.py")
sd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sd)


def ends_of(pieces):
    return list(np.cumsum([len(p) for p in pieces]))


def test_run_on_answer_decides_at_the_newline_after_b_and_the_next_digit():
    pieces = ["4", "1", "\n", "4", "2", "\n", "4", "3", "\n", "4", "4", "\n"]        # 41..43, then 44: b = 43
    kind, tokens = sd.decision_tokens("".join(pieces), ends_of(pieces), 43, "length")
    assert (kind, tokens) == ("run_on", [8, 9])                                       # "\n" after 43, then "4"


def test_answer_that_stops_at_b_decides_at_eos_and_restating_lines_count():
    pieces = ["12", " of", " 13", "\n", "13", " of", " 13", "<|im_end|>"]
    kind, tokens = sd.decision_tokens("".join(pieces), ends_of(pieces), 13, "stop")
    assert (kind, tokens) == ("stops_at_b", [7])
    pieces = ["12", "\n", "13", "\n", "<|im_end|>"]                                 # a newline, then EOS
    assert sd.decision_tokens("".join(pieces), ends_of(pieces), 13, "stop") == ("stops_at_b", [3, 4])


def test_b_as_a_prefix_of_another_number_or_never_written_is_other():
    pieces = ["12", "\n", "130", "\n"]                                              # 130 is not b = 13
    assert sd.decision_tokens("".join(pieces), ends_of(pieces), 13, "length") == ("other", [])
    pieces = ["12", "\n", "13"]                                                     # cut right after b
    assert sd.decision_tokens("".join(pieces), ends_of(pieces), 13, "length") == ("other", [])


def test_mask_and_weight_follow_the_authors_bounds_and_cap():
    masked, weight = sd.mask_and_weight(np.array([0.001, 0.49, 0.5, 1.0, 1.4, 1.5, 1.51, 3.0]))
    assert masked.tolist() == [True, True, False, False, False, False, True, True]
    assert weight.tolist() == pytest.approx([0, 0, 0.5, 1.0, 1.4, 1.5, 0, 0])


def test_summarize_pools_tokens_per_class():
    tokens = {"run_on": {"responses": 2, "decision": [(0.01, True, 0.0), (1.0, False, 1.0)],
                         "other": [(1.0, False, 1.0)] * 3 + [(2.0, True, 0.0)]}}
    row = sd.summarize(tokens)["run_on"]
    assert row["decision_mask_rate"] == 0.5 and row["other_mask_rate"] == 0.25
    assert row["decision_weight_mean"] == 0.5 and row["other_weight_mean"] == 0.75
    assert row["decision_xi_below_low"] == 1 and row["decision_xi_above_high"] == 0
