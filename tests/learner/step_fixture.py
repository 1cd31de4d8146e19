"""Recorded trajectory groups and the learner step's recorded outputs (tests/learner/step_fixture.json).

The groups were generated once by the torch engine (tiny-char, R-KV, budget 24) on the tiny-learn task and
the outputs recorded by the learner step of the code before learner/step.py (`LearnerWorker.train_step` at
commit 24f6eac, in-process, one rank; re-recorded at 5644f15, the main this refactor landed on: the same outputs
but the timings; when the budget controller took its window (docs/SPEC.md §5.1) the three budget-log `reason`
strings were edited by hand to the controller's
new wording: its decisions on these steps, hold / raise / raise, are unchanged; the `logp_old_fused` key, 0 on every
step since kl_coef 0.05 keeps the separate recompute, was added by hand with `learner.fuse_logp_old`, and so was
`kv_protected_fraction`, 0 on every step (R-KV protects nothing), with compressor protection);
`python -m tests.learner.step_fixture` regenerates the groups and re-records the outputs with the current step protocol
(only on purpose: the test compares the current code with the recording).

Scenario (3 steps, train.groups_per_step 2, filter_groups zero_variance, budget_control mismatch, kl_coef 0.05,
checkpoints every 2 versions): before each step, the step's groups are published under one admission claim
made with their weight version; step 1 has a zero-variance group (filtered), step 3 trains groups one version
stale.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from broker.admission import Admission
from broker.schema import SampleRecord, TrajectoryGroup
from broker.streams import GroupProducer

FIXTURE = Path(__file__).with_name("step_fixture.json")
RUN_ID = "step-fixture"
OVERRIDES = ["actors.sampling.samples_per_prompt=4", "actors.sampling.max_new_tokens=12", "actors.data.size=16",
             "train.groups_per_step=2", "train.steps=4", "learner.filter_groups=zero_variance",
             "learner.micro_batch_size=4", "learner.kl_coef=0.05", "learner.checkpoint_interval=2",
             "actors.engine.compressor.budget_control=mismatch", "actors.engine.compressor.kv_budget_min=16",
             "actors.engine.compressor.kv_budget_max=32", "train.group_wait_s=60"]
"""Dotted overrides of the tiny-learn preset (plus learner.checkpoint_dir, a temporary directory)."""
PLAN = [(0, 3), (1, 3), (1, 2)]
"""(weight version, groups) published before each step."""
TIMING = {"learner_wait_s", "learner_idle_fraction", "learner_idle_fraction_run", "learner_step_s",
          "learner_tokens_per_s"}
"""Report entries that measure time: not compared."""


def group_to_dict(g: TrajectoryGroup) -> dict:
    d = {k: v for k, v in vars(g).items() if k != "samples"}
    d["samples"] = [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in vars(s).items()}
                    for s in g.samples]
    return d


def group_from_dict(d: dict) -> TrajectoryGroup:
    samples = [SampleRecord(prompt_ids=np.asarray(s["prompt_ids"], np.int32),
                            response_ids=np.asarray(s["response_ids"], np.int32),
                            logp_sparse=np.asarray(s["logp_sparse"], np.float32),
                            **{k: v for k, v in s.items() if k not in ("prompt_ids", "response_ids", "logp_sparse")})
               for s in d["samples"]]
    return TrajectoryGroup(**{**{k: v for k, v in d.items() if k != "samples"}, "samples": samples})


def publish_claimed(client, broker_cfg, groups: list[TrajectoryGroup], weight_version: int) -> None:
    """Publish `groups` under one admission claim made with `weight_version` (as an actor batch is)."""
    admission = Admission(client, broker_cfg, RUN_ID)
    claim, why = admission.claim(weight_version, len(groups))
    assert claim is not None and claim.groups == len(groups), why
    GroupProducer(client, broker_cfg, RUN_ID, admission=admission).publish_many(groups, claim=claim)


def comparable(report: dict) -> dict:
    """The report's entries that do not measure time."""
    return {k: v for k, v in report.items() if k not in TIMING}


def load() -> dict:
    return json.loads(FIXTURE.read_text())


