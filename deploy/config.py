"""The run config: every component's typed config composed with omegaconf (YAML preset + dotted overrides),
validated at start with errors that name the field.

    cfg = load_config("smollm2-gsm8k", ["actors.count=3", "learner.lr=2e-6"])
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import secrets
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from actors.engines.sglang.contract import refusal_line, unsupported_compressor_settings
from actors.rollout_config import ActorsConfig, EvalConfig, RolloutConfig
from broker.config import BrokerConfig
from broker.fingerprint import probe_tokens
from deploy.model_cache import (
    SMOLLM2,
    SMOLLM2_COUNT_WARM,
    SMOLLM2_LOOKUP_STRESS_WARM,
    SMOLLM2_LOOKUP_WARM,
    TINY_CHAR,
    TINY_LLAMA,
)
from learner.config import LearnerConfig

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""The YAML presets, shipped inside the package (the repository's top-level `configs` links here)."""
PRESET_MODELS = (SMOLLM2, SMOLLM2_COUNT_WARM, SMOLLM2_LOOKUP_WARM, SMOLLM2_LOOKUP_STRESS_WARM, TINY_LLAMA, TINY_CHAR)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ConfigError(ValueError):
    """A config value is missing, of the wrong type or out of range; the message names the field."""


@dataclass
class RayConfig:
    address: str = ""
    """Ray cluster to join: "" starts a local Ray on 127.0.0.1; "auto" or "ray://host:10001" joins one."""
    num_cpus: int = 0
    """CPUs of the local Ray (0 = all of the machine's). Ignored when joining a cluster."""
    actor_resource: str = ""
    """Custom Ray resource each rollout actor requests (1 unit), e.g. "rollout": actors then run only on nodes
    started with `ray start --resources='{"rollout": N}'`. Empty: no custom resource."""
    learner_resource: str = ""
    """Custom Ray resource the learner requests (1 unit), e.g. "learner". Empty: no custom resource."""


@dataclass
class TrainConfig:
    steps: int = 4
    """The run's last weight version: a new run trains this many learner steps; a resumed or forked one trains
    from its checkpoint's version up to it (deploy/record.py)."""
    groups_per_step: int = 4
    """Prompt groups (each of samples_per_prompt responses) consumed by one learner step."""
    group_wait_s: float = 1800.0
    """Longest a learner step waits for its groups before the run fails, seconds."""
    wait_report_s: float = 30.0
    """While the run waits (for starting actors, or the learner for groups), the console says why after this
    long and again every this many seconds."""
    learner_num_cpus: float = 1.0
    """Ray CPUs of the learner."""
    learner_num_gpus: float = 0.0
    """Ray GPUs of the learner (1 on a GPU node: NCCL and bf16)."""
    sigterm_checkpoint_s: float = 20.0
    """On SIGTERM (Slurm's time limit or scancel, pod deletion, docker stop) the learner writes a checkpoint of its
    last completed step if it can within this many seconds, then the run stops as on Ctrl-C (exit 143); 0 = off.
    The scheduler's grace period (the Slurm script's --signal lead time, KubeRay's terminationGracePeriodSeconds)
    must leave room for it and the shutdown."""


@dataclass
class MlflowConfig:
    tracking_uri: str = ""
    """MLflow tracking URI (e.g. http://mlflow:5000). Empty: sqlite file `mlflow.db` in the run directory."""
    experiment: str = "sparse-rl"
    """MLflow experiment name."""


@dataclass
class PreflightConfig:
    enabled: bool = True
    """Run the KV capacity preflight (deploy/preflight.py) at the start of `train`; `sparse-rl preflight` runs it
    alone."""
    kv_memory_gb: float = 0.0
    """KV-cache memory of one rollout actor, GiB. 0: the free GPU memory minus the weights (actors on GPUs, CUDA
    visible to the driver), else the machine's available memory / actors.count minus the weights (CPU)."""
    max_prompt_tokens: int = 0
    """Prompt width to size with, tokens. 0: the longest training prompt, tokenized with the model's template."""


