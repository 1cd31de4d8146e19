"""Eviction replay (docs/SPEC.md §2.4, learner/replay.py): the learner's replayed forward gives the compressed sampler's
log-probs and gradient. Real torch engine rollouts (tiny random Llama, R-KV, three budgets in one generate call)
go through the wire format and the learner's collate; the reference is tests/actors/engines/test_torch_engine.py's
teacher-forced HF forward with per-layer masks built from the engine's own batch record."""
import copy

import numpy as np
import pytest
import torch

from actors.engines.base import SamplingParams
from actors.engines.torch_engine import TorchEngine
from compressors import CompressorConfig
from learner.config import LearnerConfig
from learner.learner import Learner
from tests.actors.engines.test_torch_engine import PROMPTS, eviction_masks, reference_logp, tiny_model, tiny_tokenizer  # noqa: F401
from tests.learner.conftest import wire_groups

BUDGETS = [10, 20, 10, 14]     # three distinct budgets: three sub-batches of one generate call
CFG = CompressorConfig(method="rkv", kv_budget=12, window=4, interval=5)


def rollouts(selection: str = "per_head", method: str = "rkv", **schedule):
    """(model, groups off the wire, the engine's per-sub-batch records with their samples); `schedule`: more
    CompressorConfig fields (a length schedule)."""
    model = tiny_model("llama", layers=3)
    cfg = CompressorConfig(method=method, kv_budget=12, window=4, interval=5, selection=selection,
                           h2o_recent=4 if method == "h2o" else 64, **schedule)
    cfg.validate()
    engine = TorchEngine(model, tiny_tokenizer(), cfg, record_evictions=True)
    prompts = PROMPTS + [list(range(20, 36))]
    budgets = None if schedule else BUDGETS          # a length schedule grows one budget within each trajectory
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=40, n=2, seed=7), kv_budgets=budgets)
    groups = wire_groups(out, method, budgets or [12] * 4, [f"g{i}" for i in range(len(out))])
    recs = (engine.last_eviction_records if budgets
            else [{**engine.last_eviction_record, "prompt_indices": [0, 1, 2, 3]}])
    subs = [(rec, [s for i in rec["prompt_indices"] for s in out[i]]) for rec in recs]
    return model, groups, subs


def learner_of(model, **overrides):
    cfg = LearnerConfig(lr=1e-3, kl_coef=0.0, policy_target="sparse", micro_batch_size=3, **overrides)
    return Learner(copy.deepcopy(model), cfg)


def replayed_logp(learner, groups):
    """The learner's replayed and dense log-probs of the collated groups, and logp_sparse: [S, T] each."""
    batch = learner.collate(groups)
    rows = torch.arange(batch.input_ids.shape[0])
    with torch.no_grad():
        r = learner._replay_forward(batch, rows, grad=False)
    return r["logp"], r["logp_dense"], batch.logp_sparse, batch.response_mask


def max_gap(a, b, mask):
    return float((a - b).abs()[mask].max())


@pytest.mark.parametrize("selection,method", [("per_head", "rkv"), ("shared", "rkv"), ("per_head", "snapkv"),
                                              ("per_head", "h2o"), ("per_head", "streamingllm"),
                                              ("per_head", "random")])
def test_replayed_logp_equals_logp_sparse(selection, method):
    model, groups, _ = rollouts(selection, method)
    check_replay(model, groups, selection)


def test_replayed_logp_equals_logp_sparse_under_a_length_schedule():
    model, groups, _ = rollouts(budget_schedule="length", budget_growth=0.5, kv_budget_final=26)
    check_replay(model, groups)


def test_replayed_logp_equals_logp_sparse_for_random_with_protection():
    """Random eviction with sinks, the prompt's last 3 tokens and the 2 largest value norms protected (one budget,
    12): its record replays within 1e-4 like a scored method's."""
    model, groups, _ = rollouts("per_head", "random", sinks=1, protect_prompt="last:3", protect_values=2)
    check_replay(model, groups)


def check_replay(model, groups, selection="per_head"):
    if selection == "shared":
        assert all(s.eviction_steps.shape[1] == 1 for g in groups for s in g.samples)   # one row per layer
    logp, dense, sparse, mask = replayed_logp(learner_of(model), groups)
    assert max_gap(logp, sparse, mask) <= 1e-4
    assert max_gap(dense, sparse, mask) > 1e-2, "nothing evicted mattered: the check would not see a wrong mask"


