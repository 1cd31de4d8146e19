"""Broker throughput: our producer -> consumer against raw redis-py XADD + XREADGROUP + XACK of the same
bytes, on one local redis-server, for groups of 16 KB, 256 KB and 2 MB (G = 8 samples each).

Ours is the API the system uses: the rollout actor publishes each batch of prompt groups with
GroupProducer.publish_many (encode + validate each group, then one MULTI/EXEC of the XADDs, the `produced`
count and XLEN for backpressure), here BATCH groups at a time; the learner reads with GroupConsumer.read
(XREADGROUP, decode + validate, one round trip for learner version + consumed flags) and commits
(SADD + XACK + XDEL + count in one MULTI/EXEC). Raw does one XADD round trip per group, then XREADGROUP +
XACK in batches of BATCH. For reference the table also gives ours with one GroupProducer.publish per group.

    python bench/broker.py [--quick]

Prints a table, then as its last line one JSON object: ours_vs_raw (min over sizes of our groups/s over
raw groups/s, publish_many), ours_publish_vs_raw (the same with publish per group), encode_decode_mb_per_s
(encode + decode of the 2 MB group), and the per-size figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

# Run as `python bench/broker.py`, this file's folder comes first on sys.path and its name would shadow
# the `broker` package.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from broker.config import BrokerConfig
from broker.redis_server import LocalRedis
from broker.run_state import key
from broker.schema import SampleRecord, TrajectoryGroup, decode_group, encode_group
from broker.streams import GroupConsumer, GroupProducer, connect

SIZES = {"16KB": 16 << 10, "256KB": 256 << 10, "2MB": 2 << 20}
G = 8  # samples per group
BATCH = 16  # groups per consumer read


def make_group(group_id: str, payload_bytes: int) -> TrajectoryGroup:
    """G samples whose response ids (int32) and logp_sparse (float32) add up to ~payload_bytes."""
    rng = np.random.default_rng(0)
    tokens = payload_bytes // (G * 8)
    samples = [SampleRecord(prompt_ids=rng.integers(0, 50000, 64, dtype=np.int32),
                            response_ids=rng.integers(0, 50000, tokens, dtype=np.int32),
                            logp_sparse=-rng.exponential(1.0, tokens).astype(np.float32),
                            finish_reason="stop", reward=1.0, kv_retained_tokens=512, kv_peak_bytes=1 << 20)
               for _ in range(G)]
    return TrajectoryGroup(run_id="bench", group_id=group_id, prompt_id="p", weight_version=0, temperature=1.0,
                           compressor="rkv", kv_budget=512, samples=samples)


def run_ours(client, cfg: BrokerConfig, run_id: str, groups: list[TrajectoryGroup], batched: bool) -> float:
    """Seconds to publish all groups (publish_many of BATCH groups, or publish per group when not batched),
    then read, decode and commit them all."""
    consumer = GroupConsumer(client, cfg, run_id, "learner-0")
    producer = GroupProducer(client, cfg, run_id)
    t0 = time.perf_counter()
    if batched:
        for i in range(0, len(groups), BATCH):
            producer.publish_many(groups[i:i + BATCH])
    else:
        for g in groups:
            producer.publish(g)
    n = 0
    while n < len(groups):
        deliveries = consumer.read(BATCH, block_ms=1000)
        consumer.commit(deliveries)
        n += len(deliveries)
    return time.perf_counter() - t0


def run_raw(client, stream: str, payload: bytes, n: int) -> float:
    """Seconds to XADD the same bytes n times, then XREADGROUP + XACK them all (no encode/decode)."""
    client.xgroup_create(stream, "raw", id="0", mkstream=True)
    t0 = time.perf_counter()
    for _ in range(n):
        client.xadd(stream, {"group": payload})
    got = 0
    while got < n:
        (_, entries), = client.xreadgroup("raw", "c", {stream: ">"}, count=BATCH, block=1000)
        client.xack(stream, "raw", *[m for m, _ in entries])
        got += len(entries)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~32 MB per size and 3 repeats (default 128 MB, 5)")
    args = ap.parse_args()
    total_bytes, repeats = (32 << 20, 3) if args.quick else (128 << 20, 5)

    rows, ratios, single_ratios, coding = [], {}, {}, {}
    with LocalRedis() as server:
        client = connect(BrokerConfig(url=server.url))
        for label, size in SIZES.items():
            n = max(32, total_bytes // size)
            cfg = BrokerConfig(url=server.url, high_watermark=n + 1)
            groups = [make_group(f"g{i}", size) for i in range(n)]
            payload = encode_group(groups[0])
            times = {"ours": [], "single": [], "raw": []}
            for r in range(repeats):  # interleaved; best of repeats on a shared machine. The order rotates, so
                # that no path always runs first after FLUSHALL (measured slower: cold server and client heaps)
                for name in [*times][r % 3:] + [*times][:r % 3]:
                    run_id = f"{name}-{label}-{r}"
                    if name == "raw":
                        times[name].append(run_raw(client, key(run_id, "groups"), payload, n))
                    else:
                        times[name].append(run_ours(client, cfg, run_id, [
                            TrajectoryGroup(**{**g.__dict__, "run_id": run_id}) for g in groups], name == "ours"))
                client.flushall()
            ours, single, raw = times.values()
            reps, t = 0, time.perf_counter()
            while reps < 20 or time.perf_counter() - t < 0.5:
                decode_group(encode_group(groups[0]))
                reps += 1
            coding[label] = reps * len(payload) / (time.perf_counter() - t) / 1e6
            ours_gps, single_gps, raw_gps = n / min(ours), n / min(single), n / min(raw)
            ratios[label], single_ratios[label] = ours_gps / raw_gps, single_gps / raw_gps
            rows.append((label, len(payload), n, ours_gps, single_gps, raw_gps, ratios[label], single_ratios[label],
                         coding[label]))

    print(f"{'payload':>8} {'bytes':>9} {'groups':>6} {'ours g/s':>9} {'ours 1by1':>9} {'raw g/s':>9} "
          f"{'ours/raw':>8} {'1by1/raw':>8} {'enc+dec MB/s':>12}")
    for label, nbytes, n, ours_gps, single_gps, raw_gps, ratio, single_ratio, mbps in rows:
        print(f"{label:>8} {nbytes:>9} {n:>6} {ours_gps:>9.1f} {single_gps:>9.1f} {raw_gps:>9.1f} {ratio:>8.3f} "
              f"{single_ratio:>8.3f} {mbps:>12.0f}")
    print(json.dumps({"ours_vs_raw": round(min(ratios.values()), 3),
                      "ours_api": f"GroupProducer.publish_many({BATCH} groups) -> GroupConsumer.read -> commit",
                      "ours_publish_vs_raw": round(min(single_ratios.values()), 3),
                      "encode_decode_mb_per_s": round(coding["2MB"], 1),
                      "ours_vs_raw_by_size": {k: round(v, 3) for k, v in ratios.items()},
                      "ours_publish_vs_raw_by_size": {k: round(v, 3) for k, v in single_ratios.items()},
                      "encode_decode_mb_per_s_by_size": {k: round(v, 1) for k, v in coding.items()}}))


if __name__ == "__main__":
    main()
