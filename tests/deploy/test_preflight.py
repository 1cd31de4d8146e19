"""KV capacity preflight (docs/SPEC.md §5.1): the byte formula by hand, the prediction against the torch engine's
measured peak KV bytes on real model files (several configs, within 10%), and the start / fail rules; the learner's
sizing (full fine-tuning and LoRA) by hand and against a real learner's measured state."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from actors.engines.base import SamplingParams
from actors.engines.kv_memory import (
    ModelShape,
    compression_event_bytes,
    kv_peak_bytes_per_sequence,
    query_ring_bytes,
    record_bytes_per_request,
)
from broker.lora import LoraConfig
from deploy.config import load_config
from deploy.model_cache import TINY_LLAMA, resolve_model
from deploy.preflight import PreflightError, learner_memory, lora_parameter_count, preflight
from learner.config import LearnerConfig

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]


def test_formula_by_hand():
    # 2 layers x 2 KV heads x head_dim 16 x 4 B: K+V of one token in one layer = 2*2*16*4 = 256 B.
    shape = ModelShape(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)
    assert shape.bytes_per_token == 512
    # prompt 101, 32 new, budget 48 + interval 16: capacity min(48+16, min(101,48)+32) = 64 slots
    # buffers 2 layers * 256 * 64 = 32,768; transient max(prompt 256*101 = 25,856, chunk 256*32 = 8,192) -> 58,624
    assert kv_peak_bytes_per_sequence(shape, 101, 32, 48, 16, compress=True) == 58_624
    # dense: capacity 101 + 32 = 133 -> 2 * 256 * 133 = 68,096 + 25,856 = 93,952
    assert kv_peak_bytes_per_sequence(shape, 101, 32, 48, 16, compress=False) == 93_952
    # short prompt 10, 20 new, budget 48: capacity min(64, 10 + 20) = 30 -> 15,360;
    # transient max(2,560, 8,192) -> 23,552
    assert kv_peak_bytes_per_sequence(shape, 10, 20, 48, 16, compress=True) == 23_552
    # bf16 Qwen2.5-1.5B shape (28 layers, 2 KV heads, 128): 2*28*2*128*2 = 28,672 B per token; prompt 100,
    # 4096 new, budget 512 + 128: per layer-token 2*2*128*2 = 1,024; capacity 640 -> 28 * 1,024 * 640 =
    # 18,350,080; transient 1,024 * 100 -> 18,452,480
    qwen = ModelShape(layers=28, kv_heads=2, head_dim=128, dtype_bytes=2)
    assert qwen.bytes_per_token == 28_672
    assert kv_peak_bytes_per_sequence(qwen, 100, 4096, 512, 128, compress=True) == 18_452_480


CONFIGS = [
    ["actors.engine.compressor.method=rkv", "actors.engine.compressor.kv_budget=48",
     "actors.engine.compressor.interval=16", "actors.sampling.max_new_tokens=32"],
    ["actors.engine.compressor.method=snapkv", "actors.engine.compressor.kv_budget=24",
     "actors.engine.compressor.interval=8", "actors.sampling.max_new_tokens=64", "actors.engine.dtype=bf16"],
    ["actors.engine.compressor.method=full", "actors.sampling.max_new_tokens=40"],
    ["actors.engine.compressor.method=streamingllm", "actors.engine.compressor.kv_budget=64",
     "actors.engine.compressor.interval=32", "actors.sampling.max_new_tokens=48",
     "actors.engine.compressor.budget_tiers=confidence"],   # sized with the largest tier budget, 96
    ["actors.engine.compressor.method=rkv", "actors.engine.compressor.kv_budget=48",   # quantized KV: codes + scales
     "actors.engine.compressor.interval=16", "actors.sampling.max_new_tokens=32",
     "actors.engine.compressor.kv_dtype=int8"],
    ["actors.engine.compressor.method=snapkv", "actors.engine.compressor.kv_budget=24",
     "actors.engine.compressor.interval=8", "actors.sampling.max_new_tokens=64", "actors.engine.dtype=bf16",
     "actors.engine.compressor.kv_dtype=fp8_e4m3"],
    ["actors.engine.compressor.method=rkv", "actors.engine.compressor.kv_budget_bytes=7700",   # 48 x 160 B int8
     "actors.engine.compressor.kv_budget=512",     # the tiny preset's 48 back to the default: one budget is set
     "actors.engine.compressor.interval=16", "actors.sampling.max_new_tokens=32",
     "actors.engine.compressor.kv_dtype=int8"],
]


@pytest.mark.parametrize("overrides", CONFIGS, ids=["rkv-fp32", "snapkv-bf16", "dense", "streamingllm-tiers",
                                                   "rkv-fp32-int8", "snapkv-bf16-fp8", "rkv-int8-bytes"])
def test_prediction_matches_measured_peak_kv_bytes(overrides):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.engines.torch_engine import TorchEngine
    from actors.tasks.data import load_train_prompts
    from compressors.budget import budget_range

    cfg = load_config("tiny", overrides)
    path = resolve_model(TINY_LLAMA)
    report = preflight(cfg, model_path=path)                            # longest training prompt, tokenized here
    tok = AutoTokenizer.from_pretrained(path)
    prompts = load_train_prompts(cfg.actors.data, tok, seed=cfg.seed)
    longest = max(prompts, key=lambda p: len(p.prompt_ids))
    assert report.prompt_tokens == len(longest.prompt_ids)
    a = cfg.actors
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.engine.dtype]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    engine = TorchEngine(model, tok, a.engine.compressor)
    batch = [longest.prompt_ids, prompts[0].prompt_ids]                 # an actor batch that holds the longest prompt
    params = SamplingParams(temperature=1.0, max_new_tokens=a.sampling.max_new_tokens, n=a.sampling.samples_per_prompt,
                            seed=0, ignore_eos=True)
    high = budget_range(a.engine.compressor)[1]
    if a.engine.compressor.kv_budget_bytes:                             # the tokens the engine resolves it to
        high = engine.compressor_cfg.kv_budget
        assert report.kv_budget == high == 48
    samples = [s for g in engine.generate(batch, params, kv_budgets=[high, high]) for s in g]
    measured = max(s.kv_peak_bytes for s in samples)
    predicted = report.sparse_per_seq if a.engine.compressor.method != "full" else report.dense_per_seq
    assert 0.9 <= predicted / measured <= 1.1, (predicted, measured)
    # and per batch: the rows of one actor batch together
    assert 0.9 <= (predicted * len(samples)) / sum(s.kv_peak_bytes for s in samples) <= 1.1
    if a.engine.compressor.method != "full":                            # the dense column is the dense engine's
        c = a.engine.compressor                                         # (at the run's KV precision)
        dense = TorchEngine(model, tok, type(c)(method="full", kv_dtype=c.kv_dtype, kv_scale=c.kv_scale))
        d = max(s.kv_peak_bytes for g in dense.generate(batch, params) for s in g)
        assert 0.9 <= report.dense_per_seq / d <= 1.1, (report.dense_per_seq, d)
        assert report.sparse_per_seq < report.dense_per_seq


def test_fits_sparse_not_dense_passes_and_a_large_budget_warns():
    base = ["actors.engine.compressor.kv_budget=48", "actors.engine.compressor.interval=16",
            "actors.sampling.max_new_tokens=32", "preflight.max_prompt_tokens=101"]
    # tiny-llama: 58,624 B sparse / 93,952 B dense per sequence (test_formula_by_hand), 4 rows per batch:
    # 234,496 B sparse, 375,808 B dense; 300,000 B = 0.000279397 GiB lies between
    cfg = load_config("tiny", base + ["preflight.kv_memory_gb=0.000279397"])
    report = preflight(cfg, model_path=resolve_model(TINY_LLAMA))
    assert report.sparse_per_batch == 234_496 and report.dense_per_batch == 375_808
    assert report.fits(report.sparse_per_seq) == 5 and report.fits(report.dense_per_seq) == 3   # 300,000 // each
    # the 101-token prompt is longer than the 48-token budget: compressed at prefill, said with the numbers
    assert report.warnings == ["prompts of up to 101 tokens exceed kv_budget=48: the prompt itself is compressed "
                               "at prefill (the long-context regime; the Sparse-RL paper compresses only the "
                               "generated trace, prompt < budget)"]
    table = report.table()
    assert "warning: prompts of up to 101 tokens exceed kv_budget=48" in table
    # with tiers the smallest budget is not kv_budget: the warning says which budget and where it comes from
    tiers = preflight(load_config("tiny", base + ["actors.engine.compressor.budget_tiers=confidence"]),
                      model_path=resolve_model(TINY_LLAMA))
    low = tiers_low = load_config("tiny", base + ["actors.engine.compressor.budget_tiers=confidence"]
                                  ).actors.engine.compressor.budget_range()[0]
    assert low < 48 and tiers.warnings[0].startswith(
        f"prompts of up to 101 tokens exceed the smallest budget the run uses, {tiers_low} tokens (kv_budget=48 with "
        "its tiers, schedule or controller): ")
    dense = preflight(load_config("tiny", base + ["actors.engine.compressor.method=full"]),
                      model_path=resolve_model(TINY_LLAMA))
    assert "engine torch, full, no KV compression" in dense.table() and not dense.warnings
    assert "234,496" in table and "375,808" in table and "seqs that fit" in table
    params = report.params()
    # the learner line: full fine-tuning (the run's) next to LoRA at rank 16, from learner_memory
    full, lora = report.learner_full, report.learner_lora
    assert f"full fine-tuning (this run) {full.total:,} B" in table
    assert f"LoRA rank 16, {lora.trainable:,} trainable parameters: {lora.total:,} B" in table
    assert params["preflight_result.learner_state_bytes_lora"] == str(lora.total) and lora.total < full.total
    assert params["preflight_result.kv_bytes_per_seq_sparse"] == "58624"
    # budget 200 >= 101 + 32: nothing would be evicted
    wide = preflight(load_config("tiny", base[1:] + ["actors.engine.compressor.kv_budget=200"]),
                     model_path=resolve_model(TINY_LLAMA))
    assert any("nothing will ever be evicted" in w for w in wide.warnings)
    assert not any("compressed at prefill" in w for w in wide.warnings)
    # the paper's regime: a prompt within the budget, a response that is not: no warning at all
    decode = preflight(load_config("tiny", base[1:3] + ["preflight.max_prompt_tokens=40"]),
                       model_path=resolve_model(TINY_LLAMA))
    assert not decode.warnings


def test_broker_queue_bytes_with_topk_logprobs_and_a_group_over_max_message_bytes():
    """Top-k log-probs (docs/SPEC.md §4) grow a group on the wire by 6 K bytes per response token: the preflight's
    group and queue bytes say so, and a group over broker.max_message_bytes fails naming the fields."""
    base = ["actors.sampling.max_new_tokens=32", "preflight.max_prompt_tokens=101", "preflight.kv_memory_gb=1",
            "broker.high_watermark=10"]
    plain = preflight(load_config("tiny", base), model_path=resolve_model(TINY_LLAMA))
    top = preflight(load_config("tiny", base + ["actors.sampling.topk_logprobs=20"]),
                    model_path=resolve_model(TINY_LLAMA))
    G = 2                                                                  # tiny: samples_per_prompt 2
    assert plain.group_bytes == G * (101 * 4 + 32 * 8)
    assert top.group_bytes - plain.group_bytes == G * 32 * 120
    assert top.queue_bytes == top.group_bytes * (10 + 2)                  # watermark + one batch of 2 groups
    assert "B at the high watermark" in top.table()
    with pytest.raises(PreflightError, match="broker.max_message_bytes=8,000.*topk_logprobs=20"):
        preflight(load_config("tiny", base + ["actors.sampling.topk_logprobs=20", "broker.max_message_bytes=8000"]),
                  model_path=resolve_model(TINY_LLAMA))


def test_fits_neither_fails_naming_fields_and_numbers():
    cfg = load_config("tiny", ["actors.engine.compressor.kv_budget=48", "actors.engine.compressor.interval=16",
                               "actors.sampling.max_new_tokens=32", "preflight.max_prompt_tokens=101",
                               "preflight.kv_memory_gb=0.0001"])    # 107,374 B < 234,496 B
    with pytest.raises(PreflightError) as err:
        preflight(cfg, model_path=resolve_model(TINY_LLAMA))
    msg = str(err.value)
    for part in ("actors.prompts_per_batch=2", "actors.sampling.samples_per_prompt=2", "234,496 B", "107,374 B",
                 "actors.sampling.max_new_tokens=32", "actors.engine.compressor.kv_budget=48",
                 "At most 1 sequences fit"):
        assert part in msg, (part, msg)


def test_train_that_does_not_fit_exits_2_before_anything_starts(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "train", "--config", "tiny", f"run_dir={tmp_path}",
                           "preflight.kv_memory_gb=0.0001"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "does not fit" in proc.stderr and "actors.prompts_per_batch=2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())                                   # no run directory was made
    ok = subprocess.run([sys.executable, "-m", "deploy.cli", "preflight", "--config", "tiny"], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "peak KV B / seq" in ok.stdout, ok.stderr


@pytest.mark.parametrize("overrides,named", [
    (["actors.engine.compressor.budget_control=mismatch", "actors.engine.compressor.kv_budget_min=16",
      "actors.engine.compressor.kv_budget_max=64", "learner.correction=off"],
     "actors.engine.compressor.budget_control"),
    (["actors.engine.compressor.budget_schedule=linear", "actors.engine.compressor.kv_budget_final=4"],
     "actors.engine.compressor.kv_budget"),
    (["preflight.kv_memory_gb=-1"], "preflight.kv_memory_gb"),
])
def test_bad_budget_config_fails_at_start_naming_the_dotted_field(overrides, named):
    from deploy.config import ConfigError
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config("tiny", overrides, check_files=False)


def test_decode_preset_compresses_the_trace_not_the_prompt():
    """smollm2-count and smollm2-count-warm are in the Sparse-RL paper's regime (the longest chat-templated prompt
    fits the KV budget, the responses they allow are 3x the budget); smollm2-copy compresses its prompt at prefill,
    and the preflight says so. (The warm-up model has the base model's tokenizer and shapes, so the preflight reads
    the base model: no warm-up run here.)"""
    for preset in ("smollm2-count", "smollm2-count-warm"):
        cfg = load_config(preset)
        cfg.model = resolve_model("smollm2-135m-instruct")
        main, budget = preflight(cfg), cfg.actors.engine.compressor.kv_budget
        assert main.prompt_tokens < budget and main.max_new_tokens >= 3 * budget, preset
        assert not any("compressed at prefill" in w for w in main.warnings), (preset, main.warnings)
    copy = preflight(load_config("smollm2-copy"))
    assert copy.prompt_tokens > 64
    assert [w for w in copy.warnings if "compressed at prefill" in w] == [
        f"prompts of up to {copy.prompt_tokens} tokens exceed kv_budget=64: the prompt itself is compressed at "
        "prefill (the long-context regime; the Sparse-RL paper compresses only the generated trace, prompt < budget)"]


def test_sglang_engine_accepts_varying_budgets():
    """Per-request budgets reach SGLang's scheduler (docs/SPEC.md §5.1): schedules, tiers and control load with it."""
    cfg = load_config("tiny", ["actors.engine.backend=sglang", "actors.engine.compressor.budget_tiers=confidence",
                               "eval.enabled=false"], check_files=False)
    assert cfg.actors.engine.compressor.budget_tiers == "confidence"


