"""Throughput of our versioned, bucketed weight sync next to one raw broadcast of a flat buffer (issue 3).

A sender (this process, rank 0) and two receiver processes (ranks 1, 2) form one gloo group through
`broker.weight_sync`. For a synthetic model of ~100 MB fp32 (`--quick`; ~400 MB otherwise) made of 4 MiB
matrices plus small vectors, each round is timed on the sender from its start until a tiny all_reduce
after it returns (so every receiver has its data):

    ours:          WeightSender.send  (manifest, manifest vote, bucket packing + cast, bucketed broadcast)
    flat baseline: group.broadcast of one preallocated flat buffer of the same bytes, same group

    ours_vs_flat_broadcast = ours GB/s / flat GB/s   at LearnerConfig's default bucket (16 MiB; target >= 0.8)

Rounds alternate between the two; GB/s are medians over `--reps` rounds, the ratio is the median of the
per-round ratios (robust to load from other processes). Prints a table and, as the
very last line, one JSON object.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

from broker.weight_sync import WeightReceiver, WeightSender, build_manifest  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402

MATRIX = 1024 * 1024   # 4 MiB in fp32


def synthetic_weights(total_mb: int) -> list[tuple[str, torch.Tensor]]:
    """Layers of one 4 MiB matrix and two 4 KiB vectors until ~total_mb MiB."""
    named, i = [], 0
    while sum(t.numel() * 4 for _, t in named) < total_mb * 2**20:
        named += [(f"layers.{i}.weight", torch.randn(1024, 1024)), (f"layers.{i}.norm.weight", torch.randn(1024)),
                  (f"layers.{i}.bias", torch.randn(1024))]
        i += 1
    return named


def barrier(group) -> None:
    group.allreduce(torch.zeros(1)).wait()


def receiver_main(port: int, rank: int, total_mb: int, buckets: list[float], reps: int) -> None:
    torch.set_num_threads(1)
    receiver = WeightReceiver("127.0.0.1", port, backend="gloo", timeout_s=120)
    receiver.join_group(0, rank, 3)
    expected = [(n, tuple(t.shape), t.dtype) for n, t in synthetic_weights(total_mb)]
    numel = sum(torch.Size(s).numel() for _, s, _ in expected)
    for _ in buckets:
        for _ in range(reps + 1):
            receiver.receive(expected)
            barrier(receiver.group)
            flat = torch.empty(numel)
            receiver.group.broadcast(flat, 0).wait()
            barrier(receiver.group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="~100 MB, buckets 4/16/64 MiB, 9 rounds")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    total_mb = 100 if args.quick else 400
    buckets = [4.0, 16.0, 64.0] if args.quick else [0.0, 1.0, 4.0, 16.0, 64.0, 256.0]
    reps = args.reps or (9 if args.quick else 9)
    torch.set_num_threads(1)

    named = synthetic_weights(total_mb)
    nbytes = sum(t.numel() * 4 for _, t in named)
    flat = torch.cat([t.reshape(-1) for _, t in named])
    sender = WeightSender(backend="gloo", timeout_s=120)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=receiver_main, args=(sender.port, r, total_mb, buckets, reps)) for r in (1, 2)]
    for p in procs:
        p.start()
    sender.open_group(0, 3)

    rows = []
    version = 0
    for bucket_mb in buckets:
        sender.bucket_mb = bucket_mb
        manifest, tensors = build_manifest(named, named[0][1].dtype, bucket_mb)
        ours, base, ratios = [], [], []
        for rep in range(reps + 1):          # round 0 warms up
            version += 1
            t0 = time.perf_counter()
            sender.send(manifest, tensors, version)
            barrier(sender.group)
            t1 = time.perf_counter()
            sender.group.broadcast(flat, 0).wait()
            barrier(sender.group)
            t2 = time.perf_counter()
            if rep:
                ours.append(t1 - t0)
                base.append(t2 - t1)
                ratios.append((t2 - t1) / (t1 - t0))
        ours_gbs = nbytes / statistics.median(ours) / 1e9
        flat_gbs = nbytes / statistics.median(base) / 1e9
        rows.append((bucket_mb, ours_gbs, flat_gbs, statistics.median(ratios)))
    for p in procs:
        p.join(timeout=60)

    print(f"weight sync, {nbytes / 2**20:.0f} MiB fp32, {len(named)} tensors, gloo, 1 sender -> 2 receivers, "
          f"median of {reps}")
    print(f"{'bucket MiB':>10} {'ours GB/s':>10} {'flat GB/s':>10} {'ratio':>7}")
    for bucket_mb, o, f, r in rows:
        print(f"{bucket_mb:>10g} {o:>10.3f} {f:>10.3f} {r:>7.3f}")
    default = next(r for r in rows if r[0] == LearnerConfig.weight_sync_bucket_mb)
    print(json.dumps({"bench": "weight_sync", "bytes": nbytes, "receivers": 2, "bucket_mb": default[0],
                      "ours_gb_per_s": round(default[1], 4), "flat_broadcast_gb_per_s": round(default[2], 4),
                      "ours_vs_flat_broadcast": round(default[3], 4),
                      "by_bucket_mb": {str(b): round(r, 4) for b, _, _, r in rows}, "target": 0.8}))


if __name__ == "__main__":
    main()
