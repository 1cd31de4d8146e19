"""The rollout actor process (one Ray actor): pull prompts, generate G samples per prompt with the engine and
the configured compressor, score them, publish one trajectory group per prompt; receive weights from the
learner between batches; never run further ahead of the learner than `broker.max_staleness`.

Threads: `run()` is the generation loop; `receive_weights()` runs concurrently (Ray max_concurrency) and
receives into a staging copy, which the loop swaps in at the next batch boundary.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import torch

from actors.data import load_train_prompts
from actors.engine import SamplingParams
from actors.reward import RewardScorer
from broker.prompts import take_prompt_indices
from broker.schema import SampleRecord, TrajectoryGroup
from broker.streams import PAUSED, GroupProducer, connect, key, queue_depth, read_learner_version
from broker.weight_sync import WeightReceiver
from compressors import CompressorConfig


def build_engine(engine_cfg, model_path: str, compressor: CompressorConfig, torch_threads: int):
    """The engine named by `engine_cfg.backend` (torch | sglang) on `model_path`, with `compressor`."""
    torch.set_num_threads(torch_threads)
    if engine_cfg.backend == "sglang":
        from actors.sglang_engine import SGLangEngine
        return SGLangEngine(model_path, compressor, dtype={"fp32": "float32", "bf16": "bfloat16"}[engine_cfg.dtype])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.torch_engine import TorchEngine
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[engine_cfg.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    return TorchEngine(model, AutoTokenizer.from_pretrained(model_path), compressor, device=device)


def expected_weights(engine):
    """What the weight receiver checks a manifest against: the torch engine's model itself (its names include
    tied aliases such as lm_head.weight), or the SGLang engine's (name, shape, dtype) list."""
    if hasattr(engine, "model"):
        return engine.model
    expected = [(name, shape, dtype) for name, (shape, dtype) in engine.manifest.items()]
    if engine.tied_embeddings and "lm_head.weight" not in engine.manifest:
        expected.append(("lm_head.weight", *engine.manifest["model.embed_tokens.weight"]))
    return expected


SLOW_START_ENV = "SPARSE_RL_TEST_SLOW_START"
"""Test hook: "actor-1=20,actor-3=5" delays those actors' start (before the model loads) by that many seconds,
as a large model's load would. Read from the environment the actor processes inherit from the driver."""


def slow_start_s(actor_id: str) -> float:
    """The start delay of `actor_id` from SLOW_START_ENV (0 when not named)."""
    for item in filter(None, os.environ.get(SLOW_START_ENV, "").split(",")):
        name, _, seconds = item.partition("=")
        if name.strip() == actor_id:
            return float(seconds)
    return 0.0


