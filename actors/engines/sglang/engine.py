"""SGLang rollout engine (GPU clusters): `sglang.Engine` in-process, same interface as `TorchEngine`.

Token ids in (`input_ids`), token ids out (`output_ids`), per-token log-probs from SGLang's sampler
(`meta_info["output_token_logprobs"]`), so the learner never re-tokenises (docs/ARCHITECTURE.md). With
`SamplingParams.topk_logprobs = K` the request asks for `top_logprobs_num = K` and the K most likely tokens at
each position come from `meta_info["output_top_logprobs"]` (per position a list of (logprob, token_id, text),
the top-k of the same tempered log-probs the sampler returns for the sampled token).

Log-prob semantics (read in sglang 0.5.23 `srt/layers/sampler.py`, `Sampler.forward`; checked by
tests/sglang at temperature 0.7): for temperature > 0 SGLang divides the logits by the temperature in place,
takes softmax, samples, and returns `log(probs)` = log_softmax(logits / temperature) -- the learner's
definition of logp_sparse (SPEC §3 "Temperature"). Temperature 0 is greedy (SGLang sets top_k = 1) and
returns log_softmax(logits). The environment variable `SGLANG_RETURN_ORIGINAL_LOGPROB=1` switches SGLang to
untempered log-probs; this engine refuses to start with it set.

Sparse mode (`compressor_cfg.method != "full"`): attention runs in our SGLang attention backend
`sparse_rl_kv` (actors/engines/sglang/triton_backend.py, registered through SGLang's plugin entry point
`sglang.srt.plugins`), which compresses each request's KV with `compressors/` every `interval` decode steps,
per layer and KV head, and gives the evicted KV slots back to SGLang's allocator. See docs/sglang.md.

With `record_evictions=True` (the rollout actor's, when the learner replays: learner.policy_target=sparse) every
Sample carries its eviction record (`Sample.eviction_steps`, the torch engine's schema), which the backend writes
when the request ends (actors/engines/sglang/records.py) into a directory named in `RECORDS_ENV`, read back here by
request id. With a compressor that protects tokens (sinks, protect_prompt, protect_values) the backend hands each
request's protected share over the same way (`PROTECTED_ENV`), into `Sample.kv_protected_fraction`.

Weight updates, two paths (docs/sglang.md, "Weight updates"):
- `load_weights(named_tensors, version)` (the `RolloutEngine` protocol): the actor receives the learner's
  broadcast with `broker.weight_sync.WeightReceiver` and hands the tensors to SGLang with
  `update_weights_from_tensor` (CUDA IPC handles on GPU, no copy through the host).
- SGLang joins the learner's collective group itself and receives the broadcast straight into its model
  (`update_weights_from_distributed`, bucketed), for a learner that drives SGLang's own protocol: not used by
  the actors; both ends are in tests/sglang/weight_group.py, on this engine's weight-update session.
Every update runs inside `begin_weight_update` / `end_weight_update` (required since 0.5.23), flushes the
prefix cache, and every engine call has a timeout; a failed call raises `RuntimeError` with SGLang's message.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Iterable

import numpy as np
import torch

from actors.engines.base import (
    EVICTION_NEVER,
    Sample,
    SamplingParams,
    check_params,
    check_score,
    collapsed_heads,
    compressor_seeds,
)
from actors.engines.sglang.contract import (  # noqa: F401  (re-exported: the engine's callers name them here)
    COMPRESSOR_ENV,
    DECODE_GRAPH_BACKENDS,
    FP8_POOL_TRY,
    JOINS_ENV,
    KV_BUDGET_RID,
    KV_STATS_ENV,
    PROTECTED_ENV,
    RECORDS_ENV,
    SPARSE_BACKEND,
    TORCH_SPARSE_BACKEND,
    budget_rid,
    protected_path,
    record_path,
    request_rid,
    rid_budget,
)
from actors.engines.sglang.lora import adapter_manifest, lora_engine_kwargs, sglang_adapter
from broker.lora import LoraConfig
from compressors import CompressorConfig, build_compressor
from compressors.budget import kv_dims, length_budget


def sglang_request(params: SamplingParams, budgets: list[int], run_budget: int | None,
                   seeds: list[int] | None = None) -> dict:
    """The keyword arguments of one `sglang.Engine.async_generate` call for len(budgets) prompts x `params.n`
    samples (prompt-major): `sampling_params` (one dict per request) and, only where needed, `rid` and
    `top_logprobs_num`. `budgets`: one KV budget (tokens) per prompt; `run_budget`: the backend's own budget
    (None: not the sparse_rl_kv backend, budgets not sent); `seeds`: one compressor seed per request
    (`actors.engines.base.compressor_seeds`; a compressor that reads seeds, method random), or None. Request ids
    carry a budget (`request_rid`) only when some prompt's differs from the run's, and a seed only when `seeds` is
    given, so a run at one budget without random sends SGLang's own ids, and no custom logit processor is attached
    ever (SGLang would run it on every decode step)."""
    sampling = []
    for j in range(len(budgets) * params.n):
        sp = {"temperature": params.temperature, "max_new_tokens": params.max_new_tokens,
              "top_p": params.top_p, "stop": list(params.stop_strings) or None, "ignore_eos": params.ignore_eos,
              "no_stop_trim": True, "skip_special_tokens": False}
        if params.top_k > 0:
            sp["top_k"] = params.top_k
        if params.seed is not None:
            sp["sampling_seed"] = params.seed + j % params.n
        sampling.append(sp)
    request = {"sampling_params": sampling}
    send_budget = run_budget is not None and set(budgets) != {run_budget}
    if send_budget or seeds is not None:
        request["rid"] = [request_rid(budgets[j // params.n] if send_budget else None,
                                      None if seeds is None else seeds[j]) for j in range(len(sampling))]
    if params.topk_logprobs > 0:
        request["top_logprobs_num"] = params.topk_logprobs
    return request


RECORD_WAIT_S = 10.0
"""Seconds `generate` waits for a request's eviction record or protected share file (the backend writes it before
SGLang sends the request's output, so it is normally there at once)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register_sglang_plugin() -> None:
    """SGLang general plugin (entry point `sglang.srt.plugins: sparse_rl_kv`): registers the attention backends
    `sparse_rl_kv` (SGLang's Triton kernels, actors/engines/sglang/triton_backend.py) and `sparse_rl_kv_torch` (the
    torch reference, actors/engines/sglang/kv_backend.py), adds them to SGLang's `--attention-backend` choices and
    to its deterministic-inference list (so `sampling_seed` is honoured). SGLang calls this in every one of its
    processes before parsing server args; it imports nothing heavy until a backend is built."""
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        DETERMINISTIC_ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
        add_deterministic_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    names = [SPARSE_BACKEND, TORCH_SPARSE_BACKEND]
    add_attention_backend_choices([n for n in names if n not in ATTENTION_BACKEND_CHOICES])
    add_deterministic_attention_backend_choices([SPARSE_BACKEND] if SPARSE_BACKEND not in
                                                DETERMINISTIC_ATTENTION_BACKEND_CHOICES else [])

    @register_attention_backend(SPARSE_BACKEND)
    def _create(runner):
        from actors.engines.sglang.triton_backend import SparseTritonAttnBackend

        return SparseTritonAttnBackend(runner, CompressorConfig(**json.loads(os.environ[COMPRESSOR_ENV])))

    @register_attention_backend(TORCH_SPARSE_BACKEND)
    def _create_torch(runner):
        from actors.engines.sglang.kv_backend import SparseKVAttnBackend

        return SparseKVAttnBackend(runner, CompressorConfig(**json.loads(os.environ[COMPRESSOR_ENV])))


