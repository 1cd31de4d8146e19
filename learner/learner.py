"""The DeepSpeed learner: dense recompute of pi_old (and pi_ref), Sparse-RL correction, GRPO update
(docs/SPEC.md §1-4). One `step` per batch of trajectory groups; each step advances the weight version.

Read `Learner.step` top to bottom: collate (a LearnerBatch) -> advantages -> recompute logp_old/logp_ref ->
correction (the step's LossInputs) -> PPO epochs x minibatches x micro-batches (`_micro_batch`: loss, metrics) ->
optimizer steps -> version += 1 -> metrics. An on-policy step (`fusable`: one epoch, one minibatch) skips the
recompute: its micro-batches' training forwards give logp_old, and the correction follows its last backward
(`_correct_fused`). learner/batching.py collates and cuts the batch, learner/distributed.py sets up the process
group and DeepSpeed, learner/weights.py exports the weights. With learner.lora (broker/lora.py) the same step trains
a peft adapter alone: the reference policy is the module with its adapter disabled, and the export is the adapter's.
"""
from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from broker.lora import add_adapter, base_identity
from broker.schema import TrajectoryGroup
from broker.weight_sync import WeightSender
from compressors.budget import kv_dims
from compressors.kv_quant import KVQuant
from learner.acceptance import acceptance_metrics
from learner.batching import LearnerBatch, LossInputs, collate, micro_batches, teacher_forced, token_balanced_split
from learner.config import LearnerConfig
from learner.correction import sparse_correction
from learner.distributed import TORCH_DTYPES, all_reduce, deepspeed_config, init_distributed
from learner.loss import aggregate, grpo_advantages, grpo_loss
from learner.metrics import LossTotals, step_metrics, tier_metrics, train_gap_metrics
from learner.replay import (
    ATTN_IMPLEMENTATION,
    collate_hints,
    exact_acceptance,
    logp_gap,
    replay_metrics,
    teacher_kl,
)
from learner.weights import WeightExport, state_bytes

PHASES = ("backward", "optimizer step")
"""The phases `Learner.step` reports through its `phase` hook, in this order for each optimizer step: backward
(each minibatch's micro-batches; the fused step's correction), optimizer step."""