class RolloutWorker:
    def __init__(self, cfg: dict, run_id: str, actor_id: str):
        from deploy.config import RunConfig  # plain dict over Ray -> typed config
        from omegaconf import OmegaConf

        logging.getLogger("math_verify").setLevel(logging.ERROR)  # per-call notes about its signal timeout
        self.cfg: RunConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))
        self.run_id, self.actor_id = run_id, actor_id
        a = self.cfg.actors
        time.sleep(slow_start_s(actor_id))  # a test hook: a model that takes long to load
        self.engine = build_engine(a.engine, self.cfg.model, a.engine.compressor, a.torch_threads)
        self.tokenizer = self.engine.tokenizer
        self.prompts = load_train_prompts(a.data, self.tokenizer, seed=self.cfg.seed)
        self.reward = RewardScorer(a.reward)
        self.redis = connect(self.cfg.broker)
        self.stopping = threading.Event()
        self.producer = GroupProducer(self.redis, self.cfg.broker, run_id, stop=self.stopping)
        l = self.cfg.learner
        self.receiver = None
        self.sync_timeout = l.weight_sync_timeout_s
        self.staged: tuple[int, list] | None = None
        self.lock = threading.Lock()  # guards `staged`
        self.generating = threading.Lock()  # held while the engine generates or weights are swapped in
        self.counters = {"groups": 0, "samples": 0, "correct": 0, "wrong": 0, "unparseable": 0, "error": 0, "tokens": 0, "gen_s": 0.0,
                         "kv_peak_bytes": 0, "staleness_wait_s": 0.0,
                         "queue_wait_s": 0.0}
        self.error = ""
        self.incarnation = uuid.uuid4().hex  # new after every (re)start: the driver rebuilds the sync group
        # The loop starts with the process, so an actor restarted by Ray (max_restarts) generates again.
        self.loop = threading.Thread(target=self._run_safely, name="rollout-loop", daemon=True)
        self.loop.start()

    def ping(self) -> dict:
        """Liveness: this process's incarnation id, weight version and whether its loop is running."""
        return {"incarnation": self.incarnation, "pid": os.getpid(), "weight_version": self.engine.weight_version,
                "loop_alive": self.loop.is_alive(), "error": self.error}

    # -- weights -----------------------------------------------------------------------------------------
    def receive_weights(self, address: tuple[str, int], generation: int, rank: int, world_size: int) -> int:
        """Join sync group `generation` of the learner's store at `address` if it is new, receive one broadcast
        into a staging copy; the generation loop swaps it in at its next batch boundary. Returns the version."""
        if self.receiver is None:
            self.receiver = WeightReceiver(*address, backend=self.cfg.learner.weight_sync_backend,
                                           timeout_s=self.sync_timeout)
        if self.receiver.generation != generation:
            self.receiver.join_group(generation, rank, world_size)
        version, tensors = self.receiver.receive(expected_weights(self.engine))
        with self.lock:
            self.staged = (version, tensors)
        self._swap(wait=False)  # swapped now if the loop is not generating, else at its next batch boundary
        return version

    def _swap(self, wait: bool = True) -> None:
        """Load the staged weights, if any, between two generate calls (never during one)."""
        if not self.generating.acquire(blocking=wait):
            return
        try:
            with self.lock:
                staged, self.staged = self.staged, None
            if staged is not None:
                version, tensors = staged
                self.engine.load_weights(tensors, version)
                if self.cfg.learner.weight_sync_verify:  # per-tensor checksums of the live weights after the swap
                    self.receiver.verify(self.engine.model)
        finally:
            self.generating.release()

    # -- generation loop -----------------------------------------------------------------------------------
    def _run_safely(self) -> None:
        try:
            self.run()
        except Exception as e:  # reported through ping(); the driver replaces this actor
            import traceback
            self.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()

    def run(self) -> None:
        """Generate -> score -> publish until stop(); one batch = prompts_per_batch prompts x G samples."""
        a, b = self.cfg.actors, self.cfg.broker
        params = SamplingParams(temperature=a.sampling.temperature, max_new_tokens=a.sampling.max_new_tokens,
                                n=a.sampling.samples_per_prompt, stop_strings=list(a.sampling.stop_strings))
        while not self.stopping.is_set():
            self._swap()
            if self.redis.exists(key(self.run_id, PAUSED)):
                self.stopping.wait(0.1)
                continue
            waited = time.monotonic()
            while read_learner_version(self.redis, self.run_id) - self.engine.weight_version > b.max_staleness:
                if self.stopping.wait(0.05):  # our weights are too old: wait for the next sync round
                    return
                self._swap()
            self.counters["staleness_wait_s"] += time.monotonic() - waited
            waited = time.monotonic()
            while queue_depth(self.redis, b, self.run_id) >= b.high_watermark:  # enough groups are waiting
                if self.stopping.wait(b.backpressure_poll_s):
                    return
                self._swap()
            self.counters["queue_wait_s"] += time.monotonic() - waited
            indices = take_prompt_indices(self.redis, self.run_id, a.prompts_per_batch)
            batch = [self.prompts[i % len(self.prompts)] for i in indices]
            params.seed = self.cfg.seed * 1_000_003 + indices[-1] + 1
            start = time.monotonic()
            with self.generating:  # weights stay fixed for the whole batch
                version = self.engine.weight_version
                outputs = self.engine.generate([p.prompt_ids for p in batch], params)
            self.counters["gen_s"] += time.monotonic() - start
            groups = []
            for index, prompt, samples in zip(indices, batch, outputs):
                records = []
                for s in samples:
                    reward = self.reward(self.tokenizer.decode(s.response_ids, skip_special_tokens=True),
                                         s.response_ids, prompt)
                    if reward.status == "error" and not self.counters["error"]:
                        print(f"{self.actor_id}: reward function failed (sample scored 0): {self.reward.last_error}")
                    records.append(SampleRecord(prompt_ids=s.prompt_ids, response_ids=s.response_ids,
                                                logp_sparse=s.logp_sparse, finish_reason=s.finish_reason,
                                                reward=reward.reward, kv_retained_tokens=s.kv_retained_tokens,
                                                kv_peak_bytes=s.kv_peak_bytes))
                    self.counters["tokens"] += len(s.response_ids)
                    self.counters["samples"] += 1
                    self.counters[reward.status] += 1
                    self.counters["kv_peak_bytes"] = max(self.counters["kv_peak_bytes"], s.kv_peak_bytes)
                groups.append(TrajectoryGroup(
                    run_id=self.run_id, group_id=uuid.uuid4().hex, prompt_id=prompt.prompt_id,
                    weight_version=version, temperature=params.temperature,
                    compressor=a.engine.compressor.method, kv_budget=a.engine.compressor.kv_budget,
                    samples=records, actor_id=self.actor_id, created_at=time.time(), prompt_index=index))
            self.producer.publish_many(groups)  # one transaction for the batch
            self.counters["groups"] += len(groups)

    def stop_generation(self) -> None:
        """Finish the current batch (its groups are published), then leave the loop."""
        self.stopping.set()
        self.loop.join()
        self._swap()  # weights received during the last batch

    def stop(self) -> None:
        """Scale-down: finish the current batch, then exit this actor process."""
        self.stop_generation()
        if self.receiver is not None:
            self.receiver.close()
        import ray
        ray.actor.exit_actor()

    def metrics(self) -> dict:
        """Rollout metrics since the last call: tokens/s, groups, KV peak bytes per sequence, queue waits."""
        c, self.counters = self.counters, {k: 0 if isinstance(v, int) else 0.0 for k, v in self.counters.items()}
        return {"rollout_tokens_per_s": c["tokens"] / c["gen_s"] if c["gen_s"] else 0.0,
                "rollout_groups": float(c["groups"]),
                "accuracy": c["correct"] / c["samples"] if c["samples"] else 0.0,
                "unparseable_fraction": c["unparseable"] / c["samples"] if c["samples"] else 0.0,
                "reward_errors": float(c["error"]),
                "kv_peak_bytes_per_seq": float(c["kv_peak_bytes"]),
                "actor_staleness_wait_s": c["staleness_wait_s"], "actor_queue_wait_s": c["queue_wait_s"],
                "producer_backpressure_wait_s": float(self.producer.backpressure_wait_s)}

    # -- evaluation ------------------------------------------------------------------------------------------
    def evaluate(self, items: list, mode: str) -> dict:
        """Score this actor's weights on `items` with the run's reward, with the full cache (dense) or the run's
        compressor (sparse); see actors.evaluate. Waits for the current batch (weights stay fixed meanwhile)."""
        from actors.evaluate import evaluate
        e = self.cfg.eval
        with self.generating:
            return evaluate(self.engine, self.tokenizer, items, mode, self.cfg.actors.engine.compressor, reward=self.reward,
                            max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_p=e.top_p,
                            batch_size=e.batch_size, seed=self.cfg.seed, instruction=self.cfg.actors.data.instruction)
