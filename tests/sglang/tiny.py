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
    from transformers import AutoTokenizer

    from actors.engines.torch_engine import TorchEngine
    from compressors import CompressorConfig

    model = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    return tuple([g[0] for g in TorchEngine(model, tok, cc).generate(prompts, params)]
                 for cc in (compressor_cfg, CompressorConfig(method="full")))


JOIN_PROMPT_LENS = (12, 23, 20, 30, 17)
"""Prompt lengths of the mid-decode join batch (unequal: the torch engine left-pads them to 30, so its
compression groups hold padding; the SGLang backend's groups are left-padded to the longest due row)."""
JOIN_MAX_NEW = (10, 40, 40, 40, 30)
"""Per-request max_new_tokens of that batch: with max_running_requests=4 the fifth request waits and joins the
running batch once the first (10 tokens) has finished, i.e. mid-decode, in another phase than the others."""


def join_prompts() -> list[list[int]]:
    return [[(13 * i + 5 * j) % 250 + 1 for j in range(n)] for i, n in enumerate(JOIN_PROMPT_LENS)]


def generate_each(eng, prompts: list[list[int]], max_new: tuple[int, ...]) -> list[tuple[list[int], "torch.Tensor"]]:
    """Greedy (ignore_eos) in one SGLang call with one max_new_tokens per request, sampling params otherwise as
    `SGLangEngine.generate` sends them: [(response ids, logp_sparse float32 tensor)] in prompt order."""
    from actors.engines.base import SamplingParams
    from actors.engines.sglang.engine import sglang_request

    request = sglang_request(SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True), [0] * len(prompts),
                             None)
    for sp, m in zip(request["sampling_params"], max_new):
        sp["max_new_tokens"] = m
    outs = eng._call(eng.engine.async_generate(input_ids=[list(p) for p in prompts], return_logprob=True,
                                               **request), "generate")
    return [(list(o["output_ids"]), torch.tensor([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
                                                 dtype=torch.float32)) for o in outs]


def assert_prefixes_equal(got, want, atol: float = 2e-5) -> None:
    """Each SGLang row (ids, logps) equals the same-length prefix of its TorchEngine Sample."""
    for i, ((ids, lp), w) in enumerate(zip(got, want)):
        n = len(ids)
        assert ids == w.response_ids[:n], f"row {i}: response ids differ"
        diff = float((lp - torch.from_numpy(w.logp_sparse[:n])).abs().max())
        assert diff <= atol, f"row {i}: logp_sparse differs by {diff:.3g} > {atol}"


def first_token_parity(response: str, response_ids, item) -> float:
    """A reward (actors.reward.function) that varies within a group of a random model's samples: 1 when the first
    response token id is odd, else 0, so that GRPO's advantages are not all 0 and a LoRA adapter gets a gradient (a
    random tiny model scores 0 on every sample of a real task)."""
    return float(bool(response_ids) and response_ids[0] % 2 == 1)
