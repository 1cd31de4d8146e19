"""Versioned, bucketed weight broadcast from the learner to the actors (docs/ARCHITECTURE.md, "Weight sync").

Learner rank 0 and the actors form their own process group, separate from DeepSpeed's: the learner hosts
a `TCPStore`; each membership *generation* g rendezvouses under `PrefixStore(f"gen{g}")` and builds a
`ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU) with rank 0 = learner, ranks 1..n = actors. Both ends
live here so actors never import the learner.

One sync, in this order on every rank (every collective has a timeout):
  1. broadcast int64 [1]: byte length of the manifest
  2. broadcast uint8 [n]: the manifest (`WeightManifest.to_wire`, JSON): version, dtype, names and full shapes,
     tied aliases, bucket layout, optional per-tensor checksums
  3. all_reduce int32 [world_size]: each actor sets its slot to 1 if the manifest does not match its model
     (the reason goes to the store); if any slot is set, every rank raises and no weight bytes move
  4. broadcast each bucket: one flat buffer of the tensors of that bucket, cast once to the sync dtype;
     tied parameters travel once.

Usage (the driver calls both ends concurrently, e.g. through Ray):
    sender = WeightSender(bucket_mb=16)                  # learner process; sender.port -> actors
    receiver = WeightReceiver("127.0.0.1", sender.port)  # each actor
    sender.open_group(generation=0, world_size=3)  ||  receiver.join_group(0, rank=1 or 2, world_size=3)
    manifest, tensors = build_manifest(model.named_parameters(remove_duplicate=False), dtype, bucket_mb=16)
    sender.send(manifest, tensors, version)  ||  version, named = receiver.receive(engine.expected_weights())
    (the actor copies `named` into its model at a batch boundary; receiver.verify(model) with verify mode)
A new membership (actors joined or left), or any failed/timed-out collective, needs a new, larger
generation number on every rank: a group whose collective failed is not reused.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_backend(backend: str) -> str:
    """auto -> nccl when CUDA is available, else gloo. Raises ValueError for anything but auto|gloo|nccl."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"weight sync backend={backend!r}: expected auto | gloo | nccl")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def local_address(peer_host: str, peer_port: int) -> str:
    """The local IP address that routes to peer_host (127.0.0.1 for a loopback peer); gloo binds to it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, peer_port))
        return s.getsockname()[0]


def checksum(t: torch.Tensor) -> str:
    """blake2b hex digest of a tensor's bytes (its dtype as is)."""
    return hashlib.blake2b(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy(),
                           digest_size=16).hexdigest()


class _GroupMember:
    """What both ends share: the store connection, the current group and its collectives with timeouts."""

    def __init__(self, host: str, port: int, is_master: bool, backend: str, timeout_s: float):
        self.backend = resolve_backend(backend)
        self.timeout = timedelta(seconds=timeout_s)
        listen_fd = None
        if is_master:  # bind the store's socket ourselves: TCPStore alone would listen on every interface
            self._listen_socket = socket.create_server((host, port))
            port, listen_fd = self._listen_socket.getsockname()[1], self._listen_socket.fileno()
        self.store = dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False, timeout=self.timeout,
                                   master_listen_fd=listen_fd)
        self.host, self.port = host, self.store.port
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))
        self.group = None
        self.generation, self.rank, self.world_size = -1, -1, 0

    def _build(self, generation: int, rank: int, world_size: int, bind_host: str) -> None:
        if generation <= self.generation:
            raise ValueError(f"generation {generation} must be larger than the current one ({self.generation})")
        store = dist.PrefixStore(f"gen{generation}", self.store)
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
            self.group = dist.ProcessGroupGloo(store, rank, world_size, opts)
        self.generation, self.rank, self.world_size = generation, rank, world_size

    def _broadcast(self, t: torch.Tensor):
        if self.group is None:
            raise RuntimeError("no weight-sync group: call open_group / join_group first")
        return self.group.broadcast(t, 0)

    def _wait(self, work) -> None:
        work.wait(self.timeout)

    def _exchange_manifest(self, manifest: dict | None) -> dict:
        """Rank 0 passes the manifest, the others None; every rank returns it (steps 1-2)."""
        data = json.dumps(manifest).encode() if manifest is not None else b""
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._wait(self._broadcast(length))
        buf = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        if manifest is not None:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._wait(self._broadcast(buf))
        return manifest if manifest is not None else json.loads(bytes(buf.cpu().numpy()))

    def _vote(self, reject: bool) -> list[int]:
        """Step 3: ranks whose manifest check failed."""
        votes = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        votes[self.rank] = int(reject)
        self._wait(self.group.allreduce(votes))
        return [r for r, v in enumerate(votes.tolist()) if v]

    def close(self) -> None:
        """Drop the current group (the store stays up for a later generation)."""
        self.group = None


