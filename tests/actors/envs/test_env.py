"""Environments of multi-turn rollouts (actors/envs/env.py) and the lookup task's (actors/envs/lookup.py): the
config and the factory are checked before anything starts; envs live in a real worker process (actors/user_code.py) and
keep their state across steps; an env that raises, returns a non-list, a wrong tuple or a NaN reward, or sleeps
past step_timeout_s ends its episode with reward 0, counted, never raised, and a timeout ends every episode of
its worker; whole episodes run through the SmolLM2 chat template (actors/envs/turns.py) with a scripted policy that
reads the context, and the tool-disabled control scores nothing. Real workers, real tokenizer, no mocks
(tests/actors/scripted_envs.py holds the test envs)."""
from __future__ import annotations

import os
import random
import re
import time

import psutil
import pytest
from transformers import AutoTokenizer

from actors.envs.env import EnvConfig, EnvPool, check_env_factory
from actors.envs.lookup import DISABLED, LookupEnv, answer_key, demonstration_stream, lookup_items, tool_answer
from actors.envs.turns import ChatTemplate
from actors.tasks.data import Prompt
from deploy.model_cache import SMOLLM2, resolve_model
from learner.warmup import _row
from tests.actors.envs.reference_episode import run_episode

SCRIPTED = "scripted_envs:ScriptedEnv"
LOOKUP = "actors.envs.lookup:LookupEnv"


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate.build(AutoTokenizer.from_pretrained(resolve_model(SMOLLM2)), name=SMOLLM2)


@pytest.fixture(scope="module")
def pool():
    """One pool of ScriptedEnvs in one worker for the tests that do not kill it."""
    p = EnvPool(EnvConfig(factory=SCRIPTED, step_timeout_s=30))
    yield p
    p.shutdown()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def prompt(question: str = "q", i: int = 0) -> Prompt:
    return Prompt(f"p-{i}", question, "7")


def lookup_prompts(n: int, seed: int = 0, hops: int = 1) -> list[Prompt]:
    return [Prompt(f"lookup-{i}", d["question"], d["answer"], metadata=d["metadata"])
            for i, d in enumerate(lookup_items(n, seed, hops=hops))]


# -- config ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, expected", [
    ("step_timeout_s", -1.0, "seconds >= 0"), ("step_timeout_s", float("inf"), "seconds >= 0"),
    ("max_turns", 0, ">= 1"), ("max_total_tokens", 0, ">= 1"), ("max_obs_tokens", 0, ">= 1"),
    ("obs_truncation", "middle", "left | right"), ("reward", "mean", "sum | last")])
def test_each_bad_config_field_fails_in_one_line_naming_it(field, value, expected):
    with pytest.raises(ValueError) as e:
        EnvConfig(**{field: value})
    assert str(e.value).startswith(f"EnvConfig.{field}=") and expected in str(e.value) and "\n" not in str(e.value)
    EnvConfig()  # the defaults are valid


def test_the_factory_is_loaded_and_its_signature_checked_at_config_time():
    assert check_env_factory(SCRIPTED, {"step_reward": 0.5}).__name__ == "ScriptedEnv"
    assert check_env_factory(LOOKUP, {"tool_disabled": True}) is LookupEnv
    cases = [("no_such_module:Env", {}, r"^env\.factory='no_such_module:Env': cannot import module"),
             ("scripted_envs:Nope", {}, r"^env\.factory='scripted_envs:Nope': module 'scripted_envs' has no callable"),
             ("scripted_envs", {}, r"expected 'package\.module:function'"),
             ("scripted_envs:only_positional", {}, r"^env\.factory='scripted_envs:only_positional': "
                                                   r"cannot be called as "
                                                   r"only_positional\(\*\*options\) "
                                                   r"with the environment's options \{\}"),
             (SCRIPTED, {"colour": 1}, r"cannot be called as ScriptedEnv.*unexpected keyword argument 'colour'")]
    for spec, options, message in cases:
        with pytest.raises(ValueError, match=message):
            check_env_factory(spec, options)
        with pytest.raises(ValueError, match=message):  # the pool checks it before starting a worker
            EnvPool(EnvConfig(factory=spec, options=options))
    with pytest.raises(ValueError, match="single-turn"):
        EnvPool(EnvConfig())


