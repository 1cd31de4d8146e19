"""The cost of eviction replay (docs/SPEC.md §2.4): learner step time and wire bytes, with and without.

At the main job's shape (preset smollm2-count-warm: its warm-up model, R-KV 48, 4 prompts x 4 samples of up to
176 new tokens, learner micro-batches of 8, fp32, one rank, on the CPU): one batch of real rollouts is generated
once by the torch engine with `record_evictions`, then the same groups are trained by two learners from the same
weights, one with learner.policy_target=dense (the paper's step) and one with sparse (replay), steps alternating
(order swapped each step) after one warm-up step each, every step on the same groups:

    replay_step_time_ratio = (sum of the replay steps' s) / (sum of the dense-target steps' s)   (goal <= 1.5;
        the replay step adds one no-grad dense forward per micro-batch for the mismatch metrics, and the masks);
        also the median of the per-step ratios and each step's seconds: on a shared machine one step's ratio
        swings with its neighbours' load (3 steps beside other jobs gave a median ratio of 1.65, and a ratio of
        the median step times of 1.37), the totals over interleaved steps average that out; the 1-minute load
        average before and after the steps says how shared the machine was
    wire_bytes_ratio = encoded group bytes with eviction records / without (mean over the batch's groups)

also the record's bytes per group before zlib (raw uint16) and after, and replay_logp_max_abs (exactness on the
real model). Prints a table and, as its very last line, one JSON object.

    python bench/replay.py                  # ~10 minutes on 2 cores
    python bench/replay.py --steps 2        # quicker
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402
import torch  # noqa: E402


def rollouts(cfg, model_path: str, dtype: torch.dtype = torch.float32, model=None):
    """One batch of the preset's rollouts (groups_per_step prompts x G samples) with eviction records (and, from a
    quantized cache, rounding hints), each group carrying its cache's quantizer (kv_quant); the model at `dtype` (or
    `model`, already loaded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.engines.base import SamplingParams
    from actors.engines.torch_engine import TorchEngine
    from actors.tasks.data import load_train_prompts
    from actors.tasks.reward import RewardScorer
    from broker.schema import SampleRecord, TrajectoryGroup

    tok = AutoTokenizer.from_pretrained(model_path)
    model = model or AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    engine = TorchEngine(model, tok, cfg.actors.engine.compressor, record_evictions=True)
    prompts = load_train_prompts(cfg.actors.data, tok, seed=0)[:cfg.train.groups_per_step]
    s = cfg.actors.sampling
    params = SamplingParams(temperature=s.temperature, max_new_tokens=s.max_new_tokens, n=s.samples_per_prompt,
                            stop_strings=list(s.stop_strings), seed=0)
    scorer = RewardScorer(cfg.actors.reward)
    groups = []
    for i, (prompt, samples) in enumerate(zip(prompts, engine.generate([p.prompt_ids for p in prompts], params))):
        records = [SampleRecord(np.asarray(x.prompt_ids, np.int32), np.asarray(x.response_ids, np.int32), x.logp_sparse,
                                x.finish_reason, scorer(tok.decode(x.response_ids, skip_special_tokens=True),
                                                        x.response_ids, prompt, x.finish_reason).reward,
                                x.kv_retained_tokens, x.kv_peak_bytes, eviction_steps=x.eviction_steps,
                                rounding_hints=x.rounding_hints)
                   for x in samples]
        groups.append(TrajectoryGroup(run_id="bench", group_id=f"g{i}", prompt_id=prompt.prompt_id, weight_version=0,
                                      temperature=s.temperature, compressor=cfg.actors.engine.compressor.method,
                                      kv_budget=cfg.actors.engine.compressor.kv_budget, samples=records,
                                      kv_quant=cfg.actors.engine.compressor.kv_quant().name))
    return groups


def wire(groups) -> dict:
    """Encoded bytes per group with and without the records, and the records' raw (uint16) bytes."""
    import dataclasses

    from broker.schema import encode_group
    with_rec = [len(encode_group(g)) for g in groups]
    bare = [len(encode_group(dataclasses.replace(g, samples=[dataclasses.replace(s, eviction_steps=None)
                                                             for s in g.samples]))) for g in groups]
    raw = [sum(s.eviction_steps.nbytes for s in g.samples) for g in groups]
    return {"group_bytes_with_records": float(np.mean(with_rec)), "group_bytes_without": float(np.mean(bare)),
            "record_bytes_raw_per_group": float(np.mean(raw)),
            "record_bytes_zlib_per_group": float(np.mean(with_rec) - np.mean(bare)),
            "wire_bytes_ratio": float(np.mean(with_rec) / np.mean(bare))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="smollm2-count-warm")
    p.add_argument("--steps", type=int, default=5, help="timed steps per learner after one warm-up step each")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from deploy.config import load_config
    from deploy.model_cache import resolve_model
    from learner.config import LearnerConfig
    from learner.learner import Learner

    cfg = load_config(args.config)
    model_path = resolve_model(cfg.model)
    t0 = time.monotonic()
    groups = rollouts(cfg, model_path)
    gen_s = time.monotonic() - t0
    sizes = wire(groups)
    learners = {}
    for target in ("dense", "sparse"):
        lc = LearnerConfig(**{**vars(cfg.learner), "policy_target": target, "checkpoint_dir": ""})
        learners[target] = Learner(model_path, lc)
    times = {"dense": [], "sparse": []}
    metrics = {}
    load_before = os.getloadavg()[0]
    for step in range(args.steps + 1):
        for target in (("dense", "sparse") if step % 2 == 0 else ("sparse", "dense")):
            start = time.perf_counter()
            metrics[target] = learners[target].step(groups, [0] * len(groups))
            if step > 0:   # the first step of each is a warm-up
                times[target].append(time.perf_counter() - start)
    ratios = [s / d for s, d in zip(times["sparse"], times["dense"])]
    result = {"config": args.config, "sequences": sum(len(g.samples) for g in groups), "steps": args.steps,
              "dense_step_s": statistics.median(times["dense"]), "replay_step_s": statistics.median(times["sparse"]),
              "replay_step_time_ratio": sum(times["sparse"]) / sum(times["dense"]), "goal_step_time_ratio": 1.5,
              "replay_step_time_ratio_median_of_steps": statistics.median(ratios),
              "dense_steps_s": [round(t, 2) for t in times["dense"]],
              "replay_steps_s": [round(t, 2) for t in times["sparse"]],
              "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              **sizes, "replay_logp_max_abs_first_step": None, "generate_s": round(gen_s, 1)}
    first = learners["sparse"]   # exactness of the last step is staleness > 0; re-measure on a fresh learner
    lc = LearnerConfig(**{**vars(cfg.learner), "policy_target": "sparse", "checkpoint_dir": ""})
    m = Learner(model_path, lc).step(groups, [0] * len(groups))
    del first
    result.update(replay_logp_max_abs_first_step=m["replay_logp_max_abs"],
                  replay_dense_gap_max=m["replay_dense_gap_max"],
                  accept_exact_mean=m["accept_exact_mean"], mismatch_kl=m["mismatch_kl"])
    for k, v in result.items():
        print(f"{k:34s} {v}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
