"""summary.json is strict JSON: a metric that no token measured in the last step (NaN, e.g. replay exactness when
every row of a step is stale under max_staleness 1) is written as null, not as a bare NaN that jq reads as null
and JavaScript's JSON.parse refuses."""
from __future__ import annotations

import json
import math

from deploy.driver import finite_or_null


def test_non_finite_metrics_become_null_and_the_rest_is_kept():
    summary = {"replay_logp_max_abs": math.nan, "grad_norm": math.inf, "pg_loss": -math.inf, "reward_mean": 0.5,
               "version": 2, "run_id": "r", "tags": [1.0, math.nan],
               "accounting": {"left_in_queue": 0, "learner_idle_fraction": math.nan}}
    out = finite_or_null(summary)
    assert out == {"replay_logp_max_abs": None, "grad_norm": None, "pg_loss": None, "reward_mean": 0.5,
                   "version": 2, "run_id": "r", "tags": [1.0, None],
                   "accounting": {"left_in_queue": 0, "learner_idle_fraction": None}}
    text = json.dumps(out, allow_nan=False)   # raises ValueError on any NaN or infinity left

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    assert json.loads(text, parse_constant=refuse) == out
    assert summary["replay_logp_max_abs"] != summary["replay_logp_max_abs"]   # the input is not changed in place
