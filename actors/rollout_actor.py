"""The rollout actor process (one Ray actor): pull prompts, generate G samples per prompt with the engine and
the configured compressor, score them, publish one trajectory group per prompt; receive weights from the
learner between batches; never run further ahead of the learner than `broker.max_staleness`: with
`broker.admission` (default) a batch is generated only after it was claimed in Redis (broker/admission.py),
so every group it makes can still be trained in time.

Threads: `run()` is the generation loop; `receive_weights()` runs concurrently (Ray max_concurrency) and
receives into a staging copy, which the loop swaps in at the next batch boundary; a heartbeat thread keeps the
current claim alive while the batch is generated. If Python exits while the loop still runs, the process ends
at once (end_at_exit_while_running).
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field

import ray
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.engines.base import SamplingParams
from actors.engines.torch_engine import TorchEngine
from actors.envs.env import ENV_FAILURES, EnvPool
from actors.envs.episode import EpisodeSample, run_episodes
from actors.envs.turns import ChatTemplate
from actors.evaluate import evaluate_run
from actors.rollout_config import RolloutConfig
from actors.tasks.data import load_train_prompts
from actors.tasks.reward import RewardResult, RewardScorer
from broker import faults
from broker import run_state as rs
from broker.admission import Admission, Claim, ClaimExpired
from broker.fingerprint import fingerprinted, probe
from broker.lora import LoraConfig
from broker.schema import SampleRecord, TrajectoryGroup
from broker.streams import GroupProducer, connect, queue_depth
from broker.weight_sync import WeightReceiver
from compressors import CompressorConfig
from compressors.budget import scheduled_budget, tier_budget, tier_of

MAX_FINGERPRINTS = 16
"""Weight-sync fingerprints an actor keeps until the driver reads them (it reads them after every sync round)."""


def build_engine(engine_cfg, model_path: str, compressor: CompressorConfig, torch_threads: int,
                 record_evictions: bool = False, lora: LoraConfig | None = None):
    """The engine named by `engine_cfg.backend` (torch | sglang) on `model_path`, with `compressor` (SGLang: and
    `engine_cfg.sglang`'s settings);
    `record_evictions`: every sample carries its eviction record (both engines: the SGLang engine's `sparse_rl_kv`
    backend records it as the torch engine does, actors/engines/sglang/records.py); `lora`: the run's learner.lora
    (both engines hold the learner's adapter: the torch engine in its peft layers, SGLang in its LoRA manager)."""
    torch.set_num_threads(torch_threads)
    if engine_cfg.backend == "sglang":
        from actors.engines.sglang.engine import SGLangEngine  # optional: SGLang is installed on GPU machines only
        return SGLangEngine(model_path, compressor, dtype={"fp32": "float32", "bf16": "bfloat16"}[engine_cfg.dtype],
                            record_evictions=record_evictions, lora=lora, **engine_cfg.sglang.kwargs())
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[engine_cfg.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    return TorchEngine(model, AutoTokenizer.from_pretrained(model_path), compressor, device=device,
                       record_evictions=record_evictions, lora=lora)


def end_at_exit_while_running(thread: threading.Thread) -> None:
    """Register an interpreter-exit hook: if `thread` (a daemon thread) still runs when Python exits, flush
    stdout and stderr and end the process at once with status 0, without finalizing the interpreter.

    Ray ends an actor gracefully by exiting Python: when its last handle is dropped (a `ray.kill` whose handle
    goes out of scope before the kill lands takes this path) or when its job ends. Finalizing kills a daemon
    thread when it next takes the GIL; one returning from a torch op then unwinds through C++ frames and the
    process aborts (std::terminate, a native stack trace in the run's console). atexit hooks run before that
    point (CPython's Py_FinalizeEx: non-daemon threads joined, atexit hooks, then the finalizing flag). A thread
    that has ended leaves the exit as it was (a scale-down joins the loop before `exit_actor`)."""
    def hook() -> None:
        if thread.is_alive():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    atexit.register(hook)


def episode_reward(s: EpisodeSample, truncated: float | None) -> RewardResult:
    """A finished episode's reward: the environment's (`truncated` instead where set and the episode ended on
    its length limit), status correct | wrong; an episode its environment failed (s.finish error, timeout or lost)
    scores 0 with status env_error, counted in env_* (ENV_FAILURES), never in reward_errors: no reward function
    ran."""
    if s.finish in ENV_FAILURES:
        return RewardResult(0.0, "env_error", "")
    reward = truncated if truncated is not None and s.finish_reason == "length" else s.reward
    return RewardResult(float(reward), "correct" if reward >= 1 else "wrong", "")


def group_counts(samples: list, statuses: list[str]) -> dict[str, int]:
    """One published group's additions to the run's actor_counts (broker/run_state.py): rollout_groups 1,
    reward_errors (samples whose reward function failed: status error), and for multi-turn episodes the
    environment's failures by kind (env_errors, env_timeouts, env_lost; MLflow rollout/<name>)."""
    counts = {"rollout_groups": 1, "reward_errors": sum(status == "error" for status in statuses)}
    if samples and isinstance(samples[0], EpisodeSample):
        counts.update({name: sum(s.finish == kind for s in samples) for kind, name in ENV_FAILURES.items()})
    return counts


@dataclass
class Batch:
    """One actor batch from its claim to its publish: the claim (None without admission), the weight version it
    is generated with, its prompt indices and prompts; then each prompt's KV budget and tier, and the samples."""
    claim: Claim | None
    version: int
    indices: list[int]
    prompts: list
    budgets: list[int] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    outputs: list = field(default_factory=list)
    counts: list[dict[str, int]] = field(default_factory=list)
    """Per group: the run counters its publish adds (run_state.add_actor_counts)."""


class RolloutWorker:
    def __init__(self, cfg: dict, run_id: str, actor_id: str):
        logging.getLogger("math_verify").setLevel(logging.ERROR)  # per-call notes about its signal timeout
        self.cfg: RolloutConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RolloutConfig), cfg))
        self.run_id, self.actor_id = run_id, actor_id
        a = self.cfg.actors
        self.redis = connect(self.cfg.broker)
        self.phase = rs.PhaseBoard(self.redis, run_id, actor_id)  # what this actor does, for the driver's console
        self.phase("loading")
        # a test's SPARSE_RL_FAULTS may make this actor slow to start, fail, or slow in every batch (broker/faults.py)
        self.engine = faults.wrap(build_engine, "actor.start", actor_id)(a.engine, self.cfg.model, a.engine.compressor,
                                                                        a.torch_threads, self.cfg.record_evictions,
                                                                        self.cfg.lora)
        self.engine_generate = faults.wrap(self.engine.generate, "actor.generate", actor_id,
                                           when=lambda: self.engine.weight_version)
        self.published = faults.wrap(lambda: None, "actor.published", actor_id, when=lambda: self.engine.weight_version)
        self.stopping_fault = faults.wrap(lambda: None, "actor.stop", actor_id)   # in stop_generation
        self.loading = -1   # the weight version being swapped in (_swap), the actor.load_weights fault's `when`
        self.load_weights = faults.wrap(self.engine.load_weights, "actor.load_weights", actor_id,
                                        when=lambda: self.loading, stale=self._stale_load)
        # the weight-sync fingerprint (broker/fingerprint.py): the probe this engine scores after every swap, and the
        # (version, log-probs) of each swap until the driver reads them (fingerprints)
        tokens = self.cfg.fingerprint_tokens
        self.probe = probe(self.engine.vocab_size, tokens) if tokens else None
        self.scored: list[tuple[int, list]] = []
        self.tokenizer = self.engine.tokenizer
        self.prompts = load_train_prompts(a.data, self.tokenizer, seed=self.cfg.seed)
        self.reward = RewardScorer(a.reward)
        self.envs = EnvPool(a.env) if a.env.factory else None   # multi-turn: the environments' worker process
        self.template = ChatTemplate.build(self.tokenizer) if self.envs is not None else None
        self.stopping = threading.Event()
        self.admission = None
        if self.cfg.broker.admission:
            self.admission = Admission(self.redis, self.cfg.broker, run_id)
        self.producer = GroupProducer(self.redis, self.cfg.broker, run_id, stop=self.stopping,
                                      admission=self.admission)
        self.claim = None  # the claim of the batch being generated; kept alive by the heartbeat thread
        self.receiver = None
        self.sync_timeout = self.cfg.weight_sync_timeout_s
        self.staged: tuple[int, list] | None = None
        self.lock = threading.Lock()  # guards `staged`
        self.generating = threading.Lock()  # held while the engine generates or weights are swapped in
        self.counters = {"samples": 0, "correct": 0, "wrong": 0, "unparseable": 0, "error": 0, "env_error": 0,
                         "tokens": 0, "gen_s": 0.0,
                         "kv_peak_bytes": 0, "staleness_wait_s": 0.0,
                         "queue_wait_s": 0.0, "admission_wait_s": 0.0, "busy_s": 0.0,
                         "kv_budget_sum": 0, "batches": 0, "episodes": 0, "turns": 0, "tool_calls": 0,
                         "env_tokens": 0, "response_tokens": 0}
        self.turn_kv: dict[int, list[int]] = {}  # multi-turn: turn -> [KV bytes sum, episodes] since metrics()
        self.busy_since: float | None = None  # monotonic start of the batch in progress (claim to publish)
        self.metrics_since = time.monotonic()
        self.tier_counters: dict[str, list[float]] = {}  # tier -> [groups, budget sum, reward sum, samples]
        self.error = ""
        self.closed = False  # close() ran: the engine and the workers are gone
        self.incarnation = uuid.uuid4().hex  # new after every (re)start: the driver rebuilds the sync group
        # The loop starts with the process, so an actor restarted by Ray (max_restarts) generates again.
        self.loop = threading.Thread(target=self._run_safely, name="rollout-loop", daemon=True)
        self.loop.start()
        end_at_exit_while_running(self.loop)
        if self.admission is not None:
            threading.Thread(target=self._heartbeat, name="claim-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        """Refresh the current claim every third of broker.claim_ttl_s (ends with the process: a killed actor's
        claim expires and its groups return to the pool)."""
        while True:
            time.sleep(self.cfg.broker.claim_ttl_s / 3)
            claim = self.claim
            if claim is not None:
                try:
                    self.admission.heartbeat(claim)
                except Exception as e:  # a Redis hiccup: the next beat retries; the claim lasts claim_ttl_s
                    print(f"{self.actor_id}: claim heartbeat failed: {type(e).__name__}: {e}")

    def ping(self) -> dict:
        """Liveness: this process's incarnation id, weight version, whether its loop is running and whether it
        holds an admission claim (is in the middle of a batch)."""
        return {"incarnation": self.incarnation, "pid": os.getpid(), "weight_version": self.engine.weight_version,
                "loop_alive": self.loop.is_alive(), "error": self.error, "in_batch": self.claim is not None}

    # -- weights -----------------------------------------------------------------------------------------
    def receive_weights(self, address: tuple[str, int], generation: int, rank: int, world_size: int) -> int:
        """Join sync group `generation` of the learner's store at `address` if it is new, receive one broadcast
        into a staging copy; the generation loop swaps it in at its next batch boundary. Returns the version."""
        if self.receiver is None:
            self.receiver = WeightReceiver(*address, backend=self.cfg.weight_sync_backend,
                                           timeout_s=self.sync_timeout)
        if self.receiver.generation != generation:
            self.receiver.join_group(generation, rank, world_size)
        version, tensors = self.receiver.receive(self.engine.expected_weights(), adapter=self.cfg.lora.enabled)
        with self.lock:
            self.staged = (version, tensors)
        self._swap(wait=False)  # swapped now if the loop is not generating, else at its next batch boundary
        return version

    def _swap(self, wait: bool = True) -> None:
        """Load the staged weights, if any, between two generate calls (never during one); then, with the weight-sync
        fingerprint on and a version it fingerprints (learner.weight_sync_fingerprint_every), score its probe with the
        engine as it now is."""
        if not self.generating.acquire(blocking=wait):
            return
        try:
            with self.lock:
                staged, self.staged = self.staged, None
            if staged is not None:
                version, tensors = staged
                self.loading = version
                self.load_weights(tensors, version)
                if self.cfg.weight_sync_verify:  # per-tensor checksums of the live weights after the swap
                    self.receiver.verify(self.engine.model)
                if self.probe is not None and fingerprinted(version, self.cfg.fingerprint_every):
                    logps = self.engine.score(self.probe)
                    with self.lock:
                        self.scored = [*self.scored[-(MAX_FINGERPRINTS - 1):], (version, logps)]
        finally:
            self.generating.release()

    def _stale_load(self, named_tensors, version: int) -> None:
        """The actor.load_weights fault `stale` (broker/faults.py): the engine reports `version` and keeps its old
        weights, a weight sync that never reached the engine."""
        self.engine.weight_version = version

    def fingerprints(self) -> list[tuple[int, list]]:
        """The weight-sync fingerprints since the last call, oldest first (at most MAX_FINGERPRINTS): (the version
        swapped in, the engine's log-probs of the probe right after: per sequence float32 [tokens - 1]), for the
        driver to compare with the learner's of that version (deploy/actor_pool.py check_fingerprints)."""
        with self.lock:
            scored, self.scored = self.scored, []
        return scored

    # -- generation loop -----------------------------------------------------------------------------------
    def _run_safely(self) -> None:
        try:
            self.run()
        except Exception as e:  # reported through ping(); the driver replaces this actor
            self.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            self.close()  # e.g. a failed SGLang scheduler: what is left of the engine ends now, in order
        self.phase("stopped")

    def run(self) -> None:
        """The generation loop until stop(), one batch (prompts_per_batch prompts x G samples) per turn:
        wait_turn -> claim -> generate -> score -> publish; each phase recorded for the console (PhaseBoard)."""
        a = self.cfg.actors
        params = a.sampling.sampling_params()
        while not self.stopping.is_set():
            if not self._wait_turn():
                continue
            with self.generating:  # weights stay fixed from the claim to the end of the batch
                batch = self._claim()
                if batch is not None:
                    self.phase("generating")
                    self._generate(batch, params)
            if batch is None:  # not admitted: wait outside the lock (weights may be swapped in meanwhile)
                self.phase("waiting for a claim")
                waited = time.monotonic()
                self.stopping.wait(self.cfg.broker.backpressure_poll_s)
                self.counters["admission_wait_s"] += time.monotonic() - waited
                continue
            self.phase("scoring")
            groups = self._score(batch, params)
            self.phase("publishing")
            self._publish(batch, groups)

    def _wait_turn(self) -> bool:
        """Wait until this actor may start a batch: generation not paused, its weights within max_staleness of
        the learner's (new weights are swapped in meanwhile), the queue below the high watermark. False when
        it should look again (paused, or stopping)."""
        b = self.cfg.broker
        self._swap()
        if rs.is_paused(self.redis, self.run_id):
            self.phase("paused")
            self.stopping.wait(0.1)
            return False
        waited = time.monotonic()
        while rs.read_learner_version(self.redis, self.run_id) - self.engine.weight_version > b.max_staleness:
            self.phase("waiting for weights")
            if self.stopping.wait(0.05):  # our weights are too old: wait for the next sync round
                return False
            self._swap()
        self.counters["staleness_wait_s"] += time.monotonic() - waited
        waited = time.monotonic()
        while queue_depth(self.redis, b, self.run_id) >= b.high_watermark:  # enough groups are waiting
            self.phase("waiting for queue space")
            if self.stopping.wait(b.backpressure_poll_s):
                return False
            self._swap()
        self.counters["queue_wait_s"] += time.monotonic() - waited
        return True

    def _claim(self) -> "Batch | None":
        """Claim the batch's groups (admission; refused: "full" | "stale" | "done") with the current weights
        and take its prompt indices. None when not admitted."""
        a, version, claim = self.cfg.actors, self.engine.weight_version, None
        if self.admission is not None:
            claim, _why = self.admission.claim(version, a.prompts_per_batch)
            if claim is None:
                return None
        n = claim.groups if claim is not None else a.prompts_per_batch
        self.claim, self.busy_since = claim, time.monotonic()
        indices = self.admission.take_prompts(claim) if claim is not None else \
            rs.take_prompt_indices(self.redis, self.run_id, n)  # a claim's come back if it is lost
        return Batch(claim, version, indices, [self.prompts[i % len(self.prompts)] for i in indices])

    def _generate(self, batch: "Batch", params: SamplingParams) -> None:
        """The engine's samples for the batch's prompts, with their KV budgets (after the weight version: see
        batch_budgets); a failure gives the claim's groups back to the pool."""
        params.seed = self.cfg.seed * 1_000_003 + batch.indices[-1] + 1
        start = time.monotonic()
        try:
            batch.budgets, batch.tiers = self.batch_budgets(batch.prompts, batch.version)
            budgets = batch.budgets if self.budget_varies else None
            if self.envs is not None:   # multi-turn: every sample an episode of the environment (envs/episode.py)
                batch.outputs = run_episodes(self.engine_generate, self.envs, self.template, batch.prompts, params,
                                             kv_budgets=budgets, batch_key=f"{batch.indices[0]}-",
                                             # kept caches: torch, sparse SGLang
                                             release=getattr(self.engine, "release_episodes", None))
            else:
                batch.outputs = self.engine_generate([p.prompt_ids for p in batch.prompts], params, kv_budgets=budgets)
        except BaseException:  # any failure, Ctrl-C included: the claim's groups go back to the pool, then re-raise
            if batch.claim is not None:
                self.claim = None
                self.admission.release(batch.claim)
            raise
        self.counters["gen_s"] += time.monotonic() - start
        self.counters["kv_budget_sum"] += sum(batch.budgets) / len(batch.budgets)
        self.counters["batches"] += 1

    def _score(self, batch: "Batch", params: SamplingParams) -> list[TrajectoryGroup]:
        """Reward every sample; one trajectory group per prompt (and, with tiers, the prompts' confidences)."""
        a = self.cfg.actors
        groups, confidences = [], {}
        for index, prompt, samples, budget, tier in zip(batch.indices, batch.prompts, batch.outputs, batch.budgets,
                                                        batch.tiers):
            scored = [self._record(s, prompt) for s in samples]
            records = [record for record, _ in scored]
            batch.counts.append({**group_counts(samples, [status for _, status in scored]),
                                 **({f"tier/{tier}/groups": 1} if tier else {})})
            groups.append(TrajectoryGroup(
                run_id=self.run_id, group_id=uuid.uuid4().hex, prompt_id=prompt.prompt_id,
                weight_version=batch.version, temperature=params.temperature, compressor=a.engine.compressor.method,
                kv_budget=budget, samples=records, actor_id=self.actor_id, created_at=time.time(), budget_tier=tier,
                prompt_index=index, kv_quant=a.engine.compressor.kv_quant().name))
            mean_reward = sum(r.reward for r in records) / len(records)
            confidences[prompt.prompt_id] = min(1.0, max(0.0, mean_reward))
            if tier:
                t = self.tier_counters.setdefault(tier, [0, 0.0, 0.0, 0])
                t[0], t[1], t[2], t[3] = t[0] + 1, t[1] + budget, t[2] + mean_reward * len(records), t[3] + len(records)
        if a.engine.compressor.budget_tiers != "off":
            rs.write_confidences(self.redis, self.run_id, confidences)
        return groups

    def _episode_reward(self, s: EpisodeSample) -> RewardResult:
        """A finished episode's reward as a RewardResult (the environment's; reward.truncated on a length cut),
        and its statistics counted."""
        c = self.counters
        c["episodes"], c["turns"], c["tool_calls"] = (c["episodes"] + 1, c["turns"] + s.turns,
                                                      c["tool_calls"] + s.tool_calls)
        c["env_tokens"], c["response_tokens"] = (c["env_tokens"] + s.obs_tokens,
                                                 c["response_tokens"] + len(s.response_ids))
        for k, nbytes in enumerate(s.turn_kv_bytes, 1):
            acc = self.turn_kv.setdefault(k, [0, 0])
            acc[0], acc[1] = acc[0] + nbytes, acc[1] + 1
        result = episode_reward(s, self.cfg.actors.reward.truncated)
        if result.status == "env_error" and not self.counters["env_error"]:
            print(f"{self.actor_id}: {self.envs.last_error}")
        return result

    def _record(self, s, prompt) -> tuple[SampleRecord, str]:
        """One scored sample (counted in the rollout metrics) and its reward status (correct | wrong |
        unparseable | error, or env_error: an episode its environment failed); a multi-turn episode brings its
        environment's reward."""
        timeouts = self.reward.timeouts
        if isinstance(s, EpisodeSample):
            reward = self._episode_reward(s)
        else:
            reward = self.reward(self.tokenizer.decode(s.response_ids, skip_special_tokens=True), s.response_ids,
                                 prompt, s.finish_reason)
        if self.reward.timeouts > timeouts:  # a timeout: said once per actor (each one is counted in reward_errors)
            if not timeouts:
                print(f"{self.actor_id}: {self.reward.last_error}; later timeouts are counted, not printed")
        elif reward.status == "error" and not self.counters["error"]:
            print(f"{self.actor_id}: reward function failed (sample scored 0): {self.reward.last_error}")
        self.counters["tokens"] += len(s.response_ids)
        self.counters["samples"] += 1
        self.counters[reward.status] += 1
        self.counters["kv_peak_bytes"] = max(self.counters["kv_peak_bytes"], s.kv_peak_bytes)
        return SampleRecord(prompt_ids=s.prompt_ids, response_ids=s.response_ids, logp_sparse=s.logp_sparse,
                            finish_reason=s.finish_reason, reward=reward.reward,
                            kv_retained_tokens=s.kv_retained_tokens, kv_peak_bytes=s.kv_peak_bytes,
                            kv_protected_fraction=s.kv_protected_fraction, topk_ids=s.topk_ids,
                            topk_logprobs=s.topk_logprobs, trainable=s.trainable,
                            eviction_steps=getattr(s, "eviction_steps", None),
                            rounding_hints=getattr(s, "rounding_hints", None)), reward.status

    def _publish(self, batch: "Batch", groups: list[TrajectoryGroup]) -> None:
        """Publish the batch's groups in one transaction under its claim (refused when the claim expired), with
        their counts (groups, reward errors, tiers) added to the run's actor_counts in the same transaction."""
        try:
            self.producer.publish_many(groups, claim=batch.claim, counts=batch.counts)
        except ClaimExpired as e:  # this process stalled longer than broker.claim_ttl_s
            print(f"{self.actor_id}: {e}")
            rs.add_actor_counts(self.redis, self.run_id, {"claims_lost": 1})
        self.claim = None
        self._count_busy()
        self.busy_since = None
        self.published()  # a test's fault (broker/faults.py): e.g. dies between two learner steps

    @property
    def budget_varies(self) -> bool:
        """Whether the budget can differ from compressor.kv_budget (schedule, controller or tiers)."""
        c = self.cfg.actors.engine.compressor
        return c.budget_schedule != "constant" or c.budget_control != "off" or c.budget_tiers != "off"

    def batch_budgets(self, batch: list, version: int) -> tuple[list[int], list[str]]:
        """(KV budget in tokens, tier name or "") of each prompt of the batch, for weights `version`.

        Base budget: the learner's controlled budget from Redis (budget_control mismatch; the learner publishes
        it before it broadcasts the weights of the same version, so reading it after the weight version makes
        the batch use a budget at least as new as its weights), else the schedule at `version`. With tiers,
        each prompt's budget is the base times its tier's scale (compressors.budget.tier_budget). With
        compressor.kv_budget_bytes: the tokens the engine resolved it to (constant; nothing else varies it)."""
        c = self.cfg.actors.engine.compressor
        if c.kv_budget_bytes:
            return [self.engine.compressor_cfg.kv_budget] * len(batch), [""] * len(batch)
        if c.budget_control == "mismatch":
            base = rs.read_kv_budget(self.redis, self.run_id, c.kv_budget)
        else:
            base = scheduled_budget(c, version, self.cfg.train_steps)
        if c.budget_tiers == "off":
            return [base] * len(batch), [""] * len(batch)
        tiers = [tier_of(c, conf)
                 for conf in rs.read_confidences(self.redis, self.run_id, [p.prompt_id for p in batch])]
        return [tier_budget(c, base, t) for t in tiers], tiers

    def stop_generation(self) -> None:
        """Finish the current batch (its groups are published), then leave the loop."""
        self.stopping_fault()
        self.stopping.set()
        self.loop.join()
        self._swap()  # weights received during the last batch

    def stop(self) -> None:
        """Scale-down: finish the current batch, then exit this actor process."""
        self.stop_generation()
        if self.receiver is not None:
            self.receiver.close()
        self.close()
        ray.actor.exit_actor()

    def close(self) -> None:
        """End the processes this actor started, in order: its reward and environment workers, then the engine
        (`RolloutEngine.shutdown`: SGLang's kills every child process of this one, so it comes last). Once; the
        engine is not usable after it. Called when the generation loop fails, at stop(), and by the driver before
        it ends the actor (deploy/actor_pool.py `shutdown`)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.reward.close()
        if self.envs is not None:
            self.envs.shutdown()
        self.engine.shutdown()

    def _count_busy(self) -> None:
        """Add the batch in progress (since busy_since) to the busy time."""
        since = self.busy_since
        if since is not None:
            now = time.monotonic()
            self.counters["busy_s"] += now - since
            self.busy_since = now

    def metrics(self) -> dict:
        """This process's rollout metrics since the last call: tokens/s, accuracy, KV peak bytes per sequence,
        queue waits (seconds), actor_idle_fraction = 1 - (time spent on batches, from claim to publish) / wall
        time; the mean KV budget of the batches (actor_kv_budget, tokens) and, with tiers, per tier its budget
        and reward; the engine's own counters since its start as `actor/<actor id>/<name>` (engine_stats: SGLang's
        measured KV pool and retractions). (Counts of events, groups and reward errors, are the run's actor_counts
        in Redis.)"""
        self._count_busy()
        now = time.monotonic()
        wall, self.metrics_since = now - self.metrics_since, now
        c, self.counters = self.counters, {k: 0 if isinstance(v, int) else 0.0 for k, v in self.counters.items()}
        tiers, self.tier_counters = self.tier_counters, {}
        per_tier = {}
        for name, (groups, budget_sum, reward_sum, samples) in tiers.items():
            per_tier.update({f"tier/{name}/kv_budget": budget_sum / groups,
                             f"tier/{name}/reward": reward_sum / samples})
        if c["batches"]:  # mean budget (tokens) of this actor's batches since the last call
            per_tier["actor_kv_budget"] = c["kv_budget_sum"] / c["batches"]
        per_tier.update(self._episode_metrics(c))
        per_tier.update({f"actor/{self.actor_id}/{k}": v for k, v in self.engine.engine_stats().items()})
        return {**per_tier,
                "rollout_tokens_per_s": c["tokens"] / c["gen_s"] if c["gen_s"] else 0.0,
                "accuracy": c["correct"] / c["samples"] if c["samples"] else 0.0,
                "unparseable_fraction": c["unparseable"] / c["samples"] if c["samples"] else 0.0,
                "kv_peak_bytes_per_seq": float(c["kv_peak_bytes"]),
                "actor_staleness_wait_s": c["staleness_wait_s"], "actor_queue_wait_s": c["queue_wait_s"],
                "actor_admission_wait_s": c["admission_wait_s"],
                "actor_idle_fraction": max(0.0, 1.0 - c["busy_s"] / wall) if wall > 0 else 0.0,
                "producer_backpressure_wait_s": float(self.producer.backpressure_wait_s)}

    def _episode_metrics(self, c: dict) -> dict:
        """Multi-turn: turns and tool calls per episode, the environment's share of the response tokens, and per
        turn k the mean KV bytes of a trajectory at its end (kv_bytes_turn_<k>); {} without episodes."""
        turn_kv, self.turn_kv = self.turn_kv, {}
        if not c["episodes"]:
            return {}
        return {"turns_per_episode": c["turns"] / c["episodes"],
                "tool_calls_per_episode": c["tool_calls"] / c["episodes"],
                "env_token_fraction": c["env_tokens"] / max(c["response_tokens"], 1),
                **{f"kv_bytes_turn_{k}": total / n for k, (total, n) in sorted(turn_kv.items())}}

    # -- evaluation ------------------------------------------------------------------------------------------
    def evaluate(self, items: list, mode: str) -> dict:
        """Score this actor's weights on `items` with the run's reward, with the full cache (dense) or
        eval.sparse_compressor, by default the run's compressor (sparse); see actors.evaluate. Waits for the current
        batch (weights stay fixed meanwhile)."""
        with self.generating:   # multi-turn (self.envs): episodes of the run's environment
            return evaluate_run(self.engine, self.tokenizer, items, mode, self.cfg.actors, self.cfg.eval, self.cfg.seed,
                                reward=self.reward, envs=self.envs, template=self.template)