def test_compression_event_bound_by_hand():
    """The SGLang sparse backend's transient memory per compression call (docs/sglang.md, "Limits, exactly"; outside
    mem_fraction_static), actors.engines.kv_memory.compression_event_bytes, for Qwen2.5-1.5B (12 query / 2 KV
    heads, head_dim 128, bf16) at budget 512 + interval 128 (640 live tokens), window 8, R-KV, 64 rows."""
    from actors.engines.kv_memory import EVENT_BYTES_CAP, compression_event_bytes, event_calls, event_chunk_rows

    # S = 64*2*640 = 81,920 scores; E = 64*(640-512) = 8,192 evicted positions
    # index: 8*(3*64 + 2*64*640 + 64*512 + 64*8 + 2*8,192) = 1,054,208 + 64*640 (bool) 40,960 + 8*64*640 (slots)
    #        327,680 + 8*64*512 (target) 262,144 = 1,684,992
    # layer: K+V gathered 2*64*640*2*128*2 = 41,943,040 + queries 64*8*12*128*2 = 1,572,864 = 43,515,904
    # R-KV redundancy: similarity block rows 2^24 // 81,920 = 204 < 640, so two blocks of 64*2*204*640 = 16,711,680:
    #   4*81,920 = 327,680 + 16*64*2*640*128 = 167,772,160 + 5*16,711,680*2 = 167,116,800 + 24*81,920 = 1,966,080
    #   = 337,182,720 (the window importance, 113,770,496, the gather, 50,331,648, and the sort, 2,949,120, are less)
    # total 1,684,992 + 43,515,904 + 337,182,720 = 382,383,616 (365 MiB)
    shape = (640, 512, 8, 12, 2, 128, 2)
    assert compression_event_bytes(64, *shape) == 382_383_616
    # the bound grows with the rows: 400 rows would need 1,509,257,600 B; under the 1 GiB cap a call holds <= 269 rows
    assert compression_event_bytes(400, *shape) == 1_509_257_600
    assert EVENT_BYTES_CAP == 1 << 30 and event_chunk_rows(*shape) == 269
    assert compression_event_bytes(269, *shape) <= EVENT_BYTES_CAP < compression_event_bytes(270, *shape)
    assert event_calls(400, 269) == 2 and compression_event_bytes(200, *shape) == 839_108_800     # 2 x 200 rows
    assert event_chunk_rows(*shape, cap=1) == 1                       # one row over the cap is still compressed
    with pytest.raises(ValueError, match="budget < live"):
        compression_event_bytes(4, 512, 512, 8, 12, 2, 128, 2)
    with pytest.raises(ValueError, match="h2o"):
        compression_event_bytes(4, 640, 512, 8, 12, 2, 128, 2, method="h2o")


