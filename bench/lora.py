"""LoRA next to full fine-tuning at the main job's shape: the bytes of one weight sync, the training state one learner
rank holds, and the learner's step time. Both learners are built in this run, on the same model and the same batch.

Model and learner: the main job's (deploy/cli.py MAIN_JOB, `smollm2-count-warm`: SmolLM2-135M warmed up on the count
task, 134.5M parameters, tied embeddings), with its learner settings as `sparse-rl train` runs them: fp32, ZeRO stage
0, 1 rank, micro-batch 8, logp_old fused into the training forward, kl_coef 0; `--threads` torch threads (default the
main job's train.learner_num_cpus, 2). The LoRA learner differs only by `learner.lora.rank=16` (`--rank`; the rank the
preflight sizes, deploy.preflight.LORA_SIZED_RANK) with learner.lora's other defaults: alpha 32 (update scaled by
alpha / rank = 2), dropout 0, target modules q/k/v/o_proj and gate/up/down_proj of every decoder layer.

Batch: synthetic and the same for both: `--groups` groups (default 2: one micro-batch of 8) x the main job's 4
samples, each a random prompt of 48 token ids and a random response of 176 (the main job's max_new_tokens), rewards
0 and 1, no eviction records (so a step runs the dense path; eviction replay would add forwards to both).

    sync_bytes_{full,lora}: bytes one weight sync sends: the learner's own sync manifest
        (Learner.export.manifest at learner.weight_sync_bucket_mb: what WeightSender.send packs bucket by bucket
        and reports as weight_sync_bytes, MLflow `weight_sync/bytes`), every tensor once at the sync dtype
    sync_bytes_ratio = sync_bytes_lora / sync_bytes_full
    state_bytes_{full,lora}: Learner.state_bytes of the learner's DeepSpeed engine (parameters, gradients, optimizer
        state: measured tensor storages, each counted once), taken at the optimizer step of the last timed step,
        when the gradients exist and Adam's moments are there from the steps before
    state_bytes_ratio = state_bytes_lora / state_bytes_full
    preflight_state_bytes_{full,lora}: the preflight's arithmetic for the same settings (deploy.preflight.
        learner_memory), and preflight_vs_measured_{full,lora} = predicted / measured
    step_time_ratio = LoRA step s / full step s: the median of the per-step ratios over `--steps` steps of each
        after one warm-up step each, the two learners alternating (the order swapped every step, against drifting
        load); step_s_{full,lora} are the medians of each

Prints a table and, as the very last line, one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

from broker.lora import LoraConfig  # noqa: E402
from broker.schema import TrajectoryGroup  # noqa: E402
from broker.weight_sync import DTYPES  # noqa: E402

PROMPT, SAMPLES = 48, 4


def make_groups(groups: int, response: int, vocab: int, seed: int = 0) -> list[TrajectoryGroup]:
    """`groups` groups of SAMPLES samples of PROMPT + `response` random ids at R-KV 48, cut at max length:
    bench/learner.py's `make_groups` (loaded from its file: bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_learner", Path(__file__).with_name("learner.py"))
    bench_learner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_learner)
    return bench_learner.make_groups(seed, groups, SAMPLES, PROMPT, response, vocab, kv_budget=48, finish="length")


def sync_bytes(learner, bucket_mb: float) -> tuple[int, int, int]:
    """(bytes, tensors, buckets) of one weight sync of `learner`: its sync manifest (WeightExport.manifest), every
    tensor once at the manifest's dtype, as WeightSender.send packs it."""
    manifest, _ = learner.export.manifest(bucket_mb)
    itemsize = torch.empty((), dtype=DTYPES[manifest.dtype]).element_size()
    return sum(math.prod(s) for s in manifest.shapes) * itemsize, len(manifest.names), len(manifest.buckets)


