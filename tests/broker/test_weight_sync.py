"""Weight broadcast from this (learner) process to two real receiver processes over gloo."""
import multiprocessing as mp
import traceback

import pytest
import torch

from broker.weight_sync import WeightManifest, WeightReceiver, WeightSender, build_manifest
from tests.learner.conftest import tiny_llama

ROUNDS = [0, 1, 64]   # bucket_mb: one tensor per bucket, 1 MiB, 64 MiB


def send(sender: WeightSender, named: list, version: int) -> dict:
    """One send of (name, tensor) pairs through the manifest (fp32, the sender's bucket size)."""
    manifest, tensors = build_manifest(named, torch.float32, sender.bucket_mb)
    return sender.send(manifest, tensors, version)


def test_manifest_lists_names_full_shapes_tied_aliases_and_buckets():
    embed, norm, w = torch.zeros(8, 4), torch.zeros(4), torch.zeros(2, 4)
    named = [("model.embed_tokens.weight", embed), ("model.norm.weight", norm), ("lm_head.weight", embed),
             ("proj.weight", w)]
    manifest, tensors = build_manifest(named, torch.bfloat16, bucket_mb=64 / 2**20)   # 64 B = 32 bf16 values
    assert manifest.names == ["model.embed_tokens.weight", "model.norm.weight", "proj.weight"]
    assert manifest.shapes == [(8, 4), (4,), (2, 4)] and manifest.dtype == "bfloat16"
    assert manifest.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert manifest.buckets == [[0], [1, 2]]   # 64 B fill the first bucket; 8 B + 16 B share the second
    assert tensors[0] is embed and tensors[2] is w
    assert manifest.expected()["lm_head.weight"] == (8, 4)
    assert WeightManifest.from_wire(manifest.to_wire(7)) == manifest
    sharded, _ = build_manifest(named, torch.float32, 0, shape_of=lambda t: (99,) + tuple(t.shape))
    assert sharded.shapes[1] == (99, 4) and sharded.buckets == [[0], [1], [2]]
    with pytest.raises(ValueError, match="dtype"):
        build_manifest(named, torch.int64, 1)


def receiver_main(port: int, rank: int, out: str) -> None:
    """Actor process: receive every round, load into its own tiny Llama, save what it got."""
    try:
        torch.set_num_threads(1)
        receiver = WeightReceiver("127.0.0.1", port, backend="gloo", timeout_s=60)
        receiver.join_group(generation=0, rank=rank, world_size=3)
        model = tiny_llama(seed=100 + rank)
        params = dict(model.named_parameters(remove_duplicate=False))
        results = {}
        for k in range(len(ROUNDS)):
            version, named = receiver.receive(model)
            staged = dict(named)
            with torch.no_grad():
                for name, t in named:
                    params[name].copy_(t)
            if k == len(ROUNDS) - 1:
                receiver.verify(model)   # the last round is sent with checksums
            results[k] = {"version": version, "named": {n: t.clone() for n, t in named},
                          "tied_staged_once": staged["lm_head.weight"] is staged["model.embed_tokens.weight"],
                          "tied_in_model": model.lm_head.weight is model.model.embed_tokens.weight}
        with torch.no_grad():
            params["model.norm.weight"].add_(1.0)
        try:
            receiver.verify(model)
        except ValueError as e:
            results["verify_error"] = str(e)
        try:
            receiver.receive(model)           # the sender sends a mismatching manifest
        except ValueError as e:
            results["mismatch_error"] = str(e)
        version, named = receiver.receive(model)   # the group still works afterwards
        results["after_mismatch_version"] = version
        torch.save(results, out)
    except Exception:
        torch.save({"crash": traceback.format_exc()}, out)
        raise


def test_broadcast_to_two_receiver_processes(tmp_path):
    torch.manual_seed(0)
    sender = WeightSender(backend="gloo", timeout_s=60)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=receiver_main, args=(sender.port, r, str(tmp_path / f"r{r}.pt"))) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        sender.open_group(generation=0, world_size=3)
        model = tiny_llama(seed=0)
        named = list(model.named_parameters(remove_duplicate=False))
        stats = []
        for k, bucket_mb in enumerate(ROUNDS):
            sender.bucket_mb = bucket_mb
            sender.verify = k == len(ROUNDS) - 1
            stats.append(send(sender, named, version=10 + k))
        unique = len(list(model.parameters()))
        assert stats[0]["weight_sync_buckets"] == unique      # the tied lm_head travels once
        assert stats[2]["weight_sync_buckets"] == 1
        assert stats[0]["weight_sync_bytes"] == sum(p.numel() * 4 for p in model.parameters())

        wrong = [(n, torch.zeros(33) if n == "model.norm.weight" else t) for n, t in named]
        wrong.append(("extra.bias", torch.zeros(2)))
        with pytest.raises(ValueError) as err:
            send(sender, wrong, version=20)
        for rank in (1, 2):
            assert f"rank {rank}" in str(err.value)
        assert "model.norm.weight: shape [33] != model [32]" in str(err.value)
        assert "extra.bias: not in this model" in str(err.value)
        send(sender, named, version=21)
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    reference = {n: t.detach() for n, t in named}
    for r in (1, 2):
        res = torch.load(tmp_path / f"r{r}.pt")
        assert "crash" not in res, res.get("crash")
        for k in range(len(ROUNDS)):
            assert res[k]["version"] == 10 + k
            assert res[k]["named"].keys() == reference.keys()
            for n, t in reference.items():
                assert torch.equal(res[k]["named"][n], t), (k, n)
            assert res[k]["tied_staged_once"] and res[k]["tied_in_model"]
        assert "model.norm.weight" in res["verify_error"]
        assert "model.norm.weight: shape [33] != model [32]" in res["mismatch_error"]
        assert "extra.bias: not in this model" in res["mismatch_error"]
        assert res["after_mismatch_version"] == 21
    assert all(p.exitcode == 0 for p in procs)


def test_receiver_rejects_bad_rank_and_generation():
    sender = WeightSender(backend="gloo", timeout_s=5)
    receiver = WeightReceiver("127.0.0.1", sender.port, backend="gloo", timeout_s=5)
    with pytest.raises(ValueError, match="rank 0"):
        receiver.join_group(0, rank=0, world_size=2)
    with pytest.raises(RuntimeError, match="open_group"):
        send(sender, [("w", torch.zeros(2))], version=1)