def test_sglang_sparse_preflight_counts_the_compression_event():
    """The preflight takes the event's bound off the KV memory for actors.engine.backend=sglang with a compressor
    (tiny-llama: 4 query / 2 KV heads x 16, fp32; R-KV 48 + 16, window 8; prompt 101 > budget, so the call
    compresses 4 prompts of 101 tokens), and a batch that fits without it but not with it fails."""
    base = ["actors.engine.backend=sglang", "eval.enabled=false", "actors.engine.compressor.kv_budget=48",
            "actors.engine.compressor.interval=16", "actors.sampling.max_new_tokens=32",
            "preflight.max_prompt_tokens=101", "actors.engine.sglang.max_running_requests=4"]
    # (the query ring at 4 + 1 request rows: 20,600 B, test_sglang_preflight_counts_the_query_ring_by_hand)
    # S = 4*2*101 = 808, E = 4*53 = 212; index 8*(12 + 808 + 192 + 32 + 424) + 404 + 3,232 + 1,536 = 16,916;
    # layer 2*4*101*2*16*4 + 4*8*4*16*4 = 111,616; one similarity block 4*2*101*101 = 81,608: redundancy
    # 3,232 + 206,848 + 5*81,608 + 19,392 = 637,512 -> 16,916 + 111,616 + 637,512 = 766,044 B
    report = preflight(load_config("tiny", base + ["preflight.kv_memory_gb=1"], check_files=False),
                       model_path=resolve_model(TINY_LLAMA))
    assert (report.event_bytes, report.event_rows, report.event_live) == (766_044, 4, 101)
    assert report.memory_bytes == (1 << 30) - 766_044 - 20_600
    assert report.params()["preflight_result.compression_event_bytes"] == "766044"
    assert "compression event (SGLang sparse backend, outside mem_fraction_static): 766,044 B" in report.table()
    torch_run = preflight(load_config("tiny", base[2:-1] + ["preflight.kv_memory_gb=1"]),
                          model_path=resolve_model(TINY_LLAMA))
    assert torch_run.event_bytes == 0 and torch_run.memory_bytes == 1 << 30
    # 900,000 B: the sparse batch's 234,496 B fit, with the event's 766,044 B (and the ring's 20,600 B) they do not
    tight = ["preflight.kv_memory_gb=0.00083819"]                      # int(0.00083819 * 2^30) = 899,999 B
    preflight(load_config("tiny", base[2:-1] + tight), model_path=resolve_model(TINY_LLAMA))
    with pytest.raises(PreflightError, match="234,496 B > 113,355 B of KV memory .*compression event 766,044 B"):
        preflight(load_config("tiny", base + tight, check_files=False), model_path=resolve_model(TINY_LLAMA))


