"""actors.evaluate builds the held-out prompts as training does: an empty `instruction` (the count and copy
presets) adds nothing to the question (it used to fall back to the GSM8K instruction, so the evaluated prompts were
~25 tokens longer than the trained ones and, under a 48-token budget, compressed at prefill); and it samples
with the rollouts' stop strings (a multi-turn turn ends at its tool call, as in training)."""
import copy
import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.config import DEFAULT_INSTRUCTION
from actors.engines.torch_engine import TorchEngine
from actors.evaluate import evaluate
from actors.tasks.data import Prompt, tokenize_prompts
from compressors import CompressorConfig
from deploy.model_cache import TINY_CHAR, resolve_model


def test_eval_prompts_are_the_training_prompts():
    path = resolve_model(TINY_CHAR)
    tok = AutoTokenizer.from_pretrained(path)
    engine = TorchEngine(AutoModelForCausalLM.from_pretrained(path), tok, CompressorConfig(method="full"))
    for instruction in ("", "count:"):
        items = [Prompt(prompt_id="p", question="list 1 to 3", answer="", metadata={})]
        trained = tokenize_prompts(copy.deepcopy(items), tok, instruction)[0].prompt_ids
        evaluate(engine, tok, items, "dense", CompressorConfig(method="full"), max_new_tokens=2,
                 instruction=instruction, reward=lambda *a: _Zero())
        assert items[0].prompt_ids == trained, instruction
    items = [Prompt(prompt_id="p", question="list 1 to 3", answer="", metadata={})]
    evaluate(engine, tok, items, "dense", CompressorConfig(method="full"), max_new_tokens=2, reward=lambda *a: _Zero())
    assert items[0].prompt_ids == tokenize_prompts(copy.deepcopy(items), tok, DEFAULT_INSTRUCTION)[0].prompt_ids


class _Zero:
    status, reward = "wrong", 0.0


def _turn_actions(tmp_path, stop_strings: list[str]) -> dict[str, str]:
    """{question: the text of its episode's one turn} of `sparse-rl eval`'s dense evaluation (deploy.evaluate.
    evaluate_model, which calls actors.evaluate.evaluate_run as the rollout actors do) of the tiny-lookup config
    with the ActionLogEnv environment, greedy, the rollouts' stop strings set to `stop_strings`."""
    from deploy.config import load_config
    from deploy.evaluate import evaluate_model

    log = tmp_path / f"actions-{len(list(tmp_path.iterdir()))}.jsonl"
    cfg = load_config("tiny-lookup", ["actors.env.factory=scripted_envs:ActionLogEnv", f"actors.env.options.log={log}",
                                      "actors.env.max_turns=1", "eval.data=train_task", "eval.limit=4",
                                      "eval.temperature=0", "eval.max_new_tokens=16"])
    cfg.actors.sampling.stop_strings = stop_strings
    evaluate_model(cfg, cfg.model, ["dense"])
    return dict(json.loads(line) for line in log.read_text().splitlines())


def test_the_held_out_evaluation_ends_a_turn_at_the_rollouts_stop_strings(tmp_path):
    """Training rollouts end each turn at actors.sampling.stop_strings (the lookup task's `</lookup>`); the run's
    held-out evaluation must sample the same way. It did not (docs/results.md 9): a turn went on past its tool
    call, the model's guesses stayed in the history, and held-out rewards were far below the training rewards.
    Greedy, so the turn cut at a stop string S (the first characters of a turn sampled without one) is a strict
    prefix of the uncut turn, for every item whose turn contains S."""
    uncut = _turn_actions(tmp_path, [])
    question, text = max(uncut.items(), key=lambda kv: len(kv[1]))
    assert len(text) >= 12, f"the tiny model's greedy turn is too short to cut: {text!r}"
    stop = text[:3]
    cut = _turn_actions(tmp_path, [stop])
    assert cut.keys() == uncut.keys()
    assert stop in cut[question] and len(cut[question]) < len(text), (cut[question], text)
    for q, full in uncut.items():
        assert full.startswith(cut[q]), (q, cut[q], full)
        if stop in full:
            assert len(cut[q]) < len(full) or full.endswith(stop), (q, cut[q], full)
