"""Throughput of our versioned, bucketed weight sync next to one raw broadcast of a flat buffer.

A sender (this process, rank 0) and two receiver processes (ranks 1, 2) form one gloo group through
`broker.weight_sync`. For a synthetic model of ~100 MB fp32 (`--quick`; ~400 MB otherwise) made of 4 MiB
matrices plus small vectors, each round is timed on the sender from its start until a tiny all_reduce
after it returns (so every receiver has its data):

    ours:          WeightSender.send  (manifest, manifest vote, bucket packing + cast, bucketed broadcast)
    flat baseline: group.broadcast of one preallocated flat buffer of the same bytes, same group

    ours_vs_flat_broadcast = ours GB/s / flat GB/s   at LearnerConfig's default bucket (16 MiB; target >= 0.8)

Rounds alternate between the two; GB/s are medians over `--reps` rounds, the ratio is the median of the
per-round ratios (robust to load from other processes).

Then the weight-sync fingerprint (learner.weight_sync_fingerprint, broker/fingerprint.py) at the main job's shape
(its model, default `sparse-rl train`'s preset, fp32; `--model` for another): the learner (a real `Learner`, this
process) sends its weights with `Learner.send_weights` to the same two receivers (each checks the manifest against
the model's expected weights), then scores the probe (`Learner.score`); an actor's engine (`TorchEngine.score`, a
copy of the model) scores it after its swap. Rounds alternate sync and probes, one thread each, as the actors and
the learner run:

    fingerprinted_vs_sync = (learner probe s + actor probe s) / sync s   (median of the per-round ratios; the
        learner's probe lengthens its sync, each actor's its pause at the swap; nothing else is added)
    fingerprint_vs_sync = fingerprinted_vs_sync / k   (per sync: only every k-th version is fingerprinted,
        learner.weight_sync_fingerprint_every = k, the main job's unless `--fingerprint-every`; target <= 0.05)
    fingerprint_every_for_target = the smallest k that meets the target at this machine's fingerprinted_vs_sync

(On a CPU a forward is bound by reading the weights, whatever the probe's few tokens, so a fingerprinted sync costs
about two weight reads beside the sync's copies; running the learner's probe beside its send, on other threads,
measured slower on a loaded 2-core machine than one after the other.)

Prints a table and, as the very last line, one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

from broker.fingerprint import PROBE_TOKENS, probe  # noqa: E402
from broker.weight_sync import WeightReceiver, WeightSender, build_manifest  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402

MATRIX = 1024 * 1024   # 4 MiB in fp32
TARGET = 0.05
"""fingerprint_vs_sync aimed at (docs/ARCHITECTURE.md, "Weight sync": the policy fingerprint's cost)."""


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


def model_expected(model_dir: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, float32) of every weight of the model in `model_dir`, tied aliases included (what an actor's
    engine expects), from its config on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return [(n, tuple(p.shape), torch.float32) for n, p in model.named_parameters(remove_duplicate=False)]


def receiver_main(port: int, rank: int, total_mb: int, buckets: list[float], reps: int, model_dir: str,
                  model_reps: int) -> None:
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
    expected = model_expected(model_dir)
    for _ in range(model_reps + 1):
        receiver.receive(expected)
        barrier(receiver.group)


def fingerprint_rounds(sender: WeightSender, model_dir: str, reps: int, every: int, tokens: int) -> dict:
    """The main job's sync next to its fingerprint (module docstring), `reps` rounds after a warm-up one, each round
    fingerprinted: medians of the sync's, the learner probe's and the actor probe's seconds and of the per-round
    ratios (fingerprinted_vs_sync), that ratio per sync with every k = `every`-th version fingerprinted
    (fingerprint_vs_sync) and the smallest k that meets TARGET (fingerprint_every_for_target). tokens: per probe
    sequence (the run's, deploy.config.fingerprint_tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.engines.torch_engine import TorchEngine
    from compressors import CompressorConfig
    from learner.learner import Learner

    sender.bucket_mb = LearnerConfig.weight_sync_bucket_mb
    learner = Learner(model_dir, LearnerConfig(kl_coef=0.0))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = TorchEngine(model, AutoTokenizer.from_pretrained(model_dir), CompressorConfig(method="full"))
    ids = probe(engine.vocab_size, tokens)
    sync, learner_s, actor_s, ratios = [], [], [], []
    for rep in range(reps + 1):                 # round 0 warms up
        t0 = time.perf_counter()
        learner.send_weights(sender)
        barrier(sender.group)
        t1 = time.perf_counter()
        learner.score(ids)
        t2 = time.perf_counter()
        engine.score(ids)
        t3 = time.perf_counter()
        if rep:
            sync.append(t1 - t0)
            learner_s.append(t2 - t1)
            actor_s.append(t3 - t2)
            ratios.append((t3 - t1) / (t1 - t0))
    ratio = statistics.median(ratios)
    return {"sync_s": statistics.median(sync), "learner_probe_s": statistics.median(learner_s),
            "actor_probe_s": statistics.median(actor_s), "fingerprinted_vs_sync": ratio, "fingerprint_every": every,
            "fingerprint_vs_sync": ratio / every, "fingerprint_every_for_target": math.ceil(ratio / TARGET),
            "bytes": sum(t.numel() * t.element_size() for t in learner.export.manifest(sender.bucket_mb)[1]),
            "probe": f"{len(ids)}x{len(ids[0])}"}


def report(rows: list, f: dict, nbytes: int, tensors: int, reps: int, model_name: str, model_reps: int,
           every: int) -> None:
    """Print the table and, as the very last line, the JSON object (module docstring)."""
    print(f"weight sync, {nbytes / 2**20:.0f} MiB fp32, {tensors} tensors, gloo, 1 sender -> 2 receivers, "
          f"median of {reps}")
    print(f"{'bucket MiB':>10} {'ours GB/s':>10} {'flat GB/s':>10} {'ratio':>7}")
    for bucket_mb, ours, flat, ratio in rows:
        print(f"{bucket_mb:>10g} {ours:>10.3f} {flat:>10.3f} {ratio:>7.3f}")
    print(f"fingerprint at {model_name} ({f['bytes'] / 2**20:.0f} MiB fp32, probe {f['probe']}), median of "
          f"{model_reps}: sync {f['sync_s']:.3f} s, learner probe {f['learner_probe_s']:.3f} s, actor probe "
          f"{f['actor_probe_s']:.3f} s: fingerprinted_vs_sync {f['fingerprinted_vs_sync']:.3f}; every "
          f"{every}: fingerprint_vs_sync {f['fingerprint_vs_sync']:.3f} (target {TARGET}: every "
          f"{f['fingerprint_every_for_target']} meets it)")
    default = next(r for r in rows if r[0] == LearnerConfig.weight_sync_bucket_mb)
    print(json.dumps({"bench": "weight_sync", "bytes": nbytes, "receivers": 2, "bucket_mb": default[0],
                      "ours_gb_per_s": round(default[1], 4), "flat_broadcast_gb_per_s": round(default[2], 4),
                      "ours_vs_flat_broadcast": round(default[3], 4),
                      "by_bucket_mb": {str(b): round(r, 4) for b, _, _, r in rows}, "target": 0.8,
                      "fingerprint_model": model_name, "fingerprint_bytes": f["bytes"], "fingerprint_probe": f["probe"],
                      **{k: round(f[k], 4) for k in ("sync_s", "learner_probe_s", "actor_probe_s")},
                      "fingerprinted_vs_sync": round(f["fingerprinted_vs_sync"], 4), "fingerprint_every": every,
                      "fingerprint_vs_sync": round(f["fingerprint_vs_sync"], 4), "fingerprint_target": TARGET,
                      "fingerprint_every_for_target": f["fingerprint_every_for_target"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="~100 MB, buckets 4/16/64 MiB, 9 rounds")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--model", default="", help="model of the fingerprint rounds: a preset model name or a Hugging "
                                                    "Face directory (default: the main job's, deploy/cli.py MAIN_JOB)")
    parser.add_argument("--model-reps", type=int, default=5, help="fingerprint rounds after a warm-up one (default 5)")
    parser.add_argument("--fingerprint-every", type=int, default=0,
                        help="k of learner.weight_sync_fingerprint_every (default: the main job's)")
    args = parser.parse_args()
    total_mb = 100 if args.quick else 400
    buckets = [4.0, 16.0, 64.0] if args.quick else [0.0, 1.0, 4.0, 16.0, 64.0, 256.0]
    reps = args.reps or (9 if args.quick else 9)
    torch.set_num_threads(1)
    from deploy.cli import MAIN_JOB
    from deploy.config import fingerprint_tokens, load_config
    from deploy.model_cache import resolve_model

    main_job = load_config(MAIN_JOB, check_files=False)
    model_name = args.model or main_job.model
    every = args.fingerprint_every or main_job.learner.weight_sync_fingerprint_every
    tokens = fingerprint_tokens(main_job) or PROBE_TOKENS   # (the main job's probe; the full one if it has it off)
    model_dir = resolve_model(model_name)   # a preset model is built once and cached

    named = synthetic_weights(total_mb)
    nbytes = sum(t.numel() * 4 for _, t in named)
    flat = torch.cat([t.reshape(-1) for _, t in named])
    sender = WeightSender(backend="gloo", timeout_s=120)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=receiver_main, args=(sender.port, r, total_mb, buckets, reps, model_dir,
                                                     args.model_reps)) for r in (1, 2)]
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
    fingerprint = fingerprint_rounds(sender, model_dir, args.model_reps, every, tokens)
    for p in procs:
        p.join(timeout=60)

    report(rows, fingerprint, nbytes, len(named), reps, model_name, args.model_reps, every)


if __name__ == "__main__":
    main()
