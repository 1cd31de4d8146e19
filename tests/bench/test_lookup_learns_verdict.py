"""Round 3's rule of docs/results.md 8 (bench/lookup_learns.py) on hand-made gains and wall times."""
import importlib.util
import sys
from pathlib import Path

import pytest

_bench = Path(__file__).parents[2] / "bench"
sys.path.insert(0, str(_bench))
_spec = importlib.util.spec_from_file_location("lookup_learns", _bench / "lookup_learns.py")
lookup_learns = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lookup_learns)
WALLS = {"preset-s0": 214.0, "preset_lr0-s0": 188.0}


def test_round_3_as_recorded_passes():
    # docs/results.md 8, round 3: gains +0.541 / +0.500 / +0.687 (mean 0.576), controls -0.105 / +0.041 / +0.021
    v = lookup_learns.verdict({0: 0.541, 1: 0.500, 2: 0.687}, {0: -0.105, 1: 0.041, 2: 0.021}, WALLS)
    assert v["mean_gain"]["value"] == pytest.approx(0.576, abs=5e-4)
    assert v["control_mean_gain"]["value"] == pytest.approx(-0.0143, abs=5e-4)
    assert v["passes"] is True


@pytest.mark.parametrize("gains,controls,walls,failing", [
    ({0: 0.3, 1: 0.3, 2: 0.29}, {0: 0, 1: 0, 2: 0}, WALLS, "mean_gain"),           # mean 0.2967 < 0.3
    ({0: 0.6, 1: 0.6, 2: 0.19}, {0: 0, 1: 0, 2: 0}, WALLS, "min_seed_gain"),       # one seed below 0.2
    ({0: 0.5, 1: 0.5, 2: 0.5}, {0: -0.105, 1: -0.105, 2: -0.105}, WALLS, "control_mean_gain"),  # round 2's control x3
    ({0: 0.5, 1: 0.5, 2: 0.5}, {0: 0, 1: 0, 2: 0}, {"preset-s1": 901.0}, "max_wall_s"),
])
def test_each_clause_can_fail(gains, controls, walls, failing):
    v = lookup_learns.verdict(gains, controls, walls)
    assert v["passes"] is False
    assert [k for k, c in v.items() if k != "passes" and not c["holds"]] == [failing]


def test_missing_seed_is_refused():
    with pytest.raises(ValueError, match=r"seeds \[2\]"):
        lookup_learns.verdict({0: 0.5, 1: 0.5}, {0: 0, 1: 0, 2: 0}, WALLS)