@dataclass
class RunConfig:
    name: str = "sparse-rl"
    """Run name; the run id is `<name>-<UTC time>-<4 random hex digits>` (see new_run_id)."""
    run_dir: str = "runs"
    """Parent directory of run directories (checkpoints, mlflow.db, plots, the resolved config)."""
    model: str = MISSING
    """A local Hugging Face model directory (with config.json; `~` is expanded), or a preset model built on
    first use (deploy/model_cache.py): smollm2-135m-instruct | smollm2-135m-count-warm | smollm2-135m-lookup-warm |
    smollm2-135m-lookup-stress-warm (warmed up on a task, cached) | tiny-llama | tiny-char. Checked at start: a
    path that does not exist or has no config.json fails naming `model`. A value shaped like a hub id,
    `org/name` (no leading '/', '.' or '~', exactly one '/', and no such local path), is let through unchecked
    for clusters with hub access: transformers downloads it on every node that loads it, and fails there when
    the hub is unreachable."""
    seed: int = 0
    """Seed of prompt order and sampling, and of the learner's minibatch shuffling unless `learner.seed` is set
    (resolve_learner_seed)."""
    ray: RayConfig = field(default_factory=RayConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    actors: ActorsConfig = field(default_factory=ActorsConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)


def rollout_config(run: RunConfig) -> RolloutConfig:
    """The part of the run config a rollout actor needs (actors/rollout_config.py), as a plain dict for Ray."""
    lcfg = run.learner
    return RolloutConfig(model=run.model, seed=run.seed, train_steps=run.train.steps, actors=run.actors,
                         broker=run.broker, eval=run.eval, weight_sync_backend=lcfg.weight_sync_backend,
                         weight_sync_timeout_s=lcfg.weight_sync_timeout_s, weight_sync_verify=lcfg.weight_sync_verify,
                         fingerprint_tokens=fingerprint_tokens(run),
                         fingerprint_every=lcfg.weight_sync_fingerprint_every, lora=lcfg.lora,
                         record_evictions=lcfg.replays(run.actors.engine.compressor.method))


def fingerprint_tokens(run: RunConfig) -> int:
    """Tokens per sequence of the weight-sync fingerprint's probe, the same for the learner and every actor:
    broker.fingerprint.probe_tokens of the smallest KV budget the run may use (none with compressor method full;
    with compressor.kv_budget_bytes, whose tokens the engine resolves from the model, the least it may hold:
    window + 1); 0 with learner.weight_sync_fingerprint=off. Raises ValueError when that budget is below the probe's
    minimum (the config check refuses the run first: check_fingerprint)."""
    if run.learner.weight_sync_fingerprint == "off":
        return 0
    compressor = run.actors.engine.compressor
    smallest = compressor.window + 1 if compressor.kv_budget_bytes else compressor.budget_range()[0]
    return probe_tokens(smallest if compressor.method != "full" else None)


def check_fingerprint(run: RunConfig) -> None:
    """learner.weight_sync_fingerprint's probe fits the run's smallest KV budget (broker/fingerprint.py), else
    ConfigError naming both fields."""
    try:
        fingerprint_tokens(run)
    except ValueError as e:
        raise ConfigError(f"learner.weight_sync_fingerprint={run.learner.weight_sync_fingerprint}: {e} "
                          f"(actors.engine.compressor.kv_budget={run.actors.engine.compressor.kv_budget} and its "
                          "schedule, controller and tiers): set learner.weight_sync_fingerprint=off") from None


def _mount_points(cls: type = RunConfig, prefix: str = "") -> dict[type, str]:
    """{component config class: its dotted path in RunConfig}, e.g. {LearnerConfig: "learner",
    SamplingConfig: "actors.sampling", CompressorConfig: "actors.engine.compressor", ...}."""
    hints = typing.get_type_hints(cls)
    found: dict[type, str] = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            found[kind] = f"{prefix}{f.name}"  # each component class is mounted once
            found.update(_mount_points(kind, f"{prefix}{f.name}."))
    return found


# How components name their fields in errors -> the dotted path the user types. Components do not know where
# they are mounted: they write `LearnerConfig.eps=...`; CompressorConfig.validate writes `compressor.<field>`.
_FIELD_OWNERS = {cls.__name__: path for cls, path in _mount_points().items()}
_FIELD_OWNERS["compressor"] = _FIELD_OWNERS["CompressorConfig"]
_FIELD_OWNER = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, _FIELD_OWNERS)) + r")\.(?=\w)")


