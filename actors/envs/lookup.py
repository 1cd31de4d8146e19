"""The tool-gated key/value lookup: a multi-turn task a small model can learn (docs/results.md 8;
docs/multi-turn.md).

Each item hides a table of `keys` keys (K1, K2, ...) with two-digit values; the prompt asks for one key's value
and says how to call the tool (`<lookup>K7</lookup>`). The environment answers a call with the entry (`K7 = 42`);
the model then answers. Only the tool reveals the value (a guess is right 1 time in 90). With `hops` 2 the asked
key's entry names another key (`K7 = K3`), whose value is the answer: the model must copy a key out of an
observation, then a value.

The KV-stress variant (docs/results.md 9): `asked` 2 or more keys in one question, answered with their values in
order, and every tool answer padded with `pad_entries` decoy entries of keys outside the table (`K11 = 37; K7 =
42; K9 = 18`), so that the whole episode exceeds a KV budget and the first value was read turns before the
answer (deploy/configs/smollm2-lookup-stress.yaml).

- `lookup_items(size, seed, keys, hops, asked)`: the item generator (`actors.data.function:
  actors.envs.lookup:lookup_items`).
- `LookupEnv(tool_disabled, call_reward, require_lookup, obs_role, pad_entries)`: the environment
  (`actors.env.factory: actors.envs.lookup:LookupEnv`). `tool_disabled` is the control: the tool answers nothing
  useful.
- `tool_answer(item, key, pad_entries)`: the tool's answer to a call of a key in the table.
- `lookup_demonstration(item, use_tool, rng, pad_entries=...)`: an episode's assistant and tool messages, and
  `demonstration_stream(template, item, use_tool, rng, pad_entries)` the same as the token stream a rollout actor
  builds, for a supervised warm-up (deploy/model_cache.py: smollm2-135m-lookup-warm, -lookup-stress-warm).
"""
from __future__ import annotations

import random
import re

CALL = re.compile(r"<lookup>\s*(K\d+)\s*</lookup>")
"""A well-formed tool call; the first one in a turn is answered."""
_INT = re.compile(r"\d+")
DISABLED = "the lookup tool is unavailable"
"""The tool's answer to every call with `tool_disabled`."""


def lookup_items(size: int, seed: int, keys: int = 8, hops: int = 1, asked: int = 1) -> list[dict]:
    """`size` items, deterministic in `seed`: a table {"K1": "42", ...} of `keys` values drawn uniformly from
    10..99, the asked key drawn uniformly; with `hops` > 1 the asked key's entry is another key, and so on for
    `hops` - 1 links (distinct keys), the last one holding the value. answer: that value (str). metadata:
    {"table": {key: str}, "target": asked key, "hops": hops}.

    With `asked` > 1 (hops 1): `asked` distinct keys drawn uniformly, asked in one question, answered with their
    values in that order; answer: the values joined by a space ("42 17"); metadata also holds "targets": the asked
    keys in order ("target" is the first). `asked` 1 gives the items of before, to the byte.

    Raises ValueError unless 1 <= hops <= keys, 1 <= asked <= keys, and hops is 1 when asked > 1."""
    if not 1 <= hops <= keys:
        raise ValueError(f"lookup_items: hops={hops}: expected 1 <= hops <= keys ({keys})")
    if not 1 <= asked <= keys or (asked > 1 and hops > 1):
        raise ValueError(f"lookup_items: asked={asked}: expected 1 <= asked <= keys ({keys}), and hops 1 (hops={hops}) "
                         f"when asked > 1")
    rng = random.Random(seed)
    out = []
    for i in range(size):
        names = [f"K{i}" for i in range(1, keys + 1)]
        table = {k: str(rng.randint(10, 99)) for k in names}
        chain = rng.sample(names, max(hops, asked))
        name = f"{_letters(seed)}-{_letters(i)}"
        if asked > 1:   # chain: the asked keys, each its own value
            out.append({"question": _question_many(chain, keys, name), "answer": " ".join(table[k] for k in chain),
                        "metadata": {"table": table, "target": chain[0], "targets": chain, "hops": 1}})
            continue
        for a, b in zip(chain, chain[1:]):
            table[a] = b
        out.append({"question": _question(chain[0], keys, hops, name), "answer": table[chain[-1]],
                    "metadata": {"table": table, "target": chain[0], "hops": hops}})
    return out