# -- the pool: state in the worker, rewards, failures ------------------------------------------------------------
def test_envs_live_in_the_worker_and_the_episode_gets_the_sum_or_the_last_reward(pool):
    assert pool.reset("a", prompt("qa")).messages == [{"role": "user", "content": "start qa"}]
    assert pool.reset("b", prompt("qb")).messages == [{"role": "user", "content": "start qb"}]
    first, second = pool.step("a", "x"), pool.step("a", "y")
    pid, turn, action = second.messages[0]["content"].split()
    assert int(pid) == pool.code.pid != os.getpid() and (turn, action) == ("2", "y")  # one env, its state kept
    assert first.reward == 0.25 and not first.done and pool.step("b", "z").messages[0]["content"].endswith(" 1 z")
    end = pool.step("a", "bye")
    assert end.done and end.reward == 1.0 and end.info == {"turns": 3} and end.failure == ""
    assert pool.episode_reward("a") == 1.5 and pool.episode_reward("b") == 0.25  # sum: 0.25 + 0.25 + 1.0
    pool.close("a"), pool.close("b")
    with pytest.raises(KeyError):
        pool.step("a", "x")
    last = EnvPool(EnvConfig(factory=SCRIPTED, step_timeout_s=0, reward="last"))  # 0: in this process
    last.reset("c", prompt())
    assert last.step("c", "x").messages[0]["content"].startswith(f"{os.getpid()} 1")
    last.step("c", "bye")
    assert last.episode_reward("c") == 1.0 and last.counts == {"errors": 0, "timeouts": 0, "lost": 0}


@pytest.mark.parametrize("no_limit", [False, True])
def test_an_env_that_raises_or_returns_the_wrong_thing_ends_its_episode_with_reward_0(pool, no_limit):
    pool = EnvPool(EnvConfig(factory=SCRIPTED, step_timeout_s=0)) if no_limit else pool
    pool.reset("warm-up", prompt())          # the worker starts at the pool's first call (UserCode.pid: None before)
    pool.close("warm-up")
    errors, worker = pool.counts["errors"], pool.code.pid
    expected = {"raise": "step raised RuntimeError: the tool crashed",
                "nan": "step returned reward nan: expected a finite number",
                "nonlist": "step returned str: expected a list of {'role': str, 'content': str} dicts",
                "fourtuple": "step returned tuple: expected (messages, reward, done, info)"}
    for n, (action, why) in enumerate(expected.items(), start=1):
        key = f"bad-{action}"
        pool.reset(key, prompt())
        assert pool.step(key, "fine").reward == 0.25  # a reward before the failure: the episode still scores 0
        step = pool.step(key, action)
        assert (step.failure, step.done, step.reward, step.messages) == ("error", True, 0.0, [])
        assert step.error == pool.last_error == (f"environment {SCRIPTED} on {key}: {why} (the episode scored 0, "
                                                 "counted in env errors)")
        assert pool.episode_reward(key) == 0.0 and pool.counts["errors"] == errors + n
        assert pool.step(key, "fine").failure == "error" and pool.counts["errors"] == errors + n  # counted once
        pool.close(key)
    bad = pool.reset("bad-reset", prompt("bad-reset"))
    assert bad.failure == "error" and "reset returned dict: expected a list" in bad.error
    assert pool.counts["errors"] == errors + 5
    pool.reset("good", prompt())
    assert pool.step("good", "bye").reward == 1.0 and pool.code.pid == worker  # errors do not cost the worker


