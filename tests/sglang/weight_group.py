"""SGLang's own weight-update path, driven from the tests (docs/sglang.md, "Weight updates", path 2): SGLang joins
the learner's collective group itself and receives the broadcast straight into its model
(`init_weights_update_group`, then `update_weights_from_distributed`, bucketed). The product's actors use path 1
(`SGLangEngine.load_weights` after `broker.weight_sync.WeightReceiver`); this is the other end checked on the CPU
lane (tests/sglang/test_sglang_engine.py, over gloo), for a learner that would drive SGLang's protocol.

- `join_weight_group(engine, ...)` + `receive_weights_from_distributed(engine, ...)`: the actor's end, on an
  `SGLangEngine` (its SGLang engine, manifest, timeouts and weight-update session);
- `sglang_sender_group(...)`: the learner's end (rank 0), torch only.
"""
from __future__ import annotations

from datetime import timedelta

from actors.engines.sglang.engine import SGLangEngine


def join_weight_group(engine: SGLangEngine, master_address: str, master_port: int, rank_offset: int,
                      world_size: int, group_name: str = "sparse_rl_weights", backend: str = "nccl") -> None:
    """SGLang joins the learner's weight-broadcast group as ranks rank_offset..rank_offset+tp_size-1
    (`init_weights_update_group`); the group's name is kept in `engine.weight_group`. The learner must be rank 0
    of a group built like `sglang_sender_group` (same address, port, world size, group name, backend) at the same
    time. Raises RuntimeError with SGLang's message on failure or timeout."""
    from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

    obj = InitWeightsUpdateGroupReqInput(master_address=master_address, master_port=master_port,
                                         rank_offset=rank_offset, world_size=world_size,
                                         group_name=group_name, backend=backend)
    engine._check(engine._call(engine.engine.tokenizer_manager.init_weights_update_group(obj, None),
                               "init_weights_update_group"), "init_weights_update_group")
    engine.weight_group = group_name


def receive_weights_from_distributed(engine: SGLangEngine, buckets: list[list[tuple[str, str, tuple[int, ...]]]],
                                     version: int) -> None:
    """Receive one weight sync straight into SGLang's model over the group of `join_weight_group`.

    buckets: per bucket, (name, dtype name e.g. "bfloat16", shape) of each tensor in broadcast order; for
        each bucket the learner broadcasts the tensors from rank 0 in that order (`dist.broadcast(t, 0,
        group)`) while this call waits (`update_weights_from_distributed`; the first bucket is received
        only after `begin_weight_update` returned: start broadcasting once this call is running).
    Runs begin_weight_update -> one update_weights_from_distributed per bucket (prefix cache flushed with
    the last) -> end_weight_update and sets `engine.weight_version = version`. Raises ValueError for names or
    shapes not in the model, RuntimeError with SGLang's message on failure or timeout.
    """
    from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

    manifest = engine.manifest
    problems = [f"{n}: {tuple(s)} vs model {manifest.get(n, (None,))[0]}" for b in buckets
                for n, _, s in b if n in manifest and tuple(s) != manifest[n][0]]
    problems += [f"unknown parameter {n!r}" for b in buckets for n, _, _ in b
                 if n not in manifest and not (n == "lm_head.weight" and engine.tied_embeddings)]
    if problems:
        raise ValueError("receive_weights_from_distributed rejected the manifest: " + "; ".join(problems))
    tm = engine.engine.tokenizer_manager

    async def _all_buckets():
        for i, bucket in enumerate(buckets):
            obj = UpdateWeightsFromDistributedReqInput(
                names=[n for n, _, _ in bucket], dtypes=[d for _, d, _ in bucket],
                shapes=[list(s) for _, _, s in bucket], group_name=engine.weight_group,
                flush_cache=i == len(buckets) - 1, weight_version=str(version))
            engine._check(await tm.update_weights_from_distributed(obj, None), f"update_weights_from_distributed "
                          f"(bucket {i})")
        return True, "ok"

    engine._weight_session(_all_buckets, "receive_weights_from_distributed")
    engine.weight_version = version


def sglang_sender_group(master_address: str, master_port: int, world_size: int,
                        group_name: str = "sparse_rl_weights", backend: str = "nccl", timeout_s: float = 600.0):
    """The learner's end (rank 0) of the group SGLang builds in `init_weights_update_group`: the same
    rendezvous as SGLang's `init_custom_process_group` -- `tcp://addr:port` (rank 0 hosts the TCPStore), keys
    under `PrefixStore(group_name)`, torch's `_new_process_group_helper(group_name=group_name)` -- so both
    ends meet. Returns the ProcessGroup; broadcast with `dist.broadcast(t, src=0, group=pg)`. Depends only on
    torch (a learner would need no SGLang). Call it concurrently with `join_weight_group`."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", 0, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