def test_sglang_replay_preflight_counts_the_eviction_records():
    """With learner.policy_target=sparse on the SGLang engine the sparse backend's eviction records
    (actors/engines/sglang/records.py) are taken off the KV memory beside the compression event (whose bound then
    counts the recording too): per request
    layers x 2 KV heads x (4 B x budget 48 + 2 B x (133 tokens rounded up to 256, + 1 dump column)) = layers x 1,412 B,
    for the 4 requests of one actor batch (eval off); none without replay, unless the compressor reads true positions
    (random, protect_prompt): then the origin map alone, layers x 2 KV heads x (4 B x 48 + 2 B dump column)."""
    base = ["actors.engine.backend=sglang", "eval.enabled=false", "actors.engine.compressor.kv_budget=48",
            "actors.engine.compressor.interval=16", "actors.sampling.max_new_tokens=32",
            "preflight.max_prompt_tokens=101", "preflight.kv_memory_gb=1",
            "actors.engine.sglang.max_running_requests=4"]
    model = resolve_model(TINY_LLAMA)
    plain = preflight(load_config("tiny", base, check_files=False), model_path=model)
    replay = preflight(load_config("tiny", base + ["learner.policy_target=sparse"], check_files=False),
                       model_path=model)
    per_request = replay.shape.layers * 1_412
    assert record_bytes_per_request(replay.shape.layers, 2, 48, 133) == per_request
    assert (plain.record_bytes, replay.record_bytes, replay.record_requests) == (0, 4 * per_request, 4)
    assert replay.event_bytes > plain.event_bytes          # the compression call's recording phase and indices
    assert replay.memory_bytes == (1 << 30) - replay.event_bytes - 4 * per_request - replay.ring_bytes
    assert f"eviction records (SGLang sparse backend, outside mem_fraction_static): {4 * per_request:,} B" \
        in replay.table()
    for method in ("random", "rkv"):
        positions = preflight(load_config("tiny", base + [f"actors.engine.compressor.method={method}",
                                                          "actors.engine.compressor.protect_prompt=all"],
                                          check_files=False), model_path=model)
        assert positions.record_bytes == 4 * replay.shape.layers * 2 * (4 * 48 + 2) == \
            4 * record_bytes_per_request(replay.shape.layers, 2, 48, 0), method
    with pytest.raises(ValueError, match="tokens=-1"):
        record_bytes_per_request(28, 2, 512, -1)


