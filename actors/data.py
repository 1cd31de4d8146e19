"""Prompt data in the GSM8K shape (`question`, `answer` ending in '#### N'), chat-templated to token ids.

Sources: a GSM8K JSONL file (e.g. the 100 real GSM8K test items vendored in actors/data/gsm8k_test.jsonl,
see actors/data/SOURCE.md) and reasoning-gym generators (basic_arithmetic, gsm_symbolic, ...), whose items are
converted to the same shape. Nothing is downloaded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from actors.config import DEFAULT_INSTRUCTION, DataConfig
from actors.reward import gold_answer

DATA_DIR = Path(__file__).resolve().parent / "data"
EVAL_SETS = {"gsm8k_test": DATA_DIR / "gsm8k_test.jsonl"}
"""Evaluation sets shipped with the package, by name."""


@dataclass
class Prompt:
    prompt_id: str
    """Stable id of the problem, e.g. 'gsm8k_test-0012' or 'gsm_symbolic-s7-0003'."""
    question: str
    """The problem text."""
    answer: str
    """Gold final answer (the text after '####', commas removed), compared by actors.reward.math_reward."""
    prompt_ids: list[int] = field(default_factory=list)
    """Chat-templated token ids of the question + instruction ([] until `tokenize_prompts`)."""


def read_gsm8k_jsonl(path: str | Path, name: str | None = None, limit: int = 0) -> list[Prompt]:
    """Rows of a GSM8K JSONL file as Prompts (no token ids yet); `limit` > 0 keeps the first `limit` rows.

    Raises ValueError naming the file and line for a row without `question` or a '#### N' answer."""
    path = Path(path)
    name = name or path.stem
    out = []
    with path.open() as fh:
        for i, line in enumerate(fh):
            if limit and len(out) >= limit:
                break
            row = json.loads(line)
            if not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
                raise ValueError(f"{path}:{i + 1}: expected string fields 'question' and 'answer'")
            try:
                answer = gold_answer(row["answer"])
            except ValueError as e:
                raise ValueError(f"{path}:{i + 1}: {e}") from None
            out.append(Prompt(f"{name}-{i:04d}", row["question"], answer))
    return out


def reasoning_gym_problems(tasks: list[str], size: int, seed: int,
                           task_options: dict[str, dict] | None = None) -> list[Prompt]:
    """`size` problems from reasoning-gym, the tasks interleaved in equal parts (deterministic in seed);
    `task_options[task]` are keyword arguments of that task's dataset config (e.g. max_terms)."""
    import reasoning_gym

    options = task_options or {}
    per_task = [reasoning_gym.create_dataset(t, size=-(-size // len(tasks)), seed=seed, **dict(options.get(t, {})))
                for t in tasks]
    out = []
    for i in range(-(-size // len(tasks))):
        for task, ds in zip(tasks, per_task):
            if len(out) < size:
                item = ds[i]
                out.append(Prompt(f"{task}-s{seed}-{i:04d}", item["question"], str(item["answer"]).replace(",", "")))
    return out


def tokenize_prompts(prompts: list[Prompt], tokenizer, instruction: str = DEFAULT_INSTRUCTION) -> list[Prompt]:
    """Fill `prompt_ids` with the tokenizer's chat template (one user turn: question + instruction, then the
    assistant header). Returns the same list."""
    for p in prompts:
        messages = [{"role": "user", "content": f"{p.question}\n{instruction}".strip()}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        p.prompt_ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return prompts


def load_train_prompts(cfg: DataConfig, tokenizer, seed: int = 0) -> list[Prompt]:
    """Training prompts described by `cfg`, tokenized with the chat template."""
    if cfg.source == "gsm8k_jsonl":
        problems = read_gsm8k_jsonl(cfg.path, limit=cfg.size)
    else:
        problems = reasoning_gym_problems(list(cfg.tasks), cfg.size, seed, cfg.task_options)
    return tokenize_prompts(problems, tokenizer, cfg.instruction)


def load_eval_items(name: str, limit: int = 0) -> list[Prompt]:
    """An evaluation set by name (see EVAL_SETS) or a path to a GSM8K JSONL; `limit` > 0 keeps the first rows.
    Not tokenized (call `tokenize_prompts`). Raises ValueError for an unknown name that is not a file."""
    path = EVAL_SETS.get(name, Path(name))
    if not path.is_file():
        raise ValueError(f"eval data {name!r}: not one of {sorted(EVAL_SETS)} and not a file")
    return read_gsm8k_jsonl(path, name=name if name in EVAL_SETS else None, limit=limit)
