"""A run's record: its id, directory, MLflow run, broker keys and checkpoints; new, resumed or forked.

    new      sparse-rl train ...                                   a new id and directory
    resumed  sparse-rl train --resume runs/<id> [overrides]        the same id, directory, MLflow run, broker keys
             (or learner.checkpoint_dir=runs/<id>/checkpoints)     and checkpoint directory: one record
    forked   sparse-rl train learner.resume_from=runs/<id>/checkpoints ...
                                                                   starts from another run's latest checkpoint, in a
                                                                   new record tagged with its parent

A checkpoint directory names the run that writes it in its OWNER file, so a checkpoint directory given by path is
either the record's own (a resume) or another's (a fork); checkpoints are only ever written by their owner.
`train.steps` counts weight versions of the record: a resumed or forked run trains from the checkpoint's version
to `train.steps`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from broker.prompts import DataPosition
from deploy.config import PRESET_MODELS, ConfigError, RunConfig, load_config, make_run_dir
from deploy.scale import RUN_INFO
from learner.checkpoint import read_client_state

MUST_MATCH = ("seed", "actors.data", "model", "learner.ranks", "learner.zero_stage",
              "actors.engine.compressor.kv_dtype", "actors.engine.compressor.kv_scale")
"""Config fields a resume or fork cannot change: the prompt order (seed, actors.data) the data position refers
to, what the checkpoint's shards fit (model, learner.ranks, learner.zero_stage), and the KV quantizer its groups
were sampled and replayed with (compressor.kv_dtype / kv_scale: each group carries it, broker/schema.py, and the
learner dead-letters another)."""
SAVED_DEFAULTS = {"actors.engine.compressor.kv_dtype": "model", "actors.engine.compressor.kv_scale": "token_head"}
"""A MUST_MATCH field's value in a config.yaml written before it existed."""

OWNER = "OWNER"
"""File in a checkpoint directory: the run directory that writes its checkpoints."""


@dataclass
class RunRecord:
    run_id: str
    run_dir: Path
    resumed: bool = False
    """True: this continues the record in run_dir (same MLflow run, broker keys, checkpoint directory)."""
    start_version: int = 0
    """Weight version of the checkpoint the learner loads (0 for a new run)."""
    mlflow_run_id: str = ""
    """The MLflow run to reopen when resumed ("" = create one)."""
    parent: dict = field(default_factory=dict)
    """A fork's parent: {"run_id", "run_dir", "mlflow_run_id", "checkpoint"}; {} otherwise."""


def read_run_info(run_dir: str | Path) -> dict:
    """The run directory's run.json ({} when absent)."""
    path = Path(run_dir) / RUN_INFO
    return json.loads(path.read_text()) if path.is_file() else {}


def checkpoint_version(ckpt_dir: str | Path) -> int | None:
    """Weight version of the latest checkpoint in ckpt_dir (DeepSpeed's `latest` names tag version_<v>);
    None when there is none."""
    latest = Path(ckpt_dir) / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    match = re.fullmatch(r"version_(\d+)", tag)
    if not match:
        raise ConfigError(f"checkpoint directory {ckpt_dir}: its latest tag {tag!r} is not version_<n>")
    return int(match.group(1))


