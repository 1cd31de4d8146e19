"""Typed config of the learner: optimiser, DeepSpeed, correction (docs/SPEC.md §2), loss (§3),
checkpoints and weight sync."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from broker.lora import LoraConfig

REJECTIONS = ("veto", "geometric", "none")
FILTERS = ("none", "zero_variance")
CORRECTIONS = ("on", "metrics_only", "off")
DTYPES = ("fp32", "bf16")
BACKENDS = ("auto", "gloo", "nccl")
PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
LOSS_AGG_MODES = ("seq-mean-token-mean", "token-mean")
POLICY_TARGETS = ("dense", "sparse")
FINGERPRINT_MODES = ("error", "warn", "off")


@dataclass
class LearnerConfig:
    # --- optimiser -------------------------------------------------------------------------------------
    lr: float = 1e-6
    """AdamW learning rate (SPEC §6: 1e-6 in the authors' runs)."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW (beta1, beta2)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    adam_eps: float = 1e-8
    """AdamW denominator epsilon."""
    grad_clip: float = 1.0
    """Global gradient-norm clip applied by DeepSpeed before each optimizer step (0 = off)."""

    # --- engine ------------------------------------------------------------------------------------------
    ranks: int = 1
    """Learner processes (data-parallel ranks): Ray actors in one placement group, one torch.distributed group
    (NCCL on GPUs, gloo on CPUs), one DeepSpeed engine over them. Each rank gets train.learner_num_cpus /
    train.learner_num_gpus. A step over N ranks is the same update as over one. N > 1 needs zero_stage >= 1."""
    placement: str = "PACK"
    """Ray placement-group strategy of the learner ranks: PACK (as few nodes as possible) | SPREAD |
    STRICT_PACK (one node) | STRICT_SPREAD (one rank per node)."""
    collective_timeout_s: float = 600.0
    """Timeout of every collective among the learner ranks, seconds: a rank that dies or hangs fails the
    step within this time, naming the rank, and nothing of the step is acknowledged."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3. With one rank, stages > 0 partition nothing and cost time (bench/learner.py:
    ~1.0x plain torch at 0, ~0.9x at 1); with N ranks stage 1 shards the optimizer state, 2 also the
    gradients, 3 also the parameters (about 1/N of the per-rank state: bench/learner.py
    zero3_state_bytes_per_rank_ratio). Stage 3 parameters are gathered bucket by bucket for the weight sync."""
    dtype: str = "fp32"
    """Training dtype: fp32 | bf16 (fp16 does not run on CPU). Weights are broadcast in this dtype."""

    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA instead of full fine-tuning (broker/lora.py; off by default: lora.rank 0): only the adapter is trained,
    held by the optimizer and sent to the actors; the KL reference is the model with the adapter disabled. LoRA
    usually wants a learning rate ~10x full fine-tuning's (the preflight warns when lr is left at 1e-6)."""

    # --- PPO loop ------------------------------------------------------------------------------------------
    ppo_epochs: int = 1
    """Passes over the step's batch."""
    minibatch_size: int = 0
    """Sequences per optimizer step (0 = the whole batch of the step: one optimizer step per epoch)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward; a minibatch accumulates gradients over its micro-batches."""
    fuse_logp_old: bool = True
    """On-policy steps (one PPO epoch, one minibatch) take logp_old from the training forward itself (its
    detached value; verl's `on_policy` case) instead of a separate no-grad forward of the batch first: about a
    quarter of a step's compute saved, the same update (the TIS weights' batch mean is applied to the summed
    gradient; SPEC §3). Only with one rank, ZeRO stage 0, fp32, kl_coef 0 and no top-k log-probs; otherwise,
    and with false, the step recomputes logp_old first. The step's metric `logp_old_fused` says which ran."""
    clip_eps: float = 0.2
    """PPO ratio clip below 1: r is clipped to [1 - clip_eps, 1 + clip_eps_high] (SPEC §3)."""
    clip_eps_high: float = 0.2
    """PPO ratio clip above 1."""
    norm_adv_by_std: bool = True
    """GRPO's advantage divides by the group's reward std (SPEC §3; the paper's). False: A = R - mean (Dr. GRPO,
    verl's `norm_adv_by_std_in_grpo`); with a graded reward near 1, a group of [1, 1, 1, 0.95] then gives
    advantages of a few hundredths, not +-1.5."""
    loss_agg_mode: str = "seq-mean-token-mean"
    """How token losses are reduced (verl's `loss_agg_mode`, SPEC §3): seq-mean-token-mean (GRPO's; slime's
    default, which the Sparse-RL authors' scripts use) averages each sequence's tokens, then the sequences;
    token-mean (DAPO section 3.3, verl's default) averages over every response token of the minibatch, so a
    long response weighs by its length and running on past the answer is not diluted per token."""
    kl_coef: float = 1e-4
    """beta of the k3 KL to the frozen reference (SPEC §3). 0 skips the reference model entirely."""

    # --- dynamic sampling (DAPO) ---------------------------------------------------------------------------
    filter_groups: str = "none"
    """none | zero_variance: groups whose G rewards are all equal (zero advantage, no policy gradient) are not
    trained but counted (`groups_filtered`); the step is filled with informative groups (DAPO's dynamic
    sampling, verl `filter_groups`), reading at most max_extra_reads more groups than train.groups_per_step,
    and admission control admits more groups per step by the filtered share seen so far."""
    max_extra_reads: int = 16
    """With filter_groups=zero_variance: groups a step may read beyond train.groups_per_step to replace
    filtered ones; then it trains what it has (`filter_shortfall` says how many it lacked)."""

    # --- Sparse-RL correction (SPEC §2) --------------------------------------------------------------------
    correction: str = "on"
    """on: veto + token mask + truncated weights | metrics_only: compute every metric, correct nothing |
    off: naive sparse GRPO (the paper's collapsing baseline), no mismatch metrics either."""
    rejection: str = "veto"
    """veto: reject a trajectory if any token has xi < eps | geometric: reject if the geometric mean of xi
    over the sequence is outside geo_bounds | none."""
    eps: float = 1e-4
    """Veto threshold on xi = pi_old / pi_sparse (one-sided; 5e-5 suggested for 7B models)."""
    geo_bounds: tuple[float, float] = (0.5, 2.0)
    """(low, high) bounds on the per-sequence geometric mean of xi for rejection='geometric'."""
    token_mask: bool = True
    """Mask out tokens whose xi is outside token_mask_bounds (the authors' default)."""
    token_mask_bounds: tuple[float, float] = (0.5, 1.5)
    """(low, high) of the token mask on xi."""
    tis_cap: float = 1.5
    """C of truncated importance sampling: w = min(xi, C), then divided by its batch mean."""

    # --- eviction replay (SPEC §2.4, learner/replay.py) -----------------------------------------------------
    policy_target: str = "dense"
    """Which policy the step trains. dense (the paper's): logp_old and the trained log-probs come from the full
    context, and the correction above corrects pi_sparse -> pi_old. sparse: eviction replay: both forwards hide,
    per layer and KV head, exactly the keys the rollout's compressor evicted (each sample's record, which the
    actors then send), so they are the compressed sampler's own log-probs, the ratio is on-policy and xi
    measures staleness only; the correction is applied to that xi (a no-op at staleness 0). The mismatch
    metrics (mismatch_kl, rejection_rate, xi_*, accept_*: what the budget controller reads) still compare the
    sampler with the dense policy, from one more no-grad dense forward per micro-batch; `replay_*` metrics say
    what the replayed correction did and how exact the replay was. A group without records is dead-lettered
    (no_eviction_record). With compressor method full there is nothing to replay: the run trains dense."""
    distill_coef: float = 0.0
    """With policy_target sparse: coefficient of the dense-teacher term, KL(pi_dense || pi_replayed) over the
    response tokens (aggregated like the policy loss), added to the GRPO loss (Shadow Mask Distillation,
    arXiv 2605.06850); 0 = replay alone. Metric `distill_kl`."""
    replay_quant_gap: bool = False
    """With policy_target sparse on groups sampled from a quantized KV cache (compressor.kv_dtype other than model:
    the replayed forwards quantize-dequantize K/V as the sampler stored them, learner/replay.py): also report
    `replay_quant_gap`, max |replayed logp_old - the same replay without the quantize-dequantize| over the step's
    trained tokens (what the quantization changes). It costs one more no-grad replayed forward per micro-batch of
    the recompute (its two forwards become three; not timed), and a step that would take logp_old from its
    training forward (fuse_logp_old) recomputes it instead. false: not measured."""

    # --- checkpoints ---------------------------------------------------------------------------------------
    checkpoint_dir: str = ""
    """Directory of DeepSpeed checkpoints (one tag per version); empty = no checkpoints."""
    checkpoint_interval: int = 50
    """The driver saves a checkpoint every this many learner versions."""
    resume_from: str = ""
    """Checkpoint directory whose latest checkpoint the learner loads at start, when it is not checkpoint_dir
    (a fork: another run's checkpoints, never written to). Empty: load checkpoint_dir's latest if it has one."""

    # --- weight sync (broker/weight_sync.py) ---------------------------------------------------------------
    weight_sync_bucket_mb: float = 16.0
    """Bucket size of the weight broadcast in MiB (0 = one tensor per bucket). Over gloo, 4-16 MiB buckets
    pipeline packing with sending and beat one flat broadcast; 64 MiB does not (bench/weight_sync.py).
    NCCL clusters usually want larger buckets (slime: 512 MiB)."""
    weight_sync_backend: str = "auto"
    """auto (nccl if CUDA is available, else gloo) | gloo | nccl."""
    weight_sync_timeout_s: float = 120.0
    """Timeout of every collective of the weight broadcast, seconds."""
    weight_sync_verify: bool = False
    """Send per-tensor checksums so actors can verify their weights after the swap. Torch engine only: refused with
    actors.engine.backend=sglang (SGLang holds the weights in its scheduler process); weight_sync_fingerprint checks
    both engines."""
    weight_sync_fingerprint: str = "error"
    """error | warn | off: after every weight sync the learner scores a fixed probe (broker/fingerprint.py: 2
    sequences of 8 token ids, shortened to the run's smallest KV budget) with the version it sends, each actor
    scores it with its engine after swapping that version in, and the driver compares the two: a difference over
    the sync dtype's tolerance (fp32 1e-3 nats, bf16 1.0) means the engine does not hold the weights it reports
    (a sync that never reached it). error: the run ends within a step with one line naming the actor and the
    version; warn: that line, and the run goes on; off: nothing is scored. Metric weight_sync_fingerprint_max_abs
    (`weight_sync/fingerprint_max_abs`: the largest difference over the actors). Works on both engines (the
    SGLang engine scores with its prefill's input log-probs); costs one forward of the probe per side per
    fingerprinted sync (bench/weight_sync.py fingerprint_vs_sync; weight_sync_fingerprint_every)."""
    weight_sync_fingerprint_every: int = 1
    """k >= 1: fingerprint only the weight versions that are multiples of k (broker/fingerprint.py fingerprinted),
    dividing the fingerprint's cost by k. A sync that never reaches an engine is then caught within k steps instead
    of one (a single missed version between two multiples is not seen: the next sync loads the whole weights)."""

    seed: Optional[int] = None
    """Seed of the minibatch shuffling generator. None (the default): the run's top-level `seed`, set when the run
    config is loaded (deploy.config.resolve_learner_seed), so `seed=k` alone changes every seeded part of a run;
    set it to shuffle with another seed than the run's. A LearnerConfig built without a run config (tests,
    benches) shuffles with 0 when it is None. Every preset leaves both unset: seed 0, learner seed 0, as when
    this field's default was 0."""

    def __post_init__(self):
        """Raise ValueError naming every bad field as `LearnerConfig.<field>=<value>: expected ...`."""
        # YAML 1.1 (omegaconf, also for dotted overrides) reads a bare on/off as a boolean, which reaches this str
        # field as "True"/"False": `learner.correction=on` means "on".
        self.correction = {"True": "on", "False": "off"}.get(str(self.correction), self.correction)
        self.weight_sync_fingerprint = {"False": "off"}.get(str(self.weight_sync_fingerprint),
                                                           self.weight_sync_fingerprint)
        checks = [
            (math.isfinite(self.lr) and self.lr >= 0, "lr", "expected a finite value >= 0"),
            (self.rejection in REJECTIONS, "rejection", f"expected one of {REJECTIONS}"),
            (self.filter_groups in FILTERS, "filter_groups", f"expected one of {FILTERS}"),
            (self.max_extra_reads >= 0, "max_extra_reads", "expected >= 0"),
            (self.correction in CORRECTIONS, "correction", f"expected one of {CORRECTIONS}"),
            (self.dtype in DTYPES, "dtype", f"expected one of {DTYPES}"),
            (self.weight_sync_backend in BACKENDS, "weight_sync_backend", f"expected one of {BACKENDS}"),
            (self.weight_sync_fingerprint in FINGERPRINT_MODES, "weight_sync_fingerprint",
             f"expected one of {FINGERPRINT_MODES}"),
            (self.weight_sync_fingerprint_every >= 1, "weight_sync_fingerprint_every", "expected >= 1"),
            (self.zero_stage in (0, 1, 2, 3), "zero_stage", "expected 0, 1, 2 or 3"),
            (self.checkpoint_interval >= 1, "checkpoint_interval", "expected >= 1 (learner versions)"),
            (self.ranks >= 1, "ranks", "expected >= 1"),
            (self.ranks <= 1 or self.zero_stage >= 1, "zero_stage",
             f"expected 1, 2 or 3 with ranks={self.ranks} (stage 0 keeps a full replica per rank)"),
            (self.placement in PLACEMENTS, "placement", f"expected one of {PLACEMENTS}"),
            (self.collective_timeout_s > 0, "collective_timeout_s", "expected > 0"),
            (self.ppo_epochs >= 1, "ppo_epochs", "expected >= 1"),
            (self.micro_batch_size >= 1, "micro_batch_size", "expected >= 1"),
            (self.minibatch_size >= 0, "minibatch_size", "expected >= 0"),
            (math.isfinite(self.kl_coef) and self.kl_coef >= 0, "kl_coef", "expected a finite value >= 0"),
            (self.loss_agg_mode in LOSS_AGG_MODES, "loss_agg_mode", f"expected one of {LOSS_AGG_MODES}"),
            (0 < self.eps < 1, "eps", "expected 0 < eps < 1"),
            (self.tis_cap > 0, "tis_cap", "expected > 0"),
            (self.token_mask_bounds[0] < self.token_mask_bounds[1], "token_mask_bounds", "expected low < high"),
            (self.geo_bounds[0] < self.geo_bounds[1], "geo_bounds", "expected low < high"),
            (self.policy_target in POLICY_TARGETS, "policy_target", f"expected one of {POLICY_TARGETS}"),
            (math.isfinite(self.distill_coef) and self.distill_coef >= 0, "distill_coef",
             "expected a finite value >= 0"),
            (not (math.isfinite(self.distill_coef) and self.distill_coef > 0) or self.policy_target == "sparse",
             "distill_coef", "the dense-teacher term needs learner.policy_target=sparse (the student is the "
             "replayed forward)"),
            (not self.replay_quant_gap or self.policy_target == "sparse", "replay_quant_gap",
             "it measures the replayed forward: needs learner.policy_target=sparse"),
        ]
        errors = [f"LearnerConfig.{name}={getattr(self, name)!r}: {rule}" for ok, name, rule in checks if not ok]
        errors += self._lora_errors()
        if errors:
            raise ValueError("; ".join(errors))

    def _lora_errors(self) -> list[str]:
        """lora.dropout > 0 makes the trained forward random: refused where it must equal the no-grad forward (the
        fused logp_old is the trained forward's value; eviction replay's exactness)."""
        if self.lora.dropout <= 0:
            return []
        clash = [f"LearnerConfig.{name}={value}" for name, value, bad in (
            ("policy_target", self.policy_target, self.policy_target == "sparse"),
            ("fuse_logp_old", "true", self.fuse_logp_old)) if bad]
        if not clash:
            return []
        return [f"LearnerConfig.lora.dropout={self.lora.dropout} with {' and '.join(clash)}: the trained forward must "
                "be deterministic (the fused logp_old is its value; replay's exactness compares it with the sampler): "
                "set learner.lora.dropout=0" + ("" if self.policy_target == "sparse" else
                                                 " or learner.fuse_logp_old=false")]

    def replays(self, compressor_method: str) -> bool:
        """Whether steps replay the rollouts' evictions: policy_target sparse on a compressing run."""
        return self.policy_target == "sparse" and compressor_method != "full"