def test_a_step_past_step_timeout_s_ends_every_episode_of_its_worker_with_reward_0():
    pool = EnvPool(EnvConfig(factory=SCRIPTED, step_timeout_s=1.0))
    for key in ("slow", "bystander"):
        pool.reset(key, prompt())
    assert pool.step("bystander", "x").reward == 0.25
    worker = pool.code.pid
    start = time.monotonic()
    step = pool.step("slow", "sleep")  # the env sleeps 60 s
    assert time.monotonic() - start < 5 and (step.failure, step.reward, step.done) == ("timeout", 0.0, True)
    assert step.error == (f"environment {SCRIPTED} on slow: step did not return within 1 s "
                          "(actors.env.step_timeout_s) (the episode scored 0, counted in env timeouts)")
    assert pool.code.pid is None and gone(worker)
    lost = pool.step("bystander", "y")  # its env died with the worker
    assert (lost.failure, lost.reward) == ("lost", 0.0) and "its worker process was killed" in lost.error
    assert pool.episode_reward("bystander") == 0.0 == pool.episode_reward("slow")
    assert pool.counts == {"errors": 0, "timeouts": 1, "lost": 1}
    pool.close("slow"), pool.close("bystander")
    pool.reset("after", prompt())  # a new worker
    assert pool.step("after", "bye").reward == 1.0 and pool.code.pid not in (None, worker)
    pool.shutdown()


# -- the lookup task -----------------------------------------------------------------------------------------------
def test_lookup_items_are_deterministic_in_the_seed_and_hide_their_answer():
    assert lookup_items(20, 3) == lookup_items(20, 3) != lookup_items(20, 4)
    for hops in (1, 2):
        for item in lookup_items(50, 0, hops=hops):
            table, target = item["metadata"]["table"], item["metadata"]["target"]
            assert (sorted(table) == sorted(f"K{i}" for i in range(1, 9))
                    and f"<lookup>{target}</lookup>" in item["question"])
            key = answer_key(table, target)
            assert (key == target) == (hops == 1) and table[key] == item["answer"] and 10 <= int(item["answer"]) <= 99
            assert item["answer"] not in item["question"]  # only the tool reveals it
    with pytest.raises(ValueError, match="hops=9"):
        lookup_items(1, 0, hops=9)


def oracle(template: ChatTemplate, answer: str | None = None):
    """A policy that reads its context: calls the key in the prompt, follows an entry that is a key, answers the
    value it read (or `answer`, or 50 when the tool told it nothing)."""
    tok = template.tokenizer

    def generate(ids, max_new_tokens):
        text = tok.decode(ids)
        read = re.findall(r"(K\d+) = (\w+)<\|im_end\|>", text)
        if answer is not None:
            out = answer
        elif read:
            out = f"<lookup>{read[-1][1]}</lookup>" if read[-1][1].startswith("K") else read[-1][1]
        elif DISABLED in text:
            out = "50"
        else:
            out = re.search(r"<lookup>K\d+</lookup>", text).group(0)
        return (tok.encode(out, add_special_tokens=False) + [template.eot_id])[:max_new_tokens]
    return generate


def test_lookup_episodes_run_token_exact_and_reward_the_value_read_through_the_tool(template):
    pool = EnvPool(EnvConfig(factory=LOOKUP, step_timeout_s=30))
    tok = template.tokenizer
    for hops, turns in ((1, 2), (2, 3)):
        for item in lookup_prompts(4, seed=hops, hops=hops):
            ep = run_episode(pool, template, f"{item.prompt_id}-{hops}", item, oracle(template), max_new_tokens=16)
            assert (ep.reward, ep.turns, ep.finish) == (1.0, turns, "done")
            assert ep.prompt_ids == template.prompt_ids([{"role": "user", "content": item.question}])
            ids, trainable = ep.rollout.ids, ep.rollout.trainable
            assert len(ids) == len(trainable) and ids[-1] == template.eot_id
            env_text = tok.decode([t for t, f in zip(ids, trainable) if f == 0])
            sampled_text = tok.decode([t for t, f in zip(ids, trainable) if f == 1])
            key = answer_key(item.metadata["table"], item.metadata["target"])
            assert f"{key} = {item.answer}" in env_text and "<|im_start|>tool" in env_text
            assert sampled_text.endswith(f"{item.answer}<|im_end|>") and "tool" not in sampled_text
    assert pool.counts == {"errors": 0, "timeouts": 0, "lost": 0}
    pool.shutdown()