def resume_config(run_dir: str | Path, overrides: list[str] = ()) -> RunConfig:
    """The config of the run in run_dir (its config.yaml) with `overrides` applied on top (e.g. train.steps=20
    to train further). A config written before compressor protection (no `protect_values`) resumes with sinks
    null (the method's own: 0) for a method other than streamingllm, which read no sinks then. Raises
    ConfigError when run_dir is not a run directory."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; expected a run directory made by "
                          "`sparse-rl train` (runs/<run id>)")
    saved = OmegaConf.load(path)
    if OmegaConf.select(saved, "eval.draw") is None:  # written before the draw was versioned:
        overrides = ["eval.draw=1", *overrides]  # its held-out items stay those it was evaluated on
    for section in ("actors.engine.compressor", "eval.sparse_compressor"):
        old = OmegaConf.select(saved, section)
        if old is not None and "protect_values" not in old and old.get("method") != "streamingllm":
            overrides = [f"{section}.sinks=null", *overrides]  # written when sinks were streamingllm's alone
    return load_config(str(path), list(overrides))


def open_record(cfg: RunConfig, resume: str | Path = "") -> RunRecord:
    """Decide and prepare the record `cfg` trains into; sets cfg.learner.checkpoint_dir (where checkpoints are
    written) and cfg.learner.resume_from (what the learner loads, "" = its checkpoint_dir if it holds one).

    Raises ConfigError (nothing created) when the resumed run has no checkpoint, a checkpoint's version is
    already at or past train.steps, the config's prompt order (seed, actors.data) or learner.lora differs from the
    checkpoint's, or learner.checkpoint_dir belongs to another run without one to load."""
    ckpt = cfg.learner.checkpoint_dir
    if resume:
        return _resumed(Path(resume).resolve(), cfg)
    if ckpt and checkpoint_version(ckpt) is not None and not cfg.learner.resume_from:
        owner = _owner(ckpt)
        if owner is not None:
            return _resumed(owner, cfg)  # the run's own checkpoints: the same as --resume <its directory>
        cfg.learner.resume_from, cfg.learner.checkpoint_dir = ckpt, ""  # nobody's: start from it, write our own
    parent = {}
    start_version = 0
    if cfg.learner.resume_from:
        src = cfg.learner.resume_from
        start_version = checkpoint_version(src)
        if start_version is None:
            raise ConfigError(f"learner.resume_from={src!r}: no checkpoint there (no 'latest' file)")
        _check_steps(cfg, start_version, src)
        owner = _owner(src)
        if owner is not None:
            _check_unchanged(owner, cfg, f"learner.resume_from={src}")
        _check_prompt_order(cfg, src)
        _check_lora(cfg, src)
        info = read_run_info(owner) if owner else {}
        parent = {"run_id": info.get("run_id", ""), "run_dir": str(owner or ""),
                  "mlflow_run_id": info.get("mlflow_run_id", ""), "checkpoint": str(Path(src).resolve())}
    if cfg.learner.checkpoint_dir:
        other = _owner(cfg.learner.checkpoint_dir)
        if other is not None:
            raise ConfigError(f"learner.checkpoint_dir={cfg.learner.checkpoint_dir!r} belongs to the run in {other}; "
                              f"resume it with `sparse-rl train --resume {other}`, or start from its checkpoint in "
                              f"a new run with learner.resume_from={cfg.learner.checkpoint_dir}")
    run_id, run_dir = make_run_dir(cfg)
    if not cfg.learner.checkpoint_dir:
        cfg.learner.checkpoint_dir = str(run_dir / "checkpoints")
    _claim(cfg.learner.checkpoint_dir, run_dir)
    return RunRecord(run_id, run_dir, start_version=start_version, parent=parent)


def _resumed(run_dir: Path, cfg: RunConfig) -> RunRecord:
    info = read_run_info(run_dir)
    if not info:
        raise ConfigError(f"--resume {run_dir}: no {RUN_INFO} there; expected a run directory made by "
                          "`sparse-rl train` (runs/<run id>)")
    ckpt = info.get("checkpoint_dir") or str(run_dir / "checkpoints")
    version = checkpoint_version(ckpt)
    if version is None:
        raise ConfigError(f"--resume {run_dir}: no checkpoint in {ckpt} (one is written every "
                          f"learner.checkpoint_interval={cfg.learner.checkpoint_interval} versions); start a new run")
    _check_steps(cfg, version, ckpt)
    _check_unchanged(run_dir, cfg, f"--resume {run_dir}")
    _check_prompt_order(cfg, ckpt)
    _check_lora(cfg, ckpt)
    cfg.learner.checkpoint_dir, cfg.learner.resume_from = ckpt, ""
    return RunRecord(info["run_id"], run_dir, resumed=True, start_version=version,
                     mlflow_run_id=info.get("mlflow_run_id", ""))


def _check_steps(cfg: RunConfig, version: int, ckpt: str | Path) -> None:
    """A resume from the checkpoint in `ckpt` (at `version`) needs train.steps beyond it."""
    if cfg.train.steps <= version:
        raise ConfigError(f"train.steps={cfg.train.steps}: the checkpoint in {ckpt} is at weight version {version} "
                          f"already; train.steps counts versions, so give train.steps > {version} to train on")