def test_replayed_gradient_equals_the_masked_reference_and_a_wrong_record_is_seen():
    """One micro-batch's gradient through the learner's collate and replay attention equals the gradient of the
    same function through `_masked_reference_attention` with the engine's own batch masks, to 1e-5; the exactness
    check breaks when one layer's record is shifted by one column or one head's record is dropped."""
    model, groups, subs = rollouts()
    learner = learner_of(model)
    weights = {}
    rng = np.random.default_rng(0)
    for g in groups:
        for s in g.samples:
            weights[id(s)] = torch.from_numpy(rng.normal(size=len(s.response_ids)).astype(np.float32))
    # the learner's gradient of sum_t w_t logp_t over every sample
    batch = learner.collate(groups)
    rows = torch.arange(batch.input_ids.shape[0])
    learner.engine.zero_grad()
    logp = learner._replay_forward(batch, rows, grad=True, dense=False)["logp"]
    flat = [s for g in groups for s in g.samples]
    w = torch.zeros_like(logp)
    for i, s in enumerate(flat):
        w[i, :len(s.response_ids)] = weights[id(s)]
    learner.engine.backward((logp * w).sum(), scale_wrt_gas=False)
    got = {n: p.grad.detach().clone() for n, p in learner.engine.module.named_parameters()}
    # the reference: per sub-batch (its own left-padded layout and record), HF's forward with explicit masks
    ref_model = copy.deepcopy(model).train()
    ref_model.set_attn_implementation("evicted_mask_reference")
    by_ids = {(tuple(s.prompt_ids), tuple(s.response_ids)): s for s in flat}
    for rec, samples in subs:
        layer_masks, _ = eviction_masks(samples, rec)
        with torch.enable_grad():
            from tests.actors.engines.test_torch_engine import padded_batch
            ids, mask, pos = padded_batch(samples, rec["prompt_width"])
            logits = ref_model(input_ids=ids, attention_mask=mask, position_ids=pos, layer_masks=layer_masks).logits
            lp = logits.float().log_softmax(-1)
            P = rec["prompt_width"]
            total = 0
            for r, s in enumerate(samples):
                T = len(s.response_ids)
                at = lp[r, torch.arange(T) + P - 1, torch.tensor(s.response_ids)]
                total = total + (at * weights[id(by_ids[(tuple(s.prompt_ids), tuple(s.response_ids))])]).sum()
            total.backward()
    for n, p in ref_model.named_parameters():   # to 1e-5 of the parameter's largest gradient (fp32 sums)
        err, scale = float((got[n] - p.grad).abs().max()), float(p.grad.abs().max())
        assert err <= 1e-5 * scale + 1e-8, (n, err, scale)

    def broken(edit):
        gs = copy.deepcopy(groups)
        for g in gs:
            for s in g.samples:
                s.eviction_steps = edit(np.array(s.eviction_steps))
        logp, _, sparse, mask = replayed_logp(learner, gs)
        return max_gap(logp, sparse, mask)

    assert broken(lambda e: e) <= 1e-4                                               # the control
    shifted = lambda e: np.concatenate([e[:1], np.roll(e[1:2], 1, axis=2), e[2:]])  # noqa: E731  layer 1, one column
    assert broken(shifted) > 1e-4
    dropped = lambda e: np.concatenate([e[:, :1], np.full_like(e[:, 1:2], 65535)], axis=1)  # noqa: E731  head 1: never
    assert broken(dropped) > 1e-4


@pytest.mark.parametrize("fuse,distill,zero_stage", [(True, 0.0, 0), (False, 0.0, 0), (True, 0.5, 0),
                                                     (False, 0.5, 3)])
def test_replaying_step_reports_exactness_and_dense_mismatch(fuse, distill, zero_stage):
    """A learner step with policy_target=sparse: replay_logp_max_abs <= 1e-4 (both forwards), the dense gap
    > 1e-2, the mismatch metrics from the dense forward (mismatch_kl far above the replayed one), Sparrow's exact
    acceptance rate in (0, 1], and with distill_coef the teacher KL reported."""
    model, groups, _ = rollouts()
    learner = learner_of(model, fuse_logp_old=fuse, distill_coef=distill, zero_stage=zero_stage)
    m = learner.step(groups, [0] * len(groups))
    assert m["logp_old_fused"] == float(fuse and zero_stage == 0)
    assert m["replay_logp_max_abs"] <= 1e-4 and m["replay_logp_train_max_abs"] <= 1e-4
    assert m["replay_dense_gap_max"] > 1e-2
    assert m["mismatch_kl"] > 100 * max(m["replay_mismatch_kl"], 1e-9)
    assert 0 < m["accept_exact_p5"] <= m["accept_exact_mean"] <= 1.0
    assert m["replay_rejection_rate"] == 0.0 and m["replay_token_mask_fraction"] == 0.0
    assert ("distill_kl" in m) == (distill > 0)
    if distill:
        assert m["distill_kl"] > 0


def test_dense_target_ignores_records_and_sparse_target_needs_them():
    model, groups, _ = rollouts()
    dense = Learner(copy.deepcopy(model), LearnerConfig(kl_coef=0.0))
    assert dense.collate(groups).replay_evicted_at is None
    assert "replay_logp_max_abs" not in dense.step(groups, [0] * len(groups))
    bare = copy.deepcopy(groups)
    bare[1].samples[0].eviction_steps = None
    with pytest.raises(ValueError, match="sample 2 has no eviction record"):
        learner_of(model).collate(bare)
    with pytest.raises(ValueError, match="distill_coef"):
        LearnerConfig(distill_coef=0.1)


def test_flex_attention_path_equals_the_sdpa_reference():
    """The CUDA path (FlexAttention with a block mask from the record), run eagerly on the CPU, against the SDPA
    reference: values, GQA and shared rows; a record moved by one column changes the output. (FlexAttention has
    no backward on the CPU: bench/replay_gpu_check.py compares gradients on a GPU.)"""
    import warnings

    from learner.replay import NEVER_INDEX, flex_replay_attention, sdpa_replay_attention

    torch.manual_seed(0)
    B, Hq, Hkv, L, D = 2, 4, 2, 24, 8
    for heads in (Hkv, 1):
        q, k, v = (torch.randn(B, h, L, D) for h in (Hq, Hkv, Hkv))
        evicted = torch.randint(0, L + 8, (B, heads, L), dtype=torch.int32)
        evicted[evicted >= L] = NEVER_INDEX
        ref = sdpa_replay_attention(q, k, v, evicted, 0.35)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = flex_replay_attention(q, k, v, evicted, 0.35, compiled=False)
            moved = flex_replay_attention(q, k, v, evicted.roll(1, dims=2), 0.35, compiled=False)
        assert got.shape == ref.shape == (B, L, Hq, D)
        assert float((got - ref).abs().max()) <= 1e-5
        assert float((moved - ref).abs().max()) > 1e-3