class Measured:
    """A learner built with a phase hook that records Learner.state_bytes at its optimizer step while `armed`."""

    def __init__(self, model_dir: str, cfg):
        from learner.learner import Learner

        self.armed, self.state = False, {}
        self.learner = Learner(model_dir, cfg, phase=self.phase)

    def phase(self, name: str) -> None:
        if self.armed and name == "optimizer step":
            self.state = self.learner.state_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 timed steps each (default 7)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--groups", type=int, default=2, help="groups of 4 samples in the batch (default 2)")
    parser.add_argument("--rank", type=int, default=0, help="LoRA rank (default deploy.preflight.LORA_SIZED_RANK)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default the main job's "
                                                              "train.learner_num_cpus)")
    args = parser.parse_args()
    steps = args.steps or (3 if args.quick else 7)
    from transformers import AutoConfig

    from deploy.cli import MAIN_JOB
    from deploy.config import load_config
    from deploy.model_cache import resolve_model
    from deploy.preflight import LORA_SIZED_RANK, learner_memory

    job = load_config(MAIN_JOB, check_files=False)
    threads = args.threads or int(job.train.learner_num_cpus)
    torch.set_num_threads(threads)
    model_dir = resolve_model(job.model)
    hf = AutoConfig.from_pretrained(model_dir)
    cfg = {"full": job.learner}
    cfg["lora"] = dataclasses.replace(job.learner, lora=LoraConfig(rank=args.rank or LORA_SIZED_RANK))
    lora = cfg["lora"].lora
    made = {kind: Measured(model_dir, c) for kind, c in cfg.items()}
    groups = make_groups(args.groups, job.actors.sampling.max_new_tokens, hf.vocab_size)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)
    sync = {kind: sync_bytes(m.learner, job.learner.weight_sync_bucket_mb) for kind, m in made.items()}

    times = {kind: [] for kind in made}
    for step in range(steps + 1):          # step 0 warms up; the order alternates against drifting load
        for kind in (("full", "lora") if step % 2 else ("lora", "full")):
            made[kind].armed = step == steps
            t0 = time.perf_counter()
            made[kind].learner.step(groups, staleness=[0] * len(groups))
            if step:
                times[kind].append(time.perf_counter() - t0)
    state = {kind: m.state for kind, m in made.items()}
    predicted = {kind: learner_memory(hf, c, c.lora) for kind, c in cfg.items()}
    step_s = {kind: statistics.median(t) for kind, t in times.items()}
    ratio = statistics.median(lo / f for lo, f in zip(times["lora"], times["full"]))
    counts = {kind: m.learner.parameter_counts() for kind, m in made.items()}
    c = job.learner
    print(f"LoRA vs full fine-tuning, {job.model} ({counts['full']['total']:,} parameters), {c.dtype}, ZeRO-"
          f"{c.zero_stage}, {c.ranks} rank; LoRA rank {lora.rank}, alpha {lora.alpha:g}, targets "
          f"{','.join(lora.target_modules)} ({counts['lora']['trainable']:,} trainable); {len(groups) * SAMPLES} seqs "
          f"x {PROMPT + job.actors.sampling.max_new_tokens} tokens, {threads} threads, median of {steps}")
    print(f"{'':>28} {'full':>16} {'LoRA':>16} {'LoRA / full':>12}")
    rows = [("sync bytes", sync["full"][0], sync["lora"][0]),
            *((f"state: {part}", state["full"][part], state["lora"][part])
              for part in ("parameters", "gradients", "optimizer_state", "total")),
            ("preflight arithmetic", predicted["full"].total, predicted["lora"].total)]
    for name, full, lo in rows:
        print(f"{name:>28} {full:>16,} {lo:>16,} {lo / full:>12.4f}")
    print(f"{'step s':>28} {step_s['full']:>16.2f} {step_s['lora']:>16.2f} {ratio:>12.4f}  (median of per-step ratios)")
    result = {"bench": "lora", "model": job.model, "dtype": c.dtype, "zero_stage": c.zero_stage, "ranks": c.ranks,
              "lora_rank": lora.rank, "lora_alpha": lora.alpha, "lora_targets": list(lora.target_modules),
              "parameters": counts["full"]["total"], "trainable_lora": counts["lora"]["trainable"],
              "sync_bytes_full": sync["full"][0], "sync_bytes_lora": sync["lora"][0],
              "sync_bytes_ratio": round(sync["lora"][0] / sync["full"][0], 5),
              "sync_tensors_full": sync["full"][1], "sync_tensors_lora": sync["lora"][1],
              "state_bytes_full": state["full"]["total"], "state_bytes_lora": state["lora"]["total"],
              "state_bytes_ratio": round(state["lora"]["total"] / state["full"]["total"], 4),
              **{f"state_{part}_{kind}": state[kind][part] for kind in made
                 for part in ("parameters", "gradients", "optimizer_state")},
              **{f"preflight_state_bytes_{kind}": predicted[kind].total for kind in made},
              **{f"preflight_vs_measured_{kind}": round(predicted[kind].total / state[kind]["total"], 4)
                 for kind in made},
              "step_s_full": round(step_s["full"], 3), "step_s_lora": round(step_s["lora"], 3),
              "step_time_ratio": round(ratio, 4), "steps": steps, "tokens_per_step": tokens, "threads": threads}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
