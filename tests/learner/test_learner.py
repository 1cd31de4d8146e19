"""A real DeepSpeed (CPU, gloo) learner step on a tiny random Llama."""
import pytest
import torch

from learner.config import LearnerConfig
from learner.learner import PHASES, Learner
from learner.loss import grpo_advantages, grpo_loss
from tests.learner.conftest import make_groups, tiny_llama


def batch_loss(learner, batch, logp_old):
    """Plain GRPO loss of the learner's current policy on `batch` against fixed `logp_old`."""
    rows = torch.arange(batch.input_ids.shape[0])
    with torch.no_grad():
        logp, _ = learner.response_logprobs(learner.engine, batch, rows)
    mask = batch.response_mask.float()
    adv = grpo_advantages(batch.reward, batch.group_index)
    return grpo_loss(logp, logp_old, adv, mask, mask, num_seqs=len(rows))[0].item(), logp


@pytest.mark.parametrize("zero_stage,dtype,kl_coef",
                         [(0, "fp32", 0.0), (1, "fp32", 0.0), (3, "fp32", 0.05), (2, "bf16", 0.0)])
def test_step_lowers_loss_and_advances_version(zero_stage, dtype, kl_coef):
    cfg = LearnerConfig(lr=1e-2, zero_stage=zero_stage, dtype=dtype, kl_coef=kl_coef, ppo_epochs=2,
                        minibatch_size=4, micro_batch_size=2, rejection="none", token_mask=False)
    learner = Learner(tiny_llama(), cfg)
    assert (learner.ref_model is None) == (kl_coef == 0)
    groups = make_groups()
    batch = learner.collate(groups)
    rows = torch.arange(batch.input_ids.shape[0])
    with torch.no_grad():
        logp_before, _ = learner.response_logprobs(learner.engine, batch, rows)
    before, _ = batch_loss(learner, batch, logp_before)

    metrics = learner.step(groups, staleness=[0, 2])

    after, logp_after = batch_loss(learner, batch, logp_before)
    assert after < before
    assert learner.version == 1 and "weight_version" not in metrics   # one version key: learner.version
    assert metrics["optimizer_steps"] == 2 * 2            # 8 sequences / minibatch 4, two epochs
    assert metrics["staleness_mean"] == 1.0 and metrics["staleness_max"] == 2.0
    assert metrics["grad_norm"] > 0
    assert metrics["reward_mean"] == 0.5
    assert (metrics["kl_loss"] > 0) == (kl_coef > 0)
    names = list(learner.gather_buckets(0, keep=True))
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names


def test_token_mean_gradient_does_not_depend_on_the_micro_batches():
    groups = make_groups(num_groups=2, G=4)          # responses of 2-8 tokens: the two modes weigh them apart
    grads = {}
    for mode in ("token-mean", "seq-mean-token-mean"):
        for micro in (1, 8):
            cfg = LearnerConfig(kl_coef=0.0, loss_agg_mode=mode, micro_batch_size=micro, rejection="none",
                                token_mask=False)
            torch.manual_seed(0)
            grads[mode, micro] = Learner(tiny_llama(), cfg).gradients(groups)
    for mode in ("token-mean", "seq-mean-token-mean"):
        for name, g in grads[mode, 8].items():
            torch.testing.assert_close(grads[mode, 1][name], g, rtol=1e-5, atol=1e-7, msg=f"{mode}: {name}")
    differ = max((grads["token-mean", 8][n] - g).abs().max().item() for n, g in grads["seq-mean-token-mean", 8].items())
    assert differ > 1e-4                              # the option changes the gradient


def test_advantages_without_std_reach_the_gradient():
    groups = make_groups(num_groups=2, G=4)          # rewards 0, 1, 0, 1 in each group: std sqrt(1/3) in both
    grads = {}
    for norm in (True, False):
        torch.manual_seed(0)
        cfg = LearnerConfig(kl_coef=0.0, norm_adv_by_std=norm, rejection="none", token_mask=False)
        grads[norm] = Learner(tiny_llama(), cfg).gradients(groups)
    std = (1 / 3) ** 0.5 + 1e-6
    assert max(g.abs().max().item() for g in grads[True].values()) > 1e-3
    for name, g in grads[True].items():              # A = (R - mean) / std: the gradient scales by 1 / std
        torch.testing.assert_close(grads[False][name] / std, g, rtol=1e-4, atol=1e-7, msg=name)


