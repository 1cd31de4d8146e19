"""LoRA (Hu et al., arXiv 2106.09685 §4.1) through peft, the one adapter function of both ends of the weight sync:
the learner trains it (learner/learner.py), the torch engine applies each version it receives
(actors/engines/torch_engine.py), so that both run the same layers on the same tensors (docs/ARCHITECTURE.md,
"LoRA"). Here because it sits below both (tests/test_layering.py).

peft is imported inside the functions: it imports transformers (~5 s), and the config (`LoraConfig`) is read by
commands that stay light (`sparse-rl scale`).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

LLAMA_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Llama / Qwen2 decoder block (attention and MLP): the default targets, as in "LoRA Without
Regret" (Schulman et al., Thinking Machines 2025: adapters on the MLP matter most) and peft's "all-linear" less the
lm_head."""
ADAPTER_NAME = "default"
"""peft's adapter name: part of every adapter parameter's name (`...q_proj.lora_A.default.weight`), on both ends."""


@dataclass
class LoraConfig:
    """`learner.lora`: LoRA instead of full fine-tuning (off by default). The learner trains only the adapter
    (W + alpha / rank x B A on each target module; B starts at 0, so version 0 is the base model) and sends only
    the adapter to the actors (docs/ARCHITECTURE.md "LoRA")."""
    rank: int = 0
    """r, the adapters' rank; 0 = off (full fine-tuning, the default), as verl's `lora_rank`."""
    alpha: float = 32.0
    """lora_alpha: the update is scaled by alpha / rank (LoRA §4.1)."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (peft's lora_dropout). > 0 makes the trained forward random,
    so it is refused with learner.policy_target=sparse and learner.fuse_logp_old=true (both need the trained forward
    to equal the no-grad one)."""
    target_modules: list[str] = field(default_factory=lambda: list(LLAMA_LINEAR))
    """Names of the linear modules that get an adapter (the last part of the module's name, as peft matches them);
    each must name a linear module of the model (checked at start, listing the model's)."""
    save_merged: bool = False
    """The run's final directory (the adapter in peft's format) also holds `merged/`: the base with the adapter merged
    into its weights (peft's merge_and_unload, as TRL's; verl's `lora.merge`), a plain Hugging Face model
    directory for tools that take no adapter."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def __post_init__(self):
        """Raise ValueError naming every bad field as `LoraConfig.<field>=<value>: expected ...`."""
        self.target_modules = list(self.target_modules)
        checks = [
            (self.rank >= 0, "rank", "expected >= 0 (0 = off)"),
            (math.isfinite(self.alpha) and self.alpha > 0, "alpha", "expected a finite value > 0"),
            (0 <= self.dropout < 1, "dropout", "expected 0 <= dropout < 1"),
            (len(self.target_modules) > 0, "target_modules", "expected at least one module name"),
        ]
        errors = [f"LoraConfig.{name}={getattr(self, name)!r}: {rule}" for ok, name, rule in checks if not ok]
        if errors:
            raise ValueError("; ".join(errors))

    def settings(self) -> dict:
        """What makes two adapters the same shape and function: rank, alpha, target modules (sorted)."""
        return {"rank": self.rank, "alpha": float(self.alpha), "target_modules": sorted(self.target_modules)}


def linear_modules(model) -> list[str]:
    """The distinct last name parts of the model's `torch.nn.Linear` modules, sorted (what target_modules may name),
    e.g. ['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']."""
    return sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def check_targets(cfg: LoraConfig, model) -> None:
    """Raise ValueError `LoraConfig.target_modules=[...]: not linear modules of the model: ...; its linear modules:
    ...` unless every target names a linear module of `model` (a module on the meta device will do)."""
    linear = linear_modules(model)
    missing = [t for t in cfg.target_modules if t not in linear]
    if missing:
        raise ValueError(f"LoraConfig.target_modules={list(cfg.target_modules)}: not linear modules of the model: "
                         f"{', '.join(missing)}; its linear modules: {', '.join(linear)}")


def add_adapter(model, cfg: LoraConfig, seed: int = 0):
    """Put a fresh LoRA adapter (peft's default init: A Kaiming-uniform, B zeros) on `cfg.target_modules` of the
    Hugging Face causal LM `model`, in place: its target Linear modules become peft's `lora.Linear` (the base
    weight under `.base_layer`, frozen with every other base parameter), the adapter in the base layer's dtype and
    device (no fp32 autocast: the weight sync sends one dtype). A is drawn with torch's CPU RNG seeded with `seed`
    (forked: the caller's RNG state is untouched), so every learner rank, and any process given the same seed,
    starts from the same adapter. Returns the `peft.PeftModel` around `model` (for `disable_adapter()` and
    `save_pretrained`); `model` itself keeps its attribute paths and forward.
    Raises ValueError for a target that is not a linear module of the model (check_targets)."""
    import peft  # late: see the module docstring

    check_targets(cfg, model)
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config, adapter_name=ADAPTER_NAME, autocast_adapter_dtype=False)


def adapter_parameters(model) -> list:
    """(name, parameter) of every adapter tensor of `model` (the Hugging Face model `add_adapter` changed, not the
    PeftModel), in module order: names as `model.named_parameters()` gives them, e.g.
    `model.layers.0.self_attn.q_proj.lora_A.default.weight` [rank, in_features] and `...lora_B.default.weight`
    [out_features, rank]. The learner's weight sync sends these and the engine expects these."""
    return [(name, p) for name, p in model.named_parameters() if ".lora_" in name]


def base_identity(model) -> dict[str, str]:
    """The base model under a LoRA adapter (after `add_adapter`: its frozen parameters): {"base_model": its
    `config._name_or_path`, "base_hash": blake2b (16 B, hex) of every frozen parameter's name, shape, dtype and bytes
    in module order}. Call it before DeepSpeed partitions the model (ZeRO-3). Costs one read of the weights (~1 s
    per GB on one core)."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        h.update(p.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return {"base_model": str(getattr(model.config, "_name_or_path", "")), "base_hash": h.hexdigest()}


def saved_name(name: str) -> str:
    """peft's saved key of the adapter parameter `name` (as adapter_parameters gives it): `model.layers.0.self_attn.
    q_proj.lora_A.default.weight` -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, the inverse of
    load_saved_adapter's renaming (what SGLang's LoRA loader reads: actors/engines/sglang/lora.py)."""
    return "base_model.model." + name.replace(f".{ADAPTER_NAME}.weight", ".weight")


ADAPTER_CONFIG = "adapter_config.json"
"""The file that makes a directory a saved peft adapter (a LoRA run's `final`)."""


def is_adapter_dir(path) -> bool:
    """Whether `path` is a directory holding a saved peft adapter (ADAPTER_CONFIG), e.g. a LoRA run's `final`."""
    return (Path(path).expanduser() / ADAPTER_CONFIG).is_file()


@dataclass
class SavedAdapter:
    """A LoRA adapter saved in peft's format (Learner.save_adapter), ready for a torch engine: `base`, the base
    model's path or name (peft's base_model_name_or_path); `config`, its LoraConfig (dropout 0: evaluation);
    `tensors`, (name as adapter_parameters gives it, tensor) pairs for TorchEngine.load_weights."""
    base: str
    config: LoraConfig
    tensors: list


def load_saved_adapter(path) -> SavedAdapter:
    """The adapter in directory `path` (peft's adapter_config.json + adapter_model.safetensors), its tensors renamed
    from peft's saved keys (`base_model.model.<module>.lora_A.weight`) to the live names
    (`<module>.lora_A.default.weight`). Raises ValueError for an adapter that is not LoRA."""
    import peft  # late: see the module docstring
    from peft.utils import load_peft_weights

    saved = peft.PeftConfig.from_pretrained(str(Path(path).expanduser()))
    if saved.peft_type != peft.PeftType.LORA:
        raise ValueError(f"{path}: a {saved.peft_type} adapter; expected LoRA")
    config = LoraConfig(rank=saved.r, alpha=float(saved.lora_alpha), target_modules=sorted(saved.target_modules))
    tensors = []
    for key, t in load_peft_weights(str(Path(path).expanduser()), device="cpu").items():
        name = key.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.weight", f".{part}.{ADAPTER_NAME}.weight")
        tensors.append((name, t))
    return SavedAdapter(saved.base_model_name_or_path, config, tensors)


def save_merged(adapter_dir, out_dir) -> None:
    """The base model of the adapter saved in `adapter_dir` (its base_model_name_or_path, loaded in fp32) with the
    adapter merged into its weights (W + alpha / rank x B A: peft's `merge_and_unload`), saved to `out_dir` as a plain
    Hugging Face model directory (no tokenizer). Raises what transformers raises when the base cannot be loaded."""
    import peft  # late: see the module docstring
    from transformers import AutoModelForCausalLM

    adapter_dir = str(Path(adapter_dir).expanduser())
    base = peft.PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().save_pretrained(str(out_dir))
