"""Typed config of the KV compressors (docs/SPEC.md §5)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

METHODS = ("rkv", "snapkv", "h2o", "streamingllm", "random", "full")
SELECTIONS = ("per_head", "shared")
SCHEDULES = ("constant", "linear", "cosine", "length")
CONTROLS = ("off", "mismatch")
TIERS = ("off", "confidence")
PHASES = ("request", "aligned")
H2O_RECENT = 64
"""h2o_recent's default (a method other than h2o must leave it so: it reads no such field)."""
KV_BUDGET = 512
"""kv_budget's default (tokens)."""
BUDGET_METRICS = ("accept_p5", "accept_p1", "accept_p50", "accept_mean", "accept_upper_p5",
                  "xi_p1", "xi_p5", "xi_p50", "xi_sym_p1", "xi_sym_p5", "xi_sym_p50")
"""accept_*: Sparrow's per-token acceptance rate (learner/acceptance.py; needs actors.sampling.topk_logprobs);
xi_*: quantiles of the sampled token's ratio xi = pi_old / pi_sparse (learner/correction.py), a one-sample
statistic whose tail sits far lower than the acceptance rate's for the same pair of distributions."""


@dataclass
class CompressorConfig:
    method: str = "rkv"
    """KV eviction policy: one of rkv | snapkv | h2o | streamingllm | random | full (full = dense, no eviction;
    random: a uniform choice per layer and KV head, scored by a hash of the sample's seed, layer, KV head, token
    position and event, Random Attention, arXiv 2609.03430 §3)."""
    kv_budget: int = KV_BUDGET
    """B: tokens kept per sequence, per layer, per KV head after a compression (prompt included)."""
    window: int = 8
    """W: observation window; the last W queries score the cache and the last W tokens are always kept."""
    interval: int = 128
    """Decode steps between compressions; the cache moves between kv_budget and kv_budget + interval tokens."""
    phase: str = "request"
    """Which decode steps a row is due for compression on (it must also hold more than its budget): request = its
    own steps s (counted from its prefill, s = 1 for the forward of its first sampled token) with
    s % interval == 0; aligned = the engine's decode steps g with g % interval == 0, g counting every decode
    forward the engine has run (all batches and calls: `TorchEngine.decode_steps`, the SGLang backend's
    `decode_steps` stat), one phase shared by all rows, so rows that joined a continuously batched SGLang batch
    at different steps are compressed in one event, not one event each. Under aligned a row that joined late
    may be compressed fewer than `interval` steps after its prefill (still only while it holds more than its
    budget; it never holds more than budget + interval), a multi-turn turn's first compression may come before
    its interval-th token (protect_observation), and the SGLang engine's kv_retained_tokens are computed as
    for a request whose prefill came at g = 0 mod interval (exact up to interval tokens). The SGLang torch
    reference backend (sparse_rl_kv_torch) takes request only."""
    rkv_lambda: float = 0.1
    """R-KV mixing weight: score = lambda * importance - (1 - lambda) * redundancy."""
    pool_kernel: int = 7
    """1-D max-pool kernel (stride 1, same padding) applied to the importance scores (R-KV, SnapKV)."""
    similarity_threshold: float = 0.5
    """R-KV: cosine similarity above which the most recent similar key is kept as the representative."""
    sinks: int | None = None
    """Attention sinks (StreamingLLM, arXiv 2309.17453 §3.2), every method: the first `sinks` valid tokens of each
    row (the sequence's first tokens: the prompt's first n, after any left padding) are never eviction candidates.
    None = the method's own: 4 for streamingllm, 0 for the others. Protection order when the budget cannot hold
    everything protected: the window, then the sinks, then protect_prompt / protect_values (see protect_prompt)."""
    protect_prompt: str = "off"
    """Prompt protection, every method (arXiv 2605.18053 §4; Random Attention, arXiv 2609.03430 §3): off | all
    (every token of the row's prompt, a multi-turn episode's first prompt) | last:<n> (the prompt's last n tokens,
    its boundary with the response). The first n prompt tokens are `sinks: n` (one name per idea). Protected
    tokens are never evicted while the budget holds them with the window: kv_budget must exceed sinks + n +
    protect_values + window (checked); with `all` a prompt longer than kv_budget - window - sinks does not fit,
    and then the budget wins, at the prefill and at every later event: the window is kept, then the sinks, then
    the protected tokens the method itself ranks highest (random: a random subset) fill the rest; the generated
    tokens before the window are evicted first, unless protect_values holds them (Compressor.select)."""
    protect_values: int = 0
    """Value-norm protection, every method (VaSE, arXiv 2606.03928 §3.1): at each event the k candidate keys with
    the largest L2 norm of their value vector, per layer and KV head (shared selection: of the norm averaged over
    the heads), are never evicted (large-value tokens whose eviction causes repetition loops); 0 = off."""
    h2o_recent: int = H2O_RECENT
    """H2O: most recent tokens always kept besides the heavy hitters (must be >= window)."""
    selection: str = "per_head"
    """per_head (R-KV reference: one kept set per layer and KV head) | shared (one set per sequence, chosen
    from layer 0 and used by every layer and head, as the authors' SGLang fork)."""
    protect_observation: bool = True
    """Multi-turn, both engines (an episode's cache kept across turns): the tokens a turn prefills into the kept
    cache (the previous turn's last sampled token, the template boundary, the environment's observation, the next
    assistant header) are never eviction candidates at that prefill: only the older cache is compressed there (to
    kv_budget, scored by the last `window` queries, the observation's), and the observation is first scored at the
    turn's first compression event, its `interval`-th generated token, when the last `window` generated queries
    have attended to it. So every generated token of the turn's first `interval` sees the whole observation, and
    an episode's peak holds kv_budget + interval + the longest prefill slots. false: the observation is compressed
    with the rest at its prefill, as a prompt longer than the budget is (the measured baseline,
    bench/multiturn_kv.py)."""
    kv_dtype: str = "model"
    """Precision K/V are stored at (compressors/kv_quant.py): model (the model dtype, as stored so far) | bf16 |
    fp8_e4m3 | int8 | int4 (two per byte; head_dim even), the last three with a scale per kv_scale. The budget
    stays in tokens; bytes per token: KVQuant.token_bytes. The torch engine stores it (actors/engines/
    batch_cache.py: every query reads the dequantized K/V, compression scores them) and each trajectory group says
    it (broker/schema.py kv_quant), learner.policy_target=sparse replays it (learner/replay.py) and the preflight
    counts its bytes (actors/engines/kv_memory.py); a run refuses any but model on the SGLang engine
    (deploy/config.py check_sglang) and with method full under policy_target sparse (check_kv_precision: no record
    to replay it along)."""
    kv_budget_bytes: int = 0
    """The budget in bytes instead of tokens (0: off, kv_budget counts): per sequence, K and V of every layer and KV
    head as stored at kv_dtype, scales included. The torch engine keeps floor(kv_budget_bytes / token bytes) tokens,
    token bytes = KVQuant.token_bytes of the model's shape (`with_byte_budget`); the preflight sizes with the same
    count. Refused with a kv_budget other than its default 512 (a preset's included: set it back to 512), a budget
    schedule, budget_control or budget_tiers (they speak
    tokens), method full, where it holds no more than `window` tokens, and on the SGLang engine (check_sglang)."""
    kv_scale: str = "token_head"
    """Scale granularity of fp8_e4m3 / int8 / int4: token_head (one float32 amax / qmax scale per token, layer and
    KV head, K and V each their own, 4 B counted in the bytes) | layer (a static per-layer scale 1.0, SGLang's fp8
    KV pool's; fp8_e4m3 only). Left token_head with model or bf16, which read no scale."""


    # --- budget control (docs/SPEC.md §5.1; Sparrow, arXiv 2606.08446) -------------------------------------
    budget_schedule: str = "constant"
    """constant | linear | cosine: the budget goes from kv_budget (weight version 0) to kv_budget_final (at
    version budget_schedule_steps, then stays): progressive shrinking (docs/SPEC.md §5.1). Actors apply the value
    of their weight version at every batch (compressors.budget.scheduled_budget).
    length (Sparrow §3.2's sparsity scheduling, both engines): the budget grows along the trajectory, from
    kv_budget at the first generated token by budget_growth tokens per generated token up to kv_budget_final;
    each compression keeps the budget of the sequence's current response length (compressors.budget.length_budget)."""
    kv_budget_final: int = 0
    """Budget at the end of the schedule, tokens (0 = kv_budget: no change); with budget_schedule length the cap
    the growing budget stops at (required, > kv_budget)."""
    budget_growth: float = 0.0
    """budget_schedule length: budget tokens added per generated token (e.g. 0.5: one more kept token every two
    generated), > 0."""
    budget_schedule_steps: int = 0
    """Weight versions over which the schedule runs (0 = train.steps)."""
    budget_control: str = "off"
    """off | mismatch: the learner moves the budget between kv_budget_min and kv_budget_max to keep
    budget_metric (a quantile of the per-token ratio xi, learner/correction.py) at or above budget_target,
    publishes it in Redis, and actors read it at every batch (learner/budget_control.py)."""
    kv_budget_min: int = 0
    """Lowest budget the controller may set, tokens (required with budget_control mismatch)."""
    kv_budget_max: int = 0
    """Highest budget the controller may set, tokens (required with budget_control mismatch)."""
    budget_metric: str = ""
    """The controlled statistic, one of BUDGET_METRICS: accept_upper_p5 (Sparrow, arXiv 2606.08446 §3.1: the 5th
    percentile over tokens of the per-token acceptance rate sum_x min(p_dense, q_sparse), here its upper bound
    from the sampler's top-k log-probs, measured near the exact p5: docs/SPEC.md §4), accept_p5 (the lower
    bound's, far below it for a small model) | accept_p1 | accept_p50 | accept_mean, or a quantile
    of the sampled token's ratio xi: xi_p1 | xi_p5 | xi_p50 | xi_sym_p1 | xi_sym_p5 | xi_sym_p50 (xi_sym =
    min(xi, 1/xi); not Sparrow's statistic, on another scale). "" (default) = accept_upper_p5 when
    actors.sampling.topk_logprobs > 0, else xi_sym_p5; an accept_* metric turns topk_logprobs on (20) if it is 0
    (deploy/config.py)."""
    budget_target: float = 0.86
    """The controller raises the budget while budget_metric < budget_target (0.86: Sparrow's threshold for
    the acceptance rate's p5)."""
    budget_hysteresis: float = 0.03
    """... and lowers it only when the mean of budget_metric over the last budget_window steps at the current
    budget is >= target + this (and budget_patience steps, doubled per recorded miss of the lower budget, have
    passed there; learner/budget_control.py)."""
    budget_patience: int = 2
    """Steps at a budget before the controller lowers it (x 2 per step the lower budget missed the target since
    it last held, up to x 16); also the steps in a row at or above target after which a budget counts as held."""
    budget_window: int = 4
    """Steps at the current budget whose budget_metric the controller averages before a lowering (>= 1)."""
    budget_step: int = 0
    """Tokens per controller change (0 = an eighth of kv_budget_max - kv_budget_min, at least 1)."""
    budget_tiers: str = "off"
    """off | confidence: difficulty-adaptive budgets (docs/SPEC.md §5.1). A prompt's confidence is the mean
    reward (clipped to [0, 1]) of its group the last time it was sampled (kept in Redis, shared by all
    actors); its budget is kv_budget (or the scheduled / controlled budget) times the scale of its tier."""
    tier_thresholds: list[float] = field(default_factory=lambda: [0.5, 0.8])
    """Confidence bounds of the tiers: hard below the first, medium up to the second (inclusive), easy above."""
    tier_scales: list[float] = field(default_factory=lambda: [1.5, 1.0, 0.5])
    """Budget multipliers of the hard, medium and easy tiers (768 / 512 / 256 at kv_budget 512). A prompt
    never sampled before gets the medium scale."""

    def budget_range(self) -> tuple[int, int]:
        """(smallest, largest) budget the run can use, tokens, over the schedule, controller bounds and tiers."""
        from compressors.budget import budget_range
        return budget_range(self)

    def __post_init__(self):
        # YAML 1.1 (omegaconf, also for dotted overrides) reads a bare `off` as a boolean, which reaches these str
        # fields as "False": `budget_control=off` means "off".
        for name in ("budget_control", "budget_tiers", "protect_prompt"):
            if str(getattr(self, name)) == "False":
                setattr(self, name, "off")

    @property
    def sink_tokens(self) -> int:
        """The sinks this config keeps: `sinks`, or the method's own when None (4 for streamingllm, else 0)."""
        if self.sinks is None:
            return 4 if self.method == "streamingllm" else 0
        return self.sinks

    def prompt_protection(self) -> tuple[str, int]:
        """protect_prompt parsed: ("off", 0) | ("all", 0) | ("last", n). Raises ValueError naming the field."""
        kind, _, n = str(self.protect_prompt).partition(":")
        if kind in ("off", "all") and not n:
            return kind, 0
        if kind == "last" and n.isdigit() and int(n) >= 1:
            return "last", int(n)
        raise ValueError(f"compressor.protect_prompt={self.protect_prompt!r}: expected off, all or last:<n> (n >= 1 "
                         "prompt tokens; the first n are compressor.sinks)")

    @property
    def reads_queries(self) -> bool:
        """True when `select` reads the window's queries (rkv, snapkv): an engine keeps the last `window` queries
        of each layer only then (the SGLang backend's query ring, docs/sglang.md)."""
        return self.method in ("rkv", "snapkv")

    @property
    def reads_positions(self) -> bool:
        """True when `select` reads each key's true position (random, protect_prompt): the SGLang backend then tracks
        them per layer and KV head (actors/engines/sglang/records.py, its origin map), recording or not."""
        return self.method == "random" or self.protect_prompt != "off"

    @property
    def protects(self) -> bool:
        """True when some token besides the window is protected (sinks, protect_prompt, protect_values)."""
        return self.sink_tokens > 0 or self.protect_prompt != "off" or self.protect_values > 0

    def validate(self) -> None:
        """Raise ValueError naming the field (`compressor.<field>`) for an impossible setting.

        Checked: method, selection and phase names; 1 <= window < kv_budget; interval >= 1; 0 <= rkv_lambda <= 1;
        pool_kernel odd and >= 1 (same padding); 0 <= similarity_threshold <= 1; for h2o
        window <= h2o_recent < kv_budget; sinks, protect_values >= 0, protect_prompt off | all | last:<n>, and
        sinks + n + protect_values + window (h2o: h2o_recent) < kv_budget (streamingllm with sinks alone: <=);
        for random h2o_recent left at its default (h2o's field); kv_dtype / kv_scale (_validate_kv_precision);
        kv_budget_bytes alone as the budget (_validate_byte_budget).
        """
        if self.method not in METHODS:
            raise ValueError(f"compressor.method={self.method!r} is unknown; expected one of {METHODS}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"compressor.selection={self.selection!r} is unknown; expected one of {SELECTIONS}")
        if self.window < 1:
            raise ValueError(f"compressor.window={self.window} must be >= 1")
        if self.kv_budget <= self.window:
            raise ValueError(f"compressor.kv_budget={self.kv_budget} must be > compressor.window={self.window}")
        if self.interval < 1:
            raise ValueError(f"compressor.interval={self.interval} must be >= 1")
        if self.phase not in PHASES:
            raise ValueError(f"compressor.phase={self.phase!r} is unknown: expected one of {PHASES}")
        if not 0.0 <= self.rkv_lambda <= 1.0:
            raise ValueError(f"compressor.rkv_lambda={self.rkv_lambda} must be in [0, 1]")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"compressor.pool_kernel={self.pool_kernel} must be odd and >= 1 (same padding)")
        if not 0.0 <= self.similarity_threshold <= 1.0:
            raise ValueError(f"compressor.similarity_threshold={self.similarity_threshold} must be in [0, 1]")
        if self.method == "h2o":
            if self.h2o_recent < self.window:
                raise ValueError(
                    f"compressor.h2o_recent={self.h2o_recent} must be >= compressor.window={self.window}")
            if self.h2o_recent >= self.kv_budget:
                raise ValueError(
                    f"compressor.h2o_recent={self.h2o_recent} must be < compressor.kv_budget={self.kv_budget}")
        self._validate_byte_budget()   # first: the budget variants _validate_budget_control checks speak tokens
        self._validate_protection()
        self._validate_budget_control()
        self._validate_kv_precision()

    def _validate_byte_budget(self) -> None:
        """kv_budget_bytes >= 0; when set, nothing else states the budget (kv_budget left at its default, no
        schedule, controller or tiers: they speak tokens) and a method that evicts."""
        if self.kv_budget_bytes < 0:
            raise ValueError(f"compressor.kv_budget_bytes={self.kv_budget_bytes} must be >= 0 (0: off)")
        if not self.kv_budget_bytes:
            return
        set_too = [f"compressor.{name}={value}" for name, value, default in (
            ("kv_budget", self.kv_budget, KV_BUDGET), ("budget_schedule", self.budget_schedule, "constant"),
            ("budget_control", self.budget_control, "off"), ("budget_tiers", self.budget_tiers, "off"))
            if value != default]
        if set_too:
            raise ValueError(f"compressor.kv_budget_bytes={self.kv_budget_bytes} with {', '.join(set_too)}: the byte "
                             "budget is the one budget, constant (schedules, the controller and tiers speak tokens): "
                             "set one of them")
        if self.method == "full":
            raise ValueError(f"compressor.kv_budget_bytes={self.kv_budget_bytes} with compressor.method=full: "
                             "nothing is evicted to keep within it")

    def with_byte_budget(self, token_bytes: int) -> "CompressorConfig":
        """This config with kv_budget_bytes resolved to tokens: kv_budget = floor(kv_budget_bytes / token_bytes)
        (token_bytes: one token's stored K and V over all layers and KV heads, KVQuant.token_bytes), kv_budget_bytes
        0, validated; itself when kv_budget_bytes is 0. Raises ValueError naming compressor.kv_budget_bytes when
        that holds no more than `window` tokens (or another check fails at that budget)."""
        if not self.kv_budget_bytes:
            return self
        from compressors.kv_quant import budget_tokens
        tokens = budget_tokens(self.kv_budget_bytes, token_bytes)
        if tokens <= self.window:
            raise ValueError(f"compressor.kv_budget_bytes={self.kv_budget_bytes} holds {tokens} tokens of "
                             f"{token_bytes} B (compressor.kv_dtype={self.kv_dtype}): expected more than "
                             f"compressor.window={self.window}, i.e. >= {(self.window + 1) * token_bytes} B")
        resolved = dataclasses.replace(self, kv_budget=tokens, kv_budget_bytes=0)
        try:
            resolved.validate()
        except ValueError as e:
            raise ValueError(f"compressor.kv_budget_bytes={self.kv_budget_bytes} ({tokens} tokens of {token_bytes} B): "
                             f"{e}") from None
        return resolved

    def kv_quant(self):
        """The KV quantizer of kv_dtype / kv_scale: compressors.kv_quant.KVQuant (its `name` travels with each
        trajectory group, broker/schema.py)."""
        from compressors.kv_quant import KVQuant
        return KVQuant(self.kv_dtype, self.kv_scale)

    def _validate_kv_precision(self) -> None:
        """kv_dtype and kv_scale known and a possible pair (KVQuant.check: layer with fp8_e4m3 only, so a scale
        is never set where nothing reads it)."""
        from compressors.kv_quant import KVQuant
        KVQuant(self.kv_dtype, self.kv_scale).check()

    def _validate_protection(self) -> None:
        """sinks, protect_prompt, protect_values; random with h2o_recent. The tokens protected whatever the prompt
        (sinks + last:n + protect_values) plus the window must leave the method a slot to choose: < kv_budget
        (streamingllm: <=, its choice is recency, which the window continues)."""
        if self.sink_tokens < 0:
            raise ValueError(f"compressor.sinks={self.sinks} must be >= 0")
        if self.protect_values < 0:
            raise ValueError(f"compressor.protect_values={self.protect_values} must be >= 0")
        if self.method == "random" and self.h2o_recent != H2O_RECENT:
            raise ValueError(f"compressor.h2o_recent={self.h2o_recent} is read by method h2o only; method random "
                             f"always keeps the last compressor.window={self.window} tokens: leave h2o_recent unset")
        fixed = {f"compressor.sinks={self.sink_tokens}": self.sink_tokens,
                 f"compressor.protect_prompt={self.protect_prompt}": self.prompt_protection()[1],
                 f"compressor.protect_values={self.protect_values}": self.protect_values}
        named = {name: n for name, n in fixed.items() if n}
        if not named or self.method == "full":
            return
        limit = self.kv_budget + (self.method == "streamingllm" and list(named)[0].startswith("compressor.sinks=")
                                  and len(named) == 1)
        recent = f"compressor.h2o_recent={self.h2o_recent}" if self.method == "h2o" else \
            f"compressor.window={self.window}"                       # the slots always kept
        if sum(named.values()) + int(recent.partition("=")[2]) >= limit:
            raise ValueError(f"{' + '.join(named)} protected + {recent} leave no slot to choose in "
                             f"compressor.kv_budget={self.kv_budget} (need protected + window < kv_budget"
                             f"{', sinks + window <= kv_budget for streamingllm' if limit > self.kv_budget else ''})")

    def _validate_budget_control(self) -> None:
        if self.budget_schedule not in SCHEDULES:
            raise ValueError(f"compressor.budget_schedule={self.budget_schedule!r} is unknown; "
                             f"expected one of {SCHEDULES}")
        if self.budget_control not in CONTROLS:
            raise ValueError(f"compressor.budget_control={self.budget_control!r} is unknown; "
                             f"expected one of {CONTROLS}")
        if self.budget_tiers not in TIERS:
            raise ValueError(f"compressor.budget_tiers={self.budget_tiers!r} is unknown; expected one of {TIERS}")
        if self.budget_metric not in ("", *BUDGET_METRICS):
            raise ValueError(f"compressor.budget_metric={self.budget_metric!r} is unknown; "
                             f"expected one of {BUDGET_METRICS}")
        if self.budget_schedule == "length" and not (self.kv_budget_final > self.kv_budget and self.budget_growth > 0):
            raise ValueError(f"compressor.budget_schedule='length' needs compressor.kv_budget_final="
                             f"{self.kv_budget_final} > compressor.kv_budget={self.kv_budget} (the cap) and "
                             f"compressor.budget_growth={self.budget_growth} > 0 (tokens per generated token)")
        if self.budget_schedule == "length" and self.budget_tiers != "off":
            raise ValueError("compressor.budget_schedule='length' cannot be combined with compressor.budget_tiers "
                             "(one start budget and cap per run)")
        for name in ("kv_budget_final", "budget_schedule_steps", "kv_budget_min", "kv_budget_max", "budget_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"compressor.{name}={getattr(self, name)} must be >= 0")
        if not 0.0 < self.budget_target <= 1.0:
            raise ValueError(f"compressor.budget_target={self.budget_target} must be in (0, 1]")
        if self.budget_hysteresis < 0:
            raise ValueError(f"compressor.budget_hysteresis={self.budget_hysteresis} must be >= 0")
        if self.budget_patience < 1:
            raise ValueError(f"compressor.budget_patience={self.budget_patience} must be >= 1")
        if self.budget_window < 1:
            raise ValueError(f"compressor.budget_window={self.budget_window} must be >= 1")
        if self.method == "full" and (self.budget_schedule != "constant" or self.budget_control != "off"
                                      or self.budget_tiers != "off"):
            raise ValueError("compressor.method='full' keeps every token: budget_schedule, budget_control and "
                             "budget_tiers need a compressing method")
        if self.budget_control == "mismatch":
            if self.budget_schedule != "constant":
                raise ValueError(f"compressor.budget_schedule={self.budget_schedule!r} cannot be combined with "
                                 "compressor.budget_control='mismatch' (the controller owns the budget)")
            if not self.kv_budget_min or not self.kv_budget_max:
                raise ValueError(f"compressor.kv_budget_min={self.kv_budget_min} and compressor.kv_budget_max="
                                 f"{self.kv_budget_max}: set both (> 0) with budget_control='mismatch'")
            if not self.kv_budget_min <= self.kv_budget <= self.kv_budget_max:
                raise ValueError(f"compressor.kv_budget={self.kv_budget} (the controller's start) must lie in "
                                 f"[compressor.kv_budget_min={self.kv_budget_min}, "
                                 f"compressor.kv_budget_max={self.kv_budget_max}]")
        if len(self.tier_thresholds) != 2 or not 0.0 <= self.tier_thresholds[0] <= self.tier_thresholds[1] <= 1.0:
            raise ValueError(f"compressor.tier_thresholds={list(self.tier_thresholds)}: expected two confidences "
                             "0 <= low <= high <= 1")
        if len(self.tier_scales) != 3 or min(self.tier_scales) <= 0:
            raise ValueError(f"compressor.tier_scales={list(self.tier_scales)}: expected three multipliers > 0 "
                             "(hard, medium, easy)")
        lo, hi = self.budget_range()
        if (lo, hi) != (self.kv_budget, self.kv_budget):
            for extreme in (lo, hi):  # every budget the run can use must itself be a valid setting
                try:
                    dataclasses.replace(self, kv_budget=extreme, budget_schedule="constant", budget_control="off",
                                        budget_tiers="off").validate()
                except ValueError as e:
                    raise ValueError(f"{e} (kv_budget={extreme} is the {'smallest' if extreme == lo else 'largest'} "
                                     "budget this run can use, from compressor.kv_budget_final / kv_budget_min / "
                                     "kv_budget_max / tier_scales)") from None
