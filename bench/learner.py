"""Learner step throughput: our DeepSpeed learner next to a plain torch loop doing the same work.

Same random Llama (hidden 256, 4 layers, vocab 8192, fp32, CPU, 1 thread) and the same batch (2 groups x 4
samples, prompt 32 + response 64 tokens) for both:

    ours:     Learner.step (DeepSpeed, ZeRO stage of LearnerConfig or --zero-stage, gloo): collate, no-grad
              recompute of logp_old over micro-batches of 4, Sparse-RL correction, GRPO loss, forward/backward per
              micro-batch, gradient clipping, AdamW step, metrics
    baseline: plain torch: no-grad recompute forward over micro-batches of 4, forward/backward per
              micro-batch with a policy-gradient loss on the same tokens, clip_grad_norm_, torch AdamW step

    deepspeed_vs_plain_torch = ours tokens/s / baseline tokens/s   (tokens = prompt + response, target >= 0.9;
        ours with learner.fuse_logp_old=false, so that both do the same work)

and our on-policy step without its separate recompute (learner.fuse_logp_old, the default: logp_old from the
training forward, SPEC section 3):

    fused_vs_two_pass = fused tokens/s / ours (two-pass) tokens/s   (target >= 1.15: one forward of three
        forward-equivalents fewer, ~1.33 at best)

Steps rotate between the three (the order shifted each step) after one warm-up step each; each ratio is the
median over `--steps` of the per-step ratios (robust to load from other processes).

Then the distributed learner (deploy/learner_group.py: Ray actors, one gloo group on loopback, real Redis), on
the same model saved to a temporary directory and the same batch, ZeRO-3 fp32, 1 rank next to 2 ranks, their
steps alternating:

    zero3_state_bytes_per_rank_ratio = parameter + gradient + optimizer-state bytes held by the larger of the
        two ranks (Learner.state_bytes: measured tensor storages after the steps) / the same with 1 rank
        (target <= 0.55: ZeRO-3 shards all three)
    ranks2_vs_rank1_tokens_per_s = tokens/s of a 2-rank step / of a 1-rank step (median of per-step ratios;
        both ranks share this machine's cores, so on a 2-core CPU it does not scale; on GPUs it should)

Prints a table and, as the very last line, one JSON object.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from broker.schema import SampleRecord, TrajectoryGroup  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.learner import Learner  # noqa: E402

VOCAB, PROMPT, RESPONSE, GROUPS, G, MICRO = 8192, 32, 64, 2, 4, 4


def make_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                        max_position_embeddings=256, tie_word_embeddings=True))


def make_groups(seed: int = 0, groups: int = GROUPS, samples: int = G, prompt: int = PROMPT, response: int = RESPONSE,
                vocab: int = VOCAB, kv_budget: int = 512, finish: str = "stop") -> list[TrajectoryGroup]:
    """`groups` groups of `samples` samples (bench/lora.py reuses it): random prompt ids [prompt] per group, random
    response ids [response] per sample, logp_sparse -log(vocab) per token, rewards alternating 0 / 1 (a non-zero
    advantage)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        ids = rng.integers(0, vocab, prompt).astype(np.int32)
        records = [SampleRecord(prompt_ids=ids, response_ids=rng.integers(0, vocab, response).astype(np.int32),
                                logp_sparse=np.full(response, -np.log(vocab), np.float32), finish_reason=finish,
                                reward=float(i % 2)) for i in range(samples)]
        out.append(TrajectoryGroup("bench", f"g{g}", f"p{g}", 0, 1.0, "rkv", kv_budget, records))
    return out


