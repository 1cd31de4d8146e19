"""Score a model on a prompt set with the full KV cache (dense) or a compressor (sparse), with the run's reward."""
from __future__ import annotations

import numpy as np

from actors.config import DEFAULT_INSTRUCTION
from actors.data import Prompt, tokenize_prompts
from actors.engine import SamplingParams
from actors.reward import RewardConfig, RewardScorer
from compressors import CompressorConfig


def evaluate(engine, tokenizer, items: list[Prompt], mode: str, compressor: CompressorConfig, *,
             max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, batch_size: int = 16,
             seed: int = 0, instruction: str | None = None, reward: RewardScorer | None = None) -> dict[str, float]:
    """One response per item; `mode` dense uses `full`, sparse uses `compressor`. The weights are the engine's
    (a torch engine is re-wrapped around the same model; nothing is copied). `reward`: the scorer (default:
    the math reward).

    Returns n, reward (mean), accuracy (correct / n), unparseable (fraction with no extractable answer, counted apart from
    wrong ones), response_length (mean tokens) and kv_peak_bytes (mean per sequence, bytes).
    Raises ValueError for a mode other than dense | sparse, or (SGLang) a mode other than the engine's own."""
    if mode not in ("dense", "sparse"):
        raise ValueError(f"mode={mode!r}: expected dense | sparse")
    from actors.torch_engine import TorchEngine

    cfg = CompressorConfig(method="full") if mode == "dense" else compressor
    if isinstance(engine, TorchEngine):
        engine = TorchEngine(engine.model, tokenizer, cfg, device=str(engine.device), weight_version=engine.weight_version)
    elif (engine.compressor_cfg.method == "full") != (mode == "dense"):  # SGLang: the backend is fixed at start
        raise ValueError(f"mode={mode!r}: this {type(engine).__name__} was started "
                         f"{'dense' if engine.compressor_cfg.method == 'full' else 'sparse'}; evaluate it in that mode")
    items = tokenize_prompts(items, tokenizer, DEFAULT_INSTRUCTION if instruction is None else instruction)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, n=1, seed=seed)
    reward = reward or RewardScorer(RewardConfig())
    statuses, rewards, lengths, kv = [], [], [], []
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        for item, (sample,) in zip(batch, engine.generate([p.prompt_ids for p in batch], params)):
            result = reward(tokenizer.decode(sample.response_ids, skip_special_tokens=True), sample.response_ids, item,
                            sample.finish_reason)
            statuses.append(result.status)
            rewards.append(result.reward)
            lengths.append(len(sample.response_ids))
            kv.append(sample.kv_peak_bytes)
    n = len(statuses)
    return {"n": n, "reward": float(np.mean(rewards)) if n else 0.0, "accuracy": statuses.count("correct") / max(n, 1),
            "unparseable": statuses.count("unparseable") / max(n, 1), "reward_errors": float(statuses.count("error")),
            "response_length": float(np.mean(lengths)) if n else 0.0, "kv_peak_bytes": float(np.mean(kv)) if n else 0.0}
