"""Multi-turn samples through the learner (docs/SPEC.md §3): environment and template tokens (`trainable` 0) are
context of the forward, never in the loss, the correction (veto, token mask, TIS) or the mismatch metrics."""
import dataclasses

import numpy as np
import torch

from broker.schema import decode_group, encode_group
from learner.config import LearnerConfig
from learner.correction import sparse_correction
from learner.learner import Learner
from learner.loss import grpo_loss
from tests.learner.conftest import make_groups, tiny_llama


def test_the_veto_ignores_an_environment_token_of_any_log_prob():
    """xi = exp(logp_old - logp_sparse): the actor sends logp_sparse 0 on environment tokens, so where the dense
    policy finds the observation unlikely (logp_old -20) xi = 2e-9 < eps and the veto rejects the whole
    sequence (the control, every token trainable); masked out, nothing is rejected and the token's loss mask and
    weight are 0. Hand-made: token 2 of sequence 0 is the environment's."""
    logp_old = torch.tensor([[-1.0, -1.2, -20.0, -0.5], [-1.0, -1.0, -1.0, -1.0]])
    logp_sparse = torch.tensor([[-1.0, -1.2, 0.0, -0.5], [-1.0, -1.0, -1.0, -1.0]])   # xi = 1 on sampled tokens
    trainable = torch.tensor([[True, True, False, True], [True, True, True, True]])
    options = dict(rejection="veto", eps=1e-4, token_mask=True, tis_cap=1.5)
    weights, loss_mask, metrics = sparse_correction(logp_old, logp_sparse, trainable, **options)
    assert metrics["rejection_rate"] == 0.0 and metrics["token_mask_fraction"] == 0.0
    assert loss_mask.tolist() == trainable.float().tolist()
    assert weights[0, 2] == 0 and torch.equal(weights[trainable], torch.ones(7))
    assert metrics["mismatch_kl"] == 0.0 and metrics["xi_max"] == 1.0
    _, control, control_metrics = sparse_correction(logp_old, logp_sparse, torch.ones_like(trainable), **options)
    assert control_metrics["rejection_rate"] == 0.5 and control[0].sum() == 0
    assert control_metrics["mismatch_kl"] > 1.0


def test_the_loss_gradient_on_environment_tokens_is_exactly_zero():
    """d loss / d logp at a masked position is exactly 0 (loss_mask multiplies it), and the loss does not move
    when an environment token's logp changes by any amount; the gradient at trained positions is non-zero."""
    logp = torch.tensor([[-1.0, -2.0, -3.0, -0.5]], requires_grad=True)
    loss_mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    args = dict(logp_old=logp.detach() - 0.1, advantages=torch.tensor([1.0]), loss_mask=loss_mask,
                weights=loss_mask.clone(), num_seqs=1)
    loss, _ = grpo_loss(logp, **args)
    loss.backward()
    assert logp.grad[0, 1] == 0.0 and (logp.grad[0, [0, 2, 3]] != 0).all()
    moved = logp.detach().clone()
    moved[0, 1] = -50.0
    assert grpo_loss(moved, **args)[0].item() == loss.item()


def with_observation(groups, obs_tokens: int = 3, logp_env: float = 0.0, trainable: bool = False):
    """Each sample's response followed by `obs_tokens` environment tokens (ids 1..obs_tokens, logp_sparse
    `logp_env`), marked trainable 0 unless `trainable`; through the wire and back."""
    out = []
    for group in groups:
        samples = []
        for s in group.samples:
            T = len(s.response_ids)
            samples.append(dataclasses.replace(
                s, response_ids=np.concatenate([s.response_ids, np.arange(1, obs_tokens + 1, dtype=np.int32)]),
                logp_sparse=np.concatenate([s.logp_sparse, np.full(obs_tokens, logp_env, np.float32)]),
                trainable=np.concatenate([np.ones(T, np.uint8), np.full(obs_tokens, int(trainable), np.uint8)])))
        out.append(decode_group(encode_group(dataclasses.replace(group, samples=samples))))
    return out


def test_environment_tokens_at_the_end_change_no_gradient():
    """A real learner (DeepSpeed, CPU): samples whose responses end in 3 environment tokens (trainable 0) give
    the gradient of the same samples without them (causal attention: trailing tokens are context of nothing), and
    the environment tokens' logp_sparse (0, the actor's, or -30) changes nothing; the control, the same tokens
    marked trainable, changes it. Tolerance: the padded length differs by 3 tokens, so fp32 GEMMs block and sum in
    another order (and by the CPU's vector width): 3.2e-8 at most on an AVX-512 EPYC, where embed_tokens' gradient
    reaches 0.19; each tensor is compared to 1e-5 of its own largest entry, the control differs by ~0.5 of it."""
    cfg = LearnerConfig(kl_coef=0.0, micro_batch_size=8, rejection="veto", token_mask=True)

    def grads(groups):
        torch.manual_seed(0)
        return Learner(tiny_llama(), cfg).gradients(groups)

    base = make_groups(num_groups=2, G=4)
    plain = grads(base)
    for logp_env in (0.0, -30.0):
        masked = grads(with_observation(base, logp_env=logp_env))
        for name, g in plain.items():
            torch.testing.assert_close(masked[name], g, rtol=1e-5, atol=1e-5 * g.abs().max().item(),
                                       msg=f"logp_env {logp_env}: {name}")
    control = grads(with_observation(base, trainable=True))
    differ = max((control[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-12) for n, g in plain.items())
    assert differ > 1e-2, differ


def test_the_trainable_mask_round_trips_and_fills_missing_samples():
    groups = with_observation(make_groups(num_groups=1, G=3))
    s = groups[0].samples[0]
    assert s.trainable.dtype == np.uint8 and s.trainable.tolist()[-3:] == [0, 0, 0]
    bare = make_groups(num_groups=1, G=3)[0]
    assert all(x.trainable is None for x in decode_group(encode_group(bare)).samples)
    bare.samples[1] = dataclasses.replace(bare.samples[1], trainable=np.zeros(len(bare.samples[1].response_ids),
                                                                                np.uint8))
    back = decode_group(encode_group(bare))
    assert back.samples[0].trainable.tolist() == [1] * len(bare.samples[0].response_ids)
    assert back.samples[1].trainable.sum() == 0


def test_a_bad_trainable_mask_is_refused_at_the_actor():
    import pytest

    from broker.schema import SchemaError
    group = make_groups(num_groups=1, G=2)[0]
    T = len(group.samples[0].response_ids)
    for mask, reason in ((np.ones(T + 1, np.uint8), "length_mismatch"), (np.full(T, 2, np.uint8), "bad_field"),
                         (np.ones(T, np.float32), "bad_field")):
        bad = dataclasses.replace(group, samples=[dataclasses.replace(group.samples[0], trainable=mask),
                                                  group.samples[1]])
        with pytest.raises(SchemaError, match=reason):
            encode_group(bad)
