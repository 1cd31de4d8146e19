"""learner.lora (broker/lora.py, through peft): the learner trains and holds only the adapter, the KL reference is the
same model with the adapter disabled, eviction replay runs through the adapter, and the adapter alone travels over
the weight sync into a torch engine holding the same adapter, which then samples the learner's policy."""
import copy
import threading

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from actors.engines.base import SamplingParams
from actors.engines.torch_engine import TorchEngine
from broker import fingerprint as fp
from broker.lora import LoraConfig, adapter_parameters, load_saved_adapter, save_merged
from broker.schema import TrajectoryGroup
from broker.weight_sync import WeightReceiver, WeightSender
from compressors import CompressorConfig
from learner.config import LearnerConfig
from learner.learner import Learner
from tests.actors.engines.test_torch_engine import PROMPTS, tiny_model, tiny_tokenizer
from tests.learner.conftest import make_groups, tiny_llama, wire_groups

LORA = LoraConfig(rank=4, alpha=8.0)
RKV = CompressorConfig(method="rkv", kv_budget=12, window=4, interval=5)


def rollout(engine: TorchEngine, version: int) -> list[TrajectoryGroup]:
    """Two samples of each of PROMPTS from `engine` (weights of `version`), rewards 0 and 1, off the wire."""
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=version))
    cc = engine.compressor_cfg
    return wire_groups(out, cc.method, [cc.kv_budget] * len(out), [f"v{version}-g{i}" for i in range(len(out))],
                       weight_version=version)


def max_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b).abs()[mask].max())


def test_only_the_adapter_is_trained_and_held_by_the_optimizer():
    learner = Learner(tiny_llama(), LearnerConfig(lr=1e-2, kl_coef=0.0, lora=LORA))
    adapter = dict(adapter_parameters(learner.engine.module))
    assert "model.layers.0.self_attn.q_proj.lora_A.default.weight" in adapter and len(adapter) == 2 * 7 * 2
    optimizer = getattr(learner.engine.optimizer, "optimizer", learner.engine.optimizer)   # the torch AdamW
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in held} == {id(p) for p in adapter.values()}
    counts = learner.parameter_counts()
    full = sum(p.numel() for p in tiny_llama().parameters())
    assert counts == {"trainable": sum(p.numel() for p in adapter.values()), "total": full + counts["trainable"]}
    base = {n: p.detach().clone() for n, p in learner.engine.module.named_parameters() if n not in adapter}
    for _ in range(2):
        learner.step(make_groups(), staleness=[0, 0])
    now = dict(learner.engine.module.named_parameters())
    assert all(torch.equal(now[n], p) for n, p in base.items())                      # the base never moves
    assert all(float(p.detach().abs().max()) > 0 for n, p in adapter.items() if "lora_B" in n)   # B left its zeros


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_zero_stages_train_and_hold_the_adapter_only(zero_stage):
    """The gradients (Learner.gradients) and the weight export are the adapter's; the optimizer's state is a small
    part of full fine-tuning's."""
    cfg = dict(lr=1e-2, kl_coef=0.0, zero_stage=zero_stage)
    learner = Learner(tiny_llama(), LearnerConfig(lora=LORA, **cfg))
    names = {n for n, _ in adapter_parameters(learner.engine.module)}
    assert set(learner.gradients(make_groups())) == names
    learner.step(make_groups(), staleness=[0, 0])
    assert set(learner.gather_buckets(16.0, keep=True)) == names
    full = Learner(tiny_llama(), LearnerConfig(**cfg))
    full.step(make_groups(), staleness=[0, 0])                          # Adam's moments exist after a step
    assert learner.state_bytes()["optimizer_state"] < full.state_bytes()["optimizer_state"] / 4


def test_the_kl_reference_is_the_base_model_with_the_adapter_disabled():
    learner = Learner(tiny_llama(), LearnerConfig(lr=1e-2, kl_coef=0.1, lora=LORA))
    assert learner.ref_model is None                                                     # no second copy
    groups = make_groups()
    for _ in range(2):
        metrics = learner.step(groups, staleness=[0, 0])
    assert metrics["kl_loss"] > 0
    batch = learner.collate(groups)
    rows = torch.arange(batch.size)
    with torch.no_grad():
        ref = learner.reference_logprobs(batch, rows)
        policy = learner.response_logprobs(learner.engine, batch, rows)[0]
        base = learner.response_logprobs(tiny_llama().eval(), batch, rows)[0]
    mask = batch.response_mask
    assert max_gap(ref, base, mask) <= 1e-6
    assert max_gap(policy, base, mask) > 1e-3, "the adapter did not move the policy: the check would see nothing"


def test_eviction_replay_runs_through_the_adapter():
    """After two steps the engine's adapter (loaded from the learner's export) has moved its log-probs; the
    learner's replayed forward gives its logp_sparse to 1e-4, the dense forward does not, and neither does the
    replayed forward with the adapter disabled."""
    model = tiny_model("llama", layers=3)
    learner = Learner(copy.deepcopy(model), LearnerConfig(lr=2e-2, kl_coef=0.0, policy_target="sparse",
                                                          micro_batch_size=3, lora=LORA))
    engine = TorchEngine(copy.deepcopy(model), tiny_tokenizer(), RKV, record_evictions=True, lora=LORA)
    for version in (1, 2):
        groups = rollout(engine, version - 1)
        learner.step(groups, staleness=[0] * len(groups))
        engine.load_weights(learner.gather_buckets(16.0, keep=True).items(), version)
    batch = learner.collate(rollout(engine, 2))
    rows, mask = torch.arange(batch.size), batch.response_mask
    with torch.no_grad():
        r = learner._replay_forward(batch, rows, grad=False)
        with learner.peft.disable_adapter():
            base = learner._replay_forward(batch, rows, grad=False, dense=False)
    assert max_gap(r["logp"], batch.logp_sparse, mask) <= 1e-4
    assert max_gap(r["logp_dense"], batch.logp_sparse, mask) > 1e-2, "nothing evicted mattered"
    assert max_gap(base["logp"], batch.logp_sparse, mask) > 1e-3, "the adapter did not matter"


