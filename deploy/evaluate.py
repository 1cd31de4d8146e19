"""`sparse-rl eval`: score a model directory (e.g. `runs/<run id>/final`) on the config's eval prompt set,
dense and/or sparse, in this process (no Ray, no Redis)."""
from __future__ import annotations

import json

from actors.data import load_eval_items
from actors.evaluate import evaluate
from actors.reward import RewardScorer
from actors.rollout_actor import build_engine
from compressors import CompressorConfig
from deploy.config import RunConfig
from deploy.model_cache import resolve_model


def evaluate_model(cfg: RunConfig, model: str, modes: list[str]) -> dict[str, float]:
    """Prints and returns `eval/<mode>/<metric>` for each mode (reward, accuracy, unparseable, response_length,
    kv_peak_bytes, n)."""
    a, e = cfg.actors, cfg.eval
    items = load_eval_items(e.data, e.limit, train=a.data, seed=cfg.seed, draw=e.draw)
    scores = {}
    for mode in modes:  # one engine per mode: SGLang fixes its attention backend when it starts
        sparse = e.sparse_compressor or a.engine.compressor
        compressor = CompressorConfig(method="full") if mode == "dense" else sparse
        engine = build_engine(a.engine, resolve_model(model), compressor, a.torch_threads)
        result = evaluate(engine, engine.tokenizer, items, mode, sparse, max_new_tokens=e.max_new_tokens,
                          temperature=e.temperature, top_p=e.top_p, batch_size=e.batch_size, seed=cfg.seed,
                          instruction=a.data.instruction, reward=RewardScorer(a.reward))
        scores.update({f"eval/{mode}/{k}": float(v) for k, v in result.items()})
        getattr(engine, "shutdown", lambda: None)()  # SGLang: free the GPU before the next mode's engine
    print(json.dumps(scores, indent=1))
    return scores
