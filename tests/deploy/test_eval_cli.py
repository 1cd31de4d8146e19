"""`sparse-rl eval` scores a model directory dense and sparse, in one process."""
from __future__ import annotations

import json
import subprocess
import sys

from deploy.model_cache import resolve_model


def test_eval_cli_dense_and_sparse():
    model = resolve_model("tiny-llama")
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "eval", "--model", model, "--config", "tiny",
                           "--mode", "dense", "--mode", "sparse", "eval.limit=3", "eval.max_new_tokens=64"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    scores = json.loads(proc.stdout[proc.stdout.index("{"):])
    for mode in ("dense", "sparse"):
        assert scores[f"eval/{mode}/n"] == 3
        assert scores[f"eval/{mode}/response_length"] > 0
    # tiny preset: budget 48 < prompt + 64 tokens, so the sparse cache peaks lower than the dense one
    assert scores["eval/sparse/kv_peak_bytes"] < scores["eval/dense/kv_peak_bytes"]


def test_sparse_evaluation_of_a_dense_rollout_run_uses_eval_sparse_compressor():
    """A dense-rollout run (compressor full) evaluated "sparse" under eval.sparse_compressor: a bounded cache.
    Control: without it, sparse evaluation of that run is dense (the same peak KV bytes)."""
    model = resolve_model("tiny-llama")

    def peaks(*overrides):
        proc = subprocess.run([sys.executable, "-m", "deploy.cli", "eval", "--model", model, "--config", "tiny",
                               "eval.limit=2", "eval.max_new_tokens=64", "actors.engine.compressor.method=full",
                               *overrides], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        scores = json.loads(proc.stdout[proc.stdout.index("{"):])
        return scores["eval/dense/kv_peak_bytes"], scores["eval/sparse/kv_peak_bytes"]

    dense, sparse = peaks()
    assert sparse == dense
    dense, sparse = peaks("eval.sparse_compressor.method=rkv", "eval.sparse_compressor.kv_budget=24",
                          "eval.sparse_compressor.interval=8")
    assert sparse < 0.75 * dense


def test_eval_cli_scores_a_saved_lora_adapter_on_its_base(tmp_path):
    """`sparse-rl eval --model runs/<id>/final` of a LoRA run: the directory is a peft adapter (no config.json),
    evaluated by the torch engine on the base its adapter_config.json names, with the adapter loaded."""
    import torch
    from transformers import AutoModelForCausalLM

    from broker.lora import LoraConfig, adapter_parameters, add_adapter

    base = resolve_model("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(base)
    peft_model = add_adapter(model, LoraConfig(rank=4))
    with torch.no_grad():
        for _, p in adapter_parameters(model):
            p.fill_(0.1)
    peft_model.save_pretrained(tmp_path / "final")
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "eval", "--model", str(tmp_path / "final"),
                           "--config", "tiny", "--mode", "dense", "eval.limit=2", "eval.max_new_tokens=16"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout[proc.stdout.index("{"):])["eval/dense/n"] == 2
