"""actors/engines/sglang/lora.py without SGLang: the adapter the learner sends reaches SGLang's LoRA loader under
peft's saved keys with peft's adapter_config fields, and the SGLang engine's manifest of it (built on the meta device)
is the learner's (names, shapes). The SGLang side runs in tests/sglang/test_sglang_lora.py."""
import json

import torch
from safetensors.torch import load_file

from actors.engines.sglang.lora import adapter_manifest, lora_engine_kwargs, sglang_adapter
from broker.lora import LoraConfig, adapter_parameters, add_adapter
from tests.actors.engines.test_torch_engine import tiny_model

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["v_proj", "q_proj", "down_proj"])


def test_the_adapter_reaches_sglang_as_peft_saves_it(tmp_path):
    model = tiny_model("qwen2")
    peft_model = add_adapter(model, LORA)
    with torch.no_grad():
        for i, (_, p) in enumerate(adapter_parameters(model)):
            p.fill_(0.01 * (i + 1))
    peft_model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    tensors, config = sglang_adapter(adapter_parameters(model), LORA)
    assert sorted(tensors) == sorted(saved)
    assert all(torch.equal(tensors[k], saved[k]) for k in saved)
    on_disk = json.loads((tmp_path / "adapter_config.json").read_text())
    for field in ("peft_type", "r", "lora_alpha", "bias", "task_type"):
        assert config[field] == on_disk[field], field
    assert sorted(config["target_modules"]) == sorted(on_disk["target_modules"])
    assert lora_engine_kwargs(LORA) == {"enable_lora": True, "max_lora_rank": 4,
                                        "lora_target_modules": ["down_proj", "q_proj", "v_proj"]}


def test_the_engine_manifest_is_the_learners_adapter():
    learner = tiny_model("qwen2")
    add_adapter(learner, LORA)
    with torch.device("meta"):
        meta = tiny_model("qwen2")
    want = {n: (tuple(p.shape), torch.bfloat16) for n, p in adapter_parameters(learner)}
    assert adapter_manifest(meta, LORA, torch.bfloat16) == want
    assert len(want) == 2 * 3 * 2                                       # 2 layers x 3 targets x (A, B)