def section_hint(key: str | None) -> str:
    """For a top-level key that is a field of a section (`policy_target=sparse`): "; did you mean
    learner.policy_target?" naming each section that has it; "" otherwise."""
    if not key or "." in key or key in {f.name for f in dataclasses.fields(RunConfig)}:
        return ""
    paths = [f"{path}.{key}" for cls, path in _mount_points().items()
             if key in {f.name for f in dataclasses.fields(cls)}]
    return f"; did you mean {' or '.join(paths)}?" if paths else ""


def dotted_names(message: str) -> str:
    """A component's error message with its field names as the user types them:
    "LearnerConfig.eps=-1.0: expected 0 < eps < 1" -> "learner.eps=-1.0: expected 0 < eps < 1"."""
    return _FIELD_OWNER.sub(lambda m: _FIELD_OWNERS[m.group(1)] + ".", message)


def preset_path(name_or_path: str) -> Path:
    """A YAML path, or the name of a preset in deploy/configs/ ("tiny", "smollm2-gsm8k", "qwen2.5-math")."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    if path.is_file():
        raise ConfigError(f"config {name_or_path!r}: expected a .yaml or .yml file, or a preset name")
    preset = CONFIG_DIR / f"{name_or_path}.yaml"
    if preset.exists():
        return preset
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"config {name_or_path!r}: no such file, and not a preset (presets: {', '.join(names)})")


def load_config(name_or_path: str, overrides: list[str] = (), *, check_files: bool = True) -> RunConfig:
    """Compose RunConfig defaults <- preset YAML <- dotted overrides, then validate every section.

    check_files=False skips the checks of files the run reads (the model directory, eval.data, actors.data.path,
    user code) and of the services it names (broker.url, ray.address): for composing a config meant for another
    machine (the presets and manifests of a cluster).
    Raises ConfigError naming the dotted field (unknown key, wrong type, value out of range, missing model or
    file, unreachable service, YAML syntax error); nothing has started when it does."""
    try:
        cfg = OmegaConf.structured(RunConfig)
        cfg = OmegaConf.merge(cfg, load_yaml(preset_path(name_or_path)))
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        run = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        section = re.search(r"is not a subclass of (\w+)\. value: (.*)", str(e))  # `learner=5`: no key in the error
        if not key and section and section.group(1) in _FIELD_OWNERS:
            path = _FIELD_OWNERS[section.group(1)]
            raise ConfigError(f"{path}={section.group(2)}: {path} is a section (set its fields: "
                              f"{path}.<field>=<value>)") from None
        message = f"config field {key}: {str(getattr(e, 'msg', e)).splitlines()[0]}" if key else f"config: {e}"
        raise ConfigError(message + section_hint(key)) from None
    except ValueError as e:  # a component's __post_init__ check
        raise ConfigError(dotted_names(str(e))) from None
    run.model = os.path.expanduser(run.model)
    resolve_learner_seed(run)
    resolve_budget_metric(run)
    validate(run, check_files=check_files)
    if check_files:
        absolute_paths(run)
    return run


def absolute_paths(run: RunConfig) -> None:
    """Make the local paths the run's processes read absolute (model directory, data files, checkpoint
    directories, run_dir): Ray workers do not start in the driver's working directory (deploy.driver.start_ray)."""
    def absolute(path: str) -> str:
        return str(Path(path).expanduser().resolve()) if path else path

    if Path(run.model).expanduser().is_dir():
        run.model = absolute(run.model)
    if run.actors.data.source == "gsm8k_jsonl":
        run.actors.data.path = absolute(run.actors.data.path)
    if Path(run.eval.data).expanduser().is_file():
        run.eval.data = absolute(run.eval.data)
    run.run_dir = absolute(run.run_dir)
    run.learner.checkpoint_dir, run.learner.resume_from = (absolute(run.learner.checkpoint_dir),
                                                           absolute(run.learner.resume_from))