def _letters(n: int) -> str:
    """n >= 0 in base 26 as capital letters (0 -> "A", 26 -> "BA"): a table's name without digits, which the
    answer is read from."""
    out = chr(65 + n % 26)
    while n >= 26:
        n //= 26
        out = chr(65 + n % 26) + out
    return out


def _question(target: str, keys: int, hops: int, name: str) -> str:
    """The prompt; `name` (the seed and the index in letters) makes every item's question its own (the table
    differs, the text would not): held-out evaluation removes repeated and training questions."""
    follow = (" Its entry is another key: look that key up too, and answer with the value it holds." if hops > 1
              else "")
    return (f"A hidden table (table {name}) holds the keys K1 to K{keys}. "
            f"To read an entry, write <lookup>{target}</lookup> and "
            f"the tool answers. What is the value of {target}?{follow} Answer with the number alone.")


def _question_many(targets: list[str], keys: int, name: str) -> str:
    """The prompt of an item asking several keys ("K7 and K2", "K7, K2 and K5")."""
    asked = ", ".join(targets[:-1]) + f" and {targets[-1]}"
    return (f"A hidden table (table {name}) holds the keys K1 to K{keys}. To read an entry, write <lookup>{targets[0]}"
            f"</lookup> and the tool answers. What are the values of {asked}? Answer with the numbers in that order.")


def targets_of(metadata: dict) -> list[str]:
    """The asked keys of a lookup_items item, in the answer's order."""
    return list(metadata.get("targets", [metadata["target"]]))


def tool_answer(item, key: str, pad_entries: int = 0) -> str:
    """The tool's answer to a call of `key` (a key of the item's table): its entry ("K7 = 42"), with `pad_entries`
    > 0 among that many decoy entries of keys outside the table (K{keys+1} .. K{keys+pad_entries}, in a shuffled
    order, values drawn from 10..99), joined by "; ", the entry at a position drawn uniformly. Deterministic in the
    item's question and `key`: a key called twice gets the same answer. `item`: a lookup_items dict or an
    actors.tasks.data.Prompt of one."""
    question, metadata = ((item["question"], item["metadata"]) if isinstance(item, dict)
                          else (item.question, item.metadata))
    table = metadata["table"]
    entry = f"{key} = {table[key]}"
    if pad_entries <= 0:
        return entry
    rng = random.Random(f"{question}|{key}")
    decoys = [f"K{k} = {rng.randint(10, 99)}" for k in range(len(table) + 1, len(table) + 1 + pad_entries)]
    rng.shuffle(decoys)
    decoys.insert(rng.randint(0, pad_entries), entry)
    return "; ".join(decoys)


def answer_key(table: dict, target: str) -> str:
    """The key whose entry is the answer: `target` followed through entries that are keys."""
    seen = {target}
    while table[target] in table and table[target] not in seen:
        target = table[target]
        seen.add(target)
    return target


