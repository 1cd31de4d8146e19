"""Torch rollout engine: batched sampling with a physically bounded, evicting KV cache (docs/SPEC.md §5).

Our own forward over the Hugging Face submodules (docs/kv_cache.md, option C): embed, rotary
embedding, and per layer input_layernorm, q/k/v projections, RoPE, attention over our cache, o_proj,
post_attention_layernorm + MLP; then norm and lm_head (`TorchEngine._forward`). The cache is ours
(actors/engines/batch_cache.py: the call's `Layout`, its `SlotPlan`, the `BatchCache` the forward extends and
compacts, the `KeptEpisode` of a multi-turn episode):

- per layer, K and V buffers `[rows, kv_heads, capacity, head_dim]` with capacity `kv_budget + interval`
  (`full`: prompt + max_new_tokens); a per-(row, KV head) validity mask of the same slots, so padding and
  per-layer, per-head kept sets are exact;
- keys are stored after RoPE at their true positions, so dropping a slot is the same as masking it out;
- every `interval` decode steps (compressor.phase request: the call's steps; aligned: the engine's
  `decode_steps`), if a layer holds more than `kv_budget` slots, `compressors` picks the
  slots to keep from the last `window` queries of that layer and `gather_kv` compacts them in place to the
  front of the buffer (in chunks, so the copy needs no second buffer). A prompt longer than the budget is
  compressed right after its prefill, layer by layer.

Rows are the G samples of every prompt (prompt-major: row = prompt_index * G + sample_index), left-padded
to the longest prompt and decoded together (`TorchEngine._generate`: set up the layout and the cache, prefill,
then per step sample, end the rows that finished, drop them from the batch (their buffers are freed), and run one
decode forward, compressing when due).
`logp_sparse` is float32 log_softmax(logits / temperature) at the sampled token, from this compressed
forward (SPEC §1, pi_sparse); with `SamplingParams.topk_logprobs = K` the K largest values of that same
log-softmax and their token ids come with it (`Sample.topk_logprobs` / `topk_ids`).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from actors.engines.base import (
    EVICTION_NEVER,
    Sample,
    SamplingParams,
    check_params,
    check_score,
    collapsed_heads,
    row_seeds,
)
from actors.engines.batch_cache import (
    KV_ENTRIES,
    BatchCache,
    CacheShape,
    KeptEpisode,
    Layout,
    SlotPlan,
    rebased,
    select_slots,
)
from broker.lora import LoraConfig, adapter_parameters, add_adapter
from compressors import Compressor, CompressorConfig, SelectContext, build_compressor
from compressors.kv_quant import KVQuant, pack_hints

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


class TorchEngine:
    """RolloutEngine on torch for Hugging Face `LlamaForCausalLM` / `Qwen2ForCausalLM` (any dtype, CPU or GPU).

    model: the HF causal LM; its weights are used as they are (no copy); put in eval mode.
    tokenizer: HF tokenizer of the model (EOS ids, stop-string decoding).
    compressor_cfg: `CompressorConfig` (method rkv|snapkv|h2o|streamingllm|random|full, kv_budget, window, interval,
        selection per_head|shared, kv_dtype, kv_budget_bytes: resolved to kv_budget tokens here); validated by
        `build_compressor`; ValueError naming compressor.kv_budget_bytes when it holds no more than window tokens.
    record_evictions: attach to every Sample its own eviction record (`Sample.eviction_steps`, see
        `sample_eviction_steps`: what the learner replays), and keep, after each `generate`,
        `last_eviction_record` (for tests of exactness): dict with
        `prompt_width` P (columns are the left-padded layout: prompt in [P - len, P), response token t at
        P + t) and `evicted_at`: one int64 tensor [rows, kv_heads, P + max_new_tokens] per layer giving the
        column of the first query that no longer sees that key column (int64 max if never evicted). With
        per-prompt `kv_budgets` the batch runs as one sub-batch per budget: `last_eviction_records` holds one
        such record per sub-batch, plus its `prompt_indices` and `kv_budget`.
    lora: learner.lora of the run (broker.lora.LoraConfig); with rank > 0 the model gets the learner's adapter
        layers (broker.lora.add_adapter, the same peft function the learner trains: its target Linear modules
        compute W x + alpha / rank x B A x inside `_forward` and `score`), `expected_weights` lists the adapter's
        tensors only and `load_weights` swaps adapter versions in without touching the base. None or rank 0: none.
    Raises ValueError if the model is not a supported, full-attention Llama/Qwen2, or a LoRA target is not one of
    its linear modules.
    """

    def __init__(self, model, tokenizer, compressor_cfg: CompressorConfig, device: str = "cpu",
                 weight_version: int = 0, record_evictions: bool = False, lora: LoraConfig | None = None):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model.config.model_type={cfg.model_type!r} is not supported; "
                             f"expected one of {SUPPORTED_MODEL_TYPES}")
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"model.config.layer_types={layer_types}: only full-attention layers are supported "
                             "(sliding-window layers would need their own eviction rule)")
        self.model = model.to(device).eval()
        self.adapter = lora is not None and lora.enabled
        if self.adapter:   # in place: self.model keeps its attribute paths, its target modules become peft's
            add_adapter(self.model, lora)
            self.model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.weight_version = weight_version
        self.vocab_size = int(cfg.vocab_size)
        self.record_evictions = record_evictions
        self.last_eviction_record: dict | None = None
        self.last_eviction_records: list[dict] = []
        self.decode_steps = 0
        """Decode forwards this engine has run, all calls and sub-batches (compressor.phase aligned: a row is due
        when this count is a multiple of interval)."""
        self._compressors: dict[int, Compressor] = {}
        self._episodes: dict[str, KeptEpisode] = {}
        attn = model.model.layers[0].self_attn
        self.num_layers = len(model.model.layers)
        self.kv_heads = cfg.num_key_value_heads
        self.q_heads = cfg.num_attention_heads
        self.head_dim = attn.head_dim
        self.kv_quant = KVQuant(compressor_cfg.kv_dtype, compressor_cfg.kv_scale)
        """The precision the batch cache stores K/V at (compressor.kv_dtype / kv_scale, BatchCache)."""
        self.kv_quant.check(self.head_dim)
        self.compressor_cfg = compressor_cfg.with_byte_budget(self.kv_quant.token_bytes(
            self.num_layers, self.kv_heads, self.head_dim, next(model.parameters()).element_size()))
        """The compressor config the engine runs: compressor.kv_budget_bytes resolved to kv_budget tokens at this
        model's shape and kv_dtype (CompressorConfig.with_byte_budget)."""
        self.compressor = build_compressor(self.compressor_cfg)
        # apply_rotary_pos_emb of the model's own modeling file (identical for Llama and Qwen2).
        self._apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = set(eos)

    # ------------------------------------------------------------------ weights
    def manifest(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(HF parameter name, shape, dtype) of every distinct parameter (tied `lm_head.weight` is listed once,
        as `model.embed_tokens.weight`)."""
        return [(name, tuple(p.shape), p.dtype) for name, p in self.model.named_parameters()]

    def expected_weights(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(HF name, shape, dtype) of every weight of the model, tied aliases included (what the weight receiver
        checks a manifest against: RolloutEngine.expected_weights); with a LoRA adapter, the adapter's tensors only
        (broker.lora.adapter_parameters: what the learner sends)."""
        named = adapter_parameters(self.model) if self.adapter else self.model.named_parameters(remove_duplicate=False)
        return [(name, tuple(p.shape), p.dtype) for name, p in named]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy tensors into the model by HF parameter name, then set `weight_version = version`.

        named_tensors: (name, tensor) pairs; a subset of the parameters is allowed (bucketed sync). With tied
            embeddings `lm_head.weight` and `model.embed_tokens.weight` name the same tensor.
        Raises ValueError listing every unknown name and every shape/dtype mismatch, before anything changes.
        """
        params = dict(self.model.named_parameters(remove_duplicate=False))
        pairs = list(named_tensors)
        errors = []
        for name, tensor in pairs:
            if name not in params:
                errors.append(f"unknown parameter name {name!r}")
            elif tuple(tensor.shape) != tuple(params[name].shape) or tensor.dtype != params[name].dtype:
                errors.append(f"{name}: got shape {tuple(tensor.shape)} dtype {tensor.dtype}, expected shape "
                              f"{tuple(params[name].shape)} dtype {params[name].dtype}")
        if self._episodes:
            errors.append(f"{len(self._episodes)} episodes hold KV caches of weight version {self.weight_version} "
                          "(release_episodes first)")
        if errors:
            raise ValueError(f"load_weights(version={version}) rejected, nothing was loaded: " + "; ".join(errors))
        with torch.no_grad():
            for name, tensor in pairs:
                params[name].copy_(tensor)
        self.weight_version = version

    @torch.inference_mode()
    def score(self, token_ids: list[list[int]]) -> list[np.ndarray]:
        """Teacher-forced log-probs of the current weights (RolloutEngine.score): per sequence float32 [len - 1],
        log_softmax of the HF model's own dense forward (no cache, nothing compressed) at each next token; one
        forward per distinct length (the probe's sequences: one). Raises ValueError for no sequences, one shorter
        than 2 tokens, or an id outside [0, vocab_size)."""
        check_score(token_ids, self.vocab_size)
        out: list[np.ndarray | None] = [None] * len(token_ids)
        for length in sorted({len(ids) for ids in token_ids}):
            rows = [i for i, ids in enumerate(token_ids) if len(ids) == length]
            ids = torch.tensor([token_ids[i] for i in rows], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            logp = logits.log_softmax(-1).gather(2, ids[:, 1:, None])[..., 0]
            for i, row in zip(rows, logp.cpu().numpy()):
                out[i] = row.astype(np.float32)
        return out

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, kv_budgets: list[int] | None = None,
                 episodes: list[str] | None = None) -> list[list[Sample]]:
        """Sample `params.n` responses for each prompt (token ids) in one batch; one list of n Samples per prompt.

        Sampling: temperature > 0 samples from softmax(logits / temperature), optionally truncated by top_k /
        top_p (evaluation only: logp_sparse stays the untruncated log-prob); temperature 0 is greedy with
        logp_sparse = log_softmax(logits). A response ends on an EOS id (kept in the response), when its
        decoded text contains a stop string (the token completing it is kept), or after max_new_tokens.

        kv_budgets: one budget (tokens) per prompt, or None for `compressor_cfg.kv_budget` everywhere (schedules,
            controller, difficulty tiers: docs/SPEC.md §5.1). With `compressor_cfg.budget_schedule` length it
            is the start budget: after t generated tokens every compression keeps
            compressors.budget.length_budget(cfg, start, t) slots, and the cache is allocated for the largest.
            Prompts with equal budgets are decoded together; each distinct budget gets its own sub-batch with its own
            cache of `budget + interval` slots, so every row is exact for, and its KV bytes bounded by, its own budget
            (sub-batches run one after another; with several, sub-batch k samples with seed `params.seed + k`).
        episodes: one key per prompt (params.n must be 1): multi-turn, the episode's cache is kept after the call
            (compressed or dense, as it is when the turn ends) until `release_episodes`. For a key the engine does
            not hold the prompt starts the episode; for a key it holds the prompt is the ids appended since the
            episode's last sampled token (template boundary, observation, next assistant header): they are
            prefilled into the kept cache at their true positions (continuing from the episode's length, not from
            the slots it retains), with the last sampled token before them, then the turn is decoded. With
            `compressor.protect_observation` (default) they are not eviction candidates at that prefill (see
            CompressorConfig). The Sample's prompt_ids are the ids given; its eviction_steps (record_evictions)
            cover the whole episode so far: [layers, heads, first prompt + every later id], steps counted from
            the end of the episode's first prompt. Without episodes nothing is kept (one first turn per row).
        Raises ValueError naming the field for empty prompts, invalid sampling values, a kv_budgets list of
        the wrong length or with a budget the compressor config rejects (e.g. <= window), an episodes list of
        the wrong length, with repeated keys, or with params.n != 1.
        """
        check_params(prompts, params)
        if episodes is not None and (len(episodes) != len(prompts) or len(set(episodes)) != len(episodes)
                                     or params.n != 1):
            raise ValueError(f"episodes: {len(episodes)} keys ({len(set(episodes))} distinct) for {len(prompts)} "
                             f"prompts with SamplingParams.n={params.n}: expected one distinct key per prompt, n=1")
        if kv_budgets is None:
            return self._generate(prompts, params, self.compressor, episodes)
        if len(kv_budgets) != len(prompts):
            raise ValueError(f"kv_budgets has {len(kv_budgets)} values for {len(prompts)} prompts")
        distinct = sorted(set(int(b) for b in kv_budgets))
        out: list[list[Sample] | None] = [None] * len(prompts)
        records = []
        for k, budget in enumerate(distinct):
            index = [i for i, b in enumerate(kv_budgets) if int(b) == budget]
            sub = (params if len(distinct) == 1 or params.seed is None
                   else dataclasses.replace(params, seed=params.seed + k))
            keys = None if episodes is None else [episodes[i] for i in index]
            for i, samples in zip(index, self._generate([prompts[i] for i in index], sub, self.compressor_for(budget),
                                                        keys)):
                out[i] = samples
            if self.record_evictions:
                records.append({**self.last_eviction_record, "prompt_indices": index, "kv_budget": budget})
        if self.record_evictions:
            self.last_eviction_records = records
        return out

    def release_episodes(self, keys: Iterable[str]) -> int:
        """Free the kept caches of these episodes (keys the engine does not hold are ignored); returns how many
        were held."""
        return sum(self._episodes.pop(k, None) is not None for k in keys)

    def episode_kv_bytes(self, key: str) -> int:
        """K/V bytes an episode's kept cache holds between its turns (its retained slots, all layers). Raises
        KeyError for a key the engine does not hold."""
        return sum(t.nbytes for layer in self._episodes[key].layers for name, t in layer.items()
                   if name in KV_ENTRIES)

    def shutdown(self) -> None:
        """Drop the kept episodes (the torch engine starts no process)."""
        self._episodes.clear()

    def engine_stats(self) -> dict[str, float]:
        """None of its own: the torch engine's KV bytes are per sample (`Sample.kv_peak_bytes`)."""
        return {}

    def compressor_for(self, budget: int) -> Compressor:
        """The compressor of `compressor_cfg` with kv_budget = budget (cached). Raises ValueError naming the
        field if that budget is not a valid setting (e.g. <= window)."""
        if budget == self.compressor_cfg.kv_budget:
            return self.compressor
        if budget not in self._compressors:
            self._compressors[budget] = build_compressor(dataclasses.replace(
                self.compressor_cfg, kv_budget=int(budget), budget_schedule="constant", budget_control="off",
                budget_tiers="off"))
        return self._compressors[budget]

    def _generate(self, prompts: list[list[int]], params: SamplingParams, compressor: Compressor,
                  keys: list[str] | None = None) -> list[list[Sample]]:
        """`generate` of one batch with one compressor (one budget); `keys`: the rows' episodes (n = 1), or None.

        Rows are the G samples of every prompt (row = prompt_index * G + sample_index). One prefill forward over
        the ids the call prefills, then one decode forward per generated token of the live rows (compressing when
        due); a row that ends leaves the batch, its Sample (and, with keys, its kept episode) made at once."""
        rows = [p for p in prompts for _ in range(params.n)]
        states = [self._episodes.pop(k, None) for k in keys] if keys is not None else [None] * len(rows)
        layout = Layout.of(rows, states, params.max_new_tokens, self.device)
        plan = SlotPlan.of(compressor.cfg, self.compressor_cfg, layout.kept, layout.new, params.max_new_tokens)
        cache = BatchCache(self._cache_shape(), len(rows), plan.capacity, compressor.cfg.window,
                           mass=compressor.needs_attention_mass,
                           columns=layout.columns if self.record_evictions else None,
                           positions="positions" in compressor.needs,
                           hints=self.record_evictions and self.kv_quant.stores)
        cache.load(states, layout)
        gen = _generator(params.seed, self.device)
        cache.seed, cache.prompt_len = _row_seeds(params.seed, len(rows), gen, self.device, compressor), \
            torch.tensor(layout.first_prompt, dtype=torch.long, device=self.device)
        # prefill: the new ids (dense causal) over the kept cache; compressed right after when over the budget
        logits = self._forward(layout.ids, layout.positions, cache, layout.width - 1, compressor,
                               compact_to=plan.filled if plan.compress_prefill else None,
                               prefill=(layout.prefill_visible(), layout.key_valid),
                               candidates=layout.kept if plan.protect else None)
        peak_bytes = cache.peak_bytes(plan.chunk_slots)
        out = _Responses(rows, params, self.eos_ids, self.tokenizer)
        next_pos, step = layout.positions[:, -1] + 1, 0                      # [R_live] the next true positions
        while True:
            tok, lp, top = _sample(logits, params, gen)                      # [R_live] int64, [R_live] float32
            finished = out.add(cache.row_ids.tolist(), tok, lp, top)
            for i, r, reason in finished:
                out.end(r, reason, cache.retained(i), peak_bytes, float(cache.protected_fraction[i]))
                if keys is not None:
                    self._episodes[keys[r]] = cache.kept_episode(i, r, layout, out.ids[r])
            if len(finished) == len(cache.row_ids):
                break
            if finished:                                                     # finished rows leave the batch
                live = cache.drop([i for i, _, _ in finished])
                tok, next_pos = tok[live], next_pos[live]
            step += 1                                        # = tokens generated so far, the same for every row
            self.decode_steps += 1
            now = plan.budget_at(step)
            logits = self._forward(tok[:, None], next_pos[:, None], cache, layout.width + step - 1,
                                   self.compressor_for(now) if plan.grows else compressor,
                                   compact_to=plan.compact_to(step, self.decode_steps, cache.n))
            next_pos = next_pos + 1
        if self.record_evictions:
            self._attach_records(cache, layout, out.samples, keys)
        return [out.samples[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def _cache_shape(self) -> CacheShape:
        """The batch cache's sizes for this model (its dtype now, the engine's device)."""
        return CacheShape(self.num_layers, self.kv_heads, self.q_heads, self.head_dim, self.model.dtype, self.device,
                          self.kv_quant)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: BatchCache, col: int,
                 compressor: Compressor, compact_to: int | None, prefill: tuple | None = None,
                 candidates: int | None = None) -> torch.Tensor:
        """One forward of `tokens` int64 [R, q] at true `positions` int64 [R, q] through the model and `cache` (in
        place); returns float32 logits [R, vocab] at the last position.

        col: layout column of the last token. prefill: (visible bool [R, 1, q, q], key_valid bool [R, q]) for the
            new ids (BatchCache.prefill: after n kept slots, the queries see them too), None for a decode step
            (q = 1, BatchCache.append). compact_to: None keeps every slot (n += q); else each layer is compacted
            (select_slots, BatchCache.compact) and holds compact_to slots after: the budget (of the step, with
            budget_schedule length), or, with `candidates` = n (protect_observation), the first n slots compacted
            to the budget and the q new ones after them.
        """
        m, hd = self.model.model, self.head_dim
        R, q = tokens.shape
        h = m.embed_tokens(tokens)
        cos, sin = m.rotary_emb(h, positions)
        keep, shares = None, []                                              # selection "shared": from layer 0
        ctx = SelectContext(prompt_len=cache.prompt_len, seed=cache.seed, event=positions[:, -1] + 1)
        for li, layer in enumerate(m.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            qs, ks, vs = (p(x).view(R, q, -1, hd).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            qs, ks = self._apply_rope(qs, ks, cos, sin)
            slots, visible = (cache.append(li, ks, vs, col, positions) if prefill is None
                              else cache.prefill(li, ks, vs, col, positions, *prefill))
            k, v = cache.read(slots)                             # stored precision, also for the new tokens
            out, probs = _attend(qs, k, v, visible, attn.scaling, want_probs="mass" in cache.layers[li])
            h = h + attn.o_proj(out.transpose(1, 2).reshape(R, q, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            cache.observe(li, slots, qs, probs, None if prefill is None else prefill[1])
            if compact_to is None:
                cache.store(li, slots, prefill is not None)
                continue
            if keep is None or compressor.cfg.selection != "shared":
                keep, share = select_slots(compressor, {**slots, "k": k, "v": v}, cache.qwin[li], candidates,
                                           dataclasses.replace(ctx, layer=li))
            shares.append(share)
            cache.compact(li, slots, keep, col)
        cache.n = cache.n + q if compact_to is None else compact_to
        if compact_to is not None and compressor.cfg.protects:
            cache.protected_fraction = torch.stack(shares).mean(0)
        return self.model.lm_head(m.norm(h[:, -1])).float()

    def _attach_records(self, cache: BatchCache, layout: Layout, samples: list[Sample],
                        keys: list[str] | None) -> None:
        """record_evictions: `last_eviction_record` of the call, each Sample's eviction_steps (its episode's tokens
        so far), and each kept episode's record re-based to its token index."""
        self.last_eviction_record = {"prompt_width": layout.width, "evicted_at": cache.evicted_at}
        by_row = torch.stack(cache.evicted_at, 1).cpu()                      # [R, layers, Hkv, P + max_new]
        for r, s in enumerate(samples):
            first = layout.first_prompt[r]                                   # the episode's first prompt
            start, total = int(layout.pad[r]), layout.prefix(r) + len(s.response_ids)   # its tokens in the layout
            s.eviction_steps = sample_eviction_steps(by_row[r], start + first, first, total - first)
            hints = cache.row_hints(r, start) if cache.hints is not None else None
            if hints is not None:
                s.rounding_hints = sample_rounding_hints(hints, self.kv_heads, self.head_dim, total)
            if keys is not None:
                self._episodes[keys[r]].evicted_at = rebased(by_row[r, :, :, start:start + total], -start)
                self._episodes[keys[r]].hints = hints


class _Responses:
    """The responses of one call's rows as they are sampled, by original row: ids, logp_sparse, top-k steps, and
    each row's Sample once it ends."""

    def __init__(self, rows: list[list[int]], params: SamplingParams, eos_ids: set[int], tokenizer):
        self.rows, self.params, self.eos_ids, self.tokenizer = rows, params, eos_ids, tokenizer
        self.ids: list[list[int]] = [[] for _ in rows]
        self.logps: list[list[float]] = [[] for _ in rows]
        self.topks: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in rows]  # (ids, logprobs) per step
        self.samples: list[Sample | None] = [None] * len(rows)
        self.stop_tail = max((len(s) for s in params.stop_strings), default=0) + 1  # tokens decoded for the check

    def add(self, row_ids: list[int], tok: torch.Tensor, lp: torch.Tensor, top) -> list[tuple[int, int, str]]:
        """One sampled token per live row (original rows `row_ids`): tok int64 [R], lp float32 [R], top (log-probs,
        ids) [R, K] or None. Returns (live index, row, finish_reason) of each row that ended, in live order."""
        finished = []
        for i, (r, t, lpt) in enumerate(zip(row_ids, tok.tolist(), lp.tolist())):
            self.ids[r].append(t)
            self.logps[r].append(lpt)
            if top is not None:
                self.topks[r].append((top[1][i], top[0][i]))
            reason = self._finish_reason(self.ids[r])
            if reason is not None:
                finished.append((i, r, reason))
        return finished

    def _finish_reason(self, ids: list[int]) -> str | None:
        """'stop' (EOS, unless ignore_eos; a stop string in the decoded tail), 'length' (max_new_tokens), or None."""
        p = self.params
        if ids[-1] in self.eos_ids and not p.ignore_eos:
            return "stop"
        if p.stop_strings and any(s in self.tokenizer.decode(ids[-self.stop_tail:]) for s in p.stop_strings):
            return "stop"
        return "length" if len(ids) >= p.max_new_tokens else None

    def end(self, r: int, reason: str, kv_retained_tokens: int, kv_peak_bytes: int,
            kv_protected_fraction: float = 0.0) -> None:
        """Row r's Sample, with its cache's retained slots, peak K/V bytes and protected share."""
        self.samples[r] = Sample(prompt_ids=list(self.rows[r]), response_ids=self.ids[r],
                                 logp_sparse=np.asarray(self.logps[r], dtype=np.float32), finish_reason=reason,
                                 kv_retained_tokens=kv_retained_tokens, kv_peak_bytes=int(kv_peak_bytes),
                                 kv_protected_fraction=kv_protected_fraction, **_stacked_topk(self.topks[r]))


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    """The sampling generator: seeded with `seed`, or non-deterministically when None."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def _row_seeds(seed: int | None, rows: int, gen: torch.Generator, device, compressor: Compressor) -> torch.Tensor:
    """Each row's sample seed for the compressor (method random's hash), int64 [rows]: `row_seeds(base, rows)`
    (actors/engines/base.py; the SGLang engine gives its requests the same, `compressor_seeds`), base =
    SamplingParams.seed, or with none one draw of the call's generator (only when the compressor reads seeds, so
    seeded sampling draws the same tokens with any compressor); zeros when it reads none."""
    if "seed" not in compressor.needs:
        return torch.zeros(rows, dtype=torch.long, device=device)
    base = seed if seed is not None else int(torch.randint(2**62, (1,), generator=gen, device=gen.device))
    return torch.tensor(row_seeds(base, rows), dtype=torch.long, device=device)


def sample_eviction_steps(evicted_at: torch.Tensor, prompt_width: int, prompt_len: int,
                          response_len: int) -> np.ndarray:
    """One row's eviction record cut to its own tokens and re-based: `evicted_at` int64 [layers, Hkv, P + max_new]
    (column of the first query that no longer sees each key column, int64 max = never) -> uint16 [layers, heads,
    prompt_len + response_len], the response tokens generated when each key was evicted (a prompt compressed at
    prefill: 0), 65535 = never; heads 1 when every KV head of every layer holds the same values (shared selection).
    Raises ValueError when a value does not fit uint16 (max_new_tokens >= 65535)."""
    cut = evicted_at[:, :, prompt_width - prompt_len:prompt_width + response_len]
    never = cut == torch.iinfo(torch.long).max
    steps = torch.where(never, 0, cut - prompt_width)
    if bool((steps[~never] >= 65535).any()) or bool((steps < 0).any()):
        raise ValueError("eviction record: steps outside [0, 65535) (max_new_tokens must be < 65535 to replay)")
    return collapsed_heads(torch.where(never, EVICTION_NEVER, steps).to(torch.int32).numpy().astype(np.uint16))


def sample_rounding_hints(hints: torch.Tensor, kv_heads: int, head_dim: int, tokens: int) -> np.ndarray:
    """One row's rounding hints (BatchCache.row_hints: int64 [n, 6], layer, 0 for K / 1 for V, KV head, token index
    over the sample's own tokens, element, code bits) as `Sample.rounding_hints`: int64 [n], ascending, each the
    element's flat index into [layers, 2, kv_heads, tokens, head_dim] (tokens = P + T) shifted left by
    HINT_CODE_BITS, or'd with its code bits (compressors.kv_quant.pack_hints)."""
    layer, kv, head, token, element, bits = hints.unbind(1)
    index = (((layer * 2 + kv) * kv_heads + head) * tokens + token) * head_dim + element
    return pack_hints(index, bits).numpy()


def _attend(q, k, v, visible, scale, want_probs):
    """Grouped-query attention. q [R, Hq, q, D]; k, v [R, Hkv, S, D]; visible bool [R, 1 or Hkv, q, S].

    Returns (out [R, Hq, q, D], probs float32 [R, Hq, q, S] if want_probs else None). Query head h reads
    KV head h // (Hq / Hkv), as HF's repeat_kv.
    """
    R, Hq, ql, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.reshape(R, Hkv, G * ql, D)
    mask = visible[:, :, None].expand(R, visible.shape[1], G, ql, S).reshape(R, visible.shape[1], G * ql, S)
    if not want_probs:
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        return out.view(R, Hq, ql, D), None
    scores = (qg @ k.transpose(-1, -2)).float() * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = probs.to(v.dtype) @ v
    return out.view(R, Hq, ql, D), probs.view(R, Hq, ql, S)


def _sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator):
    """Draw one token per row from float32 logits [R, vocab]; returns (tokens int64 [R], logp_sparse float32 [R],
    top) with top = (log-probs float32 [R, K], ids int64 [R, K]) of the K = params.topk_logprobs most likely
    tokens of the same log-softmax (descending), or None when K = 0."""
    logp = logits.log_softmax(-1) if params.temperature == 0 else (logits / params.temperature).log_softmax(-1)
    top = None
    if params.topk_logprobs > 0:
        top = logp.topk(min(params.topk_logprobs, logp.shape[-1]), dim=-1)
    if params.temperature == 0:
        tok = logp.argmax(-1)
        return tok, logp.gather(1, tok[:, None])[:, 0], top
    probs = logp.exp()
    if params.top_k > 0:
        kth = probs.topk(min(params.top_k, probs.shape[-1]), dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p * sorted_p.sum(-1, keepdim=True)
        probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
    tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return tok, logp.gather(1, tok[:, None])[:, 0], top


def _stacked_topk(steps: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """One row's per-step (ids [K], log-probs [K]) as Sample fields topk_ids int32 [T, K], topk_logprobs
    float32 [T, K]; {} when the row recorded none (topk_logprobs off)."""
    if not steps:
        return {}
    return {"topk_ids": torch.stack([i for i, _ in steps]).to(torch.int32).cpu().numpy(),
            "topk_logprobs": torch.stack([lp for _, lp in steps]).float().cpu().numpy()}