def resolve_learner_seed(run: RunConfig) -> None:
    """learner.seed None (the default) -> the run's `seed`: one seed for the whole run unless the learner's is set
    explicitly (which is kept)."""
    if run.learner.seed is None:
        run.learner.seed = run.seed


ACCEPT_TOPK = 20
"""Top-k log-probs the actors send when the budget controller reads the acceptance rate (Sparrow's top 20)."""


def resolve_budget_metric(run: RunConfig) -> None:
    """actors.engine.compressor.budget_metric "" (the default) -> accept_upper_p5 when actors.sampling.topk_logprobs
    > 0 (the p5 of the acceptance rate's upper bound: on real SmolLM2 batches within +0.00..+0.06 of the exact p5 at
    K = 20, where the lower bound's p5 sat 0.14-0.72 below it; docs/SPEC.md §5.1), else xi_sym_p5; an accept_*
    metric with topk_logprobs 0 sets topk_logprobs = ACCEPT_TOPK."""
    c, sampling = run.actors.engine.compressor, run.actors.sampling
    if not c.budget_metric:
        c.budget_metric = "accept_upper_p5" if sampling.topk_logprobs > 0 else "xi_sym_p5"
    if c.budget_metric.startswith("accept_") and c.budget_control != "off" and sampling.topk_logprobs == 0:
        sampling.topk_logprobs = ACCEPT_TOPK


def load_yaml(path: Path):
    """OmegaConf.load, with a YAML syntax error as one ConfigError line: file, line, column, problem."""
    import yaml

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        start, context = getattr(e, "context_mark", None), getattr(e, "context", None)
        if start and context and mark and start.line != mark.line:  # e.g. an unclosed [ found at the file's end
            problem += f" ({context} at line {start.line + 1}, column {start.column + 1})"
        raise ConfigError(f"config file {where}: YAML syntax error: {problem}") from None


def check_model(model: str) -> None:
    """Raise ConfigError naming `model` unless it is a preset model, a directory with config.json, or shaped
    like a hub id (see RunConfig.model)."""
    if model in PRESET_MODELS:
        return
    expected = f"expected a local Hugging Face model directory containing config.json, or a preset model " \
               f"({' | '.join(PRESET_MODELS)})"
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return
        raise ConfigError(f"model={model!r}: the directory has no config.json; {expected}")
    if path.exists():
        raise ConfigError(f"model={model!r}: a file, not a directory; {expected}")
    if not model.startswith(("/", ".", "~")) and _HUB_ID.fullmatch(model):
        return  # a hub id (org/name), for clusters with hub access
    raise ConfigError(f"model={model!r}: no such directory; {expected}, or a hub id org/name on a machine with "
                      "Hugging Face hub access")


def check(ok: bool, message: str) -> None:
    """ConfigError(message) unless ok."""
    if not ok:
        raise ConfigError(message)