def sync(learner: Learner, sender: WeightSender, receiver: WeightReceiver, engine: TorchEngine) -> dict:
    """One weight sync (the learner's export over gloo, the receiver in a thread) into `engine`; the send's stats."""
    got = {}

    def actor():
        got["version"], got["named"] = receiver.receive(engine.expected_weights(), adapter=engine.adapter)
    thread = threading.Thread(target=actor)
    thread.start()
    stats = learner.send_weights(sender)
    thread.join(timeout=60)
    engine.load_weights(got["named"], got["version"])
    return stats


def test_adapter_only_sync_gives_the_torch_engine_the_learners_policy():
    """max_staleness 0, compressor full: after two steps and two adapter-only syncs, the engine's sampled log-probs
    equal the learner's recompute to fp32 rounding, while the adapter moved the fingerprint probe by > 1e-3 from the
    base; an engine without the adapter (control) differs. Only the adapter's bytes travel."""
    model = tiny_model("llama", layers=2)
    learner = Learner(copy.deepcopy(model), LearnerConfig(lr=2e-2, kl_coef=0.0, micro_batch_size=3, lora=LORA))
    full = CompressorConfig(method="full")
    engine = TorchEngine(copy.deepcopy(model), tiny_tokenizer(), full, lora=LORA)
    control = TorchEngine(copy.deepcopy(model), tiny_tokenizer(), full)
    sender = WeightSender(backend="gloo", timeout_s=30, bucket_mb=0.01)
    receiver = WeightReceiver("127.0.0.1", sender.port, backend="gloo", timeout_s=30)
    joined = threading.Thread(target=receiver.join_group, args=(0, 1, 2))
    joined.start()
    sender.open_group(0, 2)
    joined.join(timeout=60)
    probe = fp.probe(model.config.vocab_size)
    base = learner.score(probe)
    for version in (1, 2):
        groups = rollout(engine, version - 1)                   # sampled with the learner's current version
        learner.step(groups, staleness=[0] * len(groups))
        stats = sync(learner, sender, receiver, engine)
    assert engine.weight_version == learner.version == 2
    adapter_bytes = sum(p.numel() * 4 for _, p in adapter_parameters(learner.engine.module))
    assert stats["weight_sync_bytes"] == adapter_bytes < sum(p.numel() * 4 for p in model.parameters()) / 4
    assert fp.max_abs(base, learner.score(probe)) > 1e-3
    groups = rollout(engine, 2)
    batch = learner.collate(groups)
    rows, mask = torch.arange(batch.size), batch.response_mask
    with torch.no_grad():
        recompute = learner.response_logprobs(learner.engine, batch, rows)[0]
    assert max_gap(recompute, batch.logp_sparse, mask) <= 1e-4
    sequences = [np.concatenate([s.prompt_ids, s.response_ids]).tolist() for g in groups for s in g.samples]
    ours, theirs = engine.score(sequences), control.score(sequences)
    assert fp.max_abs(ours, theirs) > 1e-3, "the control engine without the adapter should differ"
    assert fp.max_abs(ours, learner.score(sequences)) <= 1e-4


def test_the_final_adapter_is_saved_in_pefts_format_and_merged_on_request(tmp_path):
    """Learner.save_adapter (the run's `final` directory): adapter_config.json + adapter_model.safetensors, which
    peft loads onto the base model to the learner's own logits, which a torch engine loads (broker.lora.
    load_saved_adapter, as `sparse-rl eval` does) to the learner's log-probs, and which broker.lora.save_merged
    (learner.lora.save_merged) merges into a plain Hugging Face directory of the same function."""
    tiny_llama().save_pretrained(tmp_path / "base")
    learner = Learner(str(tmp_path / "base"), LearnerConfig(lr=1e-2, kl_coef=0.0, lora=LORA))
    learner.step(make_groups(), staleness=[0, 0])
    final = tmp_path / "final"
    learner.save_adapter(final, learner.gather_buckets(16.0, keep=True))
    assert {p.name for p in final.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    ids = torch.tensor([[1, 5, 9, 33, 2, 7]])
    learner.engine.module.eval()
    with torch.no_grad():
        ours = learner.engine.module(ids).logits
        assert torch.equal(PeftModel.from_pretrained(tiny_llama(), final).eval()(ids).logits, ours)
        assert not torch.allclose(ours, tiny_llama()(ids).logits, atol=1e-4), "the adapter did not move"
    saved = load_saved_adapter(final)
    assert saved.base == str(tmp_path / "base") and saved.config.settings() == LORA.settings()
    engine = TorchEngine(tiny_llama(), tiny_tokenizer(), CompressorConfig(method="full"), lora=saved.config)
    engine.load_weights(saved.tensors, version=1)
    assert fp.max_abs(engine.score(ids.tolist()), learner.score(ids.tolist())) <= 1e-4
    save_merged(final, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, ours, rtol=0, atol=1e-5)
