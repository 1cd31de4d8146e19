"""The supervised warm-up (learner/warmup.py) on the tiny-char model: after it, greedy decoding writes the
demonstrated answer; the same run with lr 0 (the control) does not, so the check can fail."""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploy.model_cache import TINY_CHAR, resolve_model
from learner.warmup import WarmupConfig, supervised_warmup

ANSWER = "7 of 9\n8 of 9\n9 of 9"


def _examples(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "count 7 9"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    return prompt, [(prompt, tok(ANSWER, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])] * 32


def _greedy(model_dir, prompt):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=len(ANSWER) + 4, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return tok.decode(out[0, len(prompt):], skip_special_tokens=True)


def test_warmup_teaches_the_demonstrated_format_and_lr_zero_does_not(tmp_path):
    base = resolve_model(TINY_CHAR)
    tok = AutoTokenizer.from_pretrained(base)
    prompt, examples = _examples(tok)
    stats = supervised_warmup(base, tmp_path / "warm", examples,
                              WarmupConfig(lr=1e-2, batch_size=8, epochs=16, freeze_embeddings=False))
    control = supervised_warmup(base, tmp_path / "control", examples,
                                WarmupConfig(lr=0.0, batch_size=8, epochs=16, freeze_embeddings=False))
    assert stats["steps"] == 64 and stats["loss_last"] < 0.1 * stats["loss_first"], stats
    assert _greedy(tmp_path / "warm", prompt) == ANSWER
    assert _greedy(tmp_path / "control", prompt) != ANSWER
    assert control["loss_last"] > 0.5 * control["loss_first"], control
    assert not (tmp_path / "warm.tmp").exists() and not (tmp_path / "warm" / "trainer").exists()