def validate(run: RunConfig, *, check_files: bool = True) -> None:
    """Checks that span components, and the files and services the run needs (unless check_files=False, see
    load_config); each component validates its own fields on construction."""
    from actors.config import validate_training_sampling
    from compressors import build_compressor

    for name, value in non_finite(to_dict(run)):   # e.g. learner.collective_timeout_s=inf, a timedelta overflow later
        raise ConfigError(f"{name}={value}: expected a finite number")
    if check_files:
        check_model(run.model)
    try:
        build_compressor(run.actors.engine.compressor)
        validate_training_sampling(run.actors.sampling)
    except ValueError as e:
        raise ConfigError(dotted_names(str(e))) from None
    if run.eval.sparse_compressor is not None:
        try:
            build_compressor(run.eval.sparse_compressor)
        except ValueError as e:
            raise ConfigError(re.sub(r"\bcompressor\.", "eval.sparse_compressor.", str(e))) from None
        check(run.actors.engine.backend != "sglang", "eval.sparse_compressor: the SGLang engine evaluates with its own "
              "compressor only (its attention backend is fixed when it starts); leave it unset")
    if check_files:
        check_user_code(run)
    check(run.eval.draw in (1, 2), f"eval.draw={run.eval.draw}: expected 1 (the first draw, repeated questions kept) "
          "or 2 (distinct questions)")
    if run.eval.enabled:
        check_eval_data(run, check_files=check_files)
    if check_files:
        if run.actors.data.source == "gsm8k_jsonl":
            check(Path(run.actors.data.path).expanduser().is_file(),
                  f"actors.data.path={run.actors.data.path!r}: no such file (source gsm8k_jsonl reads a GSM8K JSONL)")
        check_data(run)
        check_services(run)
    check_ranges(run)
    check_kv_precision(run)
    check_fingerprint(run)
    if check_files and run.learner.lora.enabled:
        check_lora_targets(run)
    if run.actors.env.factory:
        check_multiturn(run)
    for mode in run.eval.modes:
        check(mode in ("dense", "sparse"), f"eval.modes: {mode!r} is not one of dense, sparse")
    if run.actors.engine.backend == "sglang":
        check_sglang(run)


def check_ranges(run: RunConfig) -> None:
    """The run config's counts, times and Ray resources in range, and the budget controller's metric computed:
    ConfigError naming the first field out of range."""
    check(run.actors.count >= 1, f"actors.count={run.actors.count}: expected >= 1")
    truncated = run.actors.reward.truncated
    check(truncated is None or math.isfinite(truncated),
          f"actors.reward.truncated={truncated}: expected a finite number or null")
    check(run.actors.start_timeout_s > 0, f"actors.start_timeout_s={run.actors.start_timeout_s}: expected > 0")
    check(run.actors.prompts_per_batch >= 1, f"actors.prompts_per_batch={run.actors.prompts_per_batch}: expected >= 1")
    check(run.train.steps >= 1, f"train.steps={run.train.steps}: expected >= 1")
    check(run.train.sigterm_checkpoint_s >= 0,
          f"train.sigterm_checkpoint_s={run.train.sigterm_checkpoint_s}: expected >= 0")
    check(run.train.wait_report_s > 0, f"train.wait_report_s={run.train.wait_report_s}: expected > 0")
    check(run.train.groups_per_step >= 1, f"train.groups_per_step={run.train.groups_per_step}: expected >= 1")
    check(run.train.group_wait_s > 0, f"train.group_wait_s={run.train.group_wait_s}: expected > 0")
    for name, value in (("train.learner_num_cpus", run.train.learner_num_cpus),
                        ("train.learner_num_gpus", run.train.learner_num_gpus),
                        ("actors.num_cpus", run.actors.num_cpus),
                        ("actors.num_gpus", run.actors.num_gpus), ("ray.num_cpus", run.ray.num_cpus)):
        check(value >= 0, f"{name}={value}: expected >= 0 (Ray resources)")
    check(run.actors.sampling.samples_per_prompt >= 2,
          f"actors.sampling.samples_per_prompt={run.actors.sampling.samples_per_prompt}: expected >= 2 (GRPO's "
          "advantage is relative to the prompt's group: a group of one has advantage 0)")
    compressor = run.actors.engine.compressor
    check(run.preflight.kv_memory_gb >= 0, f"preflight.kv_memory_gb={run.preflight.kv_memory_gb}: expected >= 0")
    check(run.preflight.max_prompt_tokens >= 0,
          f"preflight.max_prompt_tokens={run.preflight.max_prompt_tokens}: expected >= 0")
    check(compressor.budget_control == "off" or compressor.budget_metric.startswith("accept_")
          or run.learner.correction != "off",
          f"actors.engine.compressor.budget_control={compressor.budget_control!r} reads the ratio tail "
          f"({compressor.budget_metric}) that learner.correction=off does not compute: use on or metrics_only")


