"""The learner's eviction replay (learner/replay.py, learner.policy_target=sparse) of SGLang rollouts (CPU lane): the
`sparse_rl_kv` backend records each request's evictions (actors/engines/sglang/records.py), the Samples go through
the wire format (broker/schema.py) into the learner's collate, and the replayed forward with the same weights gives
each token's logp_sparse to 1e-4 while the dense recompute differs by more than 1e-2; one layer's record shifted by
one step breaks it (the control). Sampled at temperature 1 (n = 2), one prompt longer than the budget (compressed at
prefill, step 0); R-KV, SnapKV shared, R-KV under the length schedule (budget_schedule length: 12 growing 0.5 a
token to 26, docs/sglang.md "The length schedule"), and random (unseeded: each call's seeds drawn, the record says what
was evicted)."""
import copy
import os

import numpy as np
import pytest
import torch

pytest.importorskip("sglang.srt", reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh")
from transformers import Qwen2ForCausalLM

from actors.engines.base import SamplingParams
from actors.engines.sglang.engine import SGLangEngine
from actors.engines.sglang.triton_backend import SELF_CHECK_ENV
from compressors import CompressorConfig
from learner.config import LearnerConfig
from learner.learner import Learner
from tests.learner.conftest import wire_groups
from tests.sglang.test_sglang_triton import KWARGS

pytestmark = pytest.mark.sglang
torch.set_num_threads(1)
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((20, 24, 12))]
"""Prompt lengths 20, 24 (> budget 16: compressed at prefill), 12."""
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=40, n=2, ignore_eos=True)


@pytest.fixture(scope="module", params=[
    CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8),
    CompressorConfig(method="snapkv", kv_budget=16, window=4, interval=8, selection="shared"),
    CompressorConfig(method="rkv", kv_budget=12, window=4, interval=8, budget_schedule="length", budget_growth=0.5,
                     kv_budget_final=26),
    CompressorConfig(method="random", kv_budget=16, window=4, interval=8),
], ids=["rkv-per_head", "snapkv-shared", "rkv-length", "random-per_head"])
def rollouts(request, tiny_qwen2_dir):
    """(the model, the groups off the wire) of one recording `sparse_rl_kv` engine's sampled rollouts, every decode
    step through the self-check."""
    cc = request.param
    os.environ[SELF_CHECK_ENV] = "1"
    eng = SGLangEngine(str(tiny_qwen2_dir), compressor_cfg=cc, timeout_s=600, record_evictions=True, **KWARGS)
    try:
        out = eng.generate(PROMPTS, PARAMS)
    finally:
        eng.shutdown()
        del os.environ[SELF_CHECK_ENV]
    groups = wire_groups(out, cc.method, [cc.kv_budget] * len(out), [f"g{i}" for i in range(len(out))],
                         temperature=PARAMS.temperature)
    assert all(s.eviction_steps.shape[1] == (1 if cc.selection == "shared" else 2) for g in groups for s in g.samples)
    return Qwen2ForCausalLM.from_pretrained(tiny_qwen2_dir).eval(), groups


def learner_of(model) -> Learner:
    return Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, kl_coef=0.0, policy_target="sparse",
                                                       micro_batch_size=3))


def gaps(learner, groups) -> tuple[list[float], float]:
    """(max |replayed logp - logp_sparse| per sample, max |dense logp - logp_sparse| over the batch)."""
    batch = learner.collate(groups)
    with torch.no_grad():
        r = learner._replay_forward(batch, torch.arange(batch.input_ids.shape[0]), grad=False)
    mask = batch.response_mask.bool()
    per_sample = [float((r["logp"][i] - batch.logp_sparse[i]).abs()[mask[i]].max()) for i in range(len(mask))]
    return per_sample, float((r["logp_dense"] - batch.logp_sparse).abs()[mask].max())


def test_replay_of_sglang_rollouts_equals_logp_sparse(rollouts):
    model, groups = rollouts
    learner = learner_of(model)
    replayed, dense = gaps(learner, groups)
    assert len(replayed) == len(PROMPTS) * PARAMS.n and max(replayed) <= 1e-4, replayed
    assert dense > 1e-2, f"the dense recompute differs by {dense:.3g} only: eviction did not matter"
    steps = np.concatenate([s.eviction_steps.ravel() for g in groups for s in g.samples])
    assert (steps == 0).any() and ((steps > 0) & (steps < 65535)).any()   # prefill and decode evictions replayed
    m = learner.step(groups, [0] * len(groups))
    print(f"{groups[0].compressor}: replay_logp_max_abs {m['replay_logp_max_abs']:.3g}, replay_dense_gap_max "
          f"{m['replay_dense_gap_max']:.3g}")
    assert m["replay_logp_max_abs"] <= 1e-4 and m["replay_dense_gap_max"] > 1e-2, m


def test_a_record_shifted_by_one_step_is_seen(rollouts):
    """The control: layer 1's record one step later (each evicted key seen by one more query) breaks the match."""
    model, groups = rollouts
    shifted = copy.deepcopy(groups)
    for g in shifted:
        for s in g.samples:
            e = s.eviction_steps.copy()
            e[1] = np.where(e[1] == 65535, e[1], e[1] + 1)
            s.eviction_steps = e
    replayed, _ = gaps(learner_of(model), shifted)
    assert max(replayed) > 1e-4, replayed
