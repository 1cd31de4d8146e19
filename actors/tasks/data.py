"""Prompt data in the GSM8K shape (`question`, `answer` ending in '#### N'), chat-templated to token ids.

Sources: a GSM8K JSONL file (e.g. the 100 real GSM8K test items vendored in actors/data/gsm8k_test.jsonl,
see actors/data/SOURCE.md), reasoning-gym generators (basic_arithmetic, gsm_symbolic, ...), whose items are
converted to the same shape, and a user's own task generator (`DataConfig.function`, e.g. the synthetic tasks
in actors/tasks/builtin.py). Nothing is downloaded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from actors.config import DEFAULT_INSTRUCTION, DataConfig, load_callable
from actors.tasks.reward import gold_answer
from actors.user_code import UserCodeError, call_with_timeout

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
"""The data files shipped with the package: actors/data (the package's, not this room's)."""
EVAL_SETS = {"gsm8k_test": DATA_DIR / "gsm8k_test.jsonl"}
"""Evaluation sets shipped with the package, by name."""


@dataclass
class Prompt:
    prompt_id: str
    """Stable id of the problem, e.g. 'gsm8k_test-0012' or 'gsm_symbolic-s7-0003'."""
    question: str
    """The problem text."""
    answer: str
    """Gold final answer (the text after '####', commas removed), compared by actors.tasks.reward.math_reward."""
    prompt_ids: list[int] = field(default_factory=list)
    """Chat-templated token ids of the question + instruction ([] until `tokenize_prompts`)."""
    metadata: dict = field(default_factory=dict)
    """Task-specific data for a custom reward function (e.g. the list of numbers to copy); {} otherwise."""


class DataFileError(ValueError):
    """A data file that cannot be read as GSM8K JSONL: `path`, `line` (1-based; 0 = the file as a whole) and
    `reason`; str() is "<path>: line <n>: <reason>" (or "<path>: <reason>")."""

    def __init__(self, path: str | Path, line: int, reason: str):
        self.path, self.line, self.reason = str(path), line, reason
        super().__init__(f"{path}: {self.where}")

    @property
    def where(self) -> str:
        """The line and the reason, without the path: "line 3: not JSON (...)"."""
        return f"line {self.line}: {self.reason}" if self.line else self.reason


def read_gsm8k_jsonl(path: str | Path, name: str | None = None, limit: int = 0) -> list[Prompt]:
    """Rows of a GSM8K JSONL file as Prompts (no token ids yet); `limit` > 0 keeps the first `limit` rows.
    Blank lines are skipped (a row's prompt id keeps its line number).

    Raises DataFileError (a ValueError) naming the file and line for a line that is not a JSON object, a row
    without string `question` and `answer` fields or without a '#### N' answer, and for a file without rows or
    not UTF-8 text."""
    path = Path(path)
    name = name or path.stem
    out = []
    with path.open(encoding="utf-8") as fh:
        try:
            for i, line in enumerate(fh):
                if limit and len(out) >= limit:
                    break
                if line.strip():
                    out.append(_gsm8k_row(path, name, i, line))
        except UnicodeDecodeError as e:
            raise DataFileError(path, 0, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not out:
        raise DataFileError(path, 0, "empty file: no JSON rows (expected one {\"question\": ..., \"answer\": ...} "
                                     "object per line)")
    return out


def _gsm8k_row(path: Path, name: str, i: int, line: str) -> Prompt:
    """Line i (0-based) of a GSM8K JSONL file as a Prompt; raises DataFileError."""
    try:
        row = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        raise DataFileError(path, i + 1, f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
        raise DataFileError(path, i + 1, "expected a JSON object with string fields 'question' and 'answer'")
    try:
        answer = gold_answer(row["answer"])
    except ValueError as e:
        raise DataFileError(path, i + 1, str(e)) from None
    return Prompt(f"{name}-{i:04d}", row["question"], answer)


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


def load_task_function(spec: str):
    """The task generator named by `spec` ("package.module:function").

    Raises ValueError starting with `data.function=<spec>:` if it cannot be imported or is not callable."""
    return load_callable(spec, "data.function")


def task_problems(spec: str, size: int, seed: int, options: dict | None = None,
                  timeout_s: float = DataConfig.timeout_s) -> list[Prompt]:
    """`size` problems from a task generator `fn(size: int, seed: int, **options) -> list[dict]`, each dict with
    `question` (str), `answer` (str) and optionally `metadata` (dict) and `id` (str), called in a worker process
    with a time limit of `timeout_s` seconds (actors/user_code.py; 0 = no limit, called in this process).

    Raises ValueError naming the function and item for an item without a string question and answer, ValueError
    `data.function=<spec>: <type>: <message>` when the generator raised, and UserCodeTimeout ("task generator
    <spec> did not return within <timeout_s> s (actors.data.timeout_s)") when it did not return in time."""
    load_task_function(spec)  # a bad spec fails here, naming the field
    try:
        items = call_with_timeout(spec, timeout_s, name=f"task generator {spec}", setting="actors.data.timeout_s",
                                  size=size, seed=seed, **dict(options or {}))
    except UserCodeError as e:
        raise ValueError(f"data.function={spec!r}: {e}") from None
    out = []
    for i, item in enumerate(items):
        if not isinstance(item.get("question"), str) or not isinstance(item.get("answer"), str):
            raise ValueError(f"data.function={spec!r}: item {i} needs string fields 'question' and 'answer'")
        pid = item.get("id") or f"{spec.rpartition(':')[2]}-s{seed}-{i:04d}"
        out.append(Prompt(pid, item["question"], item["answer"], metadata=dict(item.get("metadata") or {})))
    return out


def _problems(cfg: DataConfig, size: int, seed: int) -> list[Prompt]:
    if cfg.source == "gsm8k_jsonl":
        return read_gsm8k_jsonl(cfg.path, limit=size)
    if cfg.source == "function":
        return task_problems(cfg.function, size, seed, cfg.function_options, cfg.timeout_s)
    return reasoning_gym_problems(list(cfg.tasks), size, seed, cfg.task_options)


HELD_OUT_DRAWS = (1, 2)
"""Versions of the held-out draw (`eval.draw`): 1 = the first draw, whose items may repeat a question (what the
committed comparison records, docs/results/replication-decode*, were scored on); 2 = distinct questions (the
default)."""


def held_out_problems(cfg: DataConfig, size: int, seed: int, draw: int = 2) -> list[Prompt]:
    """`size` problems of the training task that are not among the training prompts: drawn with another seed
    (seed + 1_000_003: 2 x size + 16 of them) and filtered against the training questions (the first `cfg.size`
    of `seed`); with `draw` 2 (the default) also against each other: `size` distinct questions, in the order
    drawn. `draw` 1 keeps repeated questions (the items of the committed comparison records).

    Raises ValueError for a gsm8k_jsonl source (a file has no held-out part: give eval.data a file), for a draw
    that is not 1 or 2 ("eval.draw=..."), and when the draw holds fewer than `size` such questions (a task space
    too small): draw 2 names eval.limit and the number available ("eval.limit=16: only 12 distinct held-out
    problems ..."), draw 1 as it always did."""
    if draw not in HELD_OUT_DRAWS:
        raise ValueError(f"eval.draw={draw}: expected 1 (the first draw, repeated questions kept) or 2 (distinct "
                         "questions)")
    if cfg.source == "gsm8k_jsonl":
        raise ValueError("eval.data=train_task needs a generated training task (actors.data.source reasoning_gym "
                         "or function); for a JSONL training set give eval.data a held-out JSONL file")
    seen = {p.question for p in _problems(cfg, cfg.size, seed)}
    drawn = _problems(cfg, 2 * size + 16, seed + 1_000_003)
    fresh = [p for p in drawn if p.question not in seen]
    if draw == 1:
        if len(fresh) < size:
            raise ValueError(f"eval.data=train_task: only {len(fresh)} of {size} held-out problems are not training "
                             "prompts; lower eval.limit or actors.data.size")
        return fresh[:size]
    firsts: dict[str, Prompt] = {}
    for p in fresh:  # the first item of each question, in the order drawn
        firsts.setdefault(p.question, p)
    distinct = list(firsts.values())
    if len(distinct) < size:
        fix = f"set eval.limit={len(distinct)} or lower" if distinct else "lower actors.data.size"
        raise ValueError(f"eval.limit={size}: only {len(distinct)} distinct held-out problems are not training "
                         f"prompts (eval.data=train_task: {len(drawn)} drawn with another seed, repeated and training "
                         f"questions removed); {fix}")
    return distinct[:size]


def tokenize_prompts(prompts: list[Prompt], tokenizer, instruction: str = DEFAULT_INSTRUCTION) -> list[Prompt]:
    """Fill `prompt_ids` with the tokenizer's chat template (one user turn: question + instruction, then the
    assistant header). Returns the same list."""
    for p in prompts:
        messages = [{"role": "user", "content": f"{p.question}\n{instruction}".strip()}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        p.prompt_ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return prompts


def train_problems(cfg: DataConfig, seed: int = 0) -> list[Prompt]:
    """The training problems described by `cfg` (not tokenized), in the run's order.

    Raises ValueError (DataFileError for a file) when they cannot be read or there are none."""
    problems = _problems(cfg, cfg.size, seed)
    if not problems:
        raise ValueError(f"no training prompts (source {cfg.source}, size {cfg.size})")
    return problems


def load_train_prompts(cfg: DataConfig, tokenizer, seed: int = 0) -> list[Prompt]:
    """Training prompts described by `cfg`, tokenized with the chat template."""
    return tokenize_prompts(train_problems(cfg, seed), tokenizer, cfg.instruction)


def load_eval_items(name: str, limit: int = 0, train: DataConfig | None = None, seed: int = 0,
                    draw: int = 2) -> list[Prompt]:
    """An evaluation set: "train_task" (`limit` held-out problems of the training task `train`, drawn by version
    `draw` of the draw, see `held_out_problems`), a name in EVAL_SETS, or a path to a GSM8K JSONL; `limit` > 0
    keeps the first rows. Not tokenized (call `tokenize_prompts`). Raises ValueError for an unknown name that is
    not a file, and held_out_problems' errors."""
    if name == "train_task":
        if train is None:
            raise ValueError("eval.data=train_task needs the training data config")
        return held_out_problems(train, limit or 100, seed, draw)
    path = EVAL_SETS.get(name, Path(name))
    if not path.is_file():
        raise ValueError(f"eval data {name!r}: not one of {sorted(EVAL_SETS)} and not a file")
    return read_gsm8k_jsonl(path, name=name if name in EVAL_SETS else None, limit=limit)