def check_kv_precision(run: RunConfig) -> None:
    """Quantized KV (compressor.kv_dtype other than model; docs/kv_cache.md "Quantized KV") runs on the torch engine,
    which stores it, sends it with each group and is sized by the preflight, and learner.policy_target=sparse replays
    it along the eviction record. Refused in one line (ConfigError): with policy_target sparse and method full (no
    eviction record: nothing would replay the quantization); learner.replay_quant_gap where it would measure nothing
    (no replay, or kv_dtype model). With policy_target dense the quantization is part of the sampler's mismatch,
    corrected as eviction is. On the SGLang engine check_sglang refuses kv_dtype with its own reason
    (actors/engines/sglang/contract.py unsupported_compressor_settings)."""
    compressor = run.actors.engine.compressor
    check(compressor.kv_dtype == "model" or compressor.method != "full" or run.learner.policy_target != "sparse",
          f"actors.engine.compressor.kv_dtype={compressor.kv_dtype!r} with method full and "
          "learner.policy_target=sparse: the learner replays the quantization along the eviction record, which "
          "method full does not send: use a compressing method, or learner.policy_target=dense (the correction "
          "then treats the quantization as mismatch)")
    measured = run.learner.replays(compressor.method) and compressor.kv_dtype != "model"
    check(not run.learner.replay_quant_gap or measured,
          f"learner.replay_quant_gap=true measures the replay of a quantized KV cache: it needs "
          f"learner.policy_target=sparse (now {run.learner.policy_target!r}), a compressing "
          f"actors.engine.compressor.method (now {compressor.method!r}) and actors.engine.compressor.kv_dtype other "
          f"than model (now {compressor.kv_dtype!r})")


def derived_params(run: RunConfig) -> dict[str, str]:
    """MLflow params beyond the config's own keys: `kv/dtype`, the KV quantizer the rollouts store K/V with
    (compressors.kv_quant.KVQuant.name of actors.engine.compressor.kv_dtype / kv_scale, e.g. "int8/token_head"),
    the spelling each trajectory group carries."""
    return {"kv/dtype": run.actors.engine.compressor.kv_quant().name}


def check_sglang(run: RunConfig) -> None:
    """What a run on the SGLang engine (actors.engine.backend=sglang) cannot do, and its settings
    (actors.engine.sglang) against the sparse backend's needs: ConfigError naming the fields (docs/sglang.md). The
    compressor settings it cannot run are refused in one line, each dotted field with its own reason
    (actors/engines/sglang/contract.py unsupported_compressor_settings)."""
    compressor = run.actors.engine.compressor
    unsupported = unsupported_compressor_settings(compressor)
    check(not unsupported, f"{refusal_line(unsupported, 'actors.engine.compressor.')} (refused with "
          "actors.engine.backend=sglang): use actors.engine.backend=torch")
    if compressor.method != "full":
        from actors.engines.sglang.engine import check_sparse_kwargs  # late: only a sparse SGLang run needs it
        try:
            check_sparse_kwargs(run.actors.engine.sglang.kwargs())
        except ValueError as e:
            raise ConfigError(str(e).replace("engine setting ", "actors.engine.sglang.engine_kwargs.")) from None
    check(not run.learner.weight_sync_verify,
          "learner.weight_sync_verify=true checksums the torch engine's parameters after a swap; SGLang holds its "
          "weights in its scheduler process (actors.engine.backend=sglang): set learner.weight_sync_verify=false")
    if run.eval.enabled:
        own = "dense" if compressor.method == "full" else "sparse"
        check(list(run.eval.modes) == [own], f"eval.modes={list(run.eval.modes)}: the SGLang engine's attention "
              f"backend is fixed when it starts, so it evaluates in its own mode only: set eval.modes=[{own}]")


def check_lora_targets(run: RunConfig, model_path: str | None = None) -> None:
    """learner.lora.target_modules name linear modules of the run's model (broker.lora.check_targets on the model
    built on the meta device from its config.json: no weights read), else ConfigError naming the field and listing
    the model's linear modules. `model_path`: the model's resolved directory (the preflight's: a preset model's
    files), default `run.model`; one not on disk (a preset not built yet, a hub id) is checked by the learner when
    it starts."""
    from broker.lora import check_targets

    path = Path(model_path or run.model).expanduser()
    if not (path / "config.json").is_file():
        return
    import torch  # late: transformers only when a LoRA run's config is checked
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    try:
        check_targets(run.learner.lora, model)
    except ValueError as e:
        raise ConfigError(dotted_names(str(e))) from None


