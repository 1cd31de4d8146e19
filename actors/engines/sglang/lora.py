"""learner.lora on the SGLang engine (docs/sglang.md, "LoRA"): the adapter the learner trains (broker/lora.py) in
the form SGLang 0.5.23's LoRA manager takes (`sglang.Engine(enable_lora=True, ...)`,
`load_lora_adapter_from_tensors(name, tensors, config)`, a request choosing an adapter by `lora_path`).
`SGLangEngine.load_weights` loads each adapter version under its own name and unloads the previous one."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from broker.lora import LoraConfig, adapter_parameters, add_adapter, saved_name


def lora_engine_kwargs(cfg: LoraConfig) -> dict:
    """`sglang.Engine` settings that give the served model the run's adapter slots: `enable_lora`, `max_lora_rank` =
    learner.lora.rank, `lora_target_modules` = its target_modules (sorted). The kernel backend (`lora_backend`,
    SGLang's default `csgmv`; `torch_native` on the CPU lane) is the caller's (actors.engine.sglang.engine_kwargs)."""
    return {"enable_lora": True, "max_lora_rank": cfg.rank, "lora_target_modules": sorted(cfg.target_modules)}


def adapter_manifest(meta_model, cfg: LoraConfig, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{adapter parameter name: (shape, dtype)} of the run's adapter on `meta_model` (the served model built on the
    meta device; changed in place by broker.lora.add_adapter, the learner's own function): the names and shapes the
    learner's adapter-only weight sync sends, e.g. `model.layers.0.self_attn.q_proj.lora_A.default.weight` [rank,
    in_features] and `...lora_B.default.weight` [out_features, rank]. Raises ValueError for a target that is not a
    linear module of the model (broker.lora.check_targets)."""
    add_adapter(meta_model, cfg)
    return {name: (tuple(p.shape), dtype) for name, p in adapter_parameters(meta_model)}


def sglang_adapter(named_tensors: Iterable[tuple[str, torch.Tensor]], cfg: LoraConfig) -> tuple[dict, dict]:
    """(tensors, config) for SGLang's `load_lora_adapter_from_tensors`: the tensors under peft's saved keys
    (broker.lora.saved_name; SGLang's loader reads the layer index, the module and lora_A / lora_B from them) and
    peft's adapter_config fields SGLang reads (`r`, `lora_alpha`, `target_modules`; SGLang scales B A by lora_alpha
    / r, as peft does: LoRA, arXiv 2106.09685 §4.1)."""
    tensors = {saved_name(name): t for name, t in named_tensors}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": float(cfg.alpha),
              "target_modules": sorted(cfg.target_modules), "lora_dropout": 0.0, "bias": "none"}
    return tensors, config