def _entropy(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of log_probs [n, T, V] (no grad): float32 [n, T], 0 where mask is False."""
    with torch.no_grad():
        return -(log_probs.exp() * log_probs).sum(-1) * mask


class Learner:
    """A DeepSpeed engine around a Hugging Face causal LM, trained with Sparse-RL GRPO.

    Args:
        model: a path to a `save_pretrained` directory, or an `nn.Module` (HF causal LM returning `.logits`
            [batch, seq, vocab]); it becomes the engine's module (not copied).
        cfg: LearnerConfig.
        phase: the phase hook, called with each of PHASES ("backward", "optimizer step") as `step` (and
            `gradients`) starts it, e.g. a rank's phase board for the console (deploy/learner_worker.py); the
            caller records the step's first phase, the recompute, itself. Default: none.
    Attributes:
        version: int weight version; +1 per `step`. Checkpoints restore it.
        engine: the DeepSpeed engine. ref_model: frozen copy of the initial model, or None when kl_coef == 0 or
            with learner.lora (the reference is then the same model with its adapter disabled).
        peft: with learner.lora on, the `peft.PeftModel` around the engine's module (broker.lora.add_adapter: the
            adapter's layers are in the module itself; only they are trained and held by the optimizer), else None.
        base: with learner.lora on, the base model's identity {"base_model": its name or path, "base_hash": blake2b
            of its weights} (broker.lora.base_identity; checkpoints carry it), else None.
    """

    def __init__(self, model: str | os.PathLike | nn.Module, cfg: LearnerConfig,
                 phase: Callable[[str], object] | None = None):
        init_distributed(timeout_s=cfg.collective_timeout_s)
        import deepspeed  # only after DS_ACCELERATOR is set (init_distributed, above)

        self.cfg = cfg
        if not isinstance(model, nn.Module):
            model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.dtype = TORCH_DTYPES[cfg.dtype]
        if cfg.policy_target == "sparse":  # SDPA, plus the eviction-record masks when a forward passes one
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.kv_shape = kv_dims(model.config)
        """(layers, KV heads, head_dim) of the model: the layout of the samples' rounding hints."""
        self.peft, self.base = None, None
        if cfg.lora.enabled:   # the adapter's layers into `model` itself; the base frozen (broker/lora.py)
            self.peft = add_adapter(model, cfg.lora, seed=0 if cfg.seed is None else cfg.seed)
            self.base = base_identity(model)
        self.ref_model = None
        if cfg.kl_coef > 0 and self.peft is None:
            self.ref_model = copy.deepcopy(model).to(self.dtype).eval().requires_grad_(False)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=deepspeed_config(cfg))
        self.device = self.engine.device
        # the weights, out (learner/weights.py): with LoRA the adapter only
        self.export = WeightExport(self.engine, self.dtype, cfg.zero_stage, adapter=self.peft is not None)
        if self.ref_model is not None:
            self.ref_model.to(self.device)
        self.version = 0
        self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.checkpoint_state: dict = {}  # the client state of the checkpoint loaded last (learner.checkpoint)
        self.phase = phase or (lambda name: None)   # the phase hook: each of PHASES as it starts

    # ------------------------------------------------------------------------------------------------------
    def collate(self, groups: list[TrajectoryGroup], staleness: list[int] | None = None) -> LearnerBatch:
        """The groups as one LearnerBatch (learner.batching.collate), with their eviction records when this learner
        replays (policy_target sparse) and `fresh` from the groups' `staleness`. Raises ValueError on a malformed
        group (naming it)."""
        return collate(groups, self.cfg.policy_target == "sparse", staleness)

    def response_logprobs(self, model: nn.Module, batch: LearnerBatch, rows: torch.Tensor,
                          with_entropy: bool = False, topk_ids: torch.Tensor | None = None) -> tuple:
        """log pi(response token) for `rows` of a collated batch, from one teacher-forced forward of `model`
        with logits divided by each sequence's sampler temperature (SPEC §3).

        Returns: logp float32 [len(rows), T] (0 on padding), and the per-token entropy (no grad) or None; with
        `topk_ids` (int64 [len(rows), T, K], the sampler's top-k tokens) a third element, log pi at those ids
        float32 [len(rows), T, K] (no grad; for learner/acceptance.py).
        """
        log_probs = self.log_probs(model, batch, rows)
        logp = self._at_response(log_probs, batch, rows)
        entropy = _entropy(log_probs, batch.response_mask[rows].to(self.device)) if with_entropy else None
        if topk_ids is not None:
            return logp, entropy, log_probs.detach().gather(2, topk_ids.to(self.device))
        return logp, entropy

    def log_probs(self, model: nn.Module, batch: LearnerBatch, rows: torch.Tensor,
                  replay: bool = False, quant: bool = True) -> torch.Tensor:
        """float32 [len(rows), T, V]: log_softmax(logits / temperature) at the positions predicting each response
        token (padding slots: any valid position), from one teacher-forced forward of `model`; with `replay`, the
        forward hides the keys each sample's eviction record says its sampler no longer saw and, with `quant` and
        a quantized `batch.kv_quant`, reads K/V at the sampler's stored precision, with the sampler's codes where
        its rounding hints say (learner/replay.py)."""
        L = int(batch.seq_len[rows].max())
        index = batch.response_index[rows].to(self.device)
        # the lm_head runs only over the window of positions that predict response tokens (HF
        # `logits_to_keep` with explicit indices): no logits for the prompts, far less memory and time
        start = int(index[:, 0].min())
        window = torch.arange(start, max(L - 1, start + 1), device=self.device)
        extra = {"replay_evicted_at": batch.replay_evicted_at[rows, :, :, :L].to(self.device)} if replay else {}
        if replay and quant and batch.kv_quant != "model":
            extra["replay_kv_quant"] = KVQuant.parse(batch.kv_quant)
            if batch.rounding_hints is not None:
                where, bits, bounds = collate_hints([batch.rounding_hints[i] for i in rows.tolist()],
                                                    batch.seq_len[rows].tolist(), L, *self.kv_shape)
                extra["replay_rounding_hints"] = (where.to(self.device), bits.to(self.device), bounds)
        logits = model(input_ids=batch.input_ids[rows, :L].to(self.device),
                       attention_mask=batch.attention_mask[rows, :L].to(self.device),
                       logits_to_keep=window, **extra).logits
        index = (index - start).clamp(0, logits.shape[1] - 1)   # padding slots point anywhere valid
        logits = logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1])).float()
        temperature = batch.temperature[rows]
        if not bool((temperature == 1).all()):
            logits = logits / temperature.to(self.device)[:, None, None]
        return torch.log_softmax(logits, dim=-1)

    def _at_response(self, log_probs: torch.Tensor, batch: LearnerBatch, rows: torch.Tensor) -> torch.Tensor:
        """log_probs [n, T, V] at the response tokens of `rows`: float32 [n, T], 0 on padding."""
        mask = batch.response_mask[rows].to(self.device)
        return log_probs.gather(2, batch.response_ids[rows].to(self.device)[:, :, None]).squeeze(2) * mask

    def replays(self, batch: LearnerBatch) -> bool:
        """Whether steps on `batch` replay the rollouts' evictions (policy_target sparse, records present)."""
        return self.cfg.policy_target == "sparse" and batch.replay_evicted_at is not None

    def quant_gap(self, batch: LearnerBatch) -> bool:
        """Whether a step on `batch` measures replay_quant_gap: learner.replay_quant_gap, replaying, and the
        groups sampled from a quantized KV cache (batch.kv_quant other than model)."""
        return self.cfg.replay_quant_gap and self.replays(batch) and batch.kv_quant != "model"

    def _replay_forward(self, batch: LearnerBatch, rows: torch.Tensor, grad: bool, dense: bool = True,
                        unquantized: bool = False) -> dict:
        """Eviction replay's forwards of micro-batch `rows`: the replayed one (differentiated when `grad`) and,
        with `dense`, one no-grad dense forward; with `unquantized`, one more no-grad replayed forward without the
        KV quantize-dequantize (logp_unquantized [n, T]). Returns logp (replayed, [n, T]), entropy (replayed, no
        grad) and, with `dense`, logp_dense [n, T], accept_exact [n, T] (Sparrow's sum_v min(p, q) from both whole
        distributions), dense_topk [n, T, K] when the batch has top-k ids, and with grad and distill_coef > 0
        distill [n, T] = KL(pi_dense || pi_replayed) per token (differentiable); all 0 on padding."""
        mask = batch.response_mask[rows].to(self.device)
        with contextlib.nullcontext() if grad else torch.no_grad():
            replayed = self.log_probs(self.engine, batch, rows, replay=True)
        out = {"logp": self._at_response(replayed, batch, rows), "entropy": _entropy(replayed, mask)}
        if unquantized:
            with torch.no_grad():
                plain = self.log_probs(self.engine, batch, rows, replay=True, quant=False)
            out["logp_unquantized"] = self._at_response(plain, batch, rows)
        if not dense:
            return out
        with torch.no_grad():
            full = self.log_probs(self.engine, batch, rows)
        out.update(logp_dense=self._at_response(full, batch, rows),
                   accept_exact=exact_acceptance(full, replayed) * mask)
        if batch.topk_ids is not None:
            out["dense_topk"] = full.gather(2, batch.topk_ids[rows].to(self.device))
        if grad and self.cfg.distill_coef > 0:
            out["distill"] = teacher_kl(full, replayed) * mask
        return out

    # ------------------------------------------------------------------------------------------------------
    def _prepare(self, groups: list[TrajectoryGroup], batch: LearnerBatch, recompute: bool = True) -> LossInputs:
        """The LossInputs of `batch`: mask and GRPO advantages over the *whole* step, logp_old and entropy zeros
        (with eviction replay logp_dense and accept_exact too) to be filled; with `recompute`, filled from a
        no-grad forward over this rank's token-balanced share, summed over the ranks (and logp_ref), then the
        correction's weights, loss mask and metrics over the whole step: every rank holds the same tensors,
        whatever the number of ranks (SPEC §2-3). Without it a fused step's training forwards fill them."""
        shape, device = batch.response_mask.shape, self.device
        advantages = grpo_advantages(batch.reward, batch.group_index, self.cfg.norm_adv_by_std).to(device)
        t = LossInputs(batch, batch.response_mask.to(device), advantages, batch.fresh.to(device),
                       logp_old=torch.zeros(shape, device=device), entropy=torch.zeros(shape, device=device))
        if self.cfg.kl_coef > 0:
            t.logp_ref = torch.zeros(shape, device=device)
        if self.replays(batch):
            t.logp_dense, t.accept_exact = torch.zeros(shape, device=device), torch.zeros(shape, device=device)
        if self.quant_gap(batch):
            t.logp_unquantized = torch.zeros(shape, device=device)
        if recompute:
            self._correct(groups, t, self._recompute(t))
        return t

    def _recompute(self, t: LossInputs) -> torch.Tensor | None:
        """Dense recompute of pi_old (and pi_ref) with the weights held at the start of the step, into t's
        logp_old, entropy, logp_ref (replaying: logp_dense, accept_exact too); returns the dense log-probs at the
        sampler's top-k tokens, float32 [S, T, K] (None without top-k), for the acceptance rate."""
        batch, replay = t.batch, self.replays(t.batch)
        dense_topk = torch.zeros(batch.topk_ids.shape, device=self.device) if batch.topk_ids is not None else None
        shares = token_balanced_split(torch.arange(batch.size), batch.seq_len, self.world_size)
        with torch.no_grad():
            for rows in micro_batches(shares, self.cfg.micro_batch_size, self.rank):
                if rows is None:  # keeps ZeRO-3's parameter gathers in step with the other ranks
                    self._padding_recompute(batch, replay, t.logp_ref is not None)
                    continue
                if replay:   # logp_old replayed; the dense forward for the mismatch metrics
                    r = self._replay_forward(batch, rows, grad=False, unquantized=t.logp_unquantized is not None)
                    t.logp_old[rows], t.entropy[rows] = r["logp"], r["entropy"]
                    if t.logp_unquantized is not None:
                        t.logp_unquantized[rows] = r["logp_unquantized"]
                    t.logp_dense[rows], t.accept_exact[rows] = r["logp_dense"], r["accept_exact"]
                    if dense_topk is not None:
                        dense_topk[rows] = r["dense_topk"]
                elif dense_topk is not None:   # dense log-probs at the sampler's top-k tokens (acceptance rate)
                    t.logp_old[rows], t.entropy[rows], dense_topk[rows] = self.response_logprobs(
                        self.engine, batch, rows, with_entropy=True, topk_ids=batch.topk_ids[rows])
                else:
                    t.logp_old[rows], t.entropy[rows] = self.response_logprobs(self.engine, batch, rows,
                                                                               with_entropy=True)
                if t.logp_ref is not None:
                    t.logp_ref[rows] = self.reference_logprobs(batch, rows)
        for x in (t.logp_old, t.entropy, t.logp_ref, dense_topk, t.logp_dense, t.accept_exact, t.logp_unquantized):
            if x is not None:   # each row is non-zero on one rank: the sum is exact
                all_reduce(x, self.world_size)
        return dense_topk

    def _padding_recompute(self, batch: LearnerBatch, replay: bool, reference: bool) -> None:
        """The recompute's forwards of a padding slot (row 0, results dropped): the same ZeRO-3 parameter gathers as
        the other ranks' micro-batch (with LoRA the reference forward runs through the engine too)."""
        row = torch.zeros(1, dtype=torch.long)
        if replay:
            self._replay_forward(batch, row, grad=False, unquantized=self.quant_gap(batch))
        else:
            self.response_logprobs(self.engine, batch, row)
        if reference and self.peft is not None:
            self.reference_logprobs(batch, row)

    def reference_logprobs(self, batch: LearnerBatch, rows: torch.Tensor) -> torch.Tensor:
        """log pi_ref of the response tokens of `rows`, float32 [len(rows), T] (0 on padding; call under no_grad):
        the frozen copy of the initial model, or with learner.lora the engine's own module with the adapter
        disabled (peft's `disable_adapter`: the base model, no second copy; SPEC §3's KL term)."""
        if self.peft is None:
            return self.response_logprobs(self.ref_model, batch, rows)[0]
        with self.peft.disable_adapter():
            return self.response_logprobs(self.engine, batch, rows)[0]

    def _correction_options(self) -> dict:
        """The keyword arguments of `sparse_correction` this learner's config sets."""
        c = self.cfg
        return dict(correction=c.correction, rejection=c.rejection, eps=c.eps, geo_bounds=c.geo_bounds,
                    token_mask=c.token_mask, token_mask_bounds=c.token_mask_bounds, tis_cap=c.tis_cap)

    def _correct(self, groups: list[TrajectoryGroup], t: LossInputs, dense_topk: torch.Tensor | None = None) -> None:
        """t's correction weights, loss mask and metrics (SPEC §2, §4; per tier; Sparrow's acceptance rate when
        `dense_topk` is given) from its logp_old over the whole step."""
        logp_sparse = t.batch.logp_sparse.to(self.device)
        t.weights, t.loss_mask, metrics = sparse_correction(t.logp_old, logp_sparse, t.mask,
                                                            **self._correction_options())
        dense = t.logp_old if t.logp_dense is None else t.logp_dense   # the mismatch metrics: sampler vs pi_dense
        if t.logp_dense is not None:
            applied = metrics
            _, _, metrics = sparse_correction(dense, logp_sparse, t.mask, **self._correction_options())
            metrics.update(replay_metrics(t.logp_old, dense, logp_sparse, t.mask, t.fresh, t.accept_exact, applied))
        if t.logp_unquantized is not None:   # learner.replay_quant_gap: what the KV quantization changes
            metrics["replay_quant_gap"] = logp_gap(t.logp_old, t.logp_unquantized, t.mask.bool())
        if t.batch.rounding_hints is not None and self.replays(t.batch):   # the sampler's codes the replay took
            metrics["replay_quant_hints"] = float(np.mean([0 if h is None else len(h) for h in t.batch.rounding_hints]))
        metrics.update(tier_metrics(groups, self.cfg, dense, logp_sparse, t.mask))
        if dense_topk is not None:   # Sparrow's per-token acceptance rate (arXiv 2606.08446, SPEC §4): accept_*
            metrics.update(acceptance_metrics(t.batch.topk_logprobs.to(self.device), dense_topk, t.mask))
        t.metrics = metrics

    def fusable(self, batch: LearnerBatch) -> bool:
        """Whether a step on `batch` (collated) takes logp_old from its training forward (`learner.fuse_logp_old`):
        on-policy (one PPO epoch, one minibatch), one rank, ZeRO stage 0, fp32 (the gradients are the
        parameters' .grad), no reference model, no top-k log-probs to score, no replay_quant_gap to measure."""
        cfg = self.cfg
        one_minibatch = cfg.minibatch_size == 0 or cfg.minibatch_size >= batch.size
        return (cfg.fuse_logp_old and cfg.ppo_epochs == 1 and one_minibatch and self.world_size == 1
                and cfg.zero_stage == 0 and cfg.dtype == "fp32" and cfg.kl_coef == 0 and batch.topk_ids is None
                and not self.quant_gap(batch))

    # ------------------------------------------------------------------------------------------------------
    def _num_tokens(self, t: LossInputs, mb_rows: torch.Tensor) -> float | None:
        """T_N of token-mean, every response token of minibatch `mb_rows` on all ranks (SPEC §3); None for
        seq-mean-token-mean."""
        if self.cfg.loss_agg_mode != "token-mean":
            return None
        return max(float(t.mask[mb_rows].sum()), 1.0)

    def _micro_rows(self, t: LossInputs, mb_rows: torch.Tensor) -> list[torch.Tensor | None]:
        """This rank's micro-batches of minibatch `mb_rows`: its token-balanced share, cut into micro_batch_size,
        padded with None to the count of every rank (learner/batching.py; one rank: mb_rows.split)."""
        shares = token_balanced_split(mb_rows, t.batch.seq_len, self.world_size)
        return micro_batches(shares, self.cfg.micro_batch_size, self.rank)

    def _micro_batch(self, t: LossInputs, rows: torch.Tensor | None, mb_rows: torch.Tensor, num_tokens: float | None,
                     fused: bool, gap: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward and loss of micro-batch `rows` of minibatch `mb_rows` (T_N `num_tokens`), both paths of the step.
        The loss is normalised by the sequences of the whole minibatch (token-mean: by its response tokens, T_N)
        and multiplied by the number of ranks (DeepSpeed averages gradients over ranks), so that the summed gradient
        is the one-rank gradient. `fused`: the training forward gives the rows' logp_old (its value, detached: the
        weights are still those of the step's start; verl's on-policy case), and from it their veto, token mask and
        min(xi, C), unnormalised (`_correct_fused` divides the gradient by their mean afterwards: the loss is linear
        in the weights). `gap`: replaying, the first optimizer step: metrics["train_gap"], max |logp - logp_sparse|
        over staleness-0 tokens. `rows` None: a padding slot (row 0 forwarded, a zero loss) that keeps the
        gradient reductions in step with the other ranks.

        Returns: (the loss to backpropagate, metrics: grpo_loss's, distill_kl with the dense teacher, train_gap)."""
        cfg, padding = self.cfg, rows is None
        rows = torch.zeros(1, dtype=torch.long) if padding else rows
        logp, r = self._trained_forward(t, rows, fused)
        metrics = {}
        if gap:   # the first optimizer step's forwards: the weights of logp_sparse
            fresh = t.mask[rows] & t.fresh[rows, None]
            metrics["train_gap"] = logp_gap(logp, t.batch.logp_sparse[rows].to(self.device), fresh)
        distill, distill_kl = self._distill_term(r, t.mask[rows], len(mb_rows), num_tokens)
        if padding:
            return logp.sum() * 0.0, metrics
        if fused:
            t.logp_old[rows] = logp.detach()
            weights, loss_mask, _ = sparse_correction(t.logp_old[rows], t.batch.logp_sparse[rows].to(self.device),
                                                      t.mask[rows], normalize=False, **self._correction_options())
        else:
            weights, loss_mask = t.weights[rows], t.loss_mask[rows]
        loss, m = grpo_loss(
            logp, t.logp_old[rows], t.advantages[rows], loss_mask, weights, num_seqs=len(mb_rows),
            num_tokens=num_tokens, logp_ref=None if t.logp_ref is None else t.logp_ref[rows],
            kl_coef=cfg.kl_coef, clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high)
        loss = loss + distill
        return (loss * self.world_size if self.world_size > 1 else loss), {**m, **distill_kl, **metrics}

    def _trained_forward(self, t: LossInputs, rows: torch.Tensor, fused: bool) -> tuple[torch.Tensor, dict | None]:
        """The differentiated log-probs of micro-batch `rows` ([n, T]) and, replaying, `_replay_forward`'s output
        (with the dense forward when `fused` or distill_coef > 0). `fused`: also the rows of t's entropy (and
        replaying logp_dense and accept_exact), as the recompute fills them."""
        if not self.replays(t.batch):
            if not fused:
                return self.response_logprobs(self.engine, t.batch, rows)[0], None
            logp, t.entropy[rows] = self.response_logprobs(self.engine, t.batch, rows, with_entropy=True)
            return logp, None
        r = self._replay_forward(t.batch, rows, grad=True, dense=fused or self.cfg.distill_coef > 0)
        if fused:
            t.entropy[rows] = r["entropy"]
            t.logp_dense[rows], t.accept_exact[rows] = r["logp_dense"], r["accept_exact"]
        return r["logp"], r

    def _distill_term(self, r: dict | None, mask: torch.Tensor, num_seqs: int,
                      num_tokens: float | None) -> tuple[torch.Tensor | float, dict[str, float]]:
        """distill_coef x the dense-teacher KL of `_replay_forward`'s output `r`, reduced like the policy loss, and
        {"distill_kl": the unscaled KL}; (0.0, {}) without it."""
        if r is None or "distill" not in r:
            return 0.0, {}
        term = aggregate(r["distill"], mask, num_seqs, num_tokens)
        return self.cfg.distill_coef * term, {"distill_kl": float(term.detach())}

    def _correct_fused(self, groups: list[TrajectoryGroup], t: LossInputs) -> float:
        """After a fused step's last backward (its micro-batches filled t's logp_old): the correction over the
        whole step, as `_prepare` does, and the authors' normalisation by the batch mean of min(xi, C) applied to
        the summed gradient (so the update is the two-pass step's, one no-grad forward of the batch fewer).
        Returns that mean, 0.0 when none is applied."""
        self._correct(groups, t)
        applied = "replay_tis_weight_mean" if self.replays(t.batch) else "tis_weight_mean"   # of the weights used
        mean_weight = t.metrics.get(applied, 0.0) if self.cfg.correction == "on" else 0.0
        if mean_weight > 0:
            for p in self.engine.module.parameters():
                if p.grad is not None:
                    p.grad.div_(mean_weight)
        return mean_weight

    def _optimizer_step(self) -> float | None:
        """engine.step() over the micro-batches backpropagated since the last one (one optimizer step); returns
        the global gradient norm before clipping, None where DeepSpeed records none."""
        norm = None
        if self.cfg.zero_stage == 0 and self.cfg.dtype == "fp32":   # DeepSpeed records no norm on this path
            norm = torch.nn.utils.get_total_norm(
                [p.grad for p in self.engine.module.parameters() if p.grad is not None])
        self.engine.step()
        norm = self.engine.get_global_grad_norm() if norm is None else norm
        return None if norm is None else float(norm)

    def step(self, groups: list[TrajectoryGroup], staleness: list[int]) -> dict[str, float]:
        """One learner step (SPEC §1-4) on `groups`, whose staleness (learner version at consumption minus
        the group's weight_version) the caller measured. Advances `version` by 1.

        With several ranks every rank calls `step` with the same `groups` (read once, by rank 0): each rank
        recomputes and backpropagates its token-balanced share, the correction, advantages and TIS
        normalisation are computed over the whole step, and the update equals the one-rank update. Reports
        the phases "backward" and "optimizer step" through the `phase` hook as each starts (PHASES).

        Returns the SPEC §4 metrics of the step (the same on every rank): rejection_rate, token_mask_fraction,
        truncate_fraction, mismatch_kl, mismatch_kl_k1, pg_loss, kl_loss, clip_fraction, entropy, grad_norm,
        staleness_mean/max, learner_tokens_per_s, reward_mean, response_length_mean, ...
        (the version after the step is `version`).
        Raises:
            ValueError: empty batch, len(staleness) != len(groups), or a malformed group (see `collate`).
            RuntimeError / DistBackendError: a collective with the other ranks failed or timed out.
        """
        cfg = self.cfg
        if not groups:
            raise ValueError("step needs at least one TrajectoryGroup")
        if len(staleness) != len(groups):
            raise ValueError(f"staleness has {len(staleness)} values for {len(groups)} groups")
        t0 = time.perf_counter()
        batch = self.collate(groups, staleness)
        fused = self.fusable(batch)   # logp_old from the training forward: no separate recompute
        t = self._prepare(groups, batch, recompute=not fused)
        totals = LossTotals(distill=cfg.distill_coef > 0 and self.replays(batch), gap=self.replays(batch) and not fused)
        seed = 0 if cfg.seed is None else cfg.seed      # None: a LearnerConfig built without a run config
        shuffle = torch.Generator().manual_seed(seed * 1_000_003 + self.version)
        grad_norms, optimizer_steps = [], 0
        self.engine.train()
        for _epoch in range(cfg.ppo_epochs):
            for mb_rows in torch.randperm(batch.size, generator=shuffle).split(cfg.minibatch_size or batch.size):
                self.phase("backward")
                num_tokens = self._num_tokens(t, mb_rows)
                gap = totals.train_gap is not None and optimizer_steps == 0   # later updates move the weights
                for rows in self._micro_rows(t, mb_rows):
                    loss, m = self._micro_batch(t, rows, mb_rows, num_tokens, fused, gap)
                    self.engine.backward(loss, scale_wrt_gas=False)
                    totals.add(m, padding=rows is None)
                if fused and (mean_weight := self._correct_fused(groups, t)) > 0:
                    totals.sums["pg_loss"] /= mean_weight
                self.phase("optimizer step")
                norm, optimizer_steps = self._optimizer_step(), optimizer_steps + 1
                if norm is not None:
                    grad_norms.append(norm)
        self.version += 1
        if self.world_size > 1:  # the loss metrics of every rank's share; micro-step means over all ranks
            totals.all_reduce(lambda x: all_reduce(x, self.world_size), self.device)
        elapsed, metrics = time.perf_counter() - t0, t.metrics
        if self.replays(batch):   # the trained forward's exactness (fused: the same forward as logp_old)
            metrics.update(train_gap_metrics(metrics, totals.train_gap, self.world_size, self.device))
        metrics.update(step_metrics(groups, staleness, t, totals, optimizer_steps, grad_norms, fused, self.world_size,
                                    elapsed))
        return metrics

    def gradients(self, groups: list[TrajectoryGroup]) -> dict[str, torch.Tensor]:
        """The full gradient of the GRPO loss over `groups` taken as one minibatch (the step's code path:
        recompute, correction, token-balanced split, micro-batches), gathered over the ranks, without an
        optimizer step: {Hugging Face name: float32 tensor of the parameter's full shape} of every trained
        parameter (with LoRA the adapter's), the same on every rank (a collective: every rank calls it). The
        gradients are then discarded; `version` is unchanged. For tests of split invariance and for debugging."""
        from deepspeed.utils import safe_get_full_grad  # deepspeed after DS_ACCELERATOR (init_distributed)

        t = self._prepare(groups, self.collate(groups))
        self.engine.train()
        self.phase("backward")
        everything = torch.arange(t.batch.size)
        num_tokens = self._num_tokens(t, everything)
        for rows in self._micro_rows(t, everything):
            loss, _ = self._micro_batch(t, rows, everything, num_tokens, fused=False, gap=False)
            self.engine.backward(loss, scale_wrt_gas=False)
        # the reduction engine.step() would run at its accumulation boundary, without the update after it
        if self.engine.zero_optimization_partition_gradients():
            self.engine.optimizer.finalize_gradient_accumulation_boundary()
        elif self.world_size > 1:
            self.engine.allreduce_gradients()
        grads = {}
        for name, p in self.engine.module.named_parameters():
            if not p.requires_grad:   # the frozen base under LoRA
                continue
            g = safe_get_full_grad(p)
            grads[name] = g.detach().float().clone().reshape(getattr(p, "ds_shape", p.shape))
        self.engine.zero_grad()
        return grads

    # ------------------------------------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes of training state this rank holds (learner.weights.state_bytes)."""
        return state_bytes(self.engine)

    def parameter_counts(self) -> dict[str, int]:
        """{"trainable": parameters the optimizer updates (with LoRA the adapter's), "total": every parameter of
        the model}, full counts (ZeRO-3: `ds_numel`, not this rank's partition)."""
        counts = {"trainable": 0, "total": 0}
        for p in self.engine.module.parameters():
            n = int(getattr(p, "ds_numel", p.numel()))
            counts["total"] += n
            counts["trainable"] += n if p.requires_grad else 0
        return counts

    def lora_identity(self) -> dict | None:
        """What a checkpoint of a LoRA run must be resumed with: learner.lora's settings (LoraConfig.settings) and
        the base's identity and hash (`base`); None for full fine-tuning."""
        return None if self.peft is None else {**self.cfg.lora.settings(), **self.base}

    def save_adapter(self, path: str | os.PathLike, adapter: dict[str, torch.Tensor]) -> None:
        """The adapter in peft's format (`adapter_config.json` + `adapter_model.safetensors`, loadable with
        `peft.PeftModel.from_pretrained(base, path)`) from its full tensors by Hugging Face name (`gather_buckets`
        with keep: ZeRO-3 gathered over the ranks). Raises ValueError without learner.lora."""
        if self.peft is None:
            raise ValueError("save_adapter: learner.lora is off (no adapter to save)")
        state = {f"base_model.model.{name}": t for name, t in adapter.items()}   # the PeftModel's own keys
        self.peft.save_pretrained(str(path), state_dict=state)

    def score(self, token_ids: list[list[int]]) -> list[np.ndarray]:
        """Teacher-forced log-probs of the current weights (version `version`), untempered: per sequence float32
        [len - 1], log p(token t | tokens before it), from the dense forward of the old-policy recompute
        (`response_logprobs` on the engine, no grad, the module in eval mode meanwhile): the weight-sync
        fingerprint's learner side (broker/fingerprint.py). ZeRO-3 over several ranks: a collective, every rank
        calls it with the same ids. Raises ValueError for no sequences or one shorter than 2 tokens."""
        batch = teacher_forced(token_ids)
        training = self.engine.module.training
        self.engine.module.eval()
        try:
            with torch.no_grad():
                logp = self.response_logprobs(self.engine, batch, torch.arange(batch.size))[0]
        finally:
            self.engine.module.train(training)
        return [row[:len(ids) - 1].float().cpu().numpy() for row, ids in zip(logp, token_ids)]

    def send_weights(self, sender: WeightSender, peers_gather: bool = False) -> dict[str, float]:
        """The learner's one weight export: the current weights (version `version`) through `sender`
        (learner.weights.WeightExport.send)."""
        return self.export.send(sender, self.version, peers_gather)

    def gather_buckets(self, bucket_mb: float, passes: int = 1, keep: bool = False) -> dict[str, torch.Tensor]:
        """The ZeRO-3 gathers of the weight-sync buckets, `passes` times, with `keep` the full weights by name
        (learner.weights.WeightExport.gather_buckets)."""
        return self.export.gather_buckets(bucket_mb, passes, keep)
