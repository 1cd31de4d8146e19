"""The learner's weights (ZeRO-3, bf16: gathered, cast once) through the weight sync to a receiver thread."""
import threading

import torch

from broker.weight_sync import WeightReceiver, WeightSender
from learner.config import LearnerConfig
from learner.learner import Learner
from tests.learner.conftest import make_groups, tiny_llama


def test_zero3_bf16_learner_weights_reach_the_receiver():
    learner = Learner(tiny_llama(), LearnerConfig(lr=1e-2, zero_stage=3, dtype="bf16", kl_coef=0.0))
    learner.step(make_groups(), staleness=[0, 0])
    named = learner.named_weights()
    shapes = {n: tuple(p.shape) for n, p in tiny_llama().named_parameters(remove_duplicate=False)}
    assert {n: tuple(t.shape) for n, t in named} == shapes          # gathered, not ZeRO-3 partitions
    assert all(t.dtype == torch.bfloat16 for _, t in named)

    sender = WeightSender(backend="gloo", timeout_s=30, verify=True)
    receiver = WeightReceiver("127.0.0.1", sender.port, backend="gloo", timeout_s=30)
    actor_model = tiny_llama(seed=7).to(torch.bfloat16)
    got = {}

    def actor():
        receiver.join_group(generation=3, rank=1, world_size=2)
        got["version"], got["named"] = receiver.receive(actor_model)

    thread = threading.Thread(target=actor)
    thread.start()
    sender.open_group(generation=3, world_size=2)
    stats = sender.send(named, version=learner.version, dtype=torch.bfloat16)
    thread.join(timeout=60)
    assert got["version"] == 1
    received = dict(got["named"])
    for name, t in named:
        assert torch.equal(received[name], t), name
    assert stats["weight_sync_bytes"] == sum(p.numel() * 2 for p in tiny_llama().parameters())

    with torch.no_grad():
        for name, p in actor_model.named_parameters(remove_duplicate=False):
            p.copy_(received[name])
    receiver.verify(actor_model)
