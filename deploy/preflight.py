"""Capacity preflight (docs/SPEC.md §5.1): will the run's KV cache fit? Run by `sparse-rl preflight` and at the start
of `sparse-rl train`, before anything starts.

From the model's config (layers, KV heads, head dim; the engine dtype) and the run config (longest training
prompt, actors.sampling.max_new_tokens, samples_per_prompt, prompts_per_batch, the largest KV budget the run
can use over its schedule / controller / tiers, interval), it predicts the torch engine's peak KV bytes per
sequence and per actor batch, dense and sparse (actors/engines/kv_memory.py), and how many sequences fit in the KV
memory of one rollout actor:

- `preflight.kv_memory_gb` when set (> 0);
- else, actors on a GPU (actors.num_gpus > 0, CUDA visible here): the device's free memory minus the weights;
- else (CPU): the machine's available memory (MemAvailable) divided by actors.count, minus the weights.

A config whose sparse batch does not fit fails (PreflightError, a ConfigError: exit code 2) naming the fields
and the numbers; one whose dense batch does not fit but sparse does starts (that is what compression is for);
a budget at or above prompt + response gets a warning (nothing would ever be evicted), and so does a prompt
longer than the smallest budget (it is compressed at prefill: the long-context regime, not the paper's).
Multi-turn on the torch engine and on a sparse SGLang engine (the episode's cache kept across turns,
actors/envs/episode.py; SGLang's streaming sessions, docs/sglang.md): the sparse peak is
kv_budget + interval + the longest turn prefill (`longest_turn_prefill`: an observation of env.max_obs_tokens in
its template, + the last sampled id), whatever env.max_turns; the dense one the whole episode (prompt +
env.max_total_tokens); actors.engines.kv_memory.episode_kv_peak_bytes_per_sequence.

With `actors.engine.backend=sglang` and a compressor, one compression call of the sparse backend
(actors/engines/sglang/triton_backend.py) holds index tensors, one layer's gathered K/V and the compressor's
float32 scores outside SGLang's KV pool, i.e. outside `mem_fraction_static`; its upper bound
(actors.engines.kv_memory.compression_event_bytes, for the batch's rows at max(prompt, budget + interval) live
tokens, split as the backend splits them under EVENT_BYTES_CAP) is taken off the actor's memory and shown on its
own line; so are, when the run replays there (learner.policy_target=sparse), the backend's eviction records
(actors.engines.kv_memory.record_bytes_per_request per request of one generate call, `sglang_records`; without
replay, their origin map alone when the compressor reads true positions: random, protect_prompt), and the
backend's query ring (`qwin`: layers x window x query heads x head_dim values of the engine dtype, + 24 B of row
vectors, per request row of SGLang's pool, allocated at the engine's start: actors.engines.kv_memory.query_ring_bytes
for sglang_request_rows, max_running_requests + 1 or, unset, up to 4,097 rows; `sglang_ring`).

It also sizes the broker's queue: one group's wire bytes (broker.schema.group_wire_bytes: 8 bytes per response
token, + 6 K with actors.sampling.topk_logprobs = K, 120 at K = 20) times the groups the stream can hold
(broker.high_watermark + one actor batch); a group over broker.max_message_bytes fails.

And it sizes the learner (printed, never refused): the training state one learner rank holds (weights, gradients,
fp32 master copies, Adam's moments, the KL reference; `learner_memory`) with full fine-tuning and with LoRA (the
run's learner.lora, or rank LORA_SIZED_RANK for a full fine-tuning run), under the run's learner.dtype,
learner.zero_stage and learner.ranks; activations are not counted. bench/lora.py measures both on the main job.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from actors.engines.kv_memory import (
    EVENT_METHODS,
    ModelShape,
    compression_event_bytes,
    episode_kv_peak_bytes_per_sequence,
    event_calls,
    event_chunk_rows,
    kv_peak_bytes_per_sequence,
    query_ring_bytes,
    record_bytes_per_request,
    sglang_request_rows,
)
from broker.lora import LoraConfig
from broker.schema import group_wire_bytes
from compressors.budget import kv_dims
from deploy.config import ConfigError, RunConfig, check_lora_targets
from learner.config import LearnerConfig

GIB = 1 << 30
LORA_SIZED_RANK = 16
"""The adapter rank at which the preflight sizes a full fine-tuning run's LoRA alternative (learner.lora's other
settings at their defaults; bench/lora.py measures the same); a LoRA run is sized at its own learner.lora."""


class PreflightError(ConfigError):
    """The run's KV demand does not fit its memory; the message names the fields and the numbers."""