SPARSE_REQUIRED = {"disable_radix_cache": True, "chunked_prefill_size": -1, "page_size": 1,
                   "enable_streaming_session": True,
                   "disable_overlap_schedule": True, "enable_mixed_chunk": False, "tp_size": 1, "pp_size": 1,
                   "dp_size": 1, "kv_cache_dtype": "auto", "speculative_algorithm": None,
                   "cuda_graph_backend_prefill": "disabled",
                   "enable_torch_compile": False, "debug_cuda_graph": False}
"""`sglang.Engine` settings sparse mode needs, and why (docs/sglang.md, "Sparse mode"): no radix prefix cache
(a compressed prefix is not the prefix's KV); no chunked prefill or mixed chunks (a prompt is compressed after
its whole prefill); page size 1 (slots are freed one token at a time); no overlap scheduling (compression
between steps would race the next step's scheduling); one GPU per engine (tensor/pipeline/data parallel 1);
KV in the model dtype (no fp8); no speculative decoding; no prefill CUDA graph (SGLang 0.5.23 turns on its breakable,
piecewise prefill graph by default on CUDA: the prefill's ring write and compression bookkeeping were never run inside
one), no torch.compile and no breakable decode graph (`debug_cuda_graph`): only eager prefill and SGLang's full decode
graph were checked; streaming sessions on (`enable_streaming_session`: SGLang keeps an episode's request row between
its turns, `SGLangEngine.generate(..., episodes=)`; requests without a session run as before)."""


def sparse_engine_kwargs(backend: str = SPARSE_BACKEND) -> dict:
    """`sglang.Engine` settings of sparse mode: `SPARSE_REQUIRED` plus the attention backend (`sparse_rl_kv`:
    SGLang's Triton kernels, CUDA graphs stay on; `sparse_rl_kv_torch`: the torch reference, eager)."""
    kwargs = {"attention_backend": backend, **SPARSE_REQUIRED}
    if backend == TORCH_SPARSE_BACKEND:
        kwargs["disable_cuda_graph"] = True
    return kwargs


def check_sparse_settings(engine_kwargs: dict, backend: str = SPARSE_BACKEND) -> None:
    """Refuse, before SGLang starts, engine settings sparse mode would silently break: ValueError naming the
    setting. Checked: `check_sparse_kwargs`, then SGLANG_PLUGINS without `sparse_rl_kv` (SGLang would not load our
    plugin), SGLANG_USE_HND_KVCACHE (KV layout), SGLANG_ENABLE_METADATA_GLUE_GRAPH (it would capture the
    between-steps compression)."""
    check_sparse_kwargs(engine_kwargs, backend)
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed and "sparse_rl_kv" not in {x.strip() for x in allowed.split(",")}:
        raise ValueError(f"SGLANG_PLUGINS={allowed!r} does not list sparse_rl_kv: SGLang would not register the "
                         "sparse attention backend; add it")
    for env in ("SGLANG_USE_HND_KVCACHE", "SGLANG_ENABLE_METADATA_GLUE_GRAPH"):
        if os.environ.get(env, "").lower() in ("1", "true", "yes"):
            raise ValueError(f"{env} is set: sparse KV compression needs SGLang's token-major KV layout and an "
                             "eager metadata step; unset it")


def check_sparse_kwargs(engine_kwargs: dict, backend: str = SPARSE_BACKEND) -> None:
    """The engine settings alone (no environment; the config check runs it on actors.engine.sglang): ValueError
    `engine setting <key>=...` for a key of `SPARSE_REQUIRED` given with another value, an attention backend other
    than `backend`, or a CUDA-graph backend sparse mode was not checked under."""
    for key, need in SPARSE_REQUIRED.items():
        got = engine_kwargs.get(key, need)
        if key == "chunked_prefill_size" and got is None:
            continue
        if key == "kv_cache_dtype" and got in (None, "auto", str(engine_kwargs.get("dtype", "auto"))):
            continue
        if got != need:
            tried = f"; {FP8_POOL_TRY}" if key == "kv_cache_dtype" else ""
            raise ValueError(f"engine setting {key}={got!r}: sparse KV compression needs {key}={need!r} "
                             f"(docs/sglang.md, Sparse mode){tried}")
    got = engine_kwargs.get("attention_backend", backend)
    if got != backend:
        raise ValueError(f"engine setting attention_backend={got!r}: sparse mode runs in {backend!r}")
    got = engine_kwargs.get("cuda_graph_backend_decode")
    if got is not None and got not in DECODE_GRAPH_BACKENDS:
        raise ValueError(f"engine setting cuda_graph_backend_decode={got!r}: sparse KV compression runs under "
                         f"SGLang's full decode graph or eager, expected one of {DECODE_GRAPH_BACKENDS}")
    graphs = engine_kwargs.get("cuda_graph_config")
    graphs = graphs.to_dict() if hasattr(graphs, "to_dict") else graphs or {}
    for phase, allowed in (("prefill", ("disabled",)), ("decode", DECODE_GRAPH_BACKENDS)):
        got = (graphs.get(phase) or {}).get("backend")
        if got is not None and got not in allowed:
            raise ValueError(f"engine setting cuda_graph_config={{{phase!r}: {{'backend': {got!r}}}}}: sparse KV "
                             f"compression needs the {phase} graph backend in {allowed}")


