"""Tiny random Qwen2 model directories for the SGLang lane (built here, nothing downloaded)."""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

VOCAB = 256
EOS_ID = 255


def make_tiny_qwen2(out: Path, layers: int = 2, seed: int = 0) -> Path:
    """Random fp32 Qwen2 (hidden 64, 4 heads, 2 KV heads, head_dim 16, initializer_range 0.2 so attention is
    peaked and eviction changes outputs) + a word-level tokenizer over w0..w255 (w255 = EOS), saved to `out`."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
                      max_position_embeddings=4096, eos_token_id=EOS_ID, bos_token_id=None, pad_token_id=None,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).float().eval()
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{EOS_ID}")
    model.save_pretrained(out)
    hf_tok.save_pretrained(out)
    return out


def max_logp_shift(samples, dense, horizon: int) -> float:
    """Largest |logp_sparse(sample) - logp_sparse(dense sample)| over each pair's common prefix (the positions
    before their responses first differ, at most `horizon`): how far eviction moved the distribution."""
    moved = 0.0
    for s, d in zip(samples, dense):
        n = next((i for i, (a, b) in enumerate(zip(s.response_ids, d.response_ids)) if a != b), horizon)
        shift = torch.from_numpy(s.logp_sparse[:n]) - torch.from_numpy(d.logp_sparse[:n])
        moved = max(moved, float(shift.abs().max()))
    return moved


def torch_references(model_dir: Path, compressor_cfg, prompts, params) -> tuple[list, list]:
    """The first sample per prompt of TorchEngine on the model in `model_dir`, under `compressor_cfg` and dense:
    (sparse references, dense references), the SGLang lane's ground truth."""
    from actors.torch_engine import TorchEngine
    from compressors import CompressorConfig
    from transformers import AutoTokenizer

    model = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    return tuple([g[0] for g in TorchEngine(model, tok, cc).generate(prompts, params)]
                 for cc in (compressor_cfg, CompressorConfig(method="full")))
