"""Typed configs of the rollout actor: engine, sampling, prompt data (composed by deploy/config.py)."""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Optional

from actors.engines.base import SamplingParams, check_sampling
from compressors import CompressorConfig

DEFAULT_INSTRUCTION = "Solve the problem step by step. Write the final answer on the last line as '#### <number>'."


def load_callable(spec: str, field_name: str):
    """The callable named by `spec` ("package.module:function"), for the config field `field_name` (e.g.
    reward.function), whose name starts every error message.

    Raises ValueError `<field_name>=<spec>: ...` when `spec` is not of the form module:function, the module
    cannot be imported (or fails while importing), or it has no such callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{field_name}={spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module itself fails while importing
        raise ValueError(f"{field_name}={spec!r}: cannot import module {module_name!r} "
                         f"({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{field_name}={spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


SGLANG_SET_BY_SPARSE_RL = ("model_path", "dtype", "skip_tokenizer_init")
"""`sglang.Engine` arguments sparse-rl sets itself (the model, `actors.engine.dtype`, the tokenizer it reads)."""
SGLANG_NAMED = ("mem_fraction_static", "max_total_tokens", "max_running_requests", "schedule_conservativeness")
"""`SGLangConfig`'s fields passed to `sglang.Engine` under their own names."""


@dataclass
class SGLangConfig:
    """Settings of the SGLang engine (actors.engine.backend=sglang; the torch engine ignores them), passed to
    `sglang.Engine` as its ServerArgs (sglang >= 0.5.23). None leaves SGLang's own default (docs/sglang.md,
    "Settings"). Raises ValueError naming the field on a value out of range or an `engine_kwargs` key that a
    field here or sparse-rl itself sets, or that is not a keyword name."""
    mem_fraction_static: Optional[float] = None
    """Fraction of the device's memory SGLang takes for the weights and its KV pool, 0 < f < 1 (verl's
    rollout.gpu_memory_utilization). The sparse backend's query ring, compression buffers and eviction records are
    outside it (the preflight takes them off the actor's memory, deploy/preflight.py)."""
    max_total_tokens: Optional[int] = None
    """Size of SGLang's KV pool in tokens, >= 1, instead of sizing it from mem_fraction_static."""
    max_running_requests: Optional[int] = None
    """Most requests SGLang holds at once, >= 1 (verl's rollout.max_num_seqs). With a compressor it also sizes the
    sparse backend's query ring (one row per request + 1, outside mem_fraction_static); unset, SGLang picks 2,048 to
    4,096 rows and the preflight counts 4,097."""
    schedule_conservativeness: Optional[float] = None
    """How conservatively SGLang admits requests against its free KV, > 0: larger admits fewer and retracts
    fewer (SGLang's default 1.0). A sparse run ends on a retraction (its compression history restarts)."""
    deterministic: bool = False
    """SGLang's enable_deterministic_inference: batch-invariant kernels, so that each sample's own seed
    (seed + j) decides its draw; off, SGLang's engine-wide random seed does."""
    engine_kwargs: dict = field(default_factory=dict)
    """Any other `sglang.Engine` keyword argument, passed as given (e.g. {random_seed: 0, cuda_graph_max_bs: 8});
    in sparse mode one that contradicts the sparse backend is refused at config check."""

    def __post_init__(self):
        checks = [(self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1, "mem_fraction_static",
                   self.mem_fraction_static, "0 < f < 1 or null"),
                  (self.max_total_tokens is None or self.max_total_tokens >= 1, "max_total_tokens",
                   self.max_total_tokens, ">= 1 or null"),
                  (self.max_running_requests is None or self.max_running_requests >= 1, "max_running_requests",
                   self.max_running_requests, ">= 1 or null"),
                  (self.schedule_conservativeness is None or self.schedule_conservativeness > 0,
                   "schedule_conservativeness", self.schedule_conservativeness, "> 0 or null")]
        bad = [f"SGLangConfig.{name}={value}: expected {rule}" for ok, name, value, rule in checks if not ok]
        named = {"enable_deterministic_inference", *SGLANG_NAMED}
        for key in sorted(set(self.engine_kwargs) & (named | set(SGLANG_SET_BY_SPARSE_RL))):
            owner = "sparse-rl sets it" if key in SGLANG_SET_BY_SPARSE_RL else "use its own field"
            bad.append(f"SGLangConfig.engine_kwargs.{key}: {owner}")
        for key in sorted(k for k in map(str, self.engine_kwargs) if not k.isidentifier()):   # {a:1} is {"a:1": None}
            bad.append(f"SGLangConfig.engine_kwargs.{key!r}: not a keyword argument name (a mapping needs a space "
                       "after each colon: {page_size: 4})")
        if bad:
            raise ValueError("; ".join(bad))

    def kwargs(self) -> dict:
        """The `sglang.Engine` keyword arguments these settings make (the fields left None are left out)."""
        kwargs = {key: getattr(self, key) for key in SGLANG_NAMED if getattr(self, key) is not None}
        if self.deterministic:
            kwargs["enable_deterministic_inference"] = True
        return {**kwargs, **self.engine_kwargs}


