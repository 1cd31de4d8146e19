"""The torch engine with learner.lora's adapter (broker/lora.py): it expects the adapter's tensors alone, swaps adapter
versions in without touching the base, and samples with the adapter: logp_sparse (compressor full) equals the
teacher-forced log-probs of Hugging Face's own forward through the same peft layers."""
import copy

import torch

from actors.engines.base import SamplingParams
from actors.engines.torch_engine import TorchEngine
from broker.lora import LoraConfig, adapter_parameters, add_adapter
from compressors import CompressorConfig
from tests.actors.engines.test_torch_engine import PROMPTS, tiny_model, tiny_tokenizer

LORA = LoraConfig(rank=4, alpha=8.0)


def teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response token | everything before it) of a Hugging Face forward, float32 [len(response)]."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = model(ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    return logp.gather(1, torch.tensor(response)[:, None])[:, 0]


def test_the_engine_samples_through_the_adapter_it_was_sent():
    model = tiny_model("llama")
    base = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    add_adapter(reference, LORA)
    generator = torch.Generator().manual_seed(3)
    version_1 = [(n, torch.randn(p.shape, generator=generator) * 0.3) for n, p in adapter_parameters(reference)]
    with torch.no_grad():
        for (_, p), (_, value) in zip(adapter_parameters(reference), version_1):
            p.copy_(value)
    engine = TorchEngine(model, tiny_tokenizer(), CompressorConfig(method="full"), lora=LORA)
    assert [n for n, _, _ in engine.expected_weights()] == [n for n, _ in version_1]      # the adapter alone
    before = {n: p.clone() for n, p in engine.model.named_parameters() if ".lora_" not in n}
    engine.load_weights(version_1, version=1)
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters() if ".lora_" not in n)
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=0))
    gaps, control = [], []
    for prompt, samples in zip(PROMPTS, out):
        for s in samples:
            sampled = torch.from_numpy(s.logp_sparse)
            gaps.append(float((sampled - teacher_forced(reference, prompt, s.response_ids)).abs().max()))
            control.append(float((sampled - teacher_forced(base, prompt, s.response_ids)).abs().max()))
    assert max(gaps) <= 1e-4
    assert max(control) > 1e-2, "the adapter did not change the engine's policy: the check would see nothing"