class WeightSender(_GroupMember):
    """Learner side (rank 0). Starts the `TCPStore` on host:port (port 0 = a free port; read `.port`).

    Args:
        host: address the store and gloo bind to (127.0.0.1 on one machine; the learner's IP on a cluster).
        backend: auto | gloo | nccl. timeout_s: timeout of the rendezvous and of every collective, seconds.
        bucket_mb: bucket size in MiB; 0 sends one tensor per bucket. A tensor larger than a bucket travels
            alone. Settable between sends.
        verify: put per-tensor checksums into the manifest (receiver checks them and offers `verify(model)`).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backend: str = "auto", timeout_s: float = 60.0,
                 bucket_mb: float = 16.0, verify: bool = False):
        super().__init__(host, port, True, backend, timeout_s)
        self.bucket_mb = bucket_mb
        self.verify = verify

    def open_group(self, generation: int, world_size: int) -> None:
        """Build the group of `world_size` ranks (1 learner + world_size - 1 actors) for this generation.
        Blocks until every actor has called `join_group` with the same generation (or times out)."""
        self._build(generation, 0, world_size, self.host)

    def send(self, manifest: "WeightManifest", tensors: list[torch.Tensor], version: int, *,
             gather: Callable[[list[torch.Tensor]], ContextManager] | None = None) -> dict[str, float]:
        """Broadcast a new weight version to every actor of the group.

        Args:
            manifest: what is sent (build_manifest): names, full shapes, sync dtype, tied aliases, buckets.
            tensors: the tensor of each manifest entry, in order (ZeRO-3: this rank's live partitions).
            version: the weight version the actors will report.
            gather: for sharded parameters, `gather(tensors_of_one_bucket)` is a context manager inside which
                those tensors hold their full values; entered once per bucket, in order (the other shard holders
                enter the same gathers from the same manifest), so at most one bucket is gathered at a time.
        Returns:
            {"weight_sync_s": seconds, "weight_sync_bytes": payload bytes, "weight_sync_buckets": count}.
        Raises:
            ValueError: an actor rejected the manifest (the message names each rank and tensor); nothing was
                sent. RuntimeError: no group, or a collective timed out.
        """
        t0 = time.perf_counter()
        dtype, buckets = DTYPES[manifest.dtype], manifest.buckets
        itemsize = torch.empty((), dtype=dtype).element_size()
        wire = manifest.to_wire(version)
        if self.verify:
            checksums = {}
            for bucket in buckets:
                with gather([tensors[i] for i in bucket]) if gather else contextlib.nullcontext():
                    checksums.update({manifest.names[i]: checksum(tensors[i].to(dtype)) for i in bucket})
            wire["checksums"] = checksums
        self._exchange_manifest(wire)
        rejected = self._vote(False)
        if rejected:
            reasons = [f"rank {r}: {self.store.get(f'reject/{self.generation}/{version}/{r}').decode()}"
                       for r in rejected]
            raise ValueError(f"weight sync version {version} aborted, manifest rejected by " + "; ".join(reasons))

        works, payload = [], 0
        for bucket in buckets:   # pack the next bucket while the previous ones are on the wire
            with gather([tensors[i] for i in bucket]) if gather else contextlib.nullcontext():
                flat = torch.cat([tensors[i].detach().reshape(-1).to(self.device, dtype) for i in bucket])
            payload += flat.numel() * itemsize
            works.append((self._broadcast(flat), flat))
        for work, _ in works:
            self._wait(work)
        return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_bytes": payload,
                "weight_sync_buckets": len(buckets)}


@dataclass
class WeightManifest:
    """The weight-sync contract (nanoGPT-style explicit names): what the learner sends and the actor checks.

    names / shapes: the Hugging Face name and full shape of every tensor that travels, in send order (a tied
    parameter travels once, under its first name); dtype: the sync dtype ("float32" | "bfloat16" | "float16");
    tied: {alias: the name sent} for tied parameters (e.g. {"lm_head.weight": "model.embed_tokens.weight"}),
    listed explicitly so no receiver infers them; buckets: lists of indices into names, each one flat buffer
    of at most bucket_mb MiB (a larger tensor travels alone); adapter: the tensors are a LoRA adapter's only
    (broker/lora.py adapter_parameters: learner.lora on), which the receiver applies on top of the base it holds."""
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtype: str
    tied: dict[str, str]
    buckets: list[list[int]]
    adapter: bool = False

    def expected(self) -> dict[str, tuple[int, ...]]:
        """{every name the receiver gets, tied aliases included: full shape}."""
        shapes = dict(zip(self.names, self.shapes))
        return {**shapes, **{alias: shapes[target] for alias, target in self.tied.items()}}

    def to_wire(self, version: int) -> dict:
        """The JSON object broadcast before the tensors (with the weight version)."""
        return {"version": version, "dtype": self.dtype, "tied": self.tied, "buckets": self.buckets,
                "adapter": self.adapter,
                "tensors": [{"name": n, "shape": list(s)} for n, s in zip(self.names, self.shapes)]}

    @classmethod
    def from_wire(cls, wire: dict) -> "WeightManifest":
        return cls([t["name"] for t in wire["tensors"]], [tuple(t["shape"]) for t in wire["tensors"]],
                   wire["dtype"], dict(wire["tied"]), [list(b) for b in wire["buckets"]], bool(wire.get("adapter")))


def build_manifest(named_tensors, dtype: torch.dtype, bucket_mb: float,
                   shape_of: Callable[[torch.Tensor], tuple[int, ...]] | None = None, adapter: bool = False
                   ) -> tuple[WeightManifest, list[torch.Tensor]]:
    """The one way a manifest is made: from (Hugging Face name, tensor) pairs such as
    `module.named_parameters(remove_duplicate=False)`, where a tensor object listed under several names is
    tied (sent once; the later names become `tied` aliases). `shape_of` gives a tensor's full shape (default
    `tensor.shape`; ZeRO-3 partitions: `ds_shape`). Buckets hold at most `bucket_mb` MiB at `dtype` (0 = one
    tensor per bucket). Deterministic: ranks holding shards of the same parameters compute the same manifest
    and enter the same per-bucket gathers. `adapter`: the tensors are a LoRA adapter's (WeightManifest.adapter).
    Returns (manifest, the tensor of each manifest name, in order).
    Raises ValueError for no tensors or a dtype that cannot travel."""
    shape_of = shape_of or (lambda t: tuple(t.shape))
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in DTYPES:
        raise ValueError(f"weight sync dtype {dtype}: expected one of {list(DTYPES)}")
    names, tensors, tied, first_name = [], [], {}, {}
    for name, t in named_tensors:
        if id(t) in first_name:
            tied[name] = first_name[id(t)]
        else:
            first_name[id(t)] = name
            names.append(name)
            tensors.append(t)
    if not names:
        raise ValueError("a weight manifest needs at least one (name, tensor)")
    shapes = [tuple(shape_of(t)) for t in tensors]
    bucket_bytes, itemsize = bucket_mb * 2**20, torch.empty((), dtype=dtype).element_size()
    buckets, size = [], math.inf
    for i, shape in enumerate(shapes):
        nbytes = math.prod(shape) * itemsize
        if size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return WeightManifest(names, shapes, dtype_name, tied, buckets, adapter), tensors


class WeightReceiver(_GroupMember):
    """Actor side (rank >= 1): connects to the learner's store at host:port.

    Args:
        bind_host: local address gloo binds to (default: the one that routes to `host`).
    """

    def __init__(self, host: str, port: int, backend: str = "auto", timeout_s: float = 60.0,
                 bind_host: str | None = None):
        super().__init__(host, port, False, backend, timeout_s)
        self.bind_host = bind_host or local_address(host, port)
        self.last_manifest: dict | None = None

    def join_group(self, generation: int, rank: int, world_size: int) -> None:
        """Join the group of this generation as `rank` (1..world_size-1). Blocks until all ranks joined."""
        if not 1 <= rank < world_size:
            raise ValueError(f"actor rank {rank} must be in 1..{world_size - 1}")
        self._build(generation, rank, world_size, self.bind_host)

    def receive(self, expected: nn.Module | list[tuple[str, tuple[int, ...], torch.dtype]], adapter: bool = False
                ) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Receive one weight version into fresh staging tensors (the live model is not touched).

        Args:
            expected: the actor's model (its `named_parameters(remove_duplicate=False)`) or a list of
                (name, shape, dtype). The manifest must name exactly these tensors with these shapes and
                dtypes; this is checked before any weight byte moves.
            adapter: the engine expects a LoRA adapter only (learner.lora on; `expected` lists the adapter's
                tensors); a manifest of the other kind is rejected with one line saying which side sends what.
        Returns:
            (version, [(name, tensor)]) for every expected name, in the sync dtype on this rank's device;
            tied aliases are the same tensor object as their target.
        Raises:
            ValueError: manifest mismatch, naming every mismatched tensor (the sender raises too), or another
                rank's mismatch aborted the sync; or checksum mismatch in verify mode. RuntimeError: timeout.
        """
        if isinstance(expected, nn.Module):
            expected = [(n, tuple(p.shape), p.dtype) for n, p in expected.named_parameters(remove_duplicate=False)]
        wire = self._exchange_manifest(None)
        manifest, version = WeightManifest.from_wire(wire), wire["version"]
        dtype, shapes = DTYPES[manifest.dtype], manifest.expected()
        want = {name: (tuple(shape), dt) for name, shape, dt in expected}
        problems = self._mismatch(manifest, shapes, dtype, want, adapter)
        if problems:
            self.store.set(f"reject/{self.generation}/{version}/{self.rank}", "; ".join(problems))
        rejected = self._vote(bool(problems))
        if problems:
            raise ValueError(f"weight sync version {version}: manifest does not match the model: "
                             + "; ".join(problems))
        if rejected:
            raise ValueError(f"weight sync version {version} aborted: rank(s) {rejected} rejected the manifest")
        return version, self._receive_buckets(manifest, wire, expected)

    @staticmethod
    def _mismatch(manifest: WeightManifest, shapes: dict, dtype: torch.dtype, want: dict, adapter: bool) -> list[str]:
        """What differs between the manifest and the model's expected tensors (`want`: name -> (shape, dtype)); a
        manifest of the other kind (adapter / full weights) in one line instead of every name."""
        if manifest.adapter != adapter:
            kinds = {True: "a LoRA adapter only", False: "the full weights"}
            return [f"the learner sends {kinds[manifest.adapter]}, this engine expects {kinds[adapter]} "
                    "(learner.lora.rank must reach the actors as it is on the learner)"]
        problems = [f"{n}: missing from the manifest" for n in want if n not in shapes]
        problems += [f"{n}: not in this model" for n in shapes if n not in want]
        problems += [f"{n}: shape {list(shapes[n])} != model {list(s)}" for n, (s, _) in want.items()
                     if n in shapes and shapes[n] != s]
        problems += [f"{n}: dtype {dtype} != model {dt}" for n, (_, dt) in want.items() if n in shapes and dt != dtype]
        return problems

    def _receive_buckets(self, manifest: WeightManifest, wire: dict, expected: list) -> list[tuple[str, torch.Tensor]]:
        """Step 4 on the receiving side: every bucket into fresh tensors, checksums checked (verify mode); returns
        (name, tensor) for every expected name, tied aliases the same tensor object as their target."""
        version, dtype = wire["version"], DTYPES[manifest.dtype]
        tensors, works = [None] * len(manifest.names), []
        for bucket in manifest.buckets:
            numels = [math.prod(manifest.shapes[i]) for i in bucket]
            flat = torch.empty(sum(numels), dtype=dtype, device=self.device)
            works.append(self._broadcast(flat))
            for i, part in zip(bucket, flat.split(numels)):
                tensors[i] = part.view(manifest.shapes[i])
        for work in works:
            self._wait(work)
        by_name = dict(zip(manifest.names, tensors))
        by_name.update({alias: by_name[target] for alias, target in manifest.tied.items()})
        if "checksums" in wire:
            bad = [n for n, c in wire["checksums"].items() if checksum(by_name[n]) != c]
            if bad:
                raise ValueError(f"weight sync version {version}: checksum mismatch after transfer: {bad}")
        self.last_manifest = wire
        return [(name, by_name[name]) for name, _, _ in expected]

    def verify(self, model: nn.Module) -> None:
        """Verify mode, after the swap: compare each model parameter (cast to the sync dtype) with the
        checksum of the last received version. Raises ValueError naming every mismatched tensor, or when
        the last sync carried no checksums (the sender's verify is off)."""
        if not self.last_manifest or "checksums" not in self.last_manifest:
            raise ValueError("no checksums: the last sync was sent without verify mode")
        dtype = DTYPES[self.last_manifest["dtype"]]
        params = dict(model.named_parameters(remove_duplicate=False))
        bad = [n for n, c in self.last_manifest["checksums"].items()
               if n not in params or checksum(params[n].to(dtype)) != c]
        tied = self.last_manifest["tied"]
        bad += [a for a, t in tied.items() if a in params and t in params and params[a] is not params[t]
                and not torch.equal(params[a], params[t])]
        if bad:
            raise ValueError(f"weight version {self.last_manifest['version']}: model differs from the "
                             f"broadcast weights in {bad}")