def plain_torch_step(model, optimizer, ids, advantages) -> None:
    """Recompute forward (no grad) + forward/backward per micro-batch + clip + AdamW, as a PPO learner does."""
    targets = ids[:, PROMPT:]

    def logp(rows):
        logits = model(input_ids=ids[rows]).logits[:, PROMPT - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(2, targets[rows][:, :, None]).squeeze(2)

    micro = torch.arange(len(ids)).split(MICRO)
    with torch.no_grad():
        logp_old = torch.cat([logp(rows) for rows in micro])
    for rows in micro:
        ratio = (logp(rows) - logp_old[rows]).exp()
        loss = -(ratio * advantages[rows, None]).mean(1).sum() / len(ids)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="7 measured steps each")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--zero-stage", type=int, default=LearnerConfig.zero_stage)
    parser.add_argument("--no-ranks", action="store_true", help="skip the 1-vs-2-rank part")
    args = parser.parse_args()
    steps = args.steps or (7 if args.quick else 15)
    torch.set_num_threads(1)

    cfg = LearnerConfig(lr=1e-5, kl_coef=0.0, micro_batch_size=MICRO, zero_stage=args.zero_stage, dtype="fp32",
                        fuse_logp_old=False)
    learner = Learner(make_model(), cfg)
    fused = Learner(make_model(), dataclasses.replace(cfg, fuse_logp_old=True))
    plain = make_model()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-5, betas=cfg.betas, weight_decay=cfg.weight_decay)
    groups = make_groups()
    ids = torch.tensor(np.stack([np.concatenate([s.prompt_ids, s.response_ids]) for g in groups for s in g.samples]),
                       dtype=torch.long)
    advantages = torch.tensor([1.0, -1.0] * (len(ids) // 2))
    tokens = ids.numel()
    run = {"ours": lambda: learner.step(groups, staleness=[0] * len(groups)),
           "fused": lambda: fused.step(groups, staleness=[0] * len(groups)),
           "plain": lambda: plain_torch_step(plain, optimizer, ids, advantages)}

    times = {who: [] for who in run}
    for step in range(steps + 1):          # step 0 warms up; the order rotates against drifting load
        order = list(run)[step % 3:] + list(run)[:step % 3]
        for who in order:
            t0 = time.perf_counter()
            run[who]()
            if step:
                times[who].append(time.perf_counter() - t0)
    tps = {who: tokens / statistics.median(t) for who, t in times.items()}
    ratio = statistics.median(p / o for p, o in zip(times["plain"], times["ours"]))
    fused_ratio = statistics.median(o / f for o, f in zip(times["ours"], times["fused"]))
    fused_on = fused.fusable(fused.collate(groups)) and not learner.fusable(learner.collate(groups))
    print(f"learner step, Llama h256 x4 layers vocab {VOCAB}, {len(ids)} seqs x {PROMPT + RESPONSE} tokens, fp32, "
          f"1 thread, median of {steps}")
    print(f"{'':>30} {'tokens/s':>10}")
    print(f"{f'ours (ZeRO-{args.zero_stage}), two-pass':>30} {tps['ours']:>10.1f}")
    print(f"{'ours, fused logp_old' + ('' if fused_on else ' (not fusable)'):>30} {tps['fused']:>10.1f}")
    print(f"{'plain torch':>30} {tps['plain']:>10.1f}")
    result = {"bench": "learner", "zero_stage": args.zero_stage, "tokens_per_step": tokens,
              "ours_tokens_per_s": round(tps["ours"], 2), "plain_torch_tokens_per_s": round(tps["plain"], 2),
              "deepspeed_vs_plain_torch": round(ratio, 4), "target": 0.9,
              "fused_tokens_per_s": round(tps["fused"], 2), "fused": fused_on,
              "fused_vs_two_pass": round(fused_ratio, 4), "fused_target": 1.15}
    if not args.no_ranks:
        result.update(compare_ranks(groups, steps, tokens))
    print(json.dumps(result))


def compare_ranks(groups: list[TrajectoryGroup], steps: int, tokens: int) -> dict:
    """ZeRO-3 learner groups of 1 and 2 ranks (real Ray actors, gloo) on the same model and batch: state bytes
    per rank and step throughput, measured in the same run (see the module doc)."""
    import tempfile
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from broker.redis_server import LocalRedis
    from deploy.config import load_config
    from deploy.learner_group import LearnerGroup

    with tempfile.TemporaryDirectory() as tmp, LocalRedis() as redis:
        make_model().save_pretrained(tmp)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        made = {}
        try:
            for n in (1, 2):
                cfg = load_config("tiny", [f"model={tmp}", f"run_dir={tmp}", f"broker.url={redis.url}",
                                           f"learner.ranks={n}", "learner.zero_stage=3", "learner.dtype=fp32",
                                           "learner.lr=1e-5", "learner.kl_coef=0", f"learner.micro_batch_size={MICRO}",
                                           "train.learner_num_cpus=1"])
                made[n] = LearnerGroup(cfg, f"bench-ranks{n}")
            times = {1: [], 2: []}
            for step in range(steps + 1):          # step 0 warms up; the order alternates against drifting load
                for n in ((1, 2) if step % 2 else (2, 1)):
                    t0 = time.perf_counter()
                    ray.get(made[n].rank0.step_groups.remote(groups, [0] * len(groups)))
                    if step:
                        times[n].append(time.perf_counter() - t0)
            state = {n: [ray.get(r.state_bytes.remote()) for r in made[n].ranks] for n in (1, 2)}
        finally:
            for group in made.values():
                group.shutdown()
            ray.shutdown()
    one = state[1][0]["total"]
    per_rank = max(s["total"] for s in state[2])
    speed = statistics.median(a / b for a, b in zip(times[1], times[2]))
    two = " / ".join(f"{s['total'] / 2**20:.1f}" for s in state[2])
    print(f"ZeRO-3 fp32, state bytes per rank (parameters + gradients + optimizer state): "
          f"1 rank {one / 2**20:.1f} MiB, "
          f"2 ranks {two} MiB")
    print(f"step tokens/s: 1 rank {tokens / statistics.median(times[1]):.1f}, "
          f"2 ranks {tokens / statistics.median(times[2]):.1f}")
    return {"zero3_state_bytes_rank1": one, "zero3_state_bytes_per_rank_ranks2": per_rank,
            "zero3_state_bytes_per_rank_ratio": round(per_rank / one, 4), "zero3_state_bytes_target": 0.55,
            "rank1_tokens_per_s": round(tokens / statistics.median(times[1]), 2),
            "ranks2_tokens_per_s": round(tokens / statistics.median(times[2]), 2),
            "ranks2_vs_rank1_tokens_per_s": round(speed, 4)}


if __name__ == "__main__":
    main()