def _generate_groups(cfg) -> list[list[TrajectoryGroup]]:
    """The fixture's groups, made by the torch engine from the preset's model and task."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.engines.base import SamplingParams
    from actors.engines.torch_engine import TorchEngine
    from actors.tasks.data import load_train_prompts
    from actors.tasks.reward import RewardScorer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(cfg.model)
    engine = TorchEngine(AutoModelForCausalLM.from_pretrained(cfg.model).eval(), tok, cfg.actors.engine.compressor)
    prompts = load_train_prompts(cfg.actors.data, tok, seed=cfg.seed)
    scorer, s = RewardScorer(cfg.actors.reward), cfg.actors.sampling
    out, index = [], 0
    for step, (version, n) in enumerate(PLAN):
        params = SamplingParams(temperature=s.temperature, max_new_tokens=s.max_new_tokens, n=s.samples_per_prompt,
                                seed=1000 + step)
        batch = prompts[index:index + n]
        groups = []
        for i, (prompt, samples) in enumerate(zip(batch, engine.generate([p.prompt_ids for p in batch], params))):
            records = [SampleRecord(np.asarray(x.prompt_ids, np.int32), np.asarray(x.response_ids, np.int32),
                                    x.logp_sparse, x.finish_reason,
                                    scorer(tok.decode(x.response_ids, skip_special_tokens=True), x.response_ids,
                                           prompt).reward, x.kv_retained_tokens, x.kv_peak_bytes)
                       for x in samples]
            if step == 0 and i == 1:  # a zero-variance group: filtered by dynamic sampling
                for r in records:
                    r.reward = 0.5
            groups.append(TrajectoryGroup(run_id=RUN_ID, group_id=f"s{step}g{i}", prompt_id=prompt.prompt_id,
                                          weight_version=version, temperature=s.temperature,
                                          compressor=cfg.actors.engine.compressor.method,
                                          kv_budget=cfg.actors.engine.compressor.kv_budget, samples=records,
                                          actor_id="actor-0", created_at=1.0, prompt_index=index + i))
        out.append(groups)
        index += n
    return out


def _record(ckpt_dir: str) -> dict:
    """Generate the groups and record the current step protocol's outputs (the test's expectations)."""
    from broker import run_state as rs
    from broker.redis_server import LocalRedis
    from broker.streams import connect, queue_depth
    from deploy.config import load_config
    from deploy.model_cache import resolve_model
    from learner.learner import Learner
    from learner.step import LearnerStep, OneRank, Resume, StepConfig

    cfg = load_config("tiny-learn", OVERRIDES + [f"learner.checkpoint_dir={ckpt_dir}"])
    cfg.model = resolve_model(cfg.model)
    groups, steps = _generate_groups(cfg), []
    with LocalRedis() as server:
        cfg.broker.url = server.url
        learner = Learner(cfg.model, cfg.learner)
        protocol, client = LearnerStep(StepConfig.of_run(cfg), RUN_ID, learner, Resume()), connect(cfg.broker)
        for (version, _), gs in zip(PLAN, groups):
            publish_claimed(client, cfg.broker, gs, version)
            report = protocol.train_step(OneRank(learner, ckpt_dir))
            steps.append({"report": {**report.as_metrics(), "trained_prompt_ids": report.trained_prompt_ids},
                          "counts": rs.run_counts(client, RUN_ID),
                          "queue_depth": queue_depth(client, cfg.broker, RUN_ID),
                          "kv_budget": rs.read_kv_budget(client, RUN_ID, -1),
                          "learner_version": rs.read_learner_version(client, RUN_ID),
                          "step_capacity": int(client.get(rs.key(RUN_ID, rs.ADMISSION_STEP_CAPACITY))),
                          "budget_log": [json.loads(x) for x in rs.read_budget_log(client, RUN_ID)],
                          "trained_ids": list(protocol.trained_ids), "position": protocol.position.to_dict()})
    return {"recorded_with": "learner.step.LearnerStep.train_step",
            "groups": [[group_to_dict(g) for g in gs] for gs in groups], "steps": steps}


if __name__ == "__main__":  # re-record on purpose only: the test compares the code with this recording
    import tempfile

    import torch

    torch.set_num_threads(1)
    FIXTURE.write_text(json.dumps(_record(tempfile.mkdtemp()), indent=0, sort_keys=True))
