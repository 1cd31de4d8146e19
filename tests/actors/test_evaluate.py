"""actors.evaluate builds the held-out prompts as training does: an empty `instruction` (the count and copy
presets) adds nothing to the question (it used to fall back to the GSM8K instruction, so the evaluated prompts were
~25 tokens longer than the trained ones and, under a 48-token budget, compressed at prefill)."""
import copy

from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.config import DEFAULT_INSTRUCTION
from actors.data import Prompt, tokenize_prompts
from actors.evaluate import evaluate
from actors.torch_engine import TorchEngine
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
