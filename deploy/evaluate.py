"""`sparse-rl eval`: score a model directory (e.g. `runs/<run id>/final`) on the config's eval prompt set,
dense and/or sparse, in this process (no Ray, no Redis), as the run's own evaluation does (actors.evaluate.
evaluate_run: the rollouts' stop strings; with actors.env.factory set, episodes of the run's environment)."""
from __future__ import annotations

import json

from actors.envs.env import EnvPool
from actors.envs.turns import ChatTemplate
from actors.evaluate import evaluate_run
from actors.rollout_actor import build_engine
from actors.tasks.data import load_eval_items
from actors.tasks.reward import RewardScorer
from broker.lora import is_adapter_dir, load_saved_adapter
from compressors import CompressorConfig
from deploy.config import RunConfig
from deploy.model_cache import resolve_model


def evaluate_model(cfg: RunConfig, model: str, modes: list[str]) -> dict[str, float]:
    """Prints and returns `eval/<mode>/<metric>` for each mode (reward, accuracy, unparseable, response_length,
    kv_peak_bytes, n; multi-turn also turns and tool_calls). `model`: a model directory, a preset model, or a saved
    LoRA adapter (a LoRA run's `final`, broker.lora.is_adapter_dir): the torch engine on its base with the adapter
    loaded."""
    adapter = load_saved_adapter(model) if is_adapter_dir(model) else None
    a, e = cfg.actors, cfg.eval
    items = load_eval_items(e.data, e.limit, train=a.data, seed=cfg.seed, draw=e.draw)
    scores = {}
    envs = EnvPool(a.env) if a.env.factory else None   # multi-turn: one environment worker for every mode
    try:
        for mode in modes:  # one engine per mode: SGLang fixes its attention backend when it starts
            sparse = e.sparse_compressor or a.engine.compressor
            engine = build_engine(a.engine, resolve_model(adapter.base if adapter else model),
                                  CompressorConfig(method="full") if mode == "dense" else sparse, a.torch_threads,
                                  lora=adapter.config if adapter else None)
            if adapter is not None:   # the adapter's tensors in the engine's dtype
                engine.load_weights([(n, t.to(engine.model.dtype)) for n, t in adapter.tensors], version=0)
            result = evaluate_run(engine, engine.tokenizer, items, mode, a, e, cfg.seed, reward=RewardScorer(a.reward),
                                  envs=envs, template=ChatTemplate.build(engine.tokenizer) if envs else None)
            scores.update({f"eval/{mode}/{k}": float(v) for k, v in result.items()})
            getattr(engine, "shutdown", lambda: None)()  # SGLang: free the GPU before the next mode's engine
    finally:
        if envs is not None:
            envs.shutdown()
    print(json.dumps(scores, indent=1))
    return scores
