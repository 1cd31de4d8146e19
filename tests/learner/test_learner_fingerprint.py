"""The learner's side of the weight-sync fingerprint (Learner.score, broker/fingerprint.py): the recompute's dense
forward gives the rollout engine's log-probs of the probe for the same weights (within the fp32 tolerance), and one
learner step moves them by far more than that."""
import copy

import numpy as np
import pytest

from actors.engines.torch_engine import TorchEngine
from broker import fingerprint as fp
from compressors import CompressorConfig
from learner.config import LearnerConfig
from learner.learner import Learner
from tests.actors.engines.test_torch_engine import tiny_tokenizer
from tests.learner.conftest import VOCAB, make_groups, tiny_llama


@pytest.mark.parametrize("policy_target", ["dense", "sparse"])   # sparse: the replay's attention implementation
def test_learner_score_equals_the_engines_and_one_step_moves_it_past_the_tolerance(policy_target):
    model = tiny_llama()
    engine = TorchEngine(copy.deepcopy(model).eval(), tokenizer=tiny_tokenizer(), compressor_cfg=CompressorConfig(
        method="rkv", kv_budget=16, window=4, interval=4))
    learner = Learner(model, LearnerConfig(lr=1e-3, kl_coef=0.0, policy_target=policy_target))
    probe = fp.probe(VOCAB, fp.probe_tokens(16)) + [[3, 9, 27]]        # and one of another length (padding)
    learner.engine.module.train()
    before = learner.score(probe)
    assert learner.engine.module.training                                # its mode restored
    assert [b.shape for b in before] == [(fp.PROBE_TOKENS - 1,)] * fp.PROBE_SEQUENCES + [(2,)]
    assert {b.dtype for b in before} == {np.dtype(np.float32)}
    assert fp.max_abs(before, engine.score(probe)) < fp.tolerance("fp32") / 10
    learner.step(make_groups(), staleness=[0, 0])
    after = learner.score(probe)
    assert fp.max_abs(before, after) > 10 * fp.tolerance("fp32")
    engine.load_weights(learner.gather_buckets(16.0, keep=True).items(), version=1)
    assert fp.max_abs(after, engine.score(probe)) < fp.tolerance("fp32") / 10
