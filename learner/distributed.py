"""The learner's distributed set-up: its process group (`init_distributed`, the one DeepSpeed uses) and the
DeepSpeed config of a LearnerConfig (`deepspeed_config`)."""
from __future__ import annotations

import importlib
import os
import socket
import sys
from datetime import timedelta

import torch

from broker.redis_server import free_port
from learner.config import LearnerConfig

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def import_deepspeed():
    """`import deepspeed`, without the optional MLflow import of its autotuner (deepspeed/autotuning/autotuner.py,
    `try: import mlflow`), which the learner never uses: ~1.3 s of CPU per learner rank at start. A process that
    imported MLflow already keeps it. Returns the deepspeed module."""
    blocked = "mlflow" not in sys.modules
    if blocked:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError while this is set
    try:
        import deepspeed
    finally:
        if blocked:
            sys.modules.pop("mlflow", None)
    return deepspeed


def init_distributed(rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1", master_port: int = 0,
                     timeout_s: float = 600.0) -> None:
    """Initialise the learner's default process group (the one DeepSpeed uses) if nothing did yet: gloo on
    CPU (with DeepSpeed's shared-memory op build skipped, docs/ENVIRONMENT.md), nccl on CUDA; one code path.

    One rank (`world_size` 1): an in-memory store, no socket. N ranks: rank 0 hosts a TCPStore bound to
    `master_addr`:`master_port` only (127.0.0.1 = loopback, the default; a node address on a cluster), the
    others connect to it; every collective of the group times out after `timeout_s` seconds, so a rank that
    died or hangs fails the others' collective instead of blocking them. Sets RANK/WORLD_SIZE/LOCAL_RANK/
    MASTER_ADDR/MASTER_PORT when absent (LOCAL_RANK 0: each rank sees only its own GPU, as in a Ray actor).

    Raises:
        ValueError: rank outside [0, world_size), or world_size > 1 without a master_port.
        torch.distributed.DistStoreError: a rank did not join within `timeout_s`.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} must be in [0, {world_size})")
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", str(rank)), ("WORLD_SIZE", str(world_size)), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", master_addr)):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(master_port or free_port()))
    deepspeed = import_deepspeed()  # only after DS_ACCELERATOR is set: deepspeed picks its accelerator at import

    if torch.distributed.is_initialized():
        return
    if not cuda:
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        if master_addr in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets on loopback unless told otherwise
    backend = "nccl" if cuda else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if world_size == 1:
        if os.environ["WORLD_SIZE"] == "1":  # one learner process: an in-memory store, no rendezvous socket
            torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1,
                                                 timeout=timeout)
        # else: an outside launcher set the environment; DeepSpeed's env:// rendezvous below uses it
    else:
        if not master_port:
            raise ValueError("a learner group of several ranks needs the master_port of rank 0's store")
        listen_fd = None
        if rank == 0:  # bind the store's socket ourselves: TCPStore alone would listen on every interface
            global _STORE_SOCKET
            _STORE_SOCKET = socket.create_server((master_addr, master_port))
            listen_fd = _STORE_SOCKET.fileno()
        store = torch.distributed.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                                           timeout=timeout, wait_for_workers=False, master_listen_fd=listen_fd)
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)


_STORE_SOCKET = None
"""Rank 0's listening socket of the learner group's store (kept open for the life of the process)."""


def deepspeed_config(cfg: LearnerConfig) -> dict:
    """The DeepSpeed JSON config for `cfg`. Gradient accumulation is caller-owned
    (`managed_gradient_accumulation: false`): every `engine.step()` is one optimizer step over the
    micro-batches backpropagated since the last one."""
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {
            "lr": cfg.lr, "betas": list(cfg.betas), "eps": cfg.adam_eps, "weight_decay": cfg.weight_decay,
            "torch_adam": True}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def all_reduce(t: torch.Tensor, world_size: int, op=None) -> torch.Tensor:
    """The sum of `t` (or its reduction by `op`, a torch.distributed.ReduceOp) over the learner's `world_size`
    ranks, in place (no-op with one rank); returns it."""
    if world_size > 1:
        if op is None:
            torch.distributed.all_reduce(t)
        else:
            torch.distributed.all_reduce(t, op=op)
    return t