class LookupEnv:
    """One episode of the lookup task. A turn holding a call (`CALL`) gets the entry as one `obs_role` message
    (`tool_answer`: with `pad_entries` > 0 among that many decoys; reward 0, not done; an unknown key: "K9: no
    such key"; `tool_disabled`: DISABLED); a turn without one is the answer: its last integers, as many as the
    item asks keys. The answer step is done and rewards 1.0 when they equal the item's values in order (and, with
    `require_lookup`, every asked key's answer key was read through the tool), else `call_reward` if a call was
    answered before (never with the tool disabled), else 0. Every reward comes at the last step, so the episode's
    reward is the same under EnvConfig.reward sum and last. info: {"tool_call": bool, "key": called key} on a
    call, {"tool_call": False, "correct": bool, "calls": int} on the answer.

    Raises ValueError when pad_entries < 0."""

    def __init__(self, tool_disabled: bool = False, call_reward: float = 0.0, require_lookup: bool = True,
                 obs_role: str = "tool", pad_entries: int = 0):
        if not isinstance(pad_entries, int) or pad_entries < 0:
            raise ValueError(f"LookupEnv: pad_entries={pad_entries!r}: expected an integer >= 0")
        self.tool_disabled, self.call_reward = tool_disabled, call_reward
        self.require_lookup, self.obs_role, self.pad_entries = require_lookup, obs_role, pad_entries
        self.table: dict = {}
        self.read: set = set()
        self.calls = 0

    def reset(self, item) -> list[dict]:
        """The item (an actors.tasks.data.Prompt of lookup_items) as one user message."""
        self.item, self.table, self.read, self.calls = item, dict(item.metadata["table"]), set(), 0
        return [{"role": "user", "content": item.question}]

    def step(self, action_text: str):
        call = CALL.search(action_text)
        if call:
            return self._call(call.group(1))
        numbers, values = _INT.findall(action_text), self.item.answer.split()
        read = all(answer_key(self.table, t) in self.read for t in targets_of(self.item.metadata))
        correct = numbers[-len(values):] == values and (read or not self.require_lookup)
        answered = self.calls > 0 and not self.tool_disabled
        reward = 1.0 if correct else (float(self.call_reward) if answered else 0.0)
        return [], reward, True, {"tool_call": False, "correct": correct, "calls": self.calls}

    def _call(self, key: str):
        self.calls += 1
        if self.tool_disabled:
            content = DISABLED
        elif key in self.table:
            self.read.add(key)
            content = tool_answer(self.item, key, self.pad_entries)
        else:
            content = f"{key}: no such key"
        return [{"role": self.obs_role, "content": content}], 0.0, False, {"tool_call": True, "key": key}


def lookup_demonstration(item: dict, use_tool: bool, rng: random.Random, obs_role: str = "tool",
                         pad_entries: int = 0) -> list[dict]:
    """The messages after the question of one demonstration episode of `item` (a lookup_items dict): with
    `use_tool`, for each asked key and each hop an assistant call (`<lookup>K7</lookup>`) and the tool's answer as
    LookupEnv(pad_entries=pad_entries) writes it, then the answer (the values alone, in order, space-separated);
    without, a guessed answer alone (one value per asked key drawn from 10..99 with `rng`, right 1 time in 90
    each). A warm-up on a mix of both leaves the model with a choice RL can settle: look up or guess."""
    targets = targets_of(item["metadata"])
    if not use_tool:
        return [{"role": "assistant", "content": " ".join(str(rng.randint(10, 99)) for _ in targets)}]
    table, out = item["metadata"]["table"], []
    for key in targets:
        for _ in range(item["metadata"]["hops"]):
            out += [{"role": "assistant", "content": f"<lookup>{key}</lookup>"},
                    {"role": obs_role, "content": tool_answer(item, key, pad_entries)}]
            key = table[key]
    return out + [{"role": "assistant", "content": item["answer"]}]


def demonstration_stream(template, item: dict, use_tool: bool, rng: random.Random,
                         pad_entries: int = 0) -> tuple[list, list, list]:
    """`lookup_demonstration` as the rollout actor's token stream (actors/envs/turns.py): (prompt_ids, ids,
    trainable), three lists of ints, with `template` an actors.envs.turns.ChatTemplate; a call ends on its stop string
    `</lookup>` (the template's end-of-turn then opens the observation, trainable 0), the answer on the
    end-of-turn id."""
    from actors.envs.turns import Rollout

    tok, rollout = template.tokenizer, Rollout(template, max_total_tokens=1 << 16, max_obs_tokens=1 << 16)
    for m in lookup_demonstration(item, use_tool, rng, pad_entries=pad_entries):
        if m["role"] != "assistant":
            rollout.add_observation([m])
            continue
        ids = tok(m["content"], add_special_tokens=False)["input_ids"]
        rollout.add_sampled(ids if m["content"].endswith("</lookup>") else ids + [template.eot_id])
    return template.prompt_ids([{"role": "user", "content": item["question"]}]), rollout.ids, rollout.trainable
