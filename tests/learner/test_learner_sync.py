"""The learner's one weight export (Learner.send_weights: ZeRO-3, bf16, gathered bucket by bucket, cast once) over
the weight sync to a receiver thread holding an actor's model: the production path."""
import threading

import torch

from broker.weight_sync import WeightReceiver, WeightSender
from learner.config import LearnerConfig
from learner.learner import Learner
from tests.learner.conftest import make_groups, tiny_llama


def test_zero3_bf16_learner_weights_reach_the_receiver():
    learner = Learner(tiny_llama(), LearnerConfig(lr=1e-2, zero_stage=3, dtype="bf16", kl_coef=0.0))
    learner.step(make_groups(), staleness=[0, 0])
    full = learner.gather_buckets(bucket_mb=0, keep=True)
    shapes = {n: tuple(p.shape) for n, p in tiny_llama().named_parameters(remove_duplicate=False)}
    assert {n: tuple(t.shape) for n, t in full.items()} == shapes          # gathered, not ZeRO-3 partitions
    assert all(t.dtype == torch.bfloat16 for t in full.values())

    sender = WeightSender(backend="gloo", timeout_s=30, verify=True, bucket_mb=0.01)
    receiver = WeightReceiver("127.0.0.1", sender.port, backend="gloo", timeout_s=30)
    actor_model = tiny_llama(seed=7).to(torch.bfloat16)
    expected = [(n, tuple(p.shape), p.dtype) for n, p in actor_model.named_parameters(remove_duplicate=False)]
    got = {}

    def actor():
        receiver.join_group(generation=3, rank=1, world_size=2)
        got["version"], got["named"] = receiver.receive(expected)

    thread = threading.Thread(target=actor)
    thread.start()
    sender.open_group(generation=3, world_size=2)
    stats = learner.send_weights(sender)
    thread.join(timeout=60)
    assert got["version"] == 1
    received = dict(got["named"])
    for name, t in full.items():
        assert torch.equal(received[name], t), name
    assert received["lm_head.weight"] is received["model.embed_tokens.weight"]   # the tied alias travelled once
    assert stats["weight_sync_bytes"] == sum(p.numel() * 2 for p in tiny_llama().parameters())
    assert stats["weight_sync_buckets"] > 1

    with torch.no_grad():
        for name, p in actor_model.named_parameters(remove_duplicate=False):
            p.copy_(received[name])
    receiver.verify(actor_model)