def test_sglang_preflight_counts_the_query_ring_by_hand():
    """The sparse backend's query ring (`qwin`, float [layers, rows, window, query heads, head_dim] of the engine dtype,
    actors/engines/sglang/triton_backend.py) and its three int64 [rows] row vectors, for every request row of
    SGLang's pool (max_running_requests + 1 padding row; unset, SGLang's own count: at most 4,096, and at most
    max_total_tokens / 2), are taken off the KV memory; none on the torch engine or without a compressor.
    tiny-llama: 2 layers x window 8 x 4 query heads x head_dim 16 x 4 B (fp32) = 4,096 B + 3 x 8 B = 4,120 B per
    row; StreamingLLM reads no queries: no ring, 24 B per row."""
    base = ["actors.engine.backend=sglang", "eval.enabled=false", "actors.engine.compressor.kv_budget=48",
            "actors.engine.compressor.interval=16", "actors.sampling.max_new_tokens=32",
            "preflight.max_prompt_tokens=101", "preflight.kv_memory_gb=1"]
    model = resolve_model(TINY_LLAMA)

    def ring(*overrides):
        report = preflight(load_config("tiny", [*base, *overrides], check_files=False), model_path=model)
        return report.ring_bytes, report.ring_rows, report

    assert ring("actors.engine.sglang.max_running_requests=4")[:2] == (5 * 4_120, 5)      # 20,600 B
    assert ring()[:2] == (4_097 * 4_120, 4_097)                                          # 16,879,640 B
    assert ring("actors.engine.sglang.max_total_tokens=1000")[:2] == (501 * 4_120, 501)   # min(4,096, 500) + 1
    assert ring("actors.engine.sglang.max_running_requests=600",
                "actors.engine.sglang.max_total_tokens=1000")[:2] == (501 * 4_120, 501)
    bf16 = ring("actors.engine.sglang.max_running_requests=4", "actors.engine.dtype=bf16")
    assert bf16[:2] == (5 * (2 * 8 * 4 * 16 * 2 + 24), 5)                                  # 2 B a value: 2,072 B a row
    rows4 = ring("actors.engine.sglang.max_running_requests=4")[2]
    assert rows4.memory_bytes == (1 << 30) - rows4.event_bytes - 20_600
    assert rows4.params()["preflight_result.sglang_query_ring_bytes"] == "20600"
    assert "query ring (SGLang sparse backend, outside mem_fraction_static): 20,600 B for 5 request rows" \
        in rows4.table()
    torch_run = preflight(load_config("tiny", base[2:], check_files=False), model_path=model)
    full = ring("actors.engine.compressor.method=full")
    assert (torch_run.ring_bytes, full[0]) == (0, 0) and torch_run.memory_bytes == 1 << 30
    for method in ("streamingllm", "random"):
        no_ring = ring("actors.engine.sglang.max_running_requests=4", f"actors.engine.compressor.method={method}")
        assert no_ring[:2] == (5 * 24, 5), method          # no ring (it reads no queries): the row vectors only
        flags = (method == "random", method == "streamingllm")   # random reads true positions; streamingllm's sinks
        event = compression_event_bytes(4, 101, 48, 8, 4, 2, 16, 4, method, *flags)
        assert no_ring[2].event_bytes == event == compression_event_bytes(4, 101, 48, 8, 400, 2, 16, 4, method, *flags)
        print(f"{method}: query ring {no_ring[0]:,} B (rkv {ring('actors.engine.sglang.max_running_requests=4')[0]:,}"
              f" B), event {event:,} B, the same at 100x the query heads (no queries gathered)")
    assert query_ring_bytes(5, 2, 8, 4, 16, 4) == 20_600
    assert query_ring_bytes(5, 2, 0, 4, 16, 4) == 120
    with pytest.raises(ValueError, match="rows=0"):
        query_ring_bytes(0, 2, 8, 4, 16, 4)


