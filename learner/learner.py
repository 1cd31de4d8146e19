"""The DeepSpeed learner: dense recompute of pi_old (and pi_ref), Sparse-RL correction, GRPO update
(docs/SPEC.md §1-4). One `step` per batch of trajectory groups; each step advances the weight version.

Read `Learner.step` top to bottom: collate -> advantages -> recompute logp_old/logp_ref -> correction ->
PPO epochs x minibatches x micro-batches -> optimizer steps -> version += 1 -> metrics. An on-policy step
(`fusable`: one epoch, one minibatch) skips the recompute: its micro-batches' training forwards give logp_old
(`_backward_fused`).
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import time

import numpy as np
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from broker.schema import TrajectoryGroup
from broker.weight_sync import WeightSender
from learner.acceptance import acceptance_metrics
from learner.batching import micro_batches, token_balanced_split
from learner.config import LearnerConfig
from learner.correction import sparse_correction
from learner.distributed import TORCH_DTYPES, deepspeed_config, init_distributed
from learner.loss import grpo_advantages, grpo_loss
from learner.replay import ATTN_IMPLEMENTATION, collate_record, exact_acceptance, logp_gap, replay_metrics, teacher_kl
from learner.weights import WeightExport, state_bytes


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
    Attributes:
        version: int weight version; +1 per `step`. Checkpoints restore it.
        engine: the DeepSpeed engine. ref_model: frozen copy of the initial model, or None when kl_coef == 0.
    """

    def __init__(self, model: str | os.PathLike | nn.Module, cfg: LearnerConfig):
        init_distributed(timeout_s=cfg.collective_timeout_s)
        import deepspeed  # only after DS_ACCELERATOR is set (init_distributed, above)

        self.cfg = cfg
        if not isinstance(model, nn.Module):
            model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.dtype = TORCH_DTYPES[cfg.dtype]
        if cfg.policy_target == "sparse":  # SDPA, plus the eviction-record masks when a forward passes one
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.ref_model = None
        if cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).to(self.dtype).eval().requires_grad_(False)
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=deepspeed_config(cfg))
        self.device = self.engine.device
        self.export = WeightExport(self.engine, self.dtype, cfg.zero_stage)   # the weights, out (learner/weights.py)
        if self.ref_model is not None:
            self.ref_model.to(self.device)
        self.version = 0
        self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.checkpoint_state: dict = {}  # the client state of the checkpoint loaded last (learner.checkpoint)
        self._train_gap: float | None = None  # replay: the trained forward's exactness, during a step's first update

    # ------------------------------------------------------------------------------------------------------
    def collate(self, groups: list[TrajectoryGroup]) -> dict[str, torch.Tensor]:
        """Right-pad the groups' samples into tensors (S = samples over all groups, L = longest
        prompt + response, T = longest response):
        input_ids/attention_mask int64 [S, L]; response_ids int64 [S, T]; response_index int64 [S, T], the
        logit position predicting each response token (prompt_len - 1 + t); response_mask bool [S, T], True on the
        response tokens that are trained (the sample's `trainable` mask: a multi-turn rollout's observation and
        template tokens are False, context of the forward only, outside the loss, the correction and the metrics);
        logp_sparse float32 [S, T]; reward float32 [S]; group_index int64 [S]; temperature float32 [S];
        seq_len int64 [S]; and when every sample carries top-k log-probs of one width K (issue 22) topk_ids int64
        [S, T, K] and topk_logprobs float32 [S, T, K] (padding: id 0, log-prob -inf); with policy_target sparse
        and records on the samples, replay_evicted_at int32 [S, layers, heads, L] (learner/replay.py).

        Raises:
            ValueError: naming the group and sample whose logp_sparse length differs from its response, whose
                prompt is empty, or a group without samples / with temperature <= 0.
        """
        rows = []
        for g, group in enumerate(groups):
            if not group.samples:
                raise ValueError(f"group {group.group_id!r} has no samples")
            if not group.temperature > 0:
                raise ValueError(f"group {group.group_id!r}: temperature {group.temperature} must be > 0")
            for i, s in enumerate(group.samples):
                if len(s.logp_sparse) != len(s.response_ids):
                    raise ValueError(f"group {group.group_id!r} sample {i}: logp_sparse has {len(s.logp_sparse)} "
                                     f"values for {len(s.response_ids)} response tokens")
                if len(s.prompt_ids) == 0:
                    raise ValueError(f"group {group.group_id!r} sample {i}: empty prompt_ids")
                rows.append((g, group.temperature, s))
        S = len(rows)
        L = max(len(s.prompt_ids) + len(s.response_ids) for _, _, s in rows)
        T = max(1, max(len(s.response_ids) for _, _, s in rows))
        b = {
            "input_ids": torch.zeros(S, L, dtype=torch.long),
            "attention_mask": torch.zeros(S, L, dtype=torch.long),
            "response_ids": torch.zeros(S, T, dtype=torch.long),
            "response_index": torch.zeros(S, T, dtype=torch.long),
            "response_mask": torch.zeros(S, T, dtype=torch.bool),
            "logp_sparse": torch.zeros(S, T, dtype=torch.float32),
            "reward": torch.tensor([s.reward for _, _, s in rows], dtype=torch.float32),
            "group_index": torch.tensor([g for g, _, _ in rows], dtype=torch.long),
            "temperature": torch.tensor([t for _, t, _ in rows], dtype=torch.float32),
            "seq_len": torch.zeros(S, dtype=torch.long),
        }
        widths = {None if s.topk_ids is None else s.topk_ids.shape[1] for _, _, s in rows}
        K = widths.pop() if len(widths) == 1 else None
        if K:
            b["topk_ids"] = torch.zeros(S, T, K, dtype=torch.long)
            b["topk_logprobs"] = torch.full((S, T, K), float("-inf"))
        for i, (_, _, s) in enumerate(rows):
            P, R = len(s.prompt_ids), len(s.response_ids)
            if K:
                b["topk_ids"][i, :R] = torch.from_numpy(np.asarray(s.topk_ids, dtype=np.int64))
                b["topk_logprobs"][i, :R] = torch.from_numpy(np.asarray(s.topk_logprobs, dtype=np.float32))
            b["input_ids"][i, :P + R] = torch.from_numpy(
                np.concatenate([s.prompt_ids, s.response_ids]).astype(np.int64))
            b["attention_mask"][i, :P + R] = 1
            b["response_ids"][i, :R] = torch.from_numpy(np.asarray(s.response_ids, dtype=np.int64))
            b["response_index"][i, :R] = torch.arange(P - 1, P - 1 + R)
            b["response_mask"][i, :R] = True if s.trainable is None else torch.from_numpy(np.asarray(s.trainable) != 0)
            b["logp_sparse"][i, :R] = torch.from_numpy(np.array(s.logp_sparse, dtype=np.float32))
            b["seq_len"][i] = P + R
        records = [s.eviction_steps for _, _, s in rows]
        if self.cfg.policy_target == "sparse" and any(r is not None for r in records):
            present = [r for r in records if r is not None]
            b["replay_evicted_at"] = collate_record(records, [len(s.prompt_ids) for _, _, s in rows], L,
                                                    present[0].shape[0], max(r.shape[1] for r in present))
        return b

    def response_logprobs(self, model: nn.Module, batch: dict, rows: torch.Tensor,
                          with_entropy: bool = False, topk_ids: torch.Tensor | None = None) -> tuple:
        """log pi(response token) for `rows` of a collated batch, from one teacher-forced forward of `model`
        with logits divided by each sequence's sampler temperature (SPEC §3).

        Returns: logp float32 [len(rows), T] (0 on padding), and the per-token entropy (no grad) or None; with
        `topk_ids` (int64 [len(rows), T, K], the sampler's top-k tokens) a third element, log pi at those ids
        float32 [len(rows), T, K] (no grad; for learner/acceptance.py).
        """
        log_probs = self.log_probs(model, batch, rows)
        logp = self._at_response(log_probs, batch, rows)
        entropy = _entropy(log_probs, batch["response_mask"][rows].to(self.device)) if with_entropy else None
        if topk_ids is not None:
            return logp, entropy, log_probs.detach().gather(2, topk_ids.to(self.device))
        return logp, entropy

    def log_probs(self, model: nn.Module, batch: dict, rows: torch.Tensor, replay: bool = False) -> torch.Tensor:
        """float32 [len(rows), T, V]: log_softmax(logits / temperature) at the positions predicting each response
        token (padding slots: any valid position), from one teacher-forced forward of `model`; with `replay`, the
        forward hides the keys each sample's eviction record says its sampler no longer saw (learner/replay.py)."""
        L = int(batch["seq_len"][rows].max())
        index = batch["response_index"][rows].to(self.device)
        # the lm_head runs only over the window of positions that predict response tokens (HF
        # `logits_to_keep` with explicit indices): no logits for the prompts, far less memory and time
        start = int(index[:, 0].min())
        window = torch.arange(start, max(L - 1, start + 1), device=self.device)
        extra = {"replay_evicted_at": batch["replay_evicted_at"][rows, :, :, :L].to(self.device)} if replay else {}
        logits = model(input_ids=batch["input_ids"][rows, :L].to(self.device),
                       attention_mask=batch["attention_mask"][rows, :L].to(self.device),
                       logits_to_keep=window, **extra).logits
        index = (index - start).clamp(0, logits.shape[1] - 1)   # padding slots point anywhere valid
        logits = logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1])).float()
        temperature = batch["temperature"][rows]
        if not bool((temperature == 1).all()):
            logits = logits / temperature.to(self.device)[:, None, None]
        return torch.log_softmax(logits, dim=-1)

    def _at_response(self, log_probs: torch.Tensor, batch: dict, rows: torch.Tensor) -> torch.Tensor:
        """log_probs [n, T, V] at the response tokens of `rows`: float32 [n, T], 0 on padding."""
        mask = batch["response_mask"][rows].to(self.device)
        return log_probs.gather(2, batch["response_ids"][rows].to(self.device)[:, :, None]).squeeze(2) * mask

    def replays(self, batch: dict) -> bool:
        """Whether steps on `batch` replay the rollouts' evictions (policy_target sparse, records present)."""
        return self.cfg.policy_target == "sparse" and "replay_evicted_at" in batch

    def _replay_buffers(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The step-wide tensors a replaying step fills per micro-batch: logp_dense and accept_exact, [S, T]."""
        return {name: torch.zeros(mask.shape, device=self.device) for name in ("logp_dense", "accept_exact")}

    def _replay_forward(self, batch: dict, rows: torch.Tensor, grad: bool, dense: bool = True) -> dict:
        """Eviction replay's forwards of micro-batch `rows`: the replayed one (differentiated when `grad`) and,
        with `dense`, one no-grad dense forward. Returns logp (replayed, [n, T]), entropy (replayed, no grad) and,
        with `dense`, logp_dense [n, T], accept_exact [n, T] (Sparrow's sum_v min(p, q) from both whole
        distributions), dense_topk [n, T, K] when the batch has top-k ids, and with grad and distill_coef > 0
        distill [n, T] = KL(pi_dense || pi_replayed) per token (differentiable); all 0 on padding."""
        mask = batch["response_mask"][rows].to(self.device)
        with contextlib.nullcontext() if grad else torch.no_grad():
            replayed = self.log_probs(self.engine, batch, rows, replay=True)
        out = {"logp": self._at_response(replayed, batch, rows), "entropy": _entropy(replayed, mask)}
        if not dense:
            return out
        with torch.no_grad():
            full = self.log_probs(self.engine, batch, rows)
        out.update(logp_dense=self._at_response(full, batch, rows),
                   accept_exact=exact_acceptance(full, replayed) * mask)
        if "topk_ids" in batch:
            out["dense_topk"] = full.gather(2, batch["topk_ids"][rows].to(self.device))
        if grad and self.cfg.distill_coef > 0:
            out["distill"] = teacher_kl(full, replayed) * mask
        return out

    # ------------------------------------------------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the learner ranks, in place (no-op with one rank); returns it."""
        if self.world_size > 1:
            torch.distributed.all_reduce(t)
        return t

    def _prepare(self, groups: list[TrajectoryGroup], batch: dict, recompute: bool = True) -> dict:
        """The collated `batch` with mask bool [S, T] and GRPO advantages float32 [S] over the *whole* step; with
        `recompute`, also logp_old (and logp_ref) from a no-grad forward over this rank's token-balanced share,
        summed over the ranks, then correction weights, loss mask and correction metrics over the whole step:
        every rank holds the same tensors, whatever the number of ranks (SPEC §2-3). Returns a dict of the
        batch plus advantages and mask, and with `recompute` logp_old/entropy/logp_ref float32 [S, T],
        weights/loss_mask float32 [S, T] and `metrics` (without it `_backward_fused` adds them)."""
        cfg = self.cfg
        S = batch["input_ids"].shape[0]
        mask = batch["response_mask"].to(self.device)
        advantages = grpo_advantages(batch["reward"], batch["group_index"], cfg.norm_adv_by_std).to(self.device)
        fresh = batch.get("fresh", torch.ones(S, dtype=torch.bool)).to(self.device)   # rows of staleness 0
        prep = {**batch, "mask": mask, "advantages": advantages, "fresh": fresh}
        if not recompute:
            return prep

        # dense recompute of pi_old (and pi_ref) with the weights held at the start of the step
        logp_old = torch.zeros(mask.shape, device=self.device)
        entropy = torch.zeros(mask.shape, device=self.device)
        logp_ref = torch.zeros(mask.shape, device=self.device) if self.ref_model is not None else None
        dense_topk = torch.zeros(batch["topk_ids"].shape, device=self.device) if "topk_ids" in batch else None
        replay = self._replay_buffers(mask) if self.replays(batch) else None
        shares = token_balanced_split(torch.arange(S), batch["seq_len"], self.world_size)
        with torch.no_grad():
            for rows in micro_batches(shares, cfg.micro_batch_size, self.rank):
                if rows is None:  # keeps ZeRO-3's parameter gathers in step with the other ranks
                    if replay is not None:
                        self._replay_forward(batch, torch.zeros(1, dtype=torch.long), grad=False)
                    else:
                        self.response_logprobs(self.engine, batch, torch.zeros(1, dtype=torch.long))
                    continue
                if replay is not None:   # logp_old replayed; the dense forward for the mismatch metrics
                    r = self._replay_forward(batch, rows, grad=False)
                    logp_old[rows], entropy[rows] = r["logp"], r["entropy"]
                    replay["logp_dense"][rows], replay["accept_exact"][rows] = r["logp_dense"], r["accept_exact"]
                    if dense_topk is not None:
                        dense_topk[rows] = r["dense_topk"]
                elif dense_topk is not None:   # dense log-probs at the sampler's top-k tokens (acceptance rate)
                    logp_old[rows], entropy[rows], dense_topk[rows] = self.response_logprobs(
                        self.engine, batch, rows, with_entropy=True, topk_ids=batch["topk_ids"][rows])
                else:
                    logp_old[rows], entropy[rows] = self.response_logprobs(self.engine, batch, rows, with_entropy=True)
                if logp_ref is not None:
                    logp_ref[rows], _ = self.response_logprobs(self.ref_model, batch, rows)
        for t in (logp_old, entropy, logp_ref, dense_topk, *(replay or {}).values()):
            if t is not None:   # each row is non-zero on one rank: the sum is exact
                self._all_reduce(t)
        prep.update(logp_old=logp_old, entropy=entropy, logp_ref=logp_ref, **(replay or {}))
        prep.update(self._correct(groups, prep, dense_topk))
        return prep

    def _correction_options(self) -> dict:
        """The keyword arguments of `sparse_correction` this learner's config sets."""
        c = self.cfg
        return dict(correction=c.correction, rejection=c.rejection, eps=c.eps, geo_bounds=c.geo_bounds,
                    token_mask=c.token_mask, token_mask_bounds=c.token_mask_bounds, tis_cap=c.tis_cap)

    def _correct(self, groups: list[TrajectoryGroup], prep: dict, dense_topk: torch.Tensor | None = None) -> dict:
        """Correction weights, loss mask and metrics (SPEC §2, §4; per tier; Sparrow's acceptance rate when
        `dense_topk` is given) from prep's logp_old over the whole step: {weights, loss_mask, metrics}."""
        logp_sparse = prep["logp_sparse"].to(self.device)
        weights, loss_mask, metrics = sparse_correction(prep["logp_old"], logp_sparse, prep["mask"],
                                                        **self._correction_options())
        dense = prep.get("logp_dense", prep["logp_old"])   # the mismatch metrics compare the sampler with pi_dense
        if "logp_dense" in prep:
            applied = metrics
            _, _, metrics = sparse_correction(dense, logp_sparse, prep["mask"], **self._correction_options())
            metrics.update(replay_metrics(prep["logp_old"], dense, logp_sparse, prep["mask"], prep["fresh"],
                                          prep["accept_exact"], applied))
        metrics.update(self._tier_metrics(groups, dense, logp_sparse, prep["mask"]))
        if dense_topk is not None:   # Sparrow's per-token acceptance rate (issue 22): accept_*
            metrics.update(acceptance_metrics(prep["topk_logprobs"].to(self.device), dense_topk, prep["mask"]))
        return {"weights": weights, "loss_mask": loss_mask, "metrics": metrics}

    def fusable(self, batch: dict) -> bool:
        """Whether a step on `batch` (collated) takes logp_old from its training forward (`learner.fuse_logp_old`):
        on-policy (one PPO epoch, one minibatch), one rank, ZeRO stage 0, fp32 (the gradients are the
        parameters' .grad), no reference model, no top-k log-probs to score."""
        cfg = self.cfg
        one_minibatch = cfg.minibatch_size == 0 or cfg.minibatch_size >= batch["input_ids"].shape[0]
        return (cfg.fuse_logp_old and cfg.ppo_epochs == 1 and one_minibatch and self.world_size == 1
                and cfg.zero_stage == 0 and cfg.dtype == "fp32" and self.ref_model is None and "topk_ids" not in batch)

    def _num_tokens(self, prep: dict, mb_rows: torch.Tensor) -> float | None:
        """T_N of token-mean, every response token of minibatch `mb_rows` on all ranks (SPEC §3); None for
        seq-mean-token-mean."""
        if self.cfg.loss_agg_mode != "token-mean":
            return None
        return max(float(prep["mask"][mb_rows].sum()), 1.0)

    def _backward(self, prep: dict, mb_rows: torch.Tensor, sums: dict, means: dict) -> int:
        """Forward/backward of this rank's token-balanced share of minibatch `mb_rows`, in micro-batches. Each
        micro loss is normalised by the sequences of the whole minibatch (token-mean: by its response tokens, T_N)
        and multiplied by the number of ranks (DeepSpeed averages gradients over ranks), so the summed gradient
        is the one-rank gradient. Adds the loss metrics to `sums`/`means`; returns the number of real
        (non-padding) micro-batches."""
        cfg = self.cfg
        shares = token_balanced_split(mb_rows, prep["seq_len"], self.world_size)
        num_tokens = self._num_tokens(prep, mb_rows)
        count = 0
        for rows in micro_batches(shares, cfg.micro_batch_size, self.rank):
            if rows is None:  # nothing left on this rank: a zero loss keeps the gradient reductions in step
                logp, _ = self._trained_logp(prep, torch.zeros(1, dtype=torch.long), len(mb_rows), num_tokens, {})
                self.engine.backward(logp.sum() * 0.0, scale_wrt_gas=False)
                continue
            logp, distill = self._trained_logp(prep, rows, len(mb_rows), num_tokens, sums)
            logp_ref = prep["logp_ref"]
            loss, m = grpo_loss(
                logp, prep["logp_old"][rows], prep["advantages"][rows], prep["loss_mask"][rows],
                prep["weights"][rows], num_seqs=len(mb_rows), num_tokens=num_tokens,
                logp_ref=None if logp_ref is None else logp_ref[rows],
                kl_coef=cfg.kl_coef, clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high)
            loss = loss + distill
            self.engine.backward(loss * self.world_size if self.world_size > 1 else loss, scale_wrt_gas=False)
            for k in sums:
                sums[k] += m.get(k, 0.0)   # distill_kl: added by the replay branch itself
            for k in means:
                means[k] += m[k]
            count += 1
        return count

    def _trained_logp(self, prep: dict, rows: torch.Tensor, num_seqs: int, num_tokens: float | None,
                      sums: dict) -> tuple[torch.Tensor, torch.Tensor | float]:
        """The differentiated log-probs of micro-batch `rows` ([n, T]) and the dense-teacher loss term (0 without
        it). Replaying, the first optimizer step's forwards also give the exactness check of the trained forward
        (`self._train_gap`: max |logp - logp_sparse| over staleness-0 tokens) and sums["distill_kl"]."""
        if not self.replays(prep):
            return self.response_logprobs(self.engine, prep, rows)[0], 0.0
        r = self._replay_forward(prep, rows, grad=True, dense=self.cfg.distill_coef > 0)
        if self._train_gap is not None:   # the first optimizer step's forwards: the weights of logp_sparse
            fresh = prep["mask"][rows] & prep["fresh"][rows, None]
            self._train_gap = max(self._train_gap,
                                  logp_gap(r["logp"], prep["logp_sparse"][rows].to(self.device), fresh))
        return r["logp"], self._distill_term(r, prep["mask"][rows], num_seqs, num_tokens, sums)

    def _distill_term(self, r: dict, mask: torch.Tensor, num_seqs: int, num_tokens: float | None,
                      sums: dict) -> torch.Tensor | float:
        """distill_coef x the dense-teacher KL of `_replay_forward`'s output `r`, reduced like the policy loss (0
        without it); adds the unscaled KL to sums["distill_kl"]."""
        if "distill" not in r:
            return 0.0
        term = self._aggregate(r["distill"], mask, num_seqs, num_tokens)
        sums["distill_kl"] = sums.get("distill_kl", 0.0) + float(term.detach())
        return self.cfg.distill_coef * term

    @staticmethod
    def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, num_seqs: int, num_tokens: float | None):
        """A per-token loss [n, T] reduced as the policy loss is (SPEC §3): each sequence's token mean over the
        minibatch's num_seqs sequences, or, token-mean, the sum over its num_tokens response tokens."""
        maskf = mask.float()
        if num_tokens is not None:
            return (per_token * maskf).sum() / num_tokens
        return ((per_token * maskf).sum(1) / maskf.sum(1).clamp(min=1)).sum() / num_seqs

    def _backward_fused(self, groups: list[TrajectoryGroup], prep: dict, mb_rows: torch.Tensor, sums: dict,
                        means: dict) -> int:
        """`_prepare`'s recompute and `_backward` in one pass (`fusable` steps): each micro-batch's training
        forward gives logp_old (its value, detached: the weights are still those of the step's start; verl's
        on-policy case), and from it the micro-batch's veto, token mask and min(xi, C), unnormalised; after the
        last backward, the correction over the whole step fills `prep` as `_prepare` does, and the gradient is
        multiplied by 1 / (the step's mean of min(xi, C)). The loss is linear in the weights, so this is the
        update of the two-pass step, one no-grad forward of the batch fewer. Returns the micro-batches run."""
        cfg = self.cfg
        mask = prep["mask"]
        logp_old = torch.zeros(mask.shape, device=self.device)
        entropy = torch.zeros(mask.shape, device=self.device)
        num_tokens = self._num_tokens(prep, mb_rows)
        micro = mb_rows.split(cfg.micro_batch_size)
        replay = self._replay_buffers(mask) if self.replays(prep) else None
        for rows in micro:
            distill = 0.0
            if replay is not None:   # the replayed training forward, and the dense one for the metrics
                r = self._replay_forward(prep, rows, grad=True)
                logp, entropy[rows] = r["logp"], r["entropy"]
                replay["logp_dense"][rows], replay["accept_exact"][rows] = r["logp_dense"], r["accept_exact"]
                distill = self._distill_term(r, mask[rows], len(mb_rows), num_tokens, sums)
            else:
                logp, entropy[rows] = self.response_logprobs(self.engine, prep, rows, with_entropy=True)
            logp_old[rows] = logp.detach()
            truncated, keep, _ = sparse_correction(logp_old[rows], prep["logp_sparse"][rows].to(self.device),
                                                   mask[rows], normalize=False, **self._correction_options())
            loss, m = grpo_loss(logp, logp_old[rows], prep["advantages"][rows], keep, truncated,
                                num_seqs=len(mb_rows), num_tokens=num_tokens, clip_eps=cfg.clip_eps,
                                clip_eps_high=cfg.clip_eps_high)
            self.engine.backward(loss + distill, scale_wrt_gas=False)
            for k in sums:
                sums[k] += m.get(k, 0.0)   # distill_kl: added by the replay branch itself
            for k in means:
                means[k] += m[k]
        prep.update(logp_old=logp_old, entropy=entropy, logp_ref=None, **(replay or {}))
        prep.update(self._correct(groups, prep))
        applied = "replay_tis_weight_mean" if replay is not None else "tis_weight_mean"   # of the weights used
        mean_weight = prep["metrics"].get(applied, 0.0) if cfg.correction == "on" else 0.0
        if mean_weight > 0:   # the authors' normalisation by the batch mean, applied to the summed gradient
            for p in self.engine.module.parameters():
                if p.grad is not None:
                    p.grad.div_(mean_weight)
            sums["pg_loss"] /= mean_weight
        return len(micro)

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
        normalisation are computed over the whole step, and the update equals the one-rank update.

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
        batch = self.collate(groups)
        batch["fresh"] = torch.tensor([staleness[g] == 0 for g in batch["group_index"].tolist()])
        fused = self.fusable(batch)   # logp_old from the training forward: no separate recompute
        self._train_gap = 0.0 if self.replays(batch) and not fused else None
        prep = self._prepare(groups, batch, recompute=not fused)
        S, mask = prep["input_ids"].shape[0], prep["mask"]

        minibatch = cfg.minibatch_size or S
        shuffle = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.version)
        sums = {"pg_loss": 0.0, "kl_loss": 0.0}
        if cfg.distill_coef > 0 and self.replays(batch):
            sums["distill_kl"] = 0.0
        means = {"clip_fraction": 0.0, "ppo_kl": 0.0, "ratio_mean": 0.0}
        grad_norms, micro_steps, optimizer_steps, train_gap = [], 0, 0, None
        self.engine.train()
        for _epoch in range(cfg.ppo_epochs):
            order = torch.randperm(S, generator=shuffle)
            for mb_rows in order.split(minibatch):
                if fused:
                    micro_steps += self._backward_fused(groups, prep, mb_rows, sums, means)
                else:
                    micro_steps += self._backward(prep, mb_rows, sums, means)
                norm, optimizer_steps = self._optimizer_step(), optimizer_steps + 1
                if optimizer_steps == 1:   # later updates move the weights away from the sampler's
                    train_gap, self._train_gap = self._train_gap, None
                if norm is not None:
                    grad_norms.append(norm)
        self.version += 1
        if self.world_size > 1:  # the loss metrics of every rank's share; micro-step means over all ranks
            names = [*sums, *means]
            totals = self._all_reduce(torch.tensor([*sums.values(), *means.values(), micro_steps],
                                                   dtype=torch.float64, device=self.device)).tolist()
            sums = dict(zip(names[:len(sums)], totals[:len(sums)]))
            means = dict(zip(names[len(sums):], totals[len(sums):-1]))
            micro_steps = totals[-1]
        elapsed = time.perf_counter() - t0

        metrics = prep["metrics"]
        if self.replays(batch):   # the trained forward's exactness (fused: the same forward as logp_old)
            metrics.update(self._train_gap_metrics(metrics, None if fused else train_gap))
        validf = mask.float()
        response_len = prep["response_mask"].sum(1).float()
        metrics.update({k: v / optimizer_steps for k, v in sums.items()})
        metrics.update({k: v / max(micro_steps, 1) for k, v in means.items()})
        truncated = [s.finish_reason == "length" for g in groups for s in g.samples]
        kv_ratio = [s.kv_retained_tokens / max(1, len(s.prompt_ids) + len(s.response_ids))
                    for g in groups for s in g.samples]
        entropy = prep["entropy"]
        metrics.update({
            "entropy": ((entropy * validf).sum() / validf.sum().clamp(min=1)).item(),
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
            "optimizer_steps": optimizer_steps,
            "staleness_mean": float(np.mean(staleness)),
            "staleness_max": float(np.max(staleness)),
            "reward_mean": prep["reward"].mean().item(),
            "response_length_mean": response_len.mean().item(),
            "response_truncated_fraction": float(np.mean(truncated)),
            "kv_retained_ratio": float(np.mean(kv_ratio)),
            "kv_peak_bytes_mean": float(np.mean([s.kv_peak_bytes for g in groups for s in g.samples])),
            "kv_budget": float(np.mean([g.kv_budget for g in groups])),
            "num_sequences": S,
            "learner_ranks": self.world_size,
            "logp_old_fused": float(fused),
            "learner_step_s": elapsed,
            "learner_tokens_per_s": prep["seq_len"].sum().item() / elapsed,
        })
        return metrics

    def _train_gap_metrics(self, metrics: dict, train_gap: float | None) -> dict[str, float]:
        """replay_logp_train_max_abs (max |trained forward's logp - logp_sparse| over staleness-0 tokens, first
        optimizer step; the fused step's training forward is logp_old's) and replay_logp_max_abs, the larger of it
        and replay_logp_old_max_abs: what must stay <= 1e-4 in fp32 at max_staleness 0 (SPEC §4)."""
        old = metrics["replay_logp_old_max_abs"]
        if train_gap is None:
            train = old
        else:
            train = float(self._all_reduce_max(torch.tensor([train_gap], dtype=torch.float64, device=self.device)))
            if math.isnan(old):
                train = float("nan")
        worst = float("nan") if math.isnan(old) or math.isnan(train) else max(old, train)
        return {"replay_logp_train_max_abs": train, "replay_logp_max_abs": worst}

    def _all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """The maximum of `t` over the learner ranks, in place (no-op with one rank); returns it."""
        if self.world_size > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t

    def _tier_metrics(self, groups, logp_old, logp_sparse, mask) -> dict[str, float]:
        """Per difficulty tier (groups' budget_tier, issue 13): tier/<name>/rejection_rate and
        tier/<name>/xi_sym_p5, the correction's metrics over that tier's sequences only; {} with tiers off."""
        tiers = sorted({g.budget_tier for g in groups} - {""})
        if not tiers or self.cfg.correction == "off":
            return {}
        row_tier = [g.budget_tier for g in groups for _ in g.samples]
        out = {}
        for tier in tiers:
            rows = torch.tensor([i for i, t in enumerate(row_tier) if t == tier], device=logp_old.device)
            _, _, m = sparse_correction(logp_old[rows], logp_sparse[rows], mask[rows], correction="metrics_only",
                                        rejection=self.cfg.rejection, eps=self.cfg.eps, geo_bounds=self.cfg.geo_bounds)
            out[f"tier/{tier}/rejection_rate"] = m["rejection_rate"]
            out[f"tier/{tier}/xi_sym_p5"] = m["xi_sym_p5"]
        return out

    def gradients(self, groups: list[TrajectoryGroup]) -> dict[str, torch.Tensor]:
        """The full gradient of the GRPO loss over `groups` taken as one minibatch (the step's code path:
        recompute, correction, token-balanced split, micro-batches), gathered over the ranks, without an
        optimizer step: {Hugging Face name: float32 tensor of the parameter's full shape}, the same on every
        rank (a collective: every rank calls it). The gradients are then discarded; `version` is unchanged.
        For tests of split invariance and for debugging."""
        from deepspeed.utils import safe_get_full_grad  # deepspeed after DS_ACCELERATOR (init_distributed)

        prep = self._prepare(groups, self.collate(groups))
        self.engine.train()
        self._backward(prep, torch.arange(prep["input_ids"].shape[0]),
                       {"pg_loss": 0.0, "kl_loss": 0.0}, {"clip_fraction": 0.0, "ppo_kl": 0.0, "ratio_mean": 0.0})
        # the reduction engine.step() would run at its accumulation boundary, without the update after it
        if self.engine.zero_optimization_partition_gradients():
            self.engine.optimizer.finalize_gradient_accumulation_boundary()
        elif self.world_size > 1:
            self.engine.allreduce_gradients()
        grads = {}
        for name, p in self.engine.module.named_parameters():
            g = safe_get_full_grad(p)
            grads[name] = g.detach().float().clone().reshape(getattr(p, "ds_shape", p.shape))
        self.engine.zero_grad()
        return grads

    # ------------------------------------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes of training state this rank holds (learner.weights.state_bytes)."""
        return state_bytes(self.engine)

    def send_weights(self, sender: WeightSender, peers_gather: bool = False) -> dict[str, float]:
        """The learner's one weight export: the current weights (version `version`) through `sender`
        (learner.weights.WeightExport.send)."""
        return self.export.send(sender, self.version, peers_gather)

    def gather_buckets(self, bucket_mb: float, passes: int = 1, keep: bool = False) -> dict[str, torch.Tensor]:
        """The ZeRO-3 gathers of the weight-sync buckets, `passes` times, with `keep` the full weights by name
        (learner.weights.WeightExport.gather_buckets)."""
        return self.export.gather_buckets(bucket_mb, passes, keep)