@dataclass
class LearnerMemory:
    """Training state one learner rank holds, bytes, by `learner_memory`'s arithmetic (activations and ZeRO's working
    buffers are not counted)."""
    parameters: int
    """Weights held (the frozen base under LoRA included; ZeRO-3: this rank's share) + fp32 master copies of the
    trained ones."""
    gradients: int
    """Gradients of the trained parameters, in the training dtype."""
    optimizer_state: int
    """Adam's two fp32 moments of the trained parameters."""
    reference: int
    """The KL term's frozen reference copy (learner.kl_coef > 0 without LoRA), in the training dtype; else 0."""
    trainable: int
    """Parameters trained (the adapter's under LoRA), a count over the whole model."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.reference


@dataclass
class PreflightReport:
    """What the preflight computed. Bytes are ints; `fits_*` are sequences of one actor; None = unknown."""
    shape: ModelShape
    engine: str
    method: str
    prompt_tokens: int
    max_new_tokens: int
    kv_budget: int
    """Largest budget the run can use, tokens (the one the memory is sized with)."""
    interval: int
    batch_rows: int
    dense_per_seq: int
    sparse_per_seq: int
    memory_bytes: int | None
    memory_source: str
    weight_bytes: int
    group_bytes: int = 0
    """Wire bytes of one group of the longest prompt and response (top-k log-probs included)."""
    queue_bytes: int = 0
    """group_bytes x (broker.high_watermark + one actor batch of groups): the stream's largest size, bytes."""
    warnings: list[str] = field(default_factory=list)
    record_rows: int = 0
    """layers x KV heads of the eviction records each sample carries (0: none; learner.policy_target=sparse)."""
    event_bytes: int = 0
    """actors.engine.backend=sglang, compressing: upper bound of the device bytes one compression call of the
    sparse backend holds outside SGLang's KV pool (outside mem_fraction_static; `compression_event_bytes`),
    already taken off `memory_bytes`; 0 otherwise."""
    event_rows: int = 0
    """Rows compressed in that call (the batch, or a chunk of it under actors.engines.kv_memory.EVENT_BYTES_CAP)."""
    event_live: int = 0
    """Live tokens of the longest row in that call: max(prompt, budget + interval)."""
    record_bytes: int = 0
    """actors.engine.backend=sglang replaying (learner.policy_target=sparse), or with a compressor that reads true
    positions (random, protect_prompt: the records' origin map alone): device bytes of the sparse backend's eviction
    records for the requests of one generate call (`sglang_records`), outside mem_fraction_static, already taken off
    `memory_bytes`; 0 otherwise."""
    record_requests: int = 0
    """Requests those records are sized for (the larger of one actor batch and one eval batch)."""
    ring_bytes: int = 0
    """actors.engine.backend=sglang, compressing: device bytes of the sparse backend's query ring and row vectors for
    every request row of SGLang's pool (`sglang_ring`), outside mem_fraction_static, already taken off
    `memory_bytes`; 0 otherwise."""
    ring_rows: int = 0
    """Request rows that ring is sized for (actors.engines.kv_memory.sglang_request_rows)."""
    learner_full: LearnerMemory | None = None
    """Training state per learner rank with full fine-tuning (`learner_memory`, the run's learner settings)."""
    learner_lora: LearnerMemory | None = None
    """The same with LoRA: the run's learner.lora, or rank LORA_SIZED_RANK for a full fine-tuning run; None when its
    targets are not modules `lora_parameter_count` knows."""
    lora_rank: int = 0
    """The rank `learner_lora` is sized at."""
    lora_run: bool = False
    """The run trains a LoRA adapter (learner.lora on)."""

    @property
    def dense_per_batch(self) -> int:
        return self.dense_per_seq * self.batch_rows

    @property
    def sparse_per_batch(self) -> int:
        return self.sparse_per_seq * self.batch_rows

    def fits(self, per_seq: int) -> int | None:
        return None if self.memory_bytes is None else max(0, self.memory_bytes // per_seq)

    def params(self) -> dict[str, str]:
        """MLflow params (prefix `preflight_result.`): predictions and the memory they were checked against."""
        values = {"kv_bytes_per_seq_dense": self.dense_per_seq, "kv_bytes_per_seq_sparse": self.sparse_per_seq,
                  "kv_bytes_per_batch_dense": self.dense_per_batch, "kv_bytes_per_batch_sparse": self.sparse_per_batch,
                  "kv_budget_sized": self.kv_budget, "prompt_tokens": self.prompt_tokens, "batch_rows": self.batch_rows,
                  "memory_bytes": self.memory_bytes, "memory_source": self.memory_source,
                  "fits_seqs_dense": self.fits(self.dense_per_seq), "fits_seqs_sparse": self.fits(self.sparse_per_seq),
                  "model_layers": self.shape.layers, "model_kv_heads": self.shape.kv_heads,
                  "model_head_dim": self.shape.head_dim, "kv_dtype_bytes": self.shape.dtype_bytes,
                  "kv_bytes_per_token": self.shape.bytes_per_token,
                  "group_wire_bytes": self.group_bytes, "broker_queue_bytes": self.queue_bytes,
                  "compression_event_bytes": self.event_bytes, "sglang_query_ring_bytes": self.ring_bytes,
                  "learner_state_bytes_full": self.learner_full and self.learner_full.total,
                  "learner_state_bytes_lora": self.learner_lora and self.learner_lora.total}
        return {f"preflight_result.{k}": str(v) for k, v in values.items()}

    def table(self) -> str:
        """The report as a fixed-width table (one line per row), for the console."""
        s = self.shape

        def row(name, per_seq):
            fits = self.fits(per_seq)
            return (f"  {name:<7} {per_seq:>16,} {per_seq * self.batch_rows:>18,} "
                    f"{'?' if fits is None else f'{fits:,}':>14}")

        lines = [f"preflight: {s.layers} layers x {s.kv_heads} KV heads x head_dim {s.head_dim} x {s.dtype_bytes} B "
                 + (f"stored at {s.vector_bytes} B per K or V vector " if s.stored_vector_bytes else "")
                 + f"({s.bytes_per_token:,} B of K/V per token); engine {self.engine}, {self.method}, "
                 + (f"budget {self.kv_budget} (largest the run uses) + interval {self.interval}"
                    if self.method != "full" else "no KV compression"),
                 f"  prompt {self.prompt_tokens} + response {self.max_new_tokens} tokens; one actor batch = "
                 f"{self.batch_rows} sequences; KV memory per actor: "
                 + ("unknown" if self.memory_bytes is None else f"{self.memory_bytes:,} B")
                 + f" ({self.memory_source})",
                 *([f"  compression event (SGLang sparse backend, outside mem_fraction_static): {self.event_bytes:,} "
                    f"B at most per call ({self.event_rows} rows x {self.event_live} live tokens), counted in the KV "
                    "memory above"] if self.event_bytes else []),
                 *([f"  eviction records (SGLang sparse backend, outside mem_fraction_static): {self.record_bytes:,} B "
                    f"for {self.record_requests} requests, counted in the KV memory above"]
                   if self.record_bytes else []),
                 *([f"  query ring (SGLang sparse backend, outside mem_fraction_static): {self.ring_bytes:,} B for "
                    f"{self.ring_rows:,} request rows, counted in the KV memory above"] if self.ring_bytes else []),
                 f"  {'':<7} {'peak KV B / seq':>16} {'peak KV B / batch':>18} {'seqs that fit':>14}",
                 row("dense", self.dense_per_seq)]
        if self.method != "full":
            lines.append(row("sparse", self.sparse_per_seq))
        records = (f" (eviction records included, {self.record_rows} rows of 2 B per token before zlib)"
                   if self.record_rows else "")
        lines.append(f"  broker: {self.group_bytes:,} B per group on the wire{records}, {self.queue_bytes:,} B at the "
                     "high watermark")
        if self.learner_full is not None:
            lines.append(self.learner_line())
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def learner_line(self) -> str:
        """The table's learner line: training state per rank with full fine-tuning and with LoRA, and their ratio,
        e.g. `learner state per rank (weights + gradients + Adam, no activations): full fine-tuning 2,152,... B
        (2.00 GiB); LoRA rank 16, 4,884,480 trainable parameters: 616,... B (0.57 GiB), 0.29x full`, the run's
        own mode marked `(this run)`."""
        full, lora = self.learner_full, self.learner_lora
        mark = {True: " (this run)", False: ""}
        line = (f"  learner state per rank (weights + gradients + Adam, no activations): full fine-tuning"
                f"{mark[not self.lora_run]} {full.total:,} B ({full.total / GIB:.2f} GiB); ")
        if lora is None:
            return line + f"LoRA rank {self.lora_rank}: not sized (a target module outside Llama/Qwen2's linear layers)"
        return (line + f"LoRA rank {self.lora_rank}{mark[self.lora_run]}, {lora.trainable:,} trainable parameters: "
                f"{lora.total:,} B ({lora.total / GIB:.2f} GiB), {lora.total / full.total:.2f}x full")


def _decoder_dims(hf) -> tuple[int, int, int, int, int, int, int]:
    """(hidden, vocab, layers, attention heads, head_dim, KV heads, intermediate) of a Llama/Qwen2-shaped decoder's
    Hugging Face config."""
    h, heads = hf.hidden_size, hf.num_attention_heads
    layers, kv, head_dim = kv_dims(hf)
    return h, hf.vocab_size, layers, heads, head_dim, kv, getattr(hf, "intermediate_size", 4 * h)


def lora_parameter_count(hf, lora: LoraConfig) -> int:
    """Parameters of a LoRA adapter of rank r on `lora.target_modules` of a Llama/Qwen2-shaped decoder (Hugging Face
    config `hf`): r x (in_features + out_features) per target module (A is [r, in], B [out, r]), in every layer
    (q/k/v/o_proj, gate/up/down_proj) or once (lm_head). Raises ValueError for a target that is none of these."""
    h, v, n, heads, head_dim, kv, inter = _decoder_dims(hf)
    shapes = {"q_proj": (h, heads * head_dim, n), "k_proj": (h, kv * head_dim, n), "v_proj": (h, kv * head_dim, n),
              "o_proj": (heads * head_dim, h, n), "gate_proj": (h, inter, n), "up_proj": (h, inter, n),
              "down_proj": (inter, h, n), "lm_head": (h, v, 1)}
    unknown = sorted(set(lora.target_modules) - set(shapes))
    if unknown:
        raise ValueError(f"learner.lora.target_modules: {', '.join(unknown)}: not a linear module of a Llama/Qwen2 "
                         f"decoder ({', '.join(shapes)})")
    return sum(lora.rank * (i + o) * count for i, o, count in (shapes[t] for t in set(lora.target_modules)))


def learner_memory(hf, learner: LearnerConfig, lora: LoraConfig | None = None) -> LearnerMemory:
    """Training state one learner rank holds (LearnerMemory, bytes) for a Llama/Qwen2-shaped model (Hugging Face
    config `hf`) under `learner` (dtype, zero_stage, ranks, kl_coef), with full fine-tuning, or with the LoRA
    adapter `lora` (enabled) on the frozen base. Per trained parameter: its weight and gradient in the training dtype
    (4 B fp32, 2 B bf16), an fp32 master copy (4 B) where DeepSpeed keeps one (bf16, or any ZeRO stage >= 1), Adam's
    two fp32 moments (8 B): 16 B with fp32 at stage 0, 16 B with bf16 (2 + 2 + 4 + 8). The frozen base holds its
    weights only; full fine-tuning with kl_coef > 0 also a reference copy. Over N = learner.ranks, ZeRO stage 1
    shards the master copies and moments, 2 also the gradients, 3 also the weights (each / N, rounded up). Raises
    ValueError for a LoRA target `lora_parameter_count` does not know."""
    w = 4 if learner.dtype == "fp32" else 2
    n, stage = learner.ranks, learner.zero_stage
    base = _parameter_count(hf)
    adapter = lora is not None and lora.enabled
    trained = lora_parameter_count(hf, lora) if adapter else base
    held = base + trained if adapter else base
    master = 4 if learner.dtype != "fp32" or stage >= 1 else 0

    def per_rank(nbytes: int, from_stage: int) -> int:
        return -(-nbytes // n) if stage >= from_stage else nbytes
    return LearnerMemory(parameters=per_rank(held * w, 3) + per_rank(trained * master, 1),
                         gradients=per_rank(trained * w, 2), optimizer_state=per_rank(trained * 8, 1),
                         reference=base * w if learner.kl_coef > 0 and not adapter else 0, trainable=trained)


def learner_sizing(learner: LearnerConfig, hf) -> tuple[LearnerMemory, LearnerMemory | None, int]:
    """(full fine-tuning's LearnerMemory, LoRA's or None when its targets are unknown to `lora_parameter_count`, the
    LoRA rank sized) for the run's learner settings: LoRA at learner.lora when it is on, else at rank
    LORA_SIZED_RANK with learner.lora's other settings."""
    lora = learner.lora if learner.lora.enabled else LoraConfig(
        rank=LORA_SIZED_RANK, alpha=learner.lora.alpha, target_modules=learner.lora.target_modules)
    full = learner_memory(hf, learner)
    try:
        return full, learner_memory(hf, learner, lora), lora.rank
    except ValueError:
        return full, None, lora.rank


def _available_memory(cfg: RunConfig, weight_bytes: int) -> tuple[int | None, str]:
    """(KV memory of one rollout actor in bytes or None if unknown, where the number comes from)."""
    p = cfg.preflight
    if p.kv_memory_gb > 0:
        return int(p.kv_memory_gb * GIB), f"preflight.kv_memory_gb={p.kv_memory_gb:g}"
    if cfg.actors.num_gpus > 0:
        import torch
        if not torch.cuda.is_available():
            return None, "actors on GPUs, none visible here: set preflight.kv_memory_gb to check"
        free, _ = torch.cuda.mem_get_info()
        return free - weight_bytes, f"free GPU memory {free:,} B - weights {weight_bytes:,} B"
    available = _mem_available()
    if available is None:
        return None, "MemAvailable unknown: set preflight.kv_memory_gb to check"
    count = cfg.actors.count
    return (available // count - weight_bytes,
            f"MemAvailable {available:,} B / actors.count={count} - weights {weight_bytes:,} B")


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def longest_prompt(cfg: RunConfig, model_path: str) -> int:
    """preflight.max_prompt_tokens, or the longest training prompt tokenized with the model's chat template."""
    if cfg.preflight.max_prompt_tokens > 0:
        return cfg.preflight.max_prompt_tokens
    from transformers import AutoTokenizer

    from actors.tasks.data import load_train_prompts
    prompts = load_train_prompts(cfg.actors.data, AutoTokenizer.from_pretrained(model_path), seed=cfg.seed)
    return max(len(p.prompt_ids) for p in prompts)


def check_chat_template(model_path: str):
    """Multi-turn rollouts keep sampled ids verbatim (actors/envs/turns.py): the model's chat template must be
    append-only. Returns the ChatTemplate; raises ConfigError (one line naming the template) when it is not."""
    from transformers import AutoTokenizer

    from actors.envs.turns import ChatTemplate, TemplateNotAppendOnly
    try:
        return ChatTemplate.build(AutoTokenizer.from_pretrained(model_path))
    except TemplateNotAppendOnly as e:
        raise ConfigError(f"actors.env.factory: {e}") from None


def longest_turn_prefill(env, template) -> int:
    """The most ids a later turn of an episode prefills into its kept cache (torch engine, sparse SGLang): the last
    sampled id, the template's end-of-turn (a cut turn) and boundary, one observation of env.max_obs_tokens content
    tokens in the template of its role (tool or user, the longer), the next assistant header; at most
    env.max_total_tokens."""
    overhead = max(len(template.observation_ids([{"role": role, "content": ""}], closed=False))
                   for role in ("tool", "user"))
    return min(1 + overhead + env.max_obs_tokens, env.max_total_tokens)


def preflight(cfg: RunConfig, *, model_path: str | None = None, prompt_tokens: int | None = None) -> PreflightReport:
    """Predict the run's KV demand and check it against its memory (module docstring).

    model_path: the resolved model directory (default: deploy.model_cache.resolve_model(cfg.model), which builds
    a preset model's files once). prompt_tokens: prompt width to size with (default: longest_prompt).
    Returns the report (print `.table()`, log `.params()`). Raises PreflightError when the sparse (method
    full: dense) batch of one actor exceeds its KV memory, naming the fields and the numbers.
    """
    from transformers import AutoConfig

    if model_path is None:
        from deploy.model_cache import resolve_model
        model_path = resolve_model(cfg.model)
    a = cfg.actors
    c = a.engine.compressor
    if cfg.learner.lora.enabled:   # a preset model's targets: its files exist from here
        check_lora_targets(cfg, model_path)
    hf = AutoConfig.from_pretrained(model_path)
    shape = ModelShape.from_hf_config(hf, a.engine.dtype, c.kv_dtype, c.kv_scale)
    prompt = prompt_tokens or longest_prompt(cfg, model_path)
    new = a.sampling.max_new_tokens
    low, high = c.budget_range()
    if c.kv_budget_bytes:   # the tokens the torch engine keeps at this model's bytes per token
        try:
            low = high = c.with_byte_budget(shape.bytes_per_token).kv_budget
        except ValueError as e:
            raise ConfigError(str(e).replace("compressor.", "actors.engine.compressor.")) from None
    compress = c.method != "full"
    if a.env.factory:   # multi-turn: up to env.max_total_tokens after the prompt, over every turn
        turn_new, new = min(new, a.env.max_total_tokens), max(new, a.env.max_total_tokens)
        template = check_chat_template(model_path)
    dense = kv_peak_bytes_per_sequence(shape, prompt, new, high, c.interval, compress=False)
    sparse = kv_peak_bytes_per_sequence(shape, prompt, new, high, c.interval, compress=compress)
    if a.env.factory and (a.engine.backend == "torch" or compress):    # the episode's cache kept across turns
        longest = longest_turn_prefill(a.env, template)
        dense, sparse = (episode_kv_peak_bytes_per_sequence(shape, prompt, turn_new, a.env.max_total_tokens, longest,
                                                            high, c.interval, compress=kind)
                         for kind in (False, compress))
    n_params = _parameter_count(hf)
    weight_bytes = n_params * shape.dtype_bytes
    memory, source = _available_memory(cfg, weight_bytes)
    batch_rows = a.prompts_per_batch * a.sampling.samples_per_prompt
    event = (0, 0, 0)
    if a.engine.backend == "sglang" and c.method in EVENT_METHODS:      # (the backend refuses h2o at start)
        event = max(sglang_event(shape, hf.num_attention_heads, c, b, prompt, batch_rows,
                                 cfg.learner.replays(c.method) or c.reads_positions) for b in {low, high})
        if memory is not None:
            memory, source = memory - event[0], f"{source} - compression event {event[0]:,} B"
    records = sglang_records(cfg, shape, high, prompt, new, batch_rows)
    if memory is not None and records[0]:
        memory, source = memory - records[0], f"{source} - eviction records {records[0]:,} B"
    ring = sglang_ring(cfg, shape, hf.num_attention_heads)
    if memory is not None and ring[0]:
        memory, source = memory - ring[0], f"{source} - query ring {ring[0]:,} B"
    report = PreflightReport(shape, a.engine.backend, c.method, prompt, new, high, c.interval,
                             batch_rows, dense, sparse, memory, source, weight_bytes)
    report.event_bytes, report.event_rows, report.event_live = event
    report.record_bytes, report.record_requests = records
    report.ring_bytes, report.ring_rows = ring
    report.learner_full, report.learner_lora, report.lora_rank = learner_sizing(cfg.learner, hf)
    report.lora_run = cfg.learner.lora.enabled
    check_report(cfg, report, low)
    report.warnings += lora_warnings(cfg)
    return report


def lora_warnings(cfg: RunConfig) -> list[str]:
    """With learner.lora on and learner.lr left at full fine-tuning's default (LearnerConfig's, 1e-6): the warning
    that LoRA's best learning rate is ~10x full fine-tuning's ("LoRA Without Regret", Schulman et al., Thinking
    Machines 2025, "Optimal learning rates"), so that the adapter barely moves; [] otherwise."""
    default = LearnerConfig.__dataclass_fields__["lr"].default
    if not cfg.learner.lora.enabled or cfg.learner.lr != default:
        return []
    return [f"learner.lora.rank={cfg.learner.lora.rank} with learner.lr={cfg.learner.lr:g}, full fine-tuning's "
            "default: LoRA's best learning rate is about 10x full fine-tuning's; set learner.lr (e.g. "
            f"{10 * default:g})"]


def check_report(cfg: RunConfig, report: PreflightReport, low: int) -> None:
    """The broker's share of the preflight (one group's wire bytes, eviction records included, and the stream's
    largest size) and its warnings (nothing to replay, the prompt compressed at prefill, a budget that never
    evicts) added to `report`, and its refusals: PreflightError when one group exceeds broker.max_message_bytes or one
    actor batch's KV exceeds `report.memory_bytes`, naming the fields and the numbers. low: the smallest budget
    the run uses, tokens."""
    a, c, shape = cfg.actors, cfg.actors.engine.compressor, report.shape
    compress, prompt, new, high = c.method != "full", report.prompt_tokens, report.max_new_tokens, report.kv_budget
    memory, source = report.memory_bytes, report.memory_source
    G, topk = a.sampling.samples_per_prompt, a.sampling.topk_logprobs
    report.record_rows = shape.layers * shape.kv_heads if cfg.learner.replays(c.method) else 0   # eviction replay
    report.group_bytes = group_wire_bytes(G, prompt, new, topk, report.record_rows)
    if cfg.learner.policy_target == "sparse" and not compress:
        report.warnings.append("learner.policy_target=sparse with actors.engine.compressor.method=full: nothing is "
                               "evicted, so there is nothing to replay; the run trains the dense policy"
                               + (f" (learner.distill_coef={cfg.learner.distill_coef:g} is not applied: the teacher "
                                  "and the student are the same forward)" if cfg.learner.distill_coef > 0 else ""))
    report.queue_bytes = report.group_bytes * (cfg.broker.high_watermark + a.prompts_per_batch)
    if report.group_bytes > cfg.broker.max_message_bytes:
        raise PreflightError(
            f"preflight: one group is {report.group_bytes:,} B on the wire > broker.max_message_bytes="
            f"{cfg.broker.max_message_bytes:,} (actors.sampling.samples_per_prompt={G} x (prompt {prompt} x 4 B + "
            f"actors.sampling.max_new_tokens={new} x (8 + 6 x actors.sampling.topk_logprobs={topk}) B)): raise "
            "broker.max_message_bytes or lower topk_logprobs / max_new_tokens")
    if compress and prompt > low:
        budget = f"kv_budget={low}" if low == c.kv_budget else (
            f"the smallest budget the run uses, {low} tokens (kv_budget={c.kv_budget} with its tiers, schedule or "
            "controller)")
        report.warnings.append(
            f"prompts of up to {prompt} tokens exceed {budget}: the prompt itself is compressed at prefill "
            "(the long-context regime; the Sparse-RL paper compresses only the generated trace, prompt < budget)")
    if compress and low >= prompt + new:
        report.warnings.append(
            f"actors.engine.compressor.kv_budget: the smallest budget the run uses, {low} tokens, is at or above "
            f"prompt ({prompt}) + actors.sampling.max_new_tokens ({new}) = {prompt + new} tokens: nothing will ever "
            "be evicted, the rollouts are dense")
    if memory is not None:
        need = report.sparse_per_batch if compress else report.dense_per_batch
        if need > memory:
            kind = "sparse" if compress else "dense"
            budget = (f", actors.engine.compressor.kv_budget={c.kv_budget} (largest budget used: {high}) + "
                      f"interval={c.interval}" if compress else ", actors.engine.compressor.method=full")
            raise PreflightError(
                f"preflight: the {kind} KV cache of one actor batch does not fit: actors.prompts_per_batch="
                f"{a.prompts_per_batch} x actors.sampling.samples_per_prompt={a.sampling.samples_per_prompt} = "
                f"{report.batch_rows} sequences x {need // report.batch_rows:,} B = {need:,} B > {memory:,} B of KV "
                f"memory ({source}); prompt {prompt} + actors.sampling.max_new_tokens={new} tokens{budget}; "
                f"{shape.layers} layers x {shape.kv_heads} KV heads x head_dim {shape.head_dim} x {shape.dtype_bytes} "
                f"B ({a.engine.dtype}). At most {report.fits(need // report.batch_rows)} sequences fit: lower "
                "prompts_per_batch / samples_per_prompt / max_new_tokens / kv_budget, or raise preflight.kv_memory_gb")


def sglang_event(shape: ModelShape, q_heads: int, c, budget: int, prompt: int, rows: int,
                 record: bool = False) -> tuple[int, int, int]:
    """(bytes, rows per call, live tokens) of the largest compression call of the SGLang sparse backend
    (actors/engines/sglang/triton_backend.py `_event_chunks`) for `rows` requests due at once at `budget` tokens: live =
    max(prompt, budget + interval) (a prompt compressed at prefill; a decode row compressed at most interval tokens
    after it reached its budget), the rows split as the backend does under actors.engines.kv_memory.EVENT_BYTES_CAP;
    bytes = `compression_event_bytes`. c: the CompressorConfig (its protection too); record: the backend keeps
    eviction records (the run replays: learner.policy_target=sparse) or the keys' true positions
    (`CompressorConfig.reads_positions`)."""
    live = max(prompt, budget + c.interval)
    args = (budget, c.window, q_heads, shape.kv_heads, shape.head_dim, shape.dtype_bytes, c.method, record,
            c.protects, c.protect_values > 0)
    per_call = -(-rows // event_calls(rows, event_chunk_rows(live, *args)))
    return compression_event_bytes(per_call, live, *args), per_call, live


def sglang_ring(cfg: RunConfig, shape: ModelShape, q_heads: int) -> tuple[int, int]:
    """(bytes, request rows) of the SGLang sparse backend's query ring and row vectors (actors/engines/sglang/
    triton_backend.py, `qwin`) when the run compresses on the SGLang engine, else (0, 0): `query_ring_bytes` at the
    compressor's window (0 when it reads no queries: streamingllm, `CompressorConfig.reads_queries`), the model's
    `q_heads` and the engine dtype, for `sglang_request_rows` of actors.engine.sglang.max_running_requests and
    max_total_tokens."""
    a = cfg.actors
    c, sglang = a.engine.compressor, a.engine.sglang
    if a.engine.backend != "sglang" or c.method not in EVENT_METHODS:
        return 0, 0
    rows = sglang_request_rows(sglang.max_running_requests, sglang.max_total_tokens)
    window = c.window if c.reads_queries else 0
    return query_ring_bytes(rows, shape.layers, window, q_heads, shape.head_dim, shape.dtype_bytes), rows


def sglang_records(cfg: RunConfig, shape: ModelShape, budget: int, prompt: int, new: int,
                   batch_rows: int) -> tuple[int, int]:
    """(bytes, requests) of the SGLang sparse backend's eviction records (actors/engines/sglang/records.py) when the
    run replays on the SGLang engine (actors.engine.backend=sglang, learner.policy_target=sparse, compressing), else
    (0, 0): `record_bytes_per_request` at the largest `budget` and the longest request (`prompt` + the larger of
    `new` and eval.max_new_tokens), for the most requests one generate call holds (the larger of `batch_rows` and
    eval.batch_size when eval is on: the buffers grow to it and stay). A run that does not replay but whose compressor
    reads true positions (random, protect_prompt: `CompressorConfig.reads_positions`) holds the records' origin map
    alone (`record_bytes_per_request` with tokens 0)."""
    a, ev = cfg.actors, cfg.eval
    c = a.engine.compressor
    replays = cfg.learner.replays(c.method)
    if a.engine.backend != "sglang" or c.method == "full" or not (replays or c.reads_positions):
        return 0, 0
    rows = max(batch_rows, ev.batch_size if ev.enabled else 0)
    tokens = prompt + max(new, ev.max_new_tokens if ev.enabled else 0) if replays else 0
    return rows * record_bytes_per_request(shape.layers, shape.kv_heads, budget, tokens), rows


def _parameter_count(hf) -> int:
    """Parameters of a Llama/Qwen2-shaped decoder from its config (embeddings, attention, MLP, norms, head)."""
    h, v, n, heads, head_dim, kv, inter = _decoder_dims(hf)
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    per_layer = attn + 3 * h * inter + 2 * h
    head = 0 if getattr(hf, "tie_word_embeddings", False) else v * h
    return v * h + n * per_layer + h + head
