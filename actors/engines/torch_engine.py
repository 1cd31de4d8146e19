"""Torch rollout engine: batched sampling with a physically bounded, evicting KV cache (docs/SPEC.md §5).

Our own forward over the Hugging Face submodules (docs/kv_cache.md, option C): embed, rotary
embedding, and per layer input_layernorm, q/k/v projections, RoPE, attention over our cache, o_proj,
post_attention_layernorm + MLP; then norm and lm_head. The cache is ours:

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
to the longest prompt and decoded together; finished rows leave the batch (their buffers are freed).
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

from actors.engines.base import Sample, SamplingParams, check_params, check_score

# COMPACT_CHUNK: slots moved per step of the in-place compaction (the only extra K/V memory an eviction needs);
# actors/engines/kv_memory.py predicts this engine's KV bytes.
from actors.engines.kv_memory import COMPACT_CHUNK
from compressors import Compressor, CompressorConfig, accumulate_attention, build_compressor, gather_kv
from compressors.budget import length_budget

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


class TorchEngine:
    """RolloutEngine on torch for Hugging Face `LlamaForCausalLM` / `Qwen2ForCausalLM` (any dtype, CPU or GPU).

    model: the HF causal LM; its weights are used as they are (no copy); put in eval mode.
    tokenizer: HF tokenizer of the model (EOS ids, stop-string decoding).
    compressor_cfg: `CompressorConfig` (method rkv|snapkv|h2o|streamingllm|full, kv_budget, window, interval,
        selection per_head|shared); validated by `build_compressor`.
    record_evictions: attach to every Sample its own eviction record (`Sample.eviction_steps`, see
        `sample_eviction_steps`: what the learner replays), and keep, after each `generate`,
        `last_eviction_record` (for tests of exactness): dict with
        `prompt_width` P (columns are the left-padded layout: prompt in [P - len, P), response token t at
        P + t) and `evicted_at`: one int64 tensor [rows, kv_heads, P + max_new_tokens] per layer giving the
        column of the first query that no longer sees that key column (int64 max if never evicted). With
        per-prompt `kv_budgets` the batch runs as one sub-batch per budget: `last_eviction_records` holds one
        such record per sub-batch, plus its `prompt_indices` and `kv_budget`.
    Raises ValueError if the model is not a supported, full-attention Llama/Qwen2.
    """

    def __init__(self, model, tokenizer, compressor_cfg: CompressorConfig, device: str = "cpu",
                 weight_version: int = 0, record_evictions: bool = False):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model.config.model_type={cfg.model_type!r} is not supported; "
                             f"expected one of {SUPPORTED_MODEL_TYPES}")
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"model.config.layer_types={layer_types}: only full-attention layers are supported "
                             "(sliding-window layers would need their own eviction rule)")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.compressor_cfg = compressor_cfg
        self.compressor = build_compressor(compressor_cfg)
        self.weight_version = weight_version
        self.vocab_size = int(cfg.vocab_size)
        self.record_evictions = record_evictions
        self.last_eviction_record: dict | None = None
        self.last_eviction_records: list[dict] = []
        self.decode_steps = 0
        """Decode forwards this engine has run, all calls and sub-batches (compressor.phase aligned: a row is due
        when this count is a multiple of interval)."""
        self._compressors: dict[int, Compressor] = {}
        self._episodes: dict[str, _Episode] = {}
        attn = model.model.layers[0].self_attn
        self.num_layers = len(model.model.layers)
        self.kv_heads = cfg.num_key_value_heads
        self.q_heads = cfg.num_attention_heads
        self.head_dim = attn.head_dim
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
        checks a manifest against: RolloutEngine.expected_weights)."""
        return [(name, tuple(p.shape), p.dtype) for name, p in self.model.named_parameters(remove_duplicate=False)]

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

    @property
    def held_episodes(self) -> list[str]:
        """Keys of the episodes whose caches the engine keeps (see `generate`'s episodes)."""
        return list(self._episodes)

    def episode_kv_bytes(self, key: str) -> int:
        """K/V bytes an episode's kept cache holds between its turns (its retained slots, all layers). Raises
        KeyError for a key the engine does not hold."""
        return sum(layer["k"].nbytes + layer["v"].nbytes for layer in self._episodes[key].layers)

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
        """`generate` of one batch with one compressor (one budget); `keys`: the rows' episodes (n = 1), or None."""
        cc = compressor.cfg
        compress = cc.method != "full"
        hkv, hd = self.kv_heads, self.head_dim
        dev = self.device
        G, max_new = params.n, params.max_new_tokens

        rows = [p for p in prompts for _ in range(G)]
        states = [self._episodes.pop(k, None) for k in keys] if keys is not None else [None] * len(rows)
        # the ids this call prefills: a kept episode's last sampled token (never fed) first, then the given ids
        new_ids = [([st.pending] if st else []) + list(p) for p, st in zip(rows, states)]
        R, M = len(rows), max(len(p) for p in new_ids)
        done = torch.tensor([st.length if st else 0 for st in states], device=dev)   # tokens already in the cache
        lens = torch.tensor([len(p) for p in new_ids], device=dev)
        P = int((done + lens).max())                     # layout width: row r's tokens end at column P - 1
        pad = P - done - lens                            # layout column = episode token index + pad
        ids = torch.zeros(R, M, dtype=torch.long, device=dev)
        for r, p in enumerate(new_ids):
            ids[r, M - len(p):] = torch.tensor(p, dtype=torch.long)
        cols = torch.arange(M, device=dev)
        key_valid = cols[None, :] >= (M - lens)[:, None]                                   # [R, M]
        positions = (cols[None, :] - (M - lens)[:, None] + done[:, None]).clamp(min=0)     # [R, M] true positions
        old = max((st.slots for st in states if st), default=0)    # kept slots, left-padded to one width

        budget = cc.kv_budget                           # the start budget; budget_schedule length grows it per step
        grows = compress and self.compressor_cfg.budget_schedule == "length"
        largest = length_budget(self.compressor_cfg, budget, max_new) if grows else budget
        protect = old > 0 and self.compressor_cfg.protect_observation      # the new ids are not candidates now
        compress_now = compress and (old > budget if protect else old + M > budget)
        n = (budget + M if protect else budget) if compress_now else old + M       # filled slots after the prefill
        capacity = min(max(n, largest) + cc.interval, n + max_new) if compress else n + max_new
        capacity = max(capacity, old + M if old else 0)            # a kept cache is extended in place
        cache, qwin, evicted_at = self._batch_cache(states, R, old, capacity, pad, P + max_new, compressor)
        buffer_bytes = sum(c["k"].nbytes + c["v"].nbytes for c in cache) // R      # per sequence, all layers

        gen = torch.Generator(device=dev)
        if params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(params.seed)

        # ---- prefill: dense causal attention over the new ids (a pad query sees itself, so no row is empty) and
        # the kept cache; a prompt longer than the budget (a kept cache: its older part) is compressed right after.
        eye = torch.eye(M, dtype=torch.bool, device=dev)
        visible = ((cols[None, :] <= cols[:, None]) & (key_valid[:, None, :] | eye))[:, None]   # [R, 1, M, M]
        logits, transient_bytes = self._forward(ids, positions, cache, qwin, evicted_at, n=old, col=P - 1,
                                                prefill=(visible, key_valid), compress_now=compress_now,
                                                row_ids=torch.arange(R, device=dev), compressor=compressor,
                                                candidates=old if protect else None)
        # Peak K/V bytes per sequence: the buffers plus the largest transient beside them (one layer's prompt
        # K/V at prefill, or one compaction chunk). Validity and scores are not K/V and are not counted.
        chunk_bytes = 2 * min(COMPACT_CHUNK, largest) * hkv * hd * cache[0]["k"].element_size() if compress else 0
        peak_bytes = buffer_bytes + max(transient_bytes // R, chunk_bytes)

        row_ids = torch.arange(R, device=dev)                                # original row of each live row
        next_pos = positions[:, -1] + 1
        responses: list[list[int]] = [[] for _ in range(R)]
        logps: list[list[float]] = [[] for _ in range(R)]
        topks: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(R)]   # (ids, logprobs) per step
        results: list[Sample | None] = [None] * R
        stop_tail = max((len(s) for s in params.stop_strings), default=0) + 1  # tokens decoded for the stop check
        step = 0
        while True:
            tok, lp, top = _sample(logits, params, gen)                      # [R_live] int64, [R_live] float32
            finished = []
            for i, (r, t, lpt) in enumerate(zip(row_ids.tolist(), tok.tolist(), lp.tolist())):
                responses[r].append(t)
                logps[r].append(lpt)
                if top is not None:
                    topks[r].append((top[1][i], top[0][i]))
                reason = None
                if t in self.eos_ids and not params.ignore_eos:
                    reason = "stop"
                elif params.stop_strings and any(
                        s in self.tokenizer.decode(responses[r][-stop_tail:]) for s in params.stop_strings):
                    reason = "stop"
                elif len(responses[r]) >= max_new:
                    reason = "length"
                if reason is not None:
                    finished.append(i)
                    results[r] = Sample(prompt_ids=list(rows[r]), response_ids=responses[r],
                                        logp_sparse=np.asarray(logps[r], dtype=np.float32), finish_reason=reason,
                                        kv_retained_tokens=int(cache[0]["valid"][i, 0, :n].sum()),
                                        kv_peak_bytes=int(peak_bytes), **_stacked_topk(topks[r]))
                    if keys is not None:
                        self._episodes[keys[r]] = _kept_episode(cache, qwin, i, n, int(pad[r]), states[r], t,
                                                                int(P - pad[r]) + len(responses[r]) - 1,
                                                                len(rows[r]))
            if len(finished) == len(row_ids):
                break
            if finished:                                                     # finished rows leave the batch
                live = torch.ones(len(row_ids), dtype=torch.bool, device=dev)
                live[finished] = False
                keep_rows = live.nonzero().squeeze(1)
                cache = [{name: t.index_select(0, keep_rows) for name, t in c.items()} for c in cache]
                qwin = [w.index_select(0, keep_rows) for w in qwin]
                row_ids, tok, next_pos = row_ids[keep_rows], tok[keep_rows], next_pos[keep_rows]

            step += 1                                        # = tokens generated so far, the same for every row
            self.decode_steps += 1
            now = length_budget(self.compressor_cfg, budget, step) if grows else budget
            due_step = self.decode_steps if cc.phase == "aligned" else step
            compress_now = compress and due_step % cc.interval == 0 and n + 1 > now
            logits, _ = self._forward(tok[:, None], next_pos[:, None], cache, qwin, evicted_at, n=n,
                                      col=P + step - 1, prefill=None, compress_now=compress_now, row_ids=row_ids,
                                      compressor=self.compressor_for(now) if grows else compressor)
            n = now if compress_now else n + 1
            next_pos = next_pos + 1

        if self.record_evictions:
            self.last_eviction_record = {"prompt_width": P, "evicted_at": evicted_at}
            by_row = torch.stack(evicted_at, 1).cpu()                          # [R, layers, Hkv, P + max_new]
            for r, s in enumerate(results):
                first = states[r].prompt_len if states[r] else len(s.prompt_ids)   # the episode's first prompt
                start, total = int(pad[r]), int(P - pad[r]) + len(s.response_ids)  # its tokens in the layout
                s.eviction_steps = sample_eviction_steps(by_row[r], start + first, first, total - first)
                if keys is not None:
                    self._episodes[keys[r]].evicted_at = _rebased(by_row[r, :, :, start:start + total], -start)
        return [results[i * G:(i + 1) * G] for i in range(len(prompts))]

    def _batch_cache(self, states: list, R: int, old: int, capacity: int, pad: torch.Tensor, columns: int,
                     compressor: Compressor):
        """The call's cache: per layer K/V/validity (+ H2O mass, + record columns) [R, Hkv, capacity, ...] with each
        kept episode's slots in [old - its slots, old) (layout columns: + pad); the last queries per layer
        [R, Hq, w, D] (zeros before a row's own; None without kept state); with record_evictions, evicted_at per
        layer [R, Hkv, columns] (int64 max = never) holding each kept episode's record so far."""
        dev, dtype, hkv, hd = self.device, self.model.dtype, self.kv_heads, self.head_dim
        never = torch.iinfo(torch.long).max
        cache, qwin, evicted_at = [], [None] * self.num_layers, None
        for _ in range(self.num_layers):
            layer = {"k": torch.zeros(R, hkv, capacity, hd, dtype=dtype, device=dev),
                     "v": torch.zeros(R, hkv, capacity, hd, dtype=dtype, device=dev),
                     "valid": torch.zeros(R, hkv, capacity, dtype=torch.bool, device=dev)}
            if compressor.needs_attention_mass:
                layer["mass"] = torch.zeros(R, hkv, capacity, device=dev)
            if self.record_evictions:
                layer["col"] = torch.full((R, hkv, capacity), -1, dtype=torch.long, device=dev)
            cache.append(layer)
        if self.record_evictions:
            evicted_at = [torch.full((R, hkv, columns), never, dtype=torch.long, device=dev)
                          for _ in range(self.num_layers)]
        if old == 0:
            return cache, qwin, evicted_at
        width = max(st.qwin[0].shape[1] for st in states if st)
        qwin = [torch.zeros(R, self.q_heads, width, hd, dtype=dtype, device=dev) for _ in range(self.num_layers)]
        for r, st in enumerate(states):
            if st is None:
                continue
            for li, (c, kept) in enumerate(zip(cache, st.layers)):
                for name, t in kept.items():
                    c[name][r, :, old - st.slots:old] = t + int(pad[r]) if name == "col" else t
                qwin[li][r, :, width - st.qwin[li].shape[1]:] = st.qwin[li]
                if evicted_at is not None:
                    evicted_at[li][r, :, int(pad[r]):int(pad[r]) + st.evicted_at.shape[2]] = \
                        _rebased(st.evicted_at[li], int(pad[r]))
        return cache, qwin, evicted_at

    def _forward(self, tokens, positions, cache, qwin, evicted_at, n, col, prefill, compress_now, row_ids, compressor,
                 candidates=None):
        """One forward of `tokens` [R, q] at true `positions` [R, q] through the model and our cache (in place).

        prefill: (visible bool [R, 1, q, q], key_valid bool [R, q]) for the new ids. With no kept slots (n = 0) their
            K/V then go to slots [0, q) or, with compress_now, straight to the kept slots; after n kept slots they go
            to slots [n, n + q), which the queries see with the kept ones, and compress_now compacts the layer to
            kv_budget slots, or, with `candidates` = n, its first n slots to kv_budget and the new ones after them.
            None for a decode step (q = 1), whose K/V go to slot n, after which, with compress_now, each layer is
            compacted to kv_budget slots.
        col: column of the last token (left-padded layout); row_ids: original row of each of the R rows.
        Returns (logits float32 [R, vocab] at the last position, bytes of the largest transient K/V tensor).
        """
        m, cc = self.model.model, compressor.cfg
        R, q = tokens.shape
        h = m.embed_tokens(tokens)
        cos, sin = m.rotary_emb(h, positions)
        keep = None                                                          # selection "shared": from layer 0
        transient = 0
        for li, layer in enumerate(m.layers):
            attn, c = layer.self_attn, cache[li]
            x = layer.input_layernorm(h)
            qs = attn.q_proj(x).view(R, q, -1, self.head_dim).transpose(1, 2)
            ks = attn.k_proj(x).view(R, q, -1, self.head_dim).transpose(1, 2)
            vs = attn.v_proj(x).view(R, q, -1, self.head_dim).transpose(1, 2)
            qs, ks = self._apply_rope(qs, ks, cos, sin)
            if prefill is not None:
                visible, key_valid = prefill
                slots = {"k": ks, "v": vs, "valid": key_valid[:, None, :].expand(R, self.kv_heads, q)}
                if "col" in c:
                    slots["col"] = (col + 1 - q + torch.arange(q, device=ks.device)).expand(R, self.kv_heads, q)
                transient = max(transient, ks.nbytes + vs.nbytes)
                if n:                                        # extend the kept cache in place
                    for name, t in slots.items():
                        c[name][:, :, n:n + q] = t
                    # pad queries see only themselves
                    old_seen = c["valid"][:, :, None, :n] & key_valid[:, None, :, None]
                    visible = torch.cat([old_seen, visible.expand(R, self.kv_heads, q, q)], -1)
                    slots = {name: t[:, :, :n + q] for name, t in c.items() if name != "mass"}
            else:
                c["k"][:, :, n], c["v"][:, :, n], c["valid"][:, :, n] = ks[:, :, 0], vs[:, :, 0], True
                if "col" in c:
                    c["col"][:, :, n] = col
                slots = {name: t[:, :, :n + 1] for name, t in c.items()}
                visible = slots["valid"][:, :, None, :]
            out, probs = _attend(qs, slots["k"], slots["v"], visible, attn.scaling, want_probs="mass" in c)
            h = h + attn.o_proj(out.transpose(1, 2).reshape(R, q, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))

            if "mass" in c:                                                  # H2O: accumulated attention
                slots["mass"] = accumulate_attention(c["mass"][:, :, :n], probs)
            if prefill is not None and qwin[li] is None:                     # window: last queries, pads zeroed
                w = min(cc.window, q)
                qwin[li] = qs[:, :, -w:] * key_valid[:, None, -w:, None]
            else:
                new_q = qs if prefill is None else qs * key_valid[:, None, :, None]
                qwin[li] = torch.cat([qwin[li], new_q], dim=2)[:, :, -cc.window:]

            if not compress_now:
                if prefill is not None and not n:
                    for name, t in slots.items():
                        c[name][:, :, :q] = t
                elif "mass" in c:
                    c["mass"][:, :, :slots["mass"].shape[2]] = slots["mass"]
                continue
            if keep is None or cc.selection != "shared":
                keep = self._select(compressor, slots, qwin[li], candidates)
            if evicted_at is not None:                                       # record what this compaction drops
                kept = torch.zeros_like(slots["valid"]).scatter_(2, keep, True)
                r, hh, s = (slots["valid"] & ~kept).nonzero(as_tuple=True)
                evicted_at[li][row_ids[r], hh, slots["col"][r, hh, s]] = col + 1
            # Compact in place with gather_kv: keep is ascending, so chunk j only reads slots >= its destination.
            for j in range(0, keep.shape[2], COMPACT_CHUNK):
                idx = keep[:, :, j:j + COMPACT_CHUNK]
                moved = {name: gather_kv(t, idx) for name, t in slots.items()}
                for name, t in moved.items():
                    c[name][:, :, j:j + idx.shape[2]] = t

        h = m.norm(h[:, -1])
        return self.model.lm_head(h).float(), transient

    @staticmethod
    def _select(compressor: Compressor, slots: dict, queries: torch.Tensor, candidates: int | None) -> torch.Tensor:
        """The slots of one layer to keep, int64 [R, Hkv, k] ascending: compressor.select over every slot, or over
        the first `candidates` only, the later ones all kept after them. Raises RuntimeError if the compressor's
        indices are not strictly ascending."""
        end = slots["k"].shape[2] if candidates is None else candidates
        mass = slots.get("mass")
        keep = compressor.select(slots["k"][:, :, :end], queries, slots["valid"][:, :, :end],
                                 None if mass is None else mass[:, :, :end])
        if end < slots["k"].shape[2]:
            rest = torch.arange(end, slots["k"].shape[2], device=keep.device)
            keep = torch.cat([keep, rest.expand(*keep.shape[:2], rest.shape[0])], -1)
        if not bool((keep[..., 1:] > keep[..., :-1]).all()):
            raise RuntimeError("compressor.select returned slot indices that are not strictly ascending")
        return keep


