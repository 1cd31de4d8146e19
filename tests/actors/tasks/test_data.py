"""Prompt data: the vendored GSM8K items, reasoning-gym problems, chat templating, config validation."""
import dataclasses
import json

import pytest
from transformers import AutoTokenizer

from actors.config import DataConfig, EngineConfig, SamplingConfig, validate_training_sampling
from actors.engines.base import SamplingParams
from actors.tasks.data import load_eval_items, load_train_prompts, read_gsm8k_jsonl, tokenize_prompts
from actors.tasks.reward import math_reward
from deploy.model_cache import SMOLLM2, resolve_model


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(SMOLLM2))


def test_vendored_gsm8k_test_items():
    items = load_eval_items("gsm8k_test")
    assert len(items) == 100 and len({p.prompt_id for p in items}) == 100
    rows = [json.loads(line) for line in open("actors/data/gsm8k_test.jsonl")]
    assert len({r["gsm8k_test_index"] for r in rows}) == 100
    # item 1 is GSM8K test #103 (fog bank); its gold solution ends in '#### 140'
    assert rows[1]["gsm8k_test_index"] == 103 and items[1].answer == "140"
    for p, r in zip(items, rows):
        assert math_reward(r["answer"], p.answer).status == "correct"   # every gold solution verifies
    assert len(load_eval_items("gsm8k_test", limit=7)) == 7


def test_chat_template_and_reasoning_gym(tokenizer):
    prompts = load_train_prompts(DataConfig(tasks=["basic_arithmetic", "gsm_symbolic"], size=6), tokenizer, seed=3)
    assert len(prompts) == 6 and prompts[0].prompt_id.startswith("basic_arithmetic")
    assert prompts[1].prompt_id.startswith("gsm_symbolic")
    again = load_train_prompts(DataConfig(tasks=["basic_arithmetic", "gsm_symbolic"], size=6), tokenizer, seed=3)
    assert [p.question for p in prompts] == [p.question for p in again]
    text = tokenizer.decode(prompts[0].prompt_ids)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert prompts[0].question in text and "####" in text
    for p in prompts:
        assert math_reward(f"#### {p.answer}", p.answer).status == "correct"


def test_gsm8k_jsonl_source_and_bad_rows(tmp_path, tokenizer):
    good = tmp_path / "train.jsonl"
    good.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    prompts = load_train_prompts(DataConfig(source="gsm8k_jsonl", path=str(good), size=0), tokenizer)
    assert prompts[0].answer == "2" and prompts[0].prompt_ids
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl: line 1"):
        read_gsm8k_jsonl(bad)
    with pytest.raises(ValueError, match="eval data"):
        load_eval_items("no_such_set")
    assert tokenize_prompts([], tokenizer) == []


def test_the_sampling_config_becomes_the_engine_request_field_by_field():
    """SamplingConfig.sampling_params(): samples_per_prompt -> n, every other field by its own name, the seed given,
    stop strings copied; the two classes' fields differ only by that mapping (a field added to one is seen)."""
    cfg = SamplingConfig(temperature=0.7, max_new_tokens=12, samples_per_prompt=4, top_p=0.9, top_k=5,
                         stop_strings=["\n"], topk_logprobs=3)
    params = cfg.sampling_params(seed=7)
    assert params == SamplingParams(temperature=0.7, max_new_tokens=12, n=4, top_p=0.9, top_k=5, stop_strings=["\n"],
                                    seed=7, topk_logprobs=3, ignore_eos=False)
    params.stop_strings.append("x")
    assert cfg.stop_strings == ["\n"] and SamplingConfig().sampling_params().seed is None
    config_fields = {f.name for f in dataclasses.fields(SamplingConfig)}
    assert config_fields - {"samples_per_prompt"} | {"n", "seed", "ignore_eos"} == \
        {f.name for f in dataclasses.fields(SamplingParams)}

def test_training_sampling_rejects_truncation():
    validate_training_sampling(SamplingConfig())
    with pytest.raises(ValueError, match=r"^SamplingConfig\.top_p=0\.95: "):
        validate_training_sampling(SamplingConfig(top_p=0.95))
    with pytest.raises(ValueError, match=r"^SamplingParams\.top_k=50: "):
        validate_training_sampling(SamplingParams(top_k=50))
    with pytest.raises(ValueError, match=r"^SamplingConfig\.temperature=0\.0: "):
        validate_training_sampling(SamplingConfig(temperature=0.0))
    # every component message names the field as <Class>.<field>; deploy/config.py maps it to the dotted key
    with pytest.raises(ValueError, match=r"^SamplingConfig\.samples_per_prompt=0: "):
        SamplingConfig(samples_per_prompt=0)
    with pytest.raises(ValueError, match=r"^EngineConfig\.backend='vllm': "):
        EngineConfig(backend="vllm")
    with pytest.raises(ValueError, match=r"^DataConfig\.path is required"):
        DataConfig(source="gsm8k_jsonl")
