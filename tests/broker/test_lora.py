"""broker/lora.py, the adapter both ends of the weight sync apply (through peft), and the weight sync's adapter mode:
a fresh adapter is the base model, the base's hash sees the base and only the base, and a manifest of the other kind
is refused in one line on both ends."""
import threading

import pytest
import torch

from broker.lora import LoraConfig, adapter_parameters, add_adapter, base_identity, check_targets
from broker.weight_sync import WeightReceiver, WeightSender, build_manifest
from tests.learner.conftest import tiny_llama

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "down_proj"])
IDS = torch.tensor([[1, 5, 9, 33, 2, 7]])


def test_a_fresh_adapter_is_the_base_model_and_only_it_is_trainable():
    base, model = tiny_llama(), tiny_llama()
    peft_model = add_adapter(model, LORA)
    assert peft_model.base_model.model is model                        # in place: the engine keeps its paths
    adapter = adapter_parameters(model)
    assert [n for n, _ in adapter[:2]] == ["model.layers.0.self_attn.q_proj.lora_A.default.weight",
                                           "model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    assert len(adapter) == 2 * 2 * 2                                    # 2 layers x 2 targets x (A, B)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n, _ in adapter}
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, base(IDS).logits)          # B = 0
        for _, p in adapter:
            p.fill_(0.05)
        assert not torch.allclose(model(IDS).logits, base(IDS).logits, atol=1e-3)
        with peft_model.disable_adapter():
            assert torch.equal(model(IDS).logits, base(IDS).logits)


def test_the_base_hash_sees_every_base_weight_and_no_adapter_value():
    one, two = tiny_llama(), tiny_llama()
    add_adapter(one, LORA), add_adapter(two, LORA)
    assert base_identity(one) == base_identity(two)
    with torch.no_grad():
        adapter_parameters(two)[1][1].add_(1.0)
        assert base_identity(one) == base_identity(two)                  # the adapter is not the base
        two.model.norm.weight[3] = torch.nextafter(two.model.norm.weight[3], torch.tensor(2.0))
    assert base_identity(one)["base_hash"] != base_identity(two)["base_hash"]


def test_targets_must_be_linear_modules_of_the_model():
    with pytest.raises(ValueError, match=r"^LoraConfig\.target_modules=\['q_proj', 'attn'\]: not linear modules "
                                         r"of the model: attn; its linear modules: down_proj, gate_proj, k_proj, "
                                         r"lm_head, o_proj, q_proj, up_proj, v_proj$"):
        check_targets(LoraConfig(rank=2, target_modules=["q_proj", "attn"]), tiny_llama())


@pytest.mark.parametrize("sends_adapter", [True, False])
def test_a_manifest_of_the_other_kind_is_refused_in_one_line_on_both_ends(sends_adapter):
    model = tiny_llama()
    add_adapter(model, LORA)
    adapter = adapter_parameters(model)
    full = list(tiny_llama().named_parameters(remove_duplicate=False))
    named = adapter if sends_adapter else full
    expected = [(n, tuple(p.shape), p.dtype) for n, p in (full if sends_adapter else adapter)]
    sender = WeightSender(backend="gloo", timeout_s=30)
    receiver = WeightReceiver("127.0.0.1", sender.port, backend="gloo", timeout_s=30)
    errors = {}

    def actor():
        receiver.join_group(0, 1, 2)
        try:
            receiver.receive(expected, adapter=not sends_adapter)
        except ValueError as e:
            errors["actor"] = str(e)
    thread = threading.Thread(target=actor)
    thread.start()
    sender.open_group(0, 2)
    manifest, tensors = build_manifest(named, torch.float32, 16, adapter=sends_adapter)
    with pytest.raises(ValueError) as e:
        sender.send(manifest, tensors, version=3)
    thread.join(timeout=60)
    kinds = ("a LoRA adapter only", "the full weights")
    line = (f"the learner sends {kinds[not sends_adapter]}, this engine expects {kinds[sends_adapter]} "
            "(learner.lora.rank must reach the actors as it is on the learner)")
    assert errors["actor"] == f"weight sync version 3: manifest does not match the model: {line}"
    assert str(e.value) == f"weight sync version 3 aborted, manifest rejected by rank 1: {line}"
