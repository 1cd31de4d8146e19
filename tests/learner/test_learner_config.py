"""LearnerConfig checks its fields on construction, naming each bad one as `LearnerConfig.<field>`."""
from __future__ import annotations

import pytest

from learner.config import LearnerConfig


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-1e-6), "LearnerConfig.lr=-1e-06: expected a finite value >= 0"),
    (dict(eps=0.0), "LearnerConfig.eps=0.0: expected 0 < eps < 1"),
    (dict(dtype="fp16"), "LearnerConfig.dtype='fp16': expected one of ('fp32', 'bf16')"),
    (dict(geo_bounds=(2.0, 0.5)), "LearnerConfig.geo_bounds=(2.0, 0.5): expected low < high"),
    (dict(policy_target="sparse", distill_coef=float("inf")),
     "LearnerConfig.distill_coef=inf: expected a finite value >= 0"),   # trained every weight to NaN, exit 0
    (dict(kl_coef=float("inf")), "LearnerConfig.kl_coef=inf: expected a finite value >= 0"),
    (dict(lr=float("nan")), "LearnerConfig.lr=nan: expected a finite value >= 0"),
    (dict(distill_coef=-0.5), "LearnerConfig.distill_coef=-0.5: expected a finite value >= 0"),  # one error, not two
    (dict(distill_coef=0.5),
     "LearnerConfig.distill_coef=0.5: the dense-teacher term needs learner.policy_target=sparse (the student is the "
     "replayed forward)"),
    (dict(eps=2.0, zero_stage=4),
     "LearnerConfig.zero_stage=4: expected 0, 1, 2 or 3; LearnerConfig.eps=2.0: expected 0 < eps < 1"),
])
def test_bad_field_is_named(kwargs, message):
    with pytest.raises(ValueError) as err:
        LearnerConfig(**kwargs)
    assert str(err.value) == message


def test_lr_zero_is_allowed():
    assert LearnerConfig(lr=0.0).lr == 0.0  # a control run: the weights stay fixed


def test_bare_on_off_override_means_the_string():
    """YAML 1.1 reads on/off as booleans; `learner.correction=on` must still mean correction "on"."""
    from deploy.config import load_config
    assert load_config("tiny", ["learner.correction=on"]).learner.correction == "on"
    assert load_config("tiny", ["learner.correction=off"]).learner.correction == "off"