TINY = SimpleNamespace(hidden_size=8, vocab_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=4,
                       num_key_value_heads=1, intermediate_size=16, tie_word_embeddings=True)
"""A Llama-shaped config small enough to size by hand."""


def test_learner_memory_by_hand():
    # parameters: attention 8*2*4*2 (q, o) + 8*1*4*2 (k, v) = 192, MLP 3*8*16 = 384, 2 norms 16 -> 592 per layer;
    # 2 layers 1,184 + embeddings 32*8 = 256 + final norm 8 (tied head) = 1,448
    # LoRA rank 2 per layer: q 2*(8+8) 32, k 2*(8+4) 24, v 24, o 32, gate 2*(8+16) 48, up 48, down 48 = 256; x 2 = 512
    lora = LoraConfig(rank=2)
    assert lora_parameter_count(TINY, lora) == 512
    assert lora_parameter_count(TINY, LoraConfig(rank=2, target_modules=["q_proj", "lm_head"])) == 2 * 32 + 2 * 40
    with pytest.raises(ValueError, match="c_attn: not a linear module of a Llama/Qwen2 decoder"):
        lora_parameter_count(TINY, LoraConfig(rank=2, target_modules=["c_attn"]))
    # fp32, ZeRO-0, 1 rank: 16 B per parameter (weight 4, gradient 4, Adam 8; no master copy)
    full = learner_memory(TINY, LearnerConfig(kl_coef=0.0))
    assert (full.parameters, full.gradients, full.optimizer_state, full.reference) == (5_792, 5_792, 11_584, 0)
    assert full.total == 1_448 * 16 == 23_168 and full.trainable == 1_448
    # LoRA: the base and the adapter held at 4 B (1,960 x 4 = 7,840), the adapter's gradient 2,048 and Adam 4,096
    lo = learner_memory(TINY, LearnerConfig(kl_coef=0.0), lora)
    assert (lo.parameters, lo.gradients, lo.optimizer_state, lo.reference, lo.total) == (7_840, 2_048, 4_096, 0, 13_984)
    # bf16, ZeRO-3 over 2 ranks, kl_coef 0.1: weights 1,448*2/2 = 1,448 + fp32 master 1,448*4/2 = 2,896; gradients
    # 2,896/2 = 1,448; Adam 11,584/2 = 5,792; the reference 1,448*2 = 2,896, unsharded
    sharded = LearnerConfig(kl_coef=0.1, dtype="bf16", zero_stage=3, ranks=2)
    full3 = learner_memory(TINY, sharded)
    assert (full3.parameters, full3.gradients, full3.optimizer_state, full3.reference) == (4_344, 1_448, 5_792, 2_896)
    # LoRA has no reference copy: (1,960*2)/2 + 512*4/2 = 2,984; 512*2/2 = 512; 512*8/2 = 2,048
    lo3 = learner_memory(TINY, sharded, lora)
    assert (lo3.parameters, lo3.gradients, lo3.optimizer_state, lo3.reference) == (2_984, 512, 2_048, 0)
    # ZeRO-1 over 2 ranks, fp32: master copy and moments sharded, weights and gradients not
    one = learner_memory(TINY, LearnerConfig(kl_coef=0.0, zero_stage=1, ranks=2))
    assert (one.parameters, one.gradients, one.optimizer_state) == (5_792 + 2_896, 5_792, 5_792)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_learner_memory_matches_the_learners_measured_state(lora):
    """The main job's learner settings (fp32, ZeRO-0, 1 rank) on a tiny Llama: the arithmetic equals the state a real
    learner holds at its optimizer step (Learner.state_bytes; Adam's moments from the step before) to 1%."""
    from learner.learner import Learner
    from tests.learner.conftest import make_groups, tiny_llama

    cfg = LearnerConfig(lr=1e-3, kl_coef=0.0, lora=LoraConfig(rank=4) if lora else LoraConfig())
    measured = {}
    learner = Learner(tiny_llama(), cfg, phase=lambda name: name == "optimizer step" and measured.update(
        learner.state_bytes()))
    for _ in range(2):
        learner.step(make_groups(), staleness=[0, 0])
    predicted = learner_memory(tiny_llama().config, cfg, cfg.lora)
    assert predicted.trainable == learner.parameter_counts()["trainable"]
    for kind in ("parameters", "gradients"):
        assert measured[kind] == getattr(predicted, kind), kind
    assert 1 <= measured["optimizer_state"] / predicted.optimizer_state < 1.01   # + Adam's step counters
    assert measured["total"] / predicted.total < 1.01