class SGLangEngine:
    """RolloutEngine on an in-process `sglang.Engine` (sglang >= 0.5.23) for Hugging Face causal LMs.

    model_path: local directory of a Hugging Face model (config, weights, tokenizer); nothing is downloaded.
    compressor_cfg: `CompressorConfig`; method "full" = dense (SGLang's own attention backend and prefix
        cache), anything else = sparse mode through the `sparse_rl_kv` backend (validated here).
    weight_version: version of the weights at `model_path`.
    timeout_s: limit in seconds on every engine call (generate, each weight-update step).
    sparse_backend: "sparse_rl_kv" (SGLang's Triton kernels, CUDA graphs on) | "sparse_rl_kv_torch" (the torch
        reference backend, eager); sparse mode only.
    record_evictions: attach to every Sample its eviction record (`Sample.eviction_steps`, uint16 [layers, heads,
        P + T], the torch engine's record: what the learner replays, learner.policy_target=sparse), recorded by the
        `sparse_rl_kv` backend (actors/engines/sglang/records.py) and handed over through `RECORDS_ENV`'s directory;
        dense mode: every key never evicted, [layers, 1, P + T].
    lora: learner.lora of the run (broker.lora.LoraConfig); with rank > 0 SGLang starts with room for the learner's
        adapter (`lora_engine_kwargs`), `expected_weights` lists the adapter's tensors only and `load_weights` applies
        each adapter version through SGLang's LoRA manager, the base untouched (`_load_adapter`; docs/sglang.md,
        "LoRA"). Until the first version arrives requests run on the base (the learner's version 0: B = 0).
    engine_kwargs: passed to `sglang.Engine` (device, dtype, mem_fraction_static, ...); in sparse mode
        `sparse_engine_kwargs()` is added, and a setting that contradicts it is refused (`check_sparse_settings`).
    Raises ValueError on an invalid compressor config, a sparse-mode setting it cannot honour (naming the
        setting; nothing is started), record_evictions, compressor.phase aligned or budget_schedule length with the
        `sparse_rl_kv_torch` backend, or with `SGLANG_RETURN_ORIGINAL_LOGPROB` set; whatever `sglang.Engine` raises
        if the model cannot be loaded.
    Must be created under `if __name__ == "__main__":` (SGLang spawns its scheduler subprocess).
    """

    def __init__(self, model_path: str, compressor_cfg: CompressorConfig | None = None, weight_version: int = 0,
                 timeout_s: float = 600.0, sparse_backend: str = SPARSE_BACKEND, record_evictions: bool = False,
                 lora: LoraConfig | None = None, **engine_kwargs):
        import sglang

        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
            raise ValueError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return untempered log-probs, "
                             "but logp_sparse must be log_softmax(logits / temperature); unset it")
        self.compressor_cfg = compressor_cfg or CompressorConfig(method="full")
        self.compressor_cfg.validate()
        self.sparse = self.compressor_cfg.method != "full"
        self.timeout_s = timeout_s
        self.weight_version = weight_version
        kwargs = dict(engine_kwargs)
        if self.sparse:
            if sparse_backend not in (SPARSE_BACKEND, TORCH_SPARSE_BACKEND):
                raise ValueError(f"sparse_backend={sparse_backend!r}: "
                                 f"expected {SPARSE_BACKEND} | {TORCH_SPARSE_BACKEND}")
            if sparse_backend == TORCH_SPARSE_BACKEND and self.compressor_cfg.budget_schedule == "length":
                raise ValueError(f"compressor.budget_schedule='length' grows the budget within a trajectory: the "
                                 f"{TORCH_SPARSE_BACKEND} reference backend compresses every request to "
                                 f"compressor.kv_budget; use {SPARSE_BACKEND}")
            if sparse_backend == TORCH_SPARSE_BACKEND and self.compressor_cfg.phase != "request":
                raise ValueError(f"compressor.phase={self.compressor_cfg.phase!r}: "
                                 f"the {TORCH_SPARSE_BACKEND} reference "
                                 f"backend compresses in phase 'request' only; use {SPARSE_BACKEND}")
            check_sparse_settings(kwargs, sparse_backend)
            os.environ[COMPRESSOR_ENV] = json.dumps(asdict(self.compressor_cfg))
            kwargs.update(sparse_engine_kwargs(sparse_backend))
        if record_evictions and self.sparse and sparse_backend != SPARSE_BACKEND:
            raise ValueError(f"record_evictions: the {sparse_backend} reference backend records no evictions; use "
                             f"{SPARSE_BACKEND}")
        self.record_evictions = record_evictions
        self.sparse_backend = sparse_backend if self.sparse else None
        self._open_channels()
        self.stats_path, self._own_stats = self._stats_file()
        self.retractions = 0
        """Requests SGLang retracted (re-prefilled when its KV pool ran full) since the start; dense mode only."""
        self.keeps_episodes = self.sparse_backend == SPARSE_BACKEND
        """`generate(..., episodes=)` keeps each episode's compressed cache between its turns (SGLang's streaming
        sessions, sparse mode on `sparse_rl_kv`)."""
        self._episodes: dict[str, EpisodeState] = {}
        self._sessions: set[str] = set()
        """The streaming sessions this engine opened and has not closed (one per held episode)."""
        self.lora = lora if lora is not None and lora.enabled else None
        self.adapter_name, self._adapter_loads = None, 0
        """SGLang's name of the adapter version requests run under (`_load_adapter`); None: the base."""
        kwargs.update(lora_engine_kwargs(self.lora) if self.lora is not None else {})
        kwargs.setdefault("skip_tokenizer_init", False)
        self.engine = sglang.Engine(model_path=model_path, **kwargs)
        self.tokenizer = self.engine.tokenizer_manager.tokenizer
        self._failure, self._task, self._subprocesses = None, None, None
        self.engine.loop.run_until_complete(self._watch_subprocesses())
        self.subprocesses()

        self._read_model(model_path, kwargs.get("dtype"))

    def _read_model(self, model_path: str, dtype_arg) -> None:
        """The served model's manifest (HF names, shapes, dtype), built from its config on the meta device, its
        dtype (the engine's `dtype` argument `dtype_arg`, or the config's for None / "auto"), vocabulary, layers and
        K/V bytes per token."""
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            meta_model = AutoModelForCausalLM.from_config(hf_config)
        dtype = DTYPES.get(str(dtype_arg or "bfloat16").replace("torch.", ""), torch.bfloat16)
        if dtype_arg in (None, "auto"):
            dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.bfloat16
            dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.dtype = dtype
        self.manifest = {name: (tuple(p.shape), dtype) for name, p in meta_model.named_parameters()}
        self.tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.vocab_size = int(hf_config.vocab_size)
        self.num_layers = hf_config.num_hidden_layers
        layers, kv_heads, head_dim = kv_dims(hf_config)
        self.kv_bytes_per_token = (2 * layers * kv_heads * head_dim
                                   * torch.empty(0, dtype=dtype).element_size())
        """Bytes of K and V of one token over all layers in SGLang's pool."""
        self.adapter_manifest = adapter_manifest(meta_model, self.lora, dtype) if self.lora is not None else {}
        """learner.lora on: the adapter's names, shapes and dtype (what `load_weights` takes); else empty."""

    def _open_channels(self) -> None:
        """The files the backend writes for `generate`, named to SGLang's scheduler in the environment before it
        starts (an earlier engine's are unset): `joins_path` (`JOINS_ENV`, compressor.phase aligned),
        `records_dir` (`RECORDS_ENV`, record_evictions) and `protected_dir` (`PROTECTED_ENV`, a compressor that
        protects tokens, on `sparse_rl_kv`); each None when not used."""
        self.joins_path = None
        """`JOINS_ENV`'s file of this engine (compressor.phase aligned, sparse mode), else None."""
        if self.sparse and self.compressor_cfg.phase == "aligned":
            fd, self.joins_path = tempfile.mkstemp(prefix="sparse-rl-kv-joins-", suffix=".txt")
            os.close(fd)
            os.environ[JOINS_ENV] = self.joins_path
        else:
            os.environ.pop(JOINS_ENV, None)       # an earlier engine's file is not this one's
        self.records_dir = None
        """`RECORDS_ENV`'s directory of this engine (record_evictions, sparse mode), else None."""
        if self.sparse and self.record_evictions:
            self.records_dir = tempfile.mkdtemp(prefix="sparse-rl-kv-records-")
            os.environ[RECORDS_ENV] = self.records_dir
        else:
            os.environ.pop(RECORDS_ENV, None)
        self.protected_dir = None
        """`PROTECTED_ENV`'s directory of this engine (compressor.protects, sparse mode on `sparse_rl_kv`), else
        None (`Sample.kv_protected_fraction` 0: the torch reference backend hands no share over)."""
        if self.sparse_backend == SPARSE_BACKEND and self.compressor_cfg.protects:
            self.protected_dir = tempfile.mkdtemp(prefix="sparse-rl-kv-protected-")
            os.environ[PROTECTED_ENV] = self.protected_dir
        else:
            os.environ.pop(PROTECTED_ENV, None)

    # ---------------------------------------------------------------- generation
    def expected_weights(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(HF name, shape, dtype) of every weight the served model takes, tied `lm_head.weight` included (what
        the weight receiver checks a manifest against: RolloutEngine.expected_weights); with learner.lora on, the
        adapter's tensors only (broker.lora.adapter_parameters' names: what the learner sends)."""
        if self.lora is not None:
            return [(name, shape, dtype) for name, (shape, dtype) in self.adapter_manifest.items()]
        expected = [(name, shape, dtype) for name, (shape, dtype) in self.manifest.items()]
        if self.tied_embeddings and "lm_head.weight" not in self.manifest:
            expected.append(("lm_head.weight", *self.manifest["model.embed_tokens.weight"]))
        return expected

    def generate(self, prompts: list[list[int]], params: SamplingParams, kv_budgets: list[int] | None = None,
                 episodes: list[str] | None = None) -> list[list[Sample]]:
        """Sample `params.n` responses per prompt (token ids); one list of n Samples per prompt, in order.

        kv_budgets: one KV budget (tokens) per prompt, or None for `compressor_cfg.kv_budget` (schedules,
        controller, difficulty tiers: docs/SPEC.md §5.1). A budget other than the run's rides in the request id
        (`sglang_request`); the `sparse_rl_kv` backend reads it at the request's prefill and compresses the
        request to it (all requests still decode in one batch). Only in sparse mode with `sparse_rl_kv`; a dense
        engine ignores them. With `compressor_cfg.budget_schedule` length each is the request's start budget: a
        compression after t generated tokens keeps compressors.budget.length_budget(cfg, start, t) tokens (the
        backend reads t from its host mirror), as `TorchEngine.generate` does.

        Each of the n samples is its own SGLang request (prompt-major); with `params.seed` sample j gets
        `sampling_seed = seed + j`, which SGLang honours only when the engine runs with
        `enable_deterministic_inference=True` (otherwise its engine-wide `random_seed` decides).
        finish_reason: "stop" (EOS or a stop string; the token completing it is kept) | "length".
        kv_retained_tokens / kv_peak_bytes: dense = prompt + response - 1 tokens (the last token's KV is never
        written); sparse = the same count under the compression schedule (the backend applies exactly this
        schedule; under compressor.phase aligned from the engine decode step each request joined at, which the
        backend records at its prefill; the measured pool usage of the whole engine is in `kv_pool_stats()`).

        episodes: one key per prompt (params.n must be 1; sparse mode on `sparse_rl_kv` only, `keeps_episodes`):
        multi-turn with the episode's compressed cache kept between turns, as `TorchEngine.generate`'s episodes
        (docs/sglang.md, "The compressed cache across turns"). A key this engine does not hold opens an SGLang
        streaming session and the prompt starts the episode; for a key it holds the prompt is the ids appended since
        the episode's last sampled token (template boundary, observation, next header), sent as the session's next
        request: SGLang prefills the last sampled token and them at their true positions on the row it kept, and
        with compressor.protect_observation the backend compresses only the older cache at that prefill. The
        Sample's prompt_ids are the ids given; its eviction_steps (record_evictions) cover the whole episode so far,
        [layers, heads, first prompt + every later id], steps counted from the end of the first prompt. Held until
        `release_episodes`.
        Raises ValueError on empty prompts or invalid params (episodes: a wrong length, repeated keys, n != 1, a
        later turn starting with the tokenizer's BOS id, which SGLang's session would strip, an engine that does
        not keep episodes); RuntimeError if SGLang aborts a request, the call exceeds `timeout_s`, one of this
        engine's SGLang subprocesses failed, or (sparse mode) SGLang retracted a request (`num_retractions` > 0:
        re-prefilled, its compression history restarted); a failed call with episodes closes their sessions.
        """
        check_params(prompts, params)
        if self.record_evictions and params.max_new_tokens >= 65535:
            raise ValueError(f"SamplingParams.max_new_tokens={params.max_new_tokens}: an eviction record counts steps "
                             "in uint16, so record_evictions needs max_new_tokens < 65535")
        budgets = self._check_budgets(prompts, kv_budgets)
        if episodes is not None:
            return self._generate_turns(prompts, params, budgets, episodes)
        rows = [p for p in prompts for _ in range(params.n)]
        run_budget = self.compressor_cfg.kv_budget if self.sparse_backend == SPARSE_BACKEND else None
        request = sglang_request(params, budgets, run_budget, self._seeds(params, budgets))
        outs = self._call(self.engine.async_generate(input_ids=[list(r) for r in rows], return_logprob=True,
                                                     **request, **self._adapter_of(len(rows))), "generate")
        joined = self._read_joins()
        samples = [self._sample(row, out, budgets[j // params.n], joined, params.topk_logprobs)
                   for j, (row, out) in enumerate(zip(rows, outs))]
        return [samples[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _generate_turns(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int],
                        keys: list[str]) -> list[list[Sample]]:
        """`generate` with `episodes` (n = 1): a streaming session opened for every new key, then each episode's ids
        as its session's next request (`_turn_request`), all at once; each Sample counted and recorded over its
        episode (`_sample`), and the episode's state kept. Any failure closes the call's sessions, then re-raises."""
        states = self._check_turns(prompts, params, keys)
        run_budget = self.compressor_cfg.kv_budget
        try:
            self._open_sessions([k for k, st in zip(keys, states) if st is None])
            seeds = self._seeds(params, budgets) or [None] * len(prompts)
            outs = self._call(_gathered([self._turn_request(ids, params, b, run_budget, k, seed)
                                         for ids, b, k, seed in zip(prompts, budgets, keys, seeds)]), "generate")
            joined = self._read_joins()
            out = []
            for ids, o, b, key, st in zip(prompts, outs, budgets, keys, states):
                s = self._sample(list(ids), o, b, joined, params.topk_logprobs, st)
                first, before = (st.first_prompt, st.tokens) if st is not None else (len(ids), 0)
                self._episodes[key] = EpisodeState(first, before + len(ids) + len(s.response_ids),
                                                   s.kv_retained_tokens)
                out.append([s])
        except BaseException:
            with contextlib.suppress(Exception):        # the first failure is the one raised
                self._release_episodes(keys)
            raise
        return out

    def _seeds(self, params: SamplingParams, budgets: list[int]) -> list[int] | None:
        """Each request's compressor seed (prompt-major, `compressor_seeds`: the torch engine's for the same rows;
        unseeded, each batch's base drawn at random) when the `sparse_rl_kv` backend's compressor reads seeds
        (method random), else None."""
        if self.sparse_backend != SPARSE_BACKEND or "seed" not in build_compressor(self.compressor_cfg).needs:
            return None
        return compressor_seeds(params.seed, budgets, params.n, lambda: random.SystemRandom().randrange(2**62))

    def _check_turns(self, prompts: list[list[int]], params: SamplingParams, keys: list[str]) -> list:
        """The held state of each key's episode (None: a new episode); ValueError naming `episodes` for an engine
        that does not keep episodes, a wrong number of keys, repeated keys, params.n != 1, a later turn starting with
        the tokenizer's BOS id (SGLang's `Session._strip_bos_token` drops it), or (record_evictions) an episode whose
        tokens after its first prompt could reach 65535 (the record's uint16 steps)."""
        if not self.keeps_episodes:
            raise ValueError(f"episodes: this SGLang engine keeps no episode caches (it does in sparse mode on "
                             f"{SPARSE_BACKEND}); send each turn's whole history instead")
        if len(keys) != len(prompts) or len(set(keys)) != len(keys) or params.n != 1:
            raise ValueError(f"episodes: {len(keys)} keys ({len(set(keys))} distinct) for {len(prompts)} prompts "
                             f"with SamplingParams.n={params.n}: expected one distinct key per prompt, n=1")
        states = [self._episodes.get(k) for k in keys]
        bos = getattr(self.tokenizer, "bos_token_id", None)
        for key, ids, st in zip(keys, prompts, states):
            if st is not None and bos is not None and ids[0] == bos:
                raise ValueError(f"episodes: the ids of episode {key!r}'s next turn start with the BOS id {bos}, which "
                                 "SGLang's streaming session strips from a later turn; send them without it")
            after = (st.tokens - st.first_prompt + len(ids) if st is not None else 0) + params.max_new_tokens
            if self.record_evictions and after >= 65535:
                raise ValueError(f"episodes: episode {key!r} could reach {after} tokens after its first prompt; an "
                                 "eviction record counts them in uint16 (< 65535)")
        return states

    def _open_sessions(self, keys: list[str]) -> None:
        """An SGLang streaming session per key (session id = the key); RuntimeError when SGLang refuses one (a
        session of that id is open already)."""
        from sglang.srt.managers.io_struct import OpenSessionReqInput

        if not keys:
            return
        tm = self.engine.tokenizer_manager
        got = self._call(_gathered([tm.open_session(OpenSessionReqInput(capacity_of_str_len=0, session_id=k,
                                                                        streaming=True), None) for k in keys]),
                         "open_session")
        self._sessions.update(k for k, g in zip(keys, got) if g is not None)
        refused = [k for k, g in zip(keys, got) if g is None]
        if refused:
            raise RuntimeError(f"SGLang open_session refused the episodes {refused} (a session of that id is open)")

    def _turn_request(self, ids: list[int], params: SamplingParams, budget: int, run_budget: int, key: str,
                      seed: int | None = None):
        """The `async_generate` coroutine of one episode's turn: one request (`sglang_request` with n = 1, carrying
        the compressor `seed` when not None) in the session `key`, so that SGLang continues the row it kept."""
        request = sglang_request(params, [budget], run_budget, None if seed is None else [seed])
        single = {"sampling_params": request["sampling_params"][0], "session_params": {"id": key}}
        if "rid" in request:
            single["rid"] = request["rid"][0]
        if "top_logprobs_num" in request:
            single["top_logprobs_num"] = request["top_logprobs_num"]
        if self.adapter_name is not None:
            single["lora_path"] = self.adapter_name
        return self.engine.async_generate(input_ids=list(ids), return_logprob=True, **single)

    @property
    def release_episodes(self):
        """`release_episodes(keys) -> int` when this engine keeps episodes (`keeps_episodes`: sparse mode on
        `sparse_rl_kv`): close their streaming sessions, so SGLang frees each kept row and its slots (keys not held
        are ignored; returns how many were held). None otherwise, so that actors/envs/episode.py re-sends each turn's
        history (dense SGLang: its radix cache shares it)."""
        return self._release_episodes if self.keeps_episodes else None

    def _release_episodes(self, keys: Iterable[str]) -> int:
        from sglang.srt.managers.io_struct import CloseSessionReqInput

        keys = list(keys)
        held = sum(self._episodes.pop(k, None) is not None for k in keys)
        closing = [k for k in keys if k in self._sessions]
        self._sessions.difference_update(closing)
        if closing and self._failure is None:
            tm = self.engine.tokenizer_manager
            self._call(_gathered([tm.close_session(CloseSessionReqInput(session_id=k), None) for k in closing]),
                       "close_session")
        return held

    def score(self, token_ids: list[list[int]]) -> list[np.ndarray]:
        """Teacher-forced log-probs of the served weights (RolloutEngine.score): per sequence float32 [len - 1], log
        p(token t | tokens before it), untempered, from SGLang's prefill of the sequence as a prompt
        (`return_logprob=True, logprob_start_len=0`: `meta_info["input_token_logprobs"]`, one (logprob, id, text) per
        prompt token, None at the first; temperature 1, top_p 1, one new token, which is dropped). In sparse mode the
        request carries the run's budget and a prompt no longer than it is not compressed at its prefill: the
        weight-sync fingerprint's probe is cut to the smallest budget (broker/fingerprint.py). Raises ValueError for
        no sequences, one shorter than 2 tokens or an id outside [0, vocab_size); RuntimeError when SGLang returns
        another number of input log-probs, or fails as in `generate`."""
        check_score(token_ids, self.vocab_size)
        sampling = [{"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 1, "skip_special_tokens": False}
                    for _ in token_ids]
        outs = self._call(self.engine.async_generate(input_ids=[list(ids) for ids in token_ids],
                                                     sampling_params=sampling, return_logprob=True,
                                                     logprob_start_len=0, **self._adapter_of(len(token_ids))),
                          "score")
        self._read_joins()       # compressor.phase aligned: the probe's prefills are no batch's (the file is emptied)
        for ids, out in zip(token_ids, outs):   # the probe's records and protected shares go too
            if self.records_dir is not None:
                self._read_record(out["meta_info"].get("id"), len(ids) + 1)
            self._read_protected(out["meta_info"].get("id"))
        scored = []
        for ids, out in zip(token_ids, outs):
            entries = out["meta_info"].get("input_token_logprobs") or []
            values = [lp for lp, _, _ in entries[1:]]
            if len(entries) != len(ids) or any(v is None for v in values):
                raise RuntimeError(f"SGLang input_token_logprobs has {len(entries)} positions (or a None after the "
                                   f"first) for a prompt of {len(ids)} tokens")
            scored.append(np.asarray(values, dtype=np.float32))
        return scored

    def _sample(self, row: list[int], out: dict, budget: int, joined: dict[str, int] | None, topk: int,
                episode: EpisodeState | None = None) -> Sample:
        """The Sample of one request (prompt ids `row`, SGLang's output `out`, its KV `budget`; `joined`: the
        aligned phase's join steps, `_read_joins`; `topk`: SamplingParams.topk_logprobs; `episode`: the state of the
        episode this request continues, None for a request or a first turn), with its eviction record when recording
        (a continued episode's covers the whole episode). Raises RuntimeError on a finish reason other than stop |
        length, a retraction (sparse mode), log-prob ids that differ from the output ids, or a missing record
        (`_read_record`)."""
        meta = out["meta_info"]
        reason = meta["finish_reason"]
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind not in ("stop", "length"):
            raise RuntimeError(f"SGLang finished a request with finish_reason={reason!r} (expected stop|length)")
        self.retractions += int(meta.get("num_retractions") or 0)
        if self.sparse and meta.get("num_retractions"):
            raise RuntimeError(f"SGLang retracted a request {meta['num_retractions']} time(s) (KV pool full): "
                               "it was re-prefilled and compressed from scratch, so its logp_sparse does not "
                               "follow the compression schedule; give SGLang more KV (actors.engine.sglang."
                               "mem_fraction_static, max_total_tokens) or admit fewer requests (actors.engine."
                               "sglang.max_running_requests, schedule_conservativeness)")
        response = list(out["output_ids"])
        token_logprobs = meta["output_token_logprobs"]
        if [t for _, t, _ in token_logprobs] != response:
            raise RuntimeError("SGLang output_token_logprobs token ids differ from output_ids")
        kept, before = (episode.held, episode.tokens) if episode is not None else (0, 0)
        retained, peak = self._kv_tokens(len(row) + (1 if episode is not None else 0), len(response), budget,
                                         self._joined_at(joined, meta.get("id")), kept)
        sample = Sample(prompt_ids=list(row), response_ids=response,
                        logp_sparse=np.asarray([lp for lp, _, _ in token_logprobs], dtype=np.float32),
                        finish_reason=kind, kv_retained_tokens=retained, kv_peak_bytes=peak * self.kv_bytes_per_token,
                        kv_protected_fraction=self._read_protected(meta.get("id")),
                        **(_top_logprobs(meta, len(response)) if topk > 0 else {}))
        if self.record_evictions:
            sample.eviction_steps = self._read_record(meta.get("id"), before + len(row) + len(response))
        return sample

    def _read_record(self, rid, tokens: int) -> np.ndarray:
        """Request `rid`'s eviction record as `Sample.eviction_steps`: uint16 [layers, heads, tokens] (`tokens` =
        P + T; the backend's record covers the tokens whose KV was computed, the rest is never evicted; heads 1 when
        every KV head of every layer holds the same values, as the torch engine's). Read from `RECORDS_ENV`'s
        directory, where the backend wrote it when the request's row left SGLang's pool (before SGLang sent the
        output), and deleted. Dense mode: every key never evicted, [layers, 1, tokens]. Raises RuntimeError when
        no record appears within RECORD_WAIT_S seconds."""
        if self.records_dir is None:
            return np.full((self.num_layers, 1, tokens), EVICTION_NEVER, dtype=np.uint16)
        steps = _take_file(record_path(self.records_dir, rid), f"record_evictions: the {SPARSE_BACKEND} backend "
                           f"wrote no eviction record for request {rid!r} in {self.records_dir}")
        out = np.full((*steps.shape[:2], tokens), EVICTION_NEVER, dtype=np.uint16)
        n = min(tokens, steps.shape[2])
        out[:, :, :n] = steps[:, :, :n]
        return collapsed_heads(out)

    def _read_protected(self, rid) -> float:
        """Request `rid`'s protected share (`Sample.kv_protected_fraction`: the share of its kept tokens protection
        held at its last compression, mean over layers and KV heads), read from `PROTECTED_ENV`'s directory, where
        the backend wrote it when the request's row left SGLang's pool (or its finished turn parked), and deleted;
        0.0 without that directory. Raises RuntimeError when none appears within RECORD_WAIT_S seconds."""
        if self.protected_dir is None:
            return 0.0
        return float(_take_file(protected_path(self.protected_dir, rid), f"the {SPARSE_BACKEND} backend wrote no "
                                f"protected share for request {rid!r} in {self.protected_dir}"))

    def _check_budgets(self, prompts: list[list[int]], kv_budgets: list[int] | None) -> list[int]:
        """One budget per prompt (the config's when None); ValueError naming kv_budgets for a wrong length, a
        budget the compressor config rejects, or differing budgets on the torch reference backend."""
        budget = self.compressor_cfg.kv_budget
        if kv_budgets is None:
            return [budget] * len(prompts)
        if len(kv_budgets) != len(prompts):
            raise ValueError(f"kv_budgets has {len(kv_budgets)} values for {len(prompts)} prompts")
        budgets = [int(b) for b in kv_budgets]
        if not self.sparse:
            return budgets
        for b in sorted(set(budgets)):
            try:
                replace(self.compressor_cfg, kv_budget=b, budget_schedule="constant", budget_control="off",
                        budget_tiers="off").validate()
            except ValueError as e:
                raise ValueError(f"kv_budgets: {e}") from None
        if self.sparse_backend != SPARSE_BACKEND and set(budgets) != {budget}:
            raise ValueError(f"kv_budgets: per-request budgets need sparse_backend={SPARSE_BACKEND!r}")
        return budgets

    def _read_joins(self) -> dict[str, int] | None:
        """compressor.phase aligned: {request id: engine decode steps before its first} from the backend's join
        file (`JOINS_ENV`), which is then emptied (every request of the call has finished); else None."""
        if self.joins_path is None:
            return None
        with open(self.joins_path, "r+") as f:
            lines = f.read().split()
            f.truncate(0)
        return dict(zip(lines[0::2], map(int, lines[1::2])))

    def _joined_at(self, joined: dict[str, int] | None, rid) -> int:
        """Engine decode steps run before request `rid`'s first (aligned: its phase; 0 under phase request).
        Raises RuntimeError when the backend recorded no prefill for it."""
        if joined is None:
            return 0
        if rid not in joined:
            raise RuntimeError(f"compressor.phase=aligned: the {SPARSE_BACKEND} backend recorded no prefill for "
                               f"request {rid!r} in {self.joins_path}, so its KV count is unknown")
        return joined[rid]

    def _kv_tokens(self, prompt_len: int, response_len: int, budget: int, joined_at: int = 0,
                   kept: int = 0) -> tuple[int, int]:
        """(tokens in this sequence's KV when it ended, peak tokens it held) under the compression schedule of
        the sparse backend: `prompt_len` tokens prefilled after `kept` tokens of an episode's kept cache (0: a
        request or a first turn; a later turn prefills its ids and the last sampled token), compressed at the prefill
        to `budget` (the start budget) if longer -- with compressor.protect_observation and a kept cache, the kept
        part alone, the prefilled ids after it (the torch engine's `SlotPlan`); at decode
        step s (s = 1 for the forward of the first sampled token), after the step's attention, compressed to
        length_budget(compressor_cfg, budget, s) (compressors/budget.py: `budget` itself unless budget_schedule is
        length, where it grows with s; the backend's `_budget_now`) if it holds more and s % interval == 0
        (compressor.phase request), or (joined_at + s) % interval == 0 (aligned: `joined_at` = the engine decode
        steps run before the request's first, recorded by the backend at its prefill, so joined_at + s is the
        engine step the backend tests). Exact under both phases and every schedule."""
        held = kept + prompt_len
        if not self.sparse:
            return held + response_len - 1, held + response_len - 1
        interval = self.compressor_cfg.interval
        peak = held
        held = min(kept, budget) + prompt_len if kept and self.compressor_cfg.protect_observation else min(held, budget)
        for step in range(1, response_len):
            held += 1
            peak = max(peak, held)
            if (joined_at + step) % interval == 0:
                held = min(held, length_budget(self.compressor_cfg, budget, step))
        return held, peak

    def _stats_file(self) -> tuple[str | None, bool]:
        """(`KV_STATS_ENV`'s file of this engine, whether the engine made it): in sparse mode the file the
        environment names, else a new temporary file of this engine's own (removed at `shutdown`), which the
        scheduler subprocess inherits, so that every engine's pool usage can be read (`kv_pool_stats`, one engine
        per process); (None, False) in dense mode."""
        if not self.sparse:
            return None, False
        if os.environ.get(KV_STATS_ENV):
            return os.environ[KV_STATS_ENV], False
        fd, path = tempfile.mkstemp(prefix="sparse-rl-kv-stats-", suffix=".json")
        os.close(fd)
        os.environ[KV_STATS_ENV] = path
        return path, True

    def kv_pool_stats(self) -> dict | None:
        """Measured KV slot usage the sparse backend writes after every forward into this engine's stats file
        (`_stats_file`): {"peak_used_slots", "freed_slots", "compressions", "pool_slots", ...} (slots = tokens
        of K and V over all layers); None in dense mode or before the backend's first forward."""
        if not self.stats_path or not os.path.exists(self.stats_path) or not os.path.getsize(self.stats_path):
            return None
        with open(self.stats_path) as f:
            return json.load(f)

    def engine_stats(self) -> dict[str, float]:
        """This engine's counters since the start, for the actor's per-actor metrics (docs/SPEC.md §4, `actor/`):
        `sglang_retractions` (requests SGLang re-prefilled because its KV pool ran full: dense mode; sparse mode
        raises instead), and in sparse mode the measured pool (`kv_pool_stats`): `kv_pool_slots` (slots = tokens),
        `kv_pool_peak_used_slots`, `kv_pool_peak_used_fraction` (peak / pool), `kv_compressions` (requests
        compressed) and `kv_freed_slots` (slots given back to SGLang's allocator by eviction)."""
        out = {"sglang_retractions": float(self.retractions)}
        stats = self.kv_pool_stats()
        if stats:
            out.update(kv_pool_slots=float(stats["pool_slots"]),
                       kv_pool_peak_used_slots=float(stats["peak_used_slots"]),
                       kv_pool_peak_used_fraction=stats["peak_used_slots"] / max(stats["pool_slots"], 1),
                       kv_compressions=float(stats["compressions"]), kv_freed_slots=float(stats["freed_slots"]))
        return out

    # ---------------------------------------------------------------- weight updates
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace weights by Hugging Face name (tensors on any device; same names/shapes as the model, any
        float dtype: SGLang casts on load). Checks every name and shape against the model's manifest first and
        raises ValueError naming all problems before anything is sent. Then begin_weight_update ->
        update_weights_from_tensor (flush_cache) -> end_weight_update; sets `weight_version = version`.
        With learner.lora on, the adapter's tensors (`expected_weights`), checked the same way, are applied as one
        adapter version instead (`_load_adapter`). Raises RuntimeError with SGLang's message if any step fails or
        times out (the weights may then be partly updated: reload or retry)."""
        named = list(named_tensors)
        problems = [f"{len(self._episodes)} episodes hold KV caches of weight version {self.weight_version} "
                    "(release_episodes first)"] if self._episodes else []
        manifest = self.adapter_manifest if self.lora is not None else self.manifest
        for name, t in named:
            if name == "lm_head.weight" and self.tied_embeddings and name not in manifest and self.lora is None:
                continue
            if name not in manifest:
                problems.append(f"unknown parameter {name!r}")
            elif tuple(t.shape) != manifest[name][0]:
                problems.append(f"{name}: shape {tuple(t.shape)} != model {manifest[name][0]}")
            elif not t.is_floating_point():
                problems.append(f"{name}: dtype {t.dtype} is not a float dtype")
        if problems:
            raise ValueError("load_weights rejected the update (nothing changed): " + "; ".join(problems))
        if self.lora is not None:
            return self._load_adapter(named, version)
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        tm = self.engine.tokenizer_manager
        obj = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=self.engine._serialize_tensors_per_rank(named, None),
            flush_cache=True, weight_version=str(version))
        self._weight_session(lambda: tm.update_weights_from_tensor(obj, None), "update_weights_from_tensor")
        self.weight_version = version

    def _load_adapter(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Apply one adapter version (learner.lora): load it into SGLang's LoRA manager under a name of its own
        (`sparse-rl-v<version>-<n>`, `load_lora_adapter_from_tensors`, tensors and config from
        actors/engines/sglang/lora.py `sglang_adapter`), switch every later request to it (`lora_path`), then unload
        the previous version's adapter; sets `weight_version = version`. SGLang 0.5.23 gives each load a fresh
        `lora_id` (a uuid; `LoRARef`, srt/lora/lora_registry.py) and its radix cache keys a prefix on the token ids
        with that id appended to the request's extra key (`Req.__init__`, srt/managers/schedule_batch.py), so a
        prefix computed under an older version is never served to a newer one (sparse mode runs without the radix
        cache anyway); the base weights are untouched. Raises RuntimeError with SGLang's message when the load
        (nothing changed) or the unload (the new version is live) fails."""
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput, UnloadLoRAAdapterReqInput

        tensors, config = sglang_adapter(named, self.lora)
        self._adapter_loads += 1
        name, previous = f"sparse-rl-v{version}-{self._adapter_loads}", self.adapter_name
        tm = self.engine.tokenizer_manager
        load = LoadLoRAAdapterFromTensorsReqInput(
            lora_name=name, config_dict=config,
            serialized_named_tensors=self.engine._serialize_tensors_per_rank(tensors, None))
        result = self._call(tm.load_lora_adapter_from_tensors(load, None), "load_lora_adapter_from_tensors")
        if not result.success:
            raise RuntimeError(f"SGLang load_lora_adapter_from_tensors failed: {result.error_message}")
        self.adapter_name, self.weight_version = name, version
        if previous is not None:
            result = self._call(tm.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=previous), None),
                                "unload_lora_adapter")
            if not result.success:
                raise RuntimeError(f"SGLang unload_lora_adapter failed for {previous!r} ({name!r} is live): "
                                   f"{result.error_message}")

    def _adapter_of(self, requests: int) -> dict:
        """`async_generate`'s `lora_path` for `requests` requests under the live adapter version, {} on the base."""
        return {"lora_path": [self.adapter_name] * requests} if self.adapter_name is not None else {}

    def _weight_session(self, make_update, what: str) -> None:
        """begin_weight_update -> await make_update() -> end_weight_update, each with the timeout; end is
        attempted even when the update failed, then the first error is raised."""
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

        tm = self.engine.tokenizer_manager
        self._check(self._call(tm.begin_weight_update(BeginWeightUpdateReqInput(), None), "begin_weight_update"),
                    "begin_weight_update")
        try:
            self._check(self._call(make_update(), what), what)
        finally:
            self._check(self._call(tm.end_weight_update(EndWeightUpdateReqInput(), None), "end_weight_update"),
                        "end_weight_update")

    async def _watch_subprocesses(self) -> None:
        """A failing SGLang subprocess (scheduler, detokenizer) sends this process SIGQUIT, and SGLang's own
        handler then SIGKILLs the whole process tree, this process included: no error, no cleanup. Replace
        that handler (on the engine's loop, after SGLang installs its own): the pending engine call raises
        RuntimeError instead, later calls too, and `shutdown()` stops what is left."""
        import signal
        import threading

        self.engine.tokenizer_manager.auto_create_handle_loop()     # installs SGLang's handler (idempotent)
        if threading.current_thread() is threading.main_thread():
            self.engine.loop.add_signal_handler(signal.SIGQUIT, _on_subprocess_failure)
        _LIVE_ENGINES.add(self)

    def _fail(self, dead: list[str] | None = None) -> None:
        which = f" ({', '.join(dead)})" if dead else ""
        self._failure = (f"an SGLang subprocess failed{which} (its traceback, if any, is in the log above)")
        if self._task is not None:
            self._task.cancel()

    def subprocesses(self) -> dict[int, str]:
        """This engine's SGLang subprocesses (`Engine.get_all_child_pids()`: scheduler, detokenizer), pid -> the
        title SGLang gave it ("sglang::scheduler", "sglang::detokenizer"; read once, while they run)."""
        import psutil

        if getattr(self, "_subprocesses", None) is None:
            names = {}
            for pid in self.engine.get_all_child_pids():
                try:
                    names[pid] = (psutil.Process(pid).cmdline() or ["?"])[0]
                except psutil.Error:
                    names[pid] = "?"
            self._subprocesses = names
        return self._subprocesses

    def dead_subprocesses(self) -> list[str]:
        """This engine's SGLang subprocesses that no longer run (gone or a zombie), as "title pid N"."""
        import psutil

        dead = []
        for pid, name in self.subprocesses().items():
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:        # gone (or the pid now belongs to someone else's process)
                pass
            dead.append(f"{name} pid {pid}")
        return dead

    def _call(self, coro, what: str):
        """Run an engine coroutine on SGLang's event loop with `timeout_s`; TimeoutError or a failed SGLang
        subprocess of this engine (found gone before the call, or signalled during it) -> RuntimeError naming
        the call."""
        if self._failure is None:
            dead = self.dead_subprocesses()
            if dead:
                self._fail(dead)
                coro.close()
                raise RuntimeError(f"SGLang {what} failed: {self._failure}")
        if self._failure is not None:
            coro.close()
            raise RuntimeError(f"SGLang {what} refused: {self._failure}; shut the engine down")
        self._task = self.engine.loop.create_task(asyncio.wait_for(coro, self.timeout_s))
        watch = self.engine.loop.create_task(self._poll_subprocesses())
        try:
            return self.engine.loop.run_until_complete(self._task)
        except asyncio.TimeoutError as e:
            raise RuntimeError(f"SGLang {what} did not finish within timeout_s={self.timeout_s}") from e
        except asyncio.CancelledError:
            if self._failure is None:
                raise
            raise RuntimeError(f"SGLang {what} failed: {self._failure}") from None
        finally:
            watch.cancel()
            self._task = None

    async def _poll_subprocesses(self) -> None:
        """While a call runs, every SUBPROCESS_POLL_S seconds: a subprocess of this engine gone (or a zombie) fails
        the call. A subprocess killed from outside (SIGKILL, the OOM killer) sends nothing, and the call would
        otherwise wait for its timeout_s."""
        while self._failure is None:
            await asyncio.sleep(SUBPROCESS_POLL_S)
            dead = self.dead_subprocesses()
            if dead:
                self._fail(dead)

    @staticmethod
    def _check(result, what: str) -> None:
        """Raise RuntimeError with SGLang's message if an engine call reports failure."""
        if isinstance(result, tuple):
            ok, message = result[0], result[1] if len(result) > 1 else ""
        else:
            ok, message = getattr(result, "success", True), getattr(result, "message", "")
        if not ok:
            raise RuntimeError(f"SGLang {what} failed: {message}")

    def shutdown(self) -> None:
        """Stop SGLang's subprocesses. SGLang 0.5.23 kills *every* child process of this process here
        (`kill_process_tree(getpid(), include_parent=False)`), the subprocesses of other live engines too: run
        one engine per process, or shut them down together."""
        _LIVE_ENGINES.discard(self)
        self._episodes.clear()              # the sessions go with SGLang's scheduler
        self._sessions.clear()
        self.engine.shutdown()
        if self.joins_path is not None and os.path.exists(self.joins_path):
            os.remove(self.joins_path)
        if self._own_stats:
            os.environ.pop(KV_STATS_ENV, None)
            if os.path.exists(self.stats_path):
                os.remove(self.stats_path)
        for directory in (self.records_dir, self.protected_dir):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)


