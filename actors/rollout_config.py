"""The rollout actors' part of the run config: the actor pool's settings (`actors.*`), evaluation (`eval.*`), and
`RolloutConfig`, everything one rollout actor needs (deploy.config.rollout_config composes it from the run
config, so that an actor never imports deploy/)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from actors.config import DataConfig, EngineConfig, SamplingConfig
from actors.envs.env import EnvConfig
from actors.tasks.reward import RewardConfig
from broker.config import BrokerConfig
from broker.lora import LoraConfig
from compressors import CompressorConfig


@dataclass
class ActorsConfig:
    count: int = 2
    """Rollout actors at start; change it while the run goes on with `sparse-rl scale`."""
    num_cpus: float = 1.0
    """Ray CPUs per rollout actor."""
    num_gpus: float = 0.0
    """Ray GPUs per rollout actor."""
    torch_threads: int = 1
    """torch intra-op threads per actor process."""
    max_restarts: int = 2
    """Times Ray restarts a crashed rollout actor before the driver replaces it."""
    start_timeout_s: float = 1800.0
    """Longest a rollout actor may take to start (load its model and engine) before the driver replaces it,
    seconds; sized for an SGLang engine loading a 7B model. While it starts it is not pinged with
    learner.weight_sync_timeout_s and the run goes on without it; it joins the next weight sync once ready."""
    prompts_per_batch: int = 2
    """Prompts generated together; one batch is prompts_per_batch x sampling.samples_per_prompt rows."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn rollouts (actors/envs/env.py, actors/envs/episode.py): with `env.factory` set, each sample is an
    episode of the environment, whose reward replaces `reward`'s."""


@dataclass
class EvalConfig:
    enabled: bool = True
    """Score the final weights on `data` after training, once per mode."""
    before: bool = False
    """Also score the initial weights before training (logged at the initial weight version; the console
    prints a before/after table)."""
    data: str = "gsm8k_test"
    """Prompt set: "train_task" (`limit` held-out problems of the training task, scored with the training
    reward), a GSM8K-shaped JSONL path, or "gsm8k_test" (the 100 shipped GSM8K test items)."""
    limit: int = 100
    """First N items of the prompt set (0 = all; train_task: 100). train_task gives `limit` distinct questions or
    fails at the config check (exit 2) naming eval.limit and how many there are."""
    draw: int = 2
    """Version of the train_task draw: 2 = distinct questions (the default); 1 = the first draw, whose items may
    repeat a question: what the committed comparison records were scored on (bench/replication.py passes it; a
    run record written before the draw was versioned resumes with it)."""
    modes: list[str] = field(default_factory=lambda: ["dense", "sparse"])
    """dense: full KV cache; sparse: `sparse_compressor`, by default the run's compressor and budget. The SGLang
    engine evaluates in its own mode only (sparse, or dense with method full): its attention backend is fixed when
    it starts."""
    sparse_compressor: Optional[CompressorConfig] = None
    """The compressor of sparse evaluation when it is not the training rollouts' (None): e.g. a dense-rollout
    baseline evaluated under the sparse arms' budget (`eval.sparse_compressor.method=rkv
    eval.sparse_compressor.kv_budget=48 ...`; unset fields take CompressorConfig's defaults). Torch engine only."""
    max_new_tokens: int = 256
    """Response length limit at evaluation, tokens."""
    temperature: float = 0.0
    """0 = greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling at evaluation (the paper evaluates at temperature 0.8, top_p 0.95)."""
    batch_size: int = 16
    """Prompts per generate call at evaluation."""


@dataclass
class RolloutConfig:
    """What one rollout actor is given (a plain dict over Ray, typed again in the actor)."""
    model: str = MISSING
    """The model directory (resolved by the driver)."""
    seed: int = 0
    """Seed of prompt order and sampling."""
    train_steps: int = 1
    """The run's last weight version (budget schedules are a function of version / train_steps)."""
    actors: ActorsConfig = field(default_factory=ActorsConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    weight_sync_backend: str = "auto"
    """learner.weight_sync_backend of the run: auto | gloo | nccl."""
    weight_sync_timeout_s: float = 120.0
    """learner.weight_sync_timeout_s of the run, seconds."""
    weight_sync_verify: bool = False
    """learner.weight_sync_verify of the run: check per-tensor checksums after each swap."""
    fingerprint_tokens: int = 0
    """Tokens per sequence of the weight-sync fingerprint's probe (broker/fingerprint.py), scored after each swap
    (learner.weight_sync_fingerprint error | warn); 0 = off."""
    fingerprint_every: int = 1
    """learner.weight_sync_fingerprint_every of the run: the probe is scored after swapping in a version that is a
    multiple of it (broker/fingerprint.py fingerprinted)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """learner.lora of the run: with rank > 0 the engine holds the same adapter (broker/lora.py) and the weight sync
    sends it alone (the base stays as loaded)."""
    record_evictions: bool = False
    """Attach each sample's eviction record (learner.policy_target=sparse on a compressing run: the learner
    replays it). Both engines (torch, sglang)."""