def test_the_tool_disabled_control_and_a_guess_score_nothing(template):
    items = lookup_prompts(60, seed=5)
    disabled = EnvPool(EnvConfig(factory=LOOKUP, options={"tool_disabled": True, "call_reward": 0.1},
                                 step_timeout_s=0))
    rewards = [run_episode(disabled, template, f"d-{i.prompt_id}", i, oracle(template), 16).reward for i in items]
    assert sum(rewards) / len(rewards) <= 0.02, rewards
    enabled = EnvPool(EnvConfig(factory=LOOKUP, options={"call_reward": 0.1}, step_timeout_s=0))
    assert all(run_episode(enabled, template, f"e-{i.prompt_id}", i, oracle(template), 16).reward == 1.0
               for i in items)
    guess = run_episode(enabled, template, "guess", items[0], oracle(template, answer=items[0].answer), 16)
    assert (guess.reward, guess.turns) == (0.0, 1)  # the right value, never read: no reward
    wrong = run_episode(enabled, template, "wrong", items[0], call_then(template, "101"), 16)
    assert (wrong.reward, wrong.turns) == (0.1, 2)  # a well-formed call answered, a wrong value: call_reward


def call_then(template: ChatTemplate, answer: str):
    """A policy that calls the prompt's key, then answers `answer` whatever the tool said."""
    call, then = oracle(template), oracle(template, answer)
    return lambda ids, n: then(ids, n) if " = " in template.tokenizer.decode(ids) else call(ids, n)


def test_episodes_end_at_max_turns_and_max_total_tokens(template):
    item = lookup_prompts(1, seed=9)[0]
    always_call = oracle(template, answer="<lookup>K1</lookup>")
    pool = EnvPool(EnvConfig(factory=LOOKUP, step_timeout_s=0, max_turns=3))
    ep = run_episode(pool, template, "calls", item, always_call, 16)
    turn = len(always_call([], 16))
    assert (ep.turns, ep.finish, ep.reward) == (3, "max_turns", 0.0) and sum(ep.rollout.trainable) == 3 * turn
    small = EnvPool(EnvConfig(factory=LOOKUP, step_timeout_s=0, max_turns=10, max_total_tokens=40))
    ep = run_episode(small, template, "tokens", item, always_call, 16)
    assert ep.finish == "max_total_tokens" and len(ep.rollout.ids) <= 40 and ep.turns == 2


def test_warmup_demonstrations_are_the_streams_an_episode_builds(template):
    """The lookup warm-up's demonstrations (deploy/model_cache.py) replayed as a policy through LookupEnv: the
    episode's prompt, ids and trainable flags are the demonstration's to the token, a tool demonstration earns 1.0
    (1- and 2-hop), a guess 0; the warm-up trains on the sampled tokens alone."""
    pool = EnvPool(EnvConfig(factory=LOOKUP, step_timeout_s=30))
    for hops in (1, 2):
        for use_tool, item in zip((True, False, True), lookup_items(3, seed=11, hops=hops)):
            prompt, ids, trainable = demonstration_stream(template, item, use_tool, random.Random(0))
            sampled = _sampled_turns(ids, trainable)
            replay = iter(sampled)
            ep = run_episode(pool, template, f"demo-{hops}-{use_tool}-{item['answer']}",
                             Prompt("d", item["question"], item["answer"], metadata=item["metadata"]),
                             lambda _ids, _n, replay=replay: next(replay), max_new_tokens=16)
            assert (ep.prompt_ids, ep.rollout.ids, ep.rollout.trainable) == (prompt, ids, trainable)
            assert len(sampled) == (hops + 1 if use_tool else 1)
            assert ep.reward == (1.0 if use_tool else 0.0)         # a guess is never read through the tool
            labels = _row(prompt, ids, trainable)["labels"]
            assert [t for t in labels if t != -100] == [t for t, f in zip(ids, trainable) if f]
    pool.shutdown()