def _take_file(path: str, missing: str) -> np.ndarray:
    """The .npy the backend wrote at `path` for a request that ended (a record or a protected share), loaded and
    deleted; waits up to RECORD_WAIT_S seconds for it (RuntimeError `missing` + the wait after that)."""
    deadline = time.monotonic() + RECORD_WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{missing} within {RECORD_WAIT_S} s")
        time.sleep(0.01)
    out = np.load(path)
    os.remove(path)
    return out


def _top_logprobs(meta: dict, length: int) -> dict:
    """Sample fields topk_ids int32 [T, K] / topk_logprobs float32 [T, K] from one request's
    `meta_info["output_top_logprobs"]` (per position a list of K (logprob, token_id, text)). Raises
    RuntimeError when SGLang returned another number of positions than response tokens, or none at one."""
    rows = meta.get("output_top_logprobs") or []
    if len(rows) != length or any(not r for r in rows):
        raise RuntimeError(f"SGLang output_top_logprobs has {len(rows)} positions (some empty?) for {length} tokens")
    return {"topk_ids": np.asarray([[t for _, t, _ in r] for r in rows], dtype=np.int32),
            "topk_logprobs": np.asarray([[lp for lp, _, _ in r] for r in rows], dtype=np.float32)}


@dataclass
class EpisodeState:
    """What `SGLangEngine` keeps of an episode whose row SGLang's streaming session holds between its turns:
    first_prompt (tokens of its first prompt), tokens (the episode's tokens so far: the first prompt, every later id,
    every response), held (tokens in its KV cache after its last turn, `SGLangEngine._kv_tokens`)."""
    first_prompt: int
    tokens: int
    held: int


async def _gathered(coros: list) -> list:
    """The results of the coroutines `coros`, run concurrently on the engine's loop (one `_call`)."""
    return list(await asyncio.gather(*coros))


SUBPROCESS_POLL_S = 1.0
"""How often a running engine call checks that the engine's SGLang subprocesses still run (seconds)."""

_LIVE_ENGINES: set = set()
"""The SGLangEngines of this process that have not been shut down."""


def _on_subprocess_failure() -> None:
    """SIGQUIT from a failed SGLang subprocess. The signal does not say whose: the engines with a subprocess gone
    fail their call (SGLang's watchdog signals only once the process is gone); when none is (a scheduler that
    raised signals before it exits), every live engine fails, so a dead scheduler never looks like a live one."""
    engines = list(_LIVE_ENGINES)
    found = [(eng, eng.dead_subprocesses()) for eng in engines]
    found = [(eng, dead) for eng, dead in found if dead]
    for eng, dead in found or [(eng, None) for eng in engines]:
        eng._fail(dead)