@dataclasses.dataclass
class _Episode:
    """What the engine keeps of an episode between its turns. layers: per layer {k, v [Hkv, slots, D]; valid
    [Hkv, slots]; mass (H2O) [Hkv, slots]; col (record_evictions): episode token index of each slot}, the
    retained slots in time order; qwin: per layer the last <= window queries [Hq, w, D]; length: tokens whose
    K/V were computed (the next position); pending: the last sampled token (its K/V not yet computed); prompt_len:
    the first prompt's tokens; evicted_at (record_evictions): int64 [layers, Hkv, length + 1] episode token index
    of the first query that no longer saw each key (int64 max = never)."""
    layers: list
    qwin: list
    length: int
    pending: int
    prompt_len: int
    evicted_at: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        return self.layers[0]["k"].shape[1]


def _kept_episode(cache: list, qwin: list, i: int, n: int, pad: int, before: "_Episode | None", pending: int,
                  length: int, prompt_len: int) -> _Episode:
    """Live row i of the batch cache (its first n slots) as a kept episode: its valid slots only, in time order,
    record columns re-based from the layout (- pad) to the episode's token index."""
    count = max(int(c["valid"][i, :, :n].sum(-1).max()) for c in cache)
    layers = []
    for c in cache:
        order = torch.sort((~c["valid"][i, :, :n]).to(torch.int8), dim=-1, stable=True).indices[:, :count]
        kept = {name: gather_kv(t[i:i + 1, :, :n], order[None])[0] for name, t in c.items()}
        if "col" in kept:
            kept["col"] = kept["col"] - pad
        layers.append(kept)
    return _Episode(layers, [w[i].clone() for w in qwin], length, pending,
                    before.prompt_len if before is not None else prompt_len)


def _rebased(evicted_at: torch.Tensor, shift: int) -> torch.Tensor:
    """Column values of an eviction record shifted by `shift` (int64 max, never, stays)."""
    never = torch.iinfo(torch.long).max
    return torch.where(evicted_at == never, never, evicted_at + shift)


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
    steps = torch.where(never, 65535, steps).to(torch.int32).numpy().astype(np.uint16)
    if (steps == steps[:, :1]).all():
        steps = steps[:, :1]
    return np.ascontiguousarray(steps)


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