def non_finite(tree, prefix: str = ""):
    """(dotted name, value) of every NaN or infinite float in a nested dict/list of config values."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        name = f"{prefix}.{key}" if isinstance(key, str) and prefix else f"{prefix}[{key}]" if prefix else str(key)
        if isinstance(value, float) and not math.isfinite(value):
            yield name, value
        else:
            yield from non_finite(value, name)


def check_multiturn(run: RunConfig) -> None:
    """What multi-turn rollouts (actors.env.factory set) cannot do yet, refused in one line naming both settings.
    Sparse episodes and their eviction replay (learner.policy_target=sparse) run on both engines: each keeps an
    episode's compressed cache across its turns, the observation protected until the turn's first compression event,
    and its record covers the whole episode (docs/results.md 9; SGLang through its streaming sessions, docs/sglang.md
    "The compressed cache across turns on SGLang"). There each open episode holds one of SGLang's request rows
    between its turns, so a batch's episodes (and an evaluation batch's) must fit actors.engine.sglang.
    max_running_requests when it is set: a first turn waiting for a row held by a parked episode would wait for the
    call's timeout."""
    a = run.actors
    if a.engine.backend == "sglang" and a.engine.compressor.method != "full" and a.engine.sglang.max_running_requests:
        episodes = max(a.prompts_per_batch * a.sampling.samples_per_prompt,
                       run.eval.batch_size if run.eval.enabled else 0)
        check(episodes <= a.engine.sglang.max_running_requests,
              f"actors.engine.sglang.max_running_requests={a.engine.sglang.max_running_requests} with actors.env."
              f"factory set: {episodes} episodes run at once (actors.prompts_per_batch x actors.sampling."
              "samples_per_prompt, eval.batch_size) and each holds one SGLang request row between its turns: raise it")
    if run.eval.enabled and run.eval.data != "train_task":
        raise ConfigError(f"eval.data={run.eval.data!r} with actors.env.factory set: a multi-turn run evaluates "
                          "episodes of its own task: set eval.data=train_task (or eval.enabled=false)")


def check_user_code(run: RunConfig) -> None:
    """Import the user code the config names (actors.reward.function, actors.data.function with source
    function), so that a typo fails before anything starts. Raises ConfigError naming the field."""
    # late: math_verify (actors.tasks.reward) only when a config is checked
    from actors.envs.env import check_env_factory
    from actors.tasks.data import load_task_function
    from actors.tasks.reward import load_reward_function
    try:
        load_reward_function(run.actors.reward.function)
        if run.actors.data.source == "function":
            load_task_function(run.actors.data.function)
        if run.actors.env.factory:
            check_env_factory(run.actors.env.factory, run.actors.env.options)
    except ValueError as e:
        raise ConfigError(f"actors.{e}") from None


def check_eval_data(run: RunConfig, *, check_files: bool = True) -> None:
    """eval.data is "train_task" (not with a gsm8k_jsonl training source: a file has no held-out part), a name
    in actors.tasks.data.EVAL_SETS, or (check_files) an existing file."""
    from actors.tasks.data import EVAL_SETS

    name = run.eval.data
    if name == "train_task":
        if run.actors.data.source == "gsm8k_jsonl":
            raise ConfigError("eval.data='train_task': actors.data.source=gsm8k_jsonl has no held-out problems; "
                              "give eval.data a GSM8K JSONL file")
        return
    if name in EVAL_SETS or not check_files or Path(name).expanduser().is_file():
        return
    raise ConfigError(f"eval.data={name!r}: no such file, and not train_task or one of {', '.join(sorted(EVAL_SETS))}")


