"""learner.lora on the SGLang engine (actors/engines/sglang/lora.py, `SGLangEngine.load_weights` -> `_load_adapter`):
on the lane's tiny Qwen2, sparse (`sparse_rl_kv`, R-KV) with SGLang's `torch_native` LoRA backend, each adapter
version the learner would send is applied through SGLang's LoRA manager, and greedy tokens, logp_sparse and the
fingerprint's score then equal `TorchEngine` holding the same adapter (broker/lora.py's peft layers); the base
(before any version) differs. docs/sglang.md, "LoRA"."""
import pytest
import torch

pytest.importorskip("sglang.srt", reason="needs the SGLang lane venv: bash scripts/setup_sglang_cpu.sh")
from transformers import AutoTokenizer, Qwen2ForCausalLM

from actors.engines.base import SamplingParams
from actors.engines.sglang.engine import SGLangEngine
from actors.engines.torch_engine import TorchEngine
from broker.lora import LoraConfig, adapter_parameters, add_adapter
from compressors import CompressorConfig
from tests.sglang.conftest import CPU_ENGINE_KWARGS

pytestmark = pytest.mark.sglang
torch.set_num_threads(1)
LORA = LoraConfig(rank=4, alpha=8.0)
COMPRESSOR = CompressorConfig(method="rkv", kv_budget=16, window=4, interval=8)
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(20)] for i in range(2)]
PARAMS = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def adapter_version(model_dir, seed: int) -> list:
    """A version of the run's adapter as the learner sends it (broker.lora.adapter_parameters' names): A and B drawn
    N(0, 0.3^2) with `seed` (B nonzero, so the adapter changes the policy)."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir)
    add_adapter(model, LORA)
    generator = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(p.shape, generator=generator) * 0.3) for n, p in adapter_parameters(model)]


def torch_engine_samples(model_dir, version: list | None):
    """TorchEngine's first sample per prompt on the same requests, with `version` applied (None: the base)."""
    engine = TorchEngine(Qwen2ForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir),
                         COMPRESSOR, lora=LORA if version is not None else None)
    if version is not None:
        engine.load_weights(version, version=1)
    return engine, [g[0] for g in engine.generate(PROMPTS, PARAMS)]


def assert_same(got, want, atol: float = 2e-5) -> float:
    """Same tokens, logp_sparse within `atol`; returns the largest |difference|."""
    gap = 0.0
    for g, w in zip(got, want):
        assert g.response_ids == w.response_ids
        gap = max(gap, float((torch.from_numpy(g.logp_sparse) - torch.from_numpy(w.logp_sparse)).abs().max()))
    assert gap <= atol, gap
    return gap


def test_each_adapter_version_equals_the_torch_engine_with_it(tiny_qwen2_dir):
    versions = [adapter_version(tiny_qwen2_dir, seed) for seed in (3, 4)]
    eng = SGLangEngine(str(tiny_qwen2_dir), COMPRESSOR, timeout_s=900, lora=LORA, lora_backend="torch_native",
                       **CPU_ENGINE_KWARGS)
    try:
        assert [n for n, _, _ in eng.expected_weights()] == [n for n, _ in versions[0]]     # the adapter alone
        with pytest.raises(ValueError, match=r"rejected the update \(nothing changed\): .*lora_A.*shape"):
            eng.load_weights([(versions[0][0][0], torch.zeros(1, 1))], version=1)
        base = [g[0] for g in eng.generate(PROMPTS, PARAMS)]
        assert_same(base, torch_engine_samples(tiny_qwen2_dir, None)[1])               # no version yet: the base
        for version, tensors in enumerate(versions, start=1):
            eng.load_weights(tensors, version=version)
            live = eng.engine.tokenizer_manager.lora_registry.get_all_adapters()
            assert list(live) == [eng.adapter_name] == [f"sparse-rl-v{version}-{version}"]   # the previous unloaded
            got = [g[0] for g in eng.generate(PROMPTS, PARAMS)]
            reference, want = torch_engine_samples(tiny_qwen2_dir, tensors)
            gap = assert_same(got, want)
            assert eng.weight_version == version
            sequence = [PROMPTS[0] + got[0].response_ids]
            scored = float((torch.from_numpy(eng.score(sequence)[0]) - torch.from_numpy(reference.score(sequence)[0]))
                           .abs().max())
            print(f"version {version}: max |logp_sparse - torch engine's| {gap:.2e}, score {scored:.2e}")
            assert scored <= 2e-5, scored
        moved = max(float(abs(torch.from_numpy(g.logp_sparse[:1]) - torch.from_numpy(b.logp_sparse[:1])).max())
                    for g, b in zip(got, base))
        print(f"first log-prob moved by the adapter: {moved:.3f}")
        assert moved > 1e-2, "the adapter did not change SGLang's policy: the equalities would see nothing"
    finally:
        eng.shutdown()
