"""Score a model on a prompt set with the full KV cache (dense) or a compressor (sparse), with the run's reward.

`evaluate_run` is the run's held-out evaluation (the rollout actors' `evaluate` and `sparse-rl eval` both call it):
the rollouts' sampling except eval's temperature, top_p and max_new_tokens, so the stop strings are the rollouts'
(a multi-turn turn ends at its tool call as in training)."""
from __future__ import annotations

import numpy as np

from actors.config import DEFAULT_INSTRUCTION
from actors.engines.base import SamplingParams
from actors.tasks.data import Prompt, tokenize_prompts
from actors.tasks.reward import RewardConfig, RewardScorer
from compressors import CompressorConfig


def mode_engine(engine, tokenizer, mode: str, compressor: CompressorConfig):
    """The engine that evaluates `mode`: a torch engine re-wrapped around the same model with `full` (dense) or
    `compressor` (sparse); an SGLang engine as it is, in its own mode. Raises ValueError for a mode other than
    dense | sparse, or (SGLang) a mode other than the engine's own."""
    if mode not in ("dense", "sparse"):
        raise ValueError(f"mode={mode!r}: expected dense | sparse")
    from actors.engines.torch_engine import TorchEngine

    cfg = CompressorConfig(method="full") if mode == "dense" else compressor
    if isinstance(engine, TorchEngine):
        return TorchEngine(engine.model, tokenizer, cfg, device=str(engine.device),
                           weight_version=engine.weight_version)
    if (engine.compressor_cfg.method == "full") != (mode == "dense"):  # SGLang: the backend is fixed at start
        raise ValueError(f"mode={mode!r}: this {type(engine).__name__} was started "
                         f"{'dense' if engine.compressor_cfg.method == 'full' else 'sparse'}; evaluate it in that mode")
    return engine


def evaluate_run(engine, tokenizer, items: list[Prompt], mode: str, actors, eval_cfg, seed: int, *, reward=None,
                 envs=None, template=None) -> dict[str, float]:
    """The run's held-out evaluation of `engine`'s weights on `items` in `mode` (dense | sparse): with `envs` (an
    EnvPool of actors.envs.env) and `template`, episodes of the run's environment (`evaluate_episodes`), else one
    response per item scored by `reward` (`evaluate`). Sampling: eval's temperature, top_p, max_new_tokens and
    batch_size, the rollouts' stop strings (actors.sampling.stop_strings); sparse uses eval.sparse_compressor or
    the run's compressor. actors / eval_cfg: the run config's `actors` and `eval` sections. Returns the metrics of
    the function called."""
    e = eval_cfg
    common = dict(max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_p=e.top_p, batch_size=e.batch_size,
                  seed=seed, stop_strings=list(actors.sampling.stop_strings))
    compressor = e.sparse_compressor or actors.engine.compressor
    if envs is not None:
        return evaluate_episodes(engine, envs, template, items, mode, compressor, **common)
    return evaluate(engine, tokenizer, items, mode, compressor, reward=reward, instruction=actors.data.instruction,
                    **common)


def evaluate_episodes(engine, pool, template, items: list[Prompt], mode: str, compressor: CompressorConfig, *,
                      max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, batch_size: int = 16,
                      seed: int = 0, stop_strings: list[str] = ()) -> dict[str, float]:
    """Multi-turn evaluation (actors/envs/episode.py): one episode per item of `pool`'s environment, in `mode` (see
    mode_engine), each turn at most `max_new_tokens` and ended at the first of `stop_strings`. Returns n, reward
    (mean episode reward), accuracy (episodes with reward >= 1), reward_errors (0: no reward function runs),
    env_errors (episodes the environment failed: errors, timeouts and lost workers),
    response_length (mean tokens after the prompt, observations included), kv_peak_bytes (mean per episode,
    bytes), turns and tool_calls (means)."""
    from actors.envs.env import ENV_FAILURES
    from actors.envs.episode import run_episodes

    engine = mode_engine(engine, template.tokenizer, mode, compressor)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, n=1, seed=seed,
                            stop_strings=list(stop_strings))
    done = []
    for start in range(0, len(items), batch_size):
        done += [s for (s,) in run_episodes(engine.generate, pool, template, items[start:start + batch_size], params,
                                            batch_key=f"eval-{mode}-{start}-",
                                            release=getattr(engine, "release_episodes", None))]
    n = len(done)

    def mean(values) -> float:
        return float(np.mean(values)) if n else 0.0
    return {"n": n, "reward": mean([s.reward for s in done]), "accuracy": sum(s.reward >= 1 for s in done) / max(n, 1),
            "unparseable": 0.0,
            "reward_errors": 0.0, "env_errors": float(sum(s.finish in ENV_FAILURES for s in done)),
            "response_length": mean([len(s.response_ids) for s in done]),
            "kv_peak_bytes": mean([s.kv_peak_bytes for s in done]), "turns": mean([s.turns for s in done]),
            "tool_calls": mean([s.tool_calls for s in done])}


def evaluate(engine, tokenizer, items: list[Prompt], mode: str, compressor: CompressorConfig, *,
             max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, batch_size: int = 16,
             seed: int = 0, instruction: str | None = None, reward: RewardScorer | None = None,
             stop_strings: list[str] = ()) -> dict[str, float]:
    """One response per item, ended at the first of `stop_strings`; `mode` dense uses `full`, sparse uses
    `compressor`. The weights are the engine's (a torch engine is re-wrapped around the same model; nothing is
    copied). `reward`: the scorer (default: the math reward).

    Returns n, reward (mean), accuracy (correct / n), unparseable (fraction with no extractable answer, counted
    apart from wrong ones), response_length (mean tokens) and kv_peak_bytes (mean per sequence, bytes).
    Raises ValueError for a mode other than dense | sparse, or (SGLang) a mode other than the engine's own."""
    engine = mode_engine(engine, tokenizer, mode, compressor)
    items = tokenize_prompts(items, tokenizer, DEFAULT_INSTRUCTION if instruction is None else instruction)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, n=1, seed=seed,
                            stop_strings=list(stop_strings))
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