def _sampled_turns(ids, trainable) -> list[list[int]]:
    """The runs of trainable ids: one per sampled turn."""
    out, prev = [], 0
    for t, f in zip(ids, trainable):
        if f and not prev:
            out.append([])
        if f:
            out[-1].append(t)
        prev = f
    return out


# -- the KV-stress variant (docs/results.md 9) ---------------------------------------------------------------------
PAD = 4


def stress_prompts(n: int, seed: int = 0, asked: int = 2) -> list[Prompt]:
    return [Prompt(f"stress-{i}", d["question"], d["answer"], metadata=d["metadata"])
            for i, d in enumerate(lookup_items(n, seed, asked=asked))]


def test_asked_1_keeps_every_item_to_the_byte_and_asked_2_asks_two_keys_in_order():
    """The committed results depend on lookup_items' default items: their hash, computed before `asked` existed."""
    import hashlib
    import json
    pinned = {1: "2ecce2ba981194493377f85858f57631831d4dc1f1ecda03d3a9100a6d561d39",
              2: "4789e77844fa39b0e5686ddab1719c20b1abb15ac05e342de272fe9b8cfbde0d"}
    for hops, digest in pinned.items():
        items = lookup_items(64, 4321, hops=hops)
        assert items == lookup_items(64, 4321, hops=hops, asked=1)
        assert hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest() == digest
    for item in lookup_items(50, 0, asked=2):
        table, targets = item["metadata"]["table"], item["metadata"]["targets"]
        assert len(set(targets)) == 2 and item["metadata"]["target"] == targets[0]
        assert item["answer"] == f"{table[targets[0]]} {table[targets[1]]}"
        assert f"What are the values of {targets[0]} and {targets[1]}?" in item["question"]
        assert not any(v in item["question"] for v in item["answer"].split())
    for kwargs in ({"asked": 0}, {"asked": 9}, {"asked": 2, "hops": 2}):
        with pytest.raises(ValueError, match=f"asked={kwargs['asked']}"):
            lookup_items(1, 0, **kwargs)
    with pytest.raises(ValueError, match="pad_entries=-1"):
        LookupEnv(pad_entries=-1)


def test_a_padded_observation_holds_the_entry_once_among_its_decoys():
    positions = set()
    for item in stress_prompts(40, seed=3):
        env = LookupEnv(pad_entries=PAD)
        env.reset(item)
        for key, value in item.metadata["table"].items():
            (message,), reward, done, info = env.step(f"<lookup>{key}</lookup>")
            entries = message["content"].split("; ")
            assert (reward, done, info["key"], len(entries)) == (0.0, False, key, PAD + 1)
            real = [e for e in entries if e.split(" = ")[0] in item.metadata["table"]]
            assert real == [f"{key} = {value}"]
            decoys = [e.split(" = ") for e in entries if e != real[0]]
            assert sorted(k for k, _ in decoys) == sorted(f"K{k}" for k in range(9, 9 + PAD))
            assert all(10 <= int(v) <= 99 for _, v in decoys)
            again = LookupEnv(pad_entries=PAD)
            again.reset(item)
            assert again.step(f"<lookup>{key}</lookup>")[0] == [message]   # deterministic per item and key
            positions.add(entries.index(real[0]))
    assert positions == set(range(PAD + 1))                            # the entry is anywhere among the decoys