def _check_prompt_order(cfg: RunConfig, ckpt: str | Path) -> None:
    """A resume from the checkpoint in `ckpt` needs the prompt order (seed, actors.data) its data position was
    saved with: it continues where the checkpoint's run stopped. Checked against the checkpoint itself, so a fork
    of a checkpoint without its run directory's config.yaml is checked too. Raises ConfigError naming the fields."""
    saved = read_client_state(ckpt).get("data_position")
    if saved:  # (checkpoints of runs without a data position have none)
        changed = DataPosition.from_dict(saved).differences(
            cfg.seed, OmegaConf.to_container(OmegaConf.structured(cfg.actors.data)))
        if changed:
            raise ConfigError(f"resume: the prompt order differs from the checkpoint's in {ckpt}: " + "; ".join(changed)
                              + ". Resume with the checkpoint's values, or start a new run")


def _check_lora(cfg: RunConfig, ckpt: str | Path) -> None:
    """A resume from the checkpoint in `ckpt` needs its mode (LoRA or full fine-tuning) and LoRA settings (rank,
    alpha, target modules: the adapter's shapes and function): ConfigError naming learner.lora and both values,
    before anything starts. The base's weights hash is checked by the learner when it loads the checkpoint
    (learner.checkpoint.check_lora): the driver does not read the weights."""
    saved = read_client_state(ckpt).get("lora")
    lora = cfg.learner.lora
    now = lora.settings() if lora.enabled else None
    before = None if saved is None else {k: saved[k] for k in ("rank", "alpha", "target_modules")}
    if before == now:
        return

    def said(s):
        return "learner.lora.rank=0 (full fine-tuning)" if s is None else ", ".join(
            f"learner.lora.{k}={v!r}" for k, v in s.items())
    raise ConfigError(f"resume: {said(now)}, but the checkpoint in {ckpt} was trained with {said(before)}: a "
                      "checkpoint resumes with the mode and adapter it was trained with; use its learner.lora, or "
                      "start a new run")


def _check_unchanged(run_dir: Path, cfg: RunConfig, what: str) -> None:
    """Raise ConfigError (nothing written) when cfg gives a MUST_MATCH field another value than the config the
    run in run_dir trained with (its config.yaml), naming each changed field and both values."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return
    saved, now = OmegaConf.to_container(OmegaConf.load(path)), OmegaConf.to_container(OmegaConf.structured(cfg))
    changed = []
    for name in MUST_MATCH:
        old, new = _dotted(saved, name), _dotted(now, name)
        old = SAVED_DEFAULTS.get(name) if old is None else old
        pairs = {f"{name}.{k}": (old.get(k), new.get(k)) for k in {**old, **new}} if isinstance(new, dict) \
            else {name: (old, new)}
        if name == "model":
            pairs = {name: (old, new)} if _model_dir(old) != _model_dir(new) else {}
        changed += [f"{k}={b!r} (the checkpoint's: {a!r})" for k, (a, b) in sorted(pairs.items()) if a != b]
    if changed:
        raise ConfigError(f"{what}: {'; '.join(changed)}: the checkpoint's prompt order, shards and KV quantizer "
                          f"need the values it was trained with; drop these overrides, or start a new run")


def _dotted(tree: dict, name: str):
    """tree["a"]["b"] for name "a.b" (None where a key is missing)."""
    for part in name.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _model_dir(model) -> str:
    """A model value as the directory it names (a preset model: its cache directory)."""
    from deploy.model_cache import cache_dir

    path = cache_dir() / model if model in PRESET_MODELS else Path(str(model)).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


def _owner(ckpt_dir: str | Path) -> Path | None:
    path = Path(ckpt_dir) / OWNER
    return Path(path.read_text().strip()) if path.is_file() else None


def _claim(ckpt_dir: str | Path, run_dir: Path) -> None:
    """Create the checkpoint directory and name run_dir its owner."""
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    (Path(ckpt_dir) / OWNER).write_text(f"{run_dir}\n")