def check_data(run: RunConfig) -> None:
    """Read the training prompts and the evaluation items the way the run will (actors/tasks/data.py), so that a
    malformed file, an empty one, rows without string `question`/`answer` or a generator that yields nothing
    fail here, naming the field, the file and the line: `actors.data.path=F: line N: <reason>`."""
    from actors.tasks.data import DataFileError, train_problems

    data = run.actors.data
    try:
        train_problems(data, run.seed)
    except DataFileError as e:
        raise ConfigError(f"actors.data.path={e.path}: {e.where}") from None
    except Exception as e:  # a generator's own error (reasoning-gym or the user's task function)
        raise ConfigError(f"actors.data ({data.source}): {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}") from None
    if run.eval.enabled:
        check_eval_items(run)


def check_eval_items(run: RunConfig) -> None:
    """Read the evaluation items the way the run (or `sparse-rl eval`) will: a malformed or empty eval.data file,
    or a generator that yields nothing, fails naming eval.data, the file and the line."""
    from actors.tasks.data import DataFileError, load_eval_items

    try:
        load_eval_items(run.eval.data, run.eval.limit, train=run.actors.data, seed=run.seed, draw=run.eval.draw)
    except DataFileError as e:
        raise ConfigError(f"eval.data={e.path}: {e.where}") from None
    except Exception as e:
        reason = " ".join(str(e).split())[:300]
        raise ConfigError(reason if reason.startswith("eval.") else f"eval.data={run.eval.data}: "
                          f"{type(e).__name__}: {reason}") from None


REACH_TIMEOUT_S = 2.0
"""How long the start-time check waits for the given Redis and Ray head to answer, seconds."""


def check_services(run: RunConfig) -> None:
    """The services the config names answer: one PING to broker.url (when given), one TCP connect to
    ray.address (when given and not "auto"). The password (from broker.password_env) is never printed."""
    from urllib.parse import urlparse

    if run.broker.url:
        url = run.broker.url
        try:
            parsed = urlparse(url)
            parsed.port  # noqa: B018 (raises ValueError for a bad port)
        except ValueError as e:
            raise ConfigError(f"broker.url: not a redis:// URL ({e})") from None
        if parsed.password:  # the URL itself is not printed: it holds the password
            raise ConfigError(f"broker.url: embeds a password; remove it and export it as ${run.broker.password_env}")
        import redis

        password = os.environ.get(run.broker.password_env) or None
        try:
            redis.Redis.from_url(url, password=password, socket_connect_timeout=REACH_TIMEOUT_S,
                                 socket_timeout=REACH_TIMEOUT_S).ping()
        except (redis.RedisError, ValueError, OSError) as e:
            reason = " ".join(str(e).split())
            if password:
                reason = reason.replace(password, "***")
            raise ConfigError(f"broker.url={url!r}: Redis does not answer ({type(e).__name__}: {reason})") from None
    address = run.ray.address
    if address and address != "auto":
        import socket

        host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
        except ValueError:
            raise ConfigError(f"ray.address={address!r}: expected \"auto\", host:port or ray://host:port") from None
        except OSError as e:
            raise ConfigError(f"ray.address={address!r}: cannot connect to {host}:{port} ({e})") from None


def new_run_id(run: RunConfig) -> str:
    """`<name>-<UTC time to the second>-<4 random hex digits>`: runs started in the same second differ."""
    return f"{run.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def make_run_dir(run: RunConfig, draw=new_run_id) -> tuple[str, Path]:
    """(run id, its directory `<run.run_dir>/<run id>`), the directory created atomically (mkdir without
    exist_ok): when the drawn id's directory already exists, another id is drawn, so two runs never share one.
    Raises ConfigError naming run_dir when it cannot be created or written."""
    parent = Path(run.run_dir).resolve()
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run_dir={run.run_dir!r}: cannot create it ({e.strerror})") from None
    for _ in range(100):
        run_id = draw(run)
        try:
            (parent / run_id).mkdir()
            return run_id, parent / run_id
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"run_dir={run.run_dir!r}: cannot create a run directory in it ({e.strerror})") from None
    raise RuntimeError(f"no free run directory under {parent} after 100 draws")


def to_dict(run: RunConfig) -> dict:
    return dataclasses.asdict(run)