@dataclass
class EngineConfig:
    backend: str = "torch"
    """Rollout engine: torch (actors/engines/torch_engine.py, CPU or GPU) | sglang (GPU clusters)."""
    dtype: str = "fp32"
    """Model and KV-cache dtype: fp32 | bf16."""
    compressor: CompressorConfig = field(default_factory=CompressorConfig)
    """KV compression during decoding (docs/SPEC.md §5); method full = dense rollouts."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """The SGLang engine's settings (backend sglang only)."""

    def __post_init__(self):
        if self.backend not in ("torch", "sglang"):
            raise ValueError(f"EngineConfig.backend={self.backend!r}: expected torch | sglang")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"EngineConfig.dtype={self.dtype!r}: expected fp32 | bf16")


@dataclass
class SamplingConfig:
    """The run's sampling settings (`actors.sampling`, the user's names). An engine takes them as one request,
    `actors.engines.base.SamplingParams` (the engines' names: `n` for samples_per_prompt), built by
    `sampling_params()`."""
    temperature: float = 1.0
    """Softmax temperature of the sampler; the learner divides its logits by the same value (SPEC §3)."""
    max_new_tokens: int = 256
    """Response length limit in tokens."""
    samples_per_prompt: int = 8
    """G: responses per prompt (one GRPO group)."""
    top_p: float = 1.0
    """Nucleus sampling. Training requires 1.0 (see validate_training_sampling); evaluation may use less."""
    top_k: int = 0
    """Top-k sampling, 0 = off. Training requires 0."""
    stop_strings: list[str] = field(default_factory=list)
    """A response ends at the first token after which its text contains one of these."""
    topk_logprobs: int = 0
    """K: the actors also send, at every response position, the K most likely tokens of the sampling
    distribution and their log-probs (int32 ids + float16 log-probs: 6 K bytes per token on the wire, 120 at
    K = 20), from which the learner computes Sparrow's per-token acceptance rate (learner/acceptance.py,
    metrics accept_*). 0 = off; a budget controller on an accept_* metric sets it to 20 when left at 0."""

    def __post_init__(self):
        check_sampling("SamplingConfig", temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                       top_p=self.top_p, top_k=self.top_k, topk_logprobs=self.topk_logprobs,
                       samples_per_prompt=self.samples_per_prompt)

    def sampling_params(self, seed: int | None = None) -> SamplingParams:
        """The engine request of these settings (actors.engines.base.SamplingParams), field by field:
        temperature -> temperature, max_new_tokens -> max_new_tokens, samples_per_prompt -> n (as SGLang and vLLM
        name it), top_p -> top_p, top_k -> top_k, stop_strings -> stop_strings (a copy), topk_logprobs ->
        topk_logprobs; `seed` -> seed (None: unseeded; the rollout actor sets it per batch); ignore_eos False
        (a benchmark setting, no config field)."""
        return SamplingParams(temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                              n=self.samples_per_prompt, top_p=self.top_p, top_k=self.top_k,
                              stop_strings=list(self.stop_strings), seed=seed, topk_logprobs=self.topk_logprobs)