def test_a_stress_episode_exceeds_the_budget_and_its_first_value_is_read_turns_before_the_answer(template):
    """Rendered through SmolLM2's tokenizer with the preset's own options: the whole episode is > 3x the preset's
    KV budget, more than a budget of tokens lie between the first value read and the answer, and no observation
    is cut (env.max_obs_tokens, max_total_tokens)."""
    from deploy.config import load_config
    cfg = load_config("smollm2-lookup-stress", check_files=False)
    a, tok = cfg.actors, template.tokenizer
    budget, pad = a.engine.compressor.kv_budget, a.env.options["pad_entries"]
    for item in lookup_items(8, 5, **a.data.function_options):
        prompt, ids, trainable = demonstration_stream(template, item, True, random.Random(0), pad_entries=pad)
        assert len(prompt) + len(ids) > 3 * budget and len(ids) <= a.env.max_total_tokens
        for key in item["metadata"]["targets"]:
            content = tool_answer(item, key, pad)
            assert len(tok(content, add_special_tokens=False)["input_ids"]) <= a.env.max_obs_tokens
        first = item["metadata"]["table"][item["metadata"]["targets"][0]]
        text = tok.decode(ids)
        read_at = len(tok(text[:text.index(f"{item['metadata']['targets'][0]} = {first}") + 10],
                          add_special_tokens=False)["input_ids"])
        assert len(ids) - read_at > budget and _sampled_turns(ids, trainable)[-1] == tok(
            item["answer"], add_special_tokens=False)["input_ids"] + [template.eot_id]


def test_stress_demonstrations_replay_through_the_padded_env_to_the_token(template, monkeypatch):
    """A stress demonstration (each asked key called in turn, both values answered) replayed through
    LookupEnv(pad_entries=4) gives its stream to the token and 1.0, a guess 0; an environment that writes its
    answers differently (entries joined by ", ") gives another stream: the demonstrations must be the env's."""
    options = {"pad_entries": PAD}
    pool = EnvPool(EnvConfig(factory=LOOKUP, options=options, step_timeout_s=0, max_total_tokens=192,
                             max_obs_tokens=64))

    def replay(name, item, demo):
        turns = iter(_sampled_turns(demo[1], demo[2]))
        return run_episode(pool, template, name,
                           Prompt("d", item["question"], item["answer"], metadata=item["metadata"]),
                           lambda _ids, _n: next(turns), max_new_tokens=24)

    items = lookup_items(3, seed=12, asked=2)
    for use_tool, item in zip((True, False, True), items):
        demo = demonstration_stream(template, item, use_tool, random.Random(0), pad_entries=PAD)
        ep = replay(f"stress-{use_tool}-{item['answer']}", item, demo)
        assert (ep.prompt_ids, ep.rollout.ids, ep.rollout.trainable) == demo
        assert (ep.reward, ep.turns) == ((1.0, 3) if use_tool else (0.0, 1))
    import actors.envs.lookup as lookup_env
    written = lookup_env.tool_answer
    monkeypatch.setattr(lookup_env, "tool_answer", lambda *a: written(*a).replace("; ", ", "))
    demo = demonstration_stream(template, items[0], True, random.Random(0), pad_entries=PAD)
    monkeypatch.undo()
    ep = replay("stress-other", items[0], demo)
    assert ep.rollout.ids != demo[1]
    pool.shutdown()


def test_the_stress_answer_needs_both_values_in_order_each_read_through_the_tool():
    item = stress_prompts(1, seed=4)[0]
    (k1, k2), (v1, v2) = item.metadata["targets"], item.answer.split()

    def episode(calls, answer, **options):
        env = LookupEnv(pad_entries=PAD, **options)
        env.reset(item)
        for key in calls:
            env.step(f"<lookup>{key}</lookup>")
        return env.step(answer)[1]

    assert episode([k1, k2], f"{v1} {v2}") == episode([k2, k1], f"The values are {v1} and {v2}.") == 1.0
    assert episode([k1, k2], f"{v2} {v1}") == 0.0 and episode([k1, k2], v2) == 0.0     # order swapped, one value
    assert episode([k1, k2], f"{v2} {v1}", call_reward=0.1) == 0.1
    assert episode([k1], f"{v1} {v2}") == episode([k2], f"{v1} {v2}") == 0.0           # one key not read
    assert episode([k1], f"{v1} {v2}", require_lookup=False) == 1.0
    assert episode([k1, k2], f"{v1} {v2}", tool_disabled=True) == 0.0