def test_correction_rejects_mismatched_samples():
    learner = Learner(tiny_llama(), LearnerConfig(lr=1e-3, kl_coef=0.0))
    groups = make_groups(num_groups=1, G=4)
    groups[0].samples[1].logp_sparse[0] = 0.0     # xi ~ (1/64) / 1 = 0.016: token-masked, not vetoed
    groups[0].samples[2].logp_sparse[0] = 12.0    # xi = pi_old / pi_sparse ~ e^-16 < 1e-4: vetoed
    metrics = learner.step(groups, staleness=[0])
    assert metrics["rejection_rate"] == pytest.approx(1 / 4)
    assert metrics["token_mask_fraction"] > 0
    assert metrics["mismatch_kl"] > 0


def test_bad_groups_are_named():
    learner = Learner(tiny_llama(), LearnerConfig(kl_coef=0.0))
    groups = make_groups(num_groups=1)
    groups[0].samples[3].logp_sparse = groups[0].samples[3].logp_sparse[:-1]
    with pytest.raises(ValueError, match="group 'g0-0' sample 3"):
        learner.step(groups, staleness=[0])
    with pytest.raises(ValueError, match="staleness"):
        learner.step(make_groups(num_groups=2), staleness=[0])
    assert learner.version == 0


def test_response_logprobs_match_a_full_forward_at_the_sampler_temperature():
    model = tiny_llama()
    learner = Learner(model, LearnerConfig(kl_coef=0.0))
    groups = make_groups(num_groups=3, temperature=0.7)     # prompts of different lengths
    groups[1].temperature = 1.3
    batch = learner.collate(groups)
    rows = torch.arange(batch.input_ids.shape[0])
    with torch.no_grad():
        logp, entropy = learner.response_logprobs(learner.engine, batch, rows, with_entropy=True)
        i = 0
        for g in groups:
            for s in g.samples:
                ids = torch.tensor(list(s.prompt_ids) + list(s.response_ids))[None]
                logits = model(input_ids=ids).logits[0] / g.temperature
                P, R = len(s.prompt_ids), len(s.response_ids)
                full = torch.log_softmax(logits[P - 1:P - 1 + R], -1)
                expected = full[torch.arange(R), torch.tensor(s.response_ids, dtype=torch.long)]
                torch.testing.assert_close(logp[i, :R], expected, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(entropy[i, :R], -(full.exp() * full).sum(-1), atol=1e-5, rtol=1e-5)
                assert (logp[i, R:] == 0).all()
                i += 1


@pytest.mark.parametrize("k", [64, 8])
def test_step_acceptance_rate_against_the_exact_full_vocabulary_value(k):
    """Groups carrying the sampler's top-k log-probs (docs/SPEC.md §4) through the wire (float16): the step's accept_*
    equal Sparrow's alpha = sum_x min(p, q) computed here over the whole vocabulary when k = the vocabulary, and
    bracket it (accept_mean <= exact mean <= accept_upper_mean) with k = 8. q is the dense distribution of the
    same model with noise on its logits; temperature 0.7 on both sides."""
    from broker.schema import decode_group, encode_group

    model = tiny_llama()
    groups = make_groups(num_groups=2, G=3, temperature=0.7)
    gen = torch.Generator().manual_seed(0)
    exact = []
    with torch.no_grad():
        for g in groups:
            for s in g.samples:
                ids = torch.tensor(list(s.prompt_ids) + list(s.response_ids))[None]
                P, R = len(s.prompt_ids), len(s.response_ids)
                logits = model(input_ids=ids).logits[0, P - 1:P - 1 + R] / 0.7
                logq = (logits + torch.randn(logits.shape, generator=gen)).log_softmax(-1)
                exact.append(torch.minimum(logits.softmax(-1), logq.exp()).sum(-1))
                top = logq.topk(k, dim=-1)
                s.topk_ids, s.topk_logprobs = top.indices.numpy(), top.values.numpy()
    groups = [decode_group(encode_group(g)) for g in groups]
    exact = torch.cat(exact).double()
    learner = Learner(model, LearnerConfig(lr=1e-3, kl_coef=0.0))
    m = learner.step(groups, staleness=[0, 0])
    if k == 64:
        assert m["accept_mean"] == pytest.approx(exact.mean().item(), abs=2e-3)
        assert m["accept_p5"] == pytest.approx(torch.quantile(exact, 0.05).item(), abs=2e-3)
        assert m["accept_upper_p5"] == pytest.approx(m["accept_p5"], abs=2e-3)
        assert m["accept_topk_mass_outside"] == pytest.approx(0, abs=2e-3)
    else:
        assert m["accept_mean"] < exact.mean().item() - 1e-3 < m["accept_upper_mean"]
        assert m["accept_topk_mass_outside"] > 0.01
    assert "accept_p5" not in Learner(tiny_llama(), LearnerConfig(kl_coef=0.0)).step(make_groups(2), [0, 0])


@pytest.mark.parametrize("correction,rejection", [("on", "veto"), ("on", "geometric"), ("metrics_only", "veto")])
def test_fused_step_is_the_two_pass_update(correction, rejection):
    """logp_old from the training forward (learner.fuse_logp_old) gives the two-pass step's gradient, metrics and
    weights. Sparse log-probs far from the model's (min(xi, 1.5) averaging well below 1, a vetoed and a masked
    token) make the TIS normalisation a factor of several: a fused step that skipped it, or normalised per
    micro-batch, would differ."""
    groups = make_groups(num_groups=2, G=4)
    for g in groups:
        for i, s in enumerate(g.samples):
            s.logp_sparse = s.logp_sparse + 0.3 * (i % 3)   # xi = pi_old / pi_sparse shrinks by e^-0.3, e^-0.6
    groups[0].samples[2].logp_sparse[0] = 12.0               # xi < 1e-4: vetoed
    groups[1].samples[1].logp_sparse[0] = 0.0                # a token far outside [0.5, 1.5]: masked
    runs = {}
    for fuse in (True, False):
        torch.manual_seed(0)
        cfg = LearnerConfig(lr=1e-3, kl_coef=0.0, micro_batch_size=3, correction=correction, rejection=rejection,
                            fuse_logp_old=fuse)
        learner = Learner(tiny_llama(), cfg)
        metrics = learner.step(groups, staleness=[0, 0])
        runs[fuse] = metrics, {n: p.detach().clone() for n, p in learner.engine.module.named_parameters()}
    (fused, fused_params), (two_pass, two_pass_params) = runs[True], runs[False]
    assert fused["logp_old_fused"] == 1.0 and two_pass["logp_old_fused"] == 0.0
    if correction == "on":
        assert fused["tis_weight_mean"] < 0.8 and (fused["rejection_rate"] > 0 or rejection == "geometric")
    for key in ("grad_norm", "pg_loss", "rejection_rate", "token_mask_fraction", "mismatch_kl", "entropy",
                "xi_sym_p5", "tis_weight_mean", "clip_fraction", "ratio_mean"):
        assert fused.get(key) == pytest.approx(two_pass.get(key), rel=1e-4, abs=1e-7), key
    for name, p in fused_params.items():
        torch.testing.assert_close(p, two_pass_params[name], rtol=1e-4, atol=1e-6, msg=name)


def test_steps_that_are_not_on_policy_recompute_logp_old():
    groups = make_groups(num_groups=2, G=4)
    for cfg in (LearnerConfig(kl_coef=0.0, ppo_epochs=2), LearnerConfig(kl_coef=0.0, minibatch_size=4),
                LearnerConfig(kl_coef=0.05), LearnerConfig(kl_coef=0.0, zero_stage=1)):
        assert Learner(tiny_llama(), cfg).step(groups, staleness=[0, 0])["logp_old_fused"] == 0.0


def test_step_reports_its_phases_through_the_hook():
    """Learner.step reports its parts through the explicit `phase` hook as each starts (the console's phase lines;
    nothing wraps the learner's methods by name): backward, then optimizer step, once per optimizer step, on the
    two-pass step (two epochs of two minibatches) and on the fused one; `gradients` runs a backward."""
    for cfg, updates in ((LearnerConfig(kl_coef=0.0, ppo_epochs=2, minibatch_size=4, micro_batch_size=3), 4),
                         (LearnerConfig(kl_coef=0.0, micro_batch_size=3), 1)):
        seen = []
        learner = Learner(tiny_llama(), cfg, phase=seen.append)
        metrics = learner.step(make_groups(), staleness=[0, 0])
        assert metrics["logp_old_fused"] == float(updates == 1)
        assert seen == list(PHASES) * updates == ["backward", "optimizer step"] * updates
        seen.clear()
        learner.gradients(make_groups())
        assert seen == ["backward"]
    Learner(tiny_llama(), LearnerConfig(kl_coef=0.0)).step(make_groups(), staleness=[0, 0])   # no hook: none