def validate_training_sampling(sampling) -> None:
    """Training rollouts sample from the full softmax: truncated sampling makes logp_sparse incomparable with
    the learner's pi_old (SPEC §3). `sampling`: a SamplingConfig or actors.engines.base.SamplingParams.

    Raises ValueError naming `<class>.top_p` if it is not 1, `<class>.top_k` if it is not 0,
    `<class>.temperature` if it is not > 0 (<class>: SamplingConfig or SamplingParams)."""
    owner = type(sampling).__name__
    if sampling.top_p != 1.0:
        raise ValueError(f"{owner}.top_p={sampling.top_p}: training rollouts require top_p = 1.0 "
                         "(set it only for evaluation)")
    if sampling.top_k != 0:
        raise ValueError(f"{owner}.top_k={sampling.top_k}: training rollouts require top_k = 0 (off)")
    if sampling.temperature <= 0:
        raise ValueError(f"{owner}.temperature={sampling.temperature}: training rollouts require temperature > 0 "
                         "(greedy decoding has no sampling distribution to correct)")


@dataclass
class DataConfig:
    source: str = "reasoning_gym"
    """Training prompts: reasoning_gym (generated, see `tasks`) | gsm8k_jsonl (a file in GSM8K shape, `path`) |
    function (a task generator of your own, `function`)."""
    tasks: list[str] = field(default_factory=lambda: ["basic_arithmetic", "gsm_symbolic"])
    """reasoning-gym dataset names, mixed in equal parts (e.g. basic_arithmetic, gsm_symbolic)."""
    task_options: dict[str, dict] = field(default_factory=dict)
    """Per reasoning-gym task, keyword arguments of its dataset config, e.g. {basic_arithmetic: {max_terms: 2,
    max_digits: 2, operators: [+, -]}} for problems a small model can sometimes solve."""
    function: str = ""
    """For source function: "package.module:function", called as `function(size=..., seed=..., **function_options)`
    and returning a list of dicts with `question` and `answer` (str) and optional `metadata` (dict, passed to
    the reward function with the item) and `id`. Synthetic tasks shipped: actors.tasks:copy_numbers,
    actors.tasks:digits (see actors/tasks/builtin.py)."""
    function_options: dict = field(default_factory=dict)
    """Keyword arguments of `function` (e.g. {count: 12})."""
    timeout_s: float = 300.0
    """For source function: longest one call of `function` may take, seconds. It runs in a worker process
    (actors/user_code.py), so a generator that never returns is stopped: the start fails with one line naming
    the function and this timeout (at the config check: exit 2). 0 = no limit (called in the process itself)."""
    path: str = ""
    """GSM8K-shape JSONL (`question`, `answer` ending in '#### N') for source gsm8k_jsonl."""
    size: int = 512
    """Number of training prompts (reasoning_gym: generated; gsm8k_jsonl: first `size` rows, 0 = all)."""
    instruction: str = DEFAULT_INSTRUCTION
    """Appended to every question in the user turn of the chat template."""

    def __post_init__(self):
        if self.source not in ("reasoning_gym", "gsm8k_jsonl", "function"):
            raise ValueError(f"DataConfig.source={self.source!r}: expected reasoning_gym | gsm8k_jsonl | function")
        if self.source == "function" and not self.function:
            raise ValueError("DataConfig.function is required when DataConfig.source is function")
        if self.source == "gsm8k_jsonl" and not self.path:
            raise ValueError("DataConfig.path is required when DataConfig.source is gsm8k_jsonl")
        if self.source == "reasoning_gym" and not self.tasks:
            raise ValueError("DataConfig.tasks must name at least one reasoning-gym dataset")
        if self.size < 0:
            raise ValueError(f"DataConfig.size={self.size}: expected >= 0")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s >= 0):
            raise ValueError(f"DataConfig.timeout_s={self.timeout_s}: expected seconds >= 0 (0 = no limit)")
