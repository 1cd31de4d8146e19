"""Token-exact turns (actors/envs/turns.py) with the real tokenizers the project ships, loaded from the local model
cache (no model hub): SmolLM2-135M-Instruct's (its own ChatML template, with a default system message and "\\n"
after each end-of-turn) and tiny-char's (the test presets' character tokenizer, whose template writes role
letters and no boundary). No other model's chat template is on the machine or in the .venv; a template that is
not append-only (tests/actors/envs/templates/strips_think.jinja, Qwen3-like: earlier <think> blocks stripped) is
vendored and fails the check.

What is checked: the append-only check passes the shipped templates and fails, in one line naming the template,
on one that is not; a multi-turn stream built turn by turn is the template's own rendering of the conversation;
sampled ids are kept verbatim where decode -> encode would change them; boundary and environment tokens are not
trainable; observations are cut to max_obs_tokens on either side; the rollout stays within max_total_tokens."""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from actors.envs.turns import ChatTemplate, Rollout, TemplateNotAppendOnly, render, truncate_contents
from deploy.model_cache import SMOLLM2, TINY_CHAR, resolve_model

STRIPS_THINK = Path(__file__).resolve().parent / "templates" / "strips_think.jinja"


def tokenizer(name: str):
    return AutoTokenizer.from_pretrained(resolve_model(name))


@pytest.fixture(scope="module")
def smol() -> ChatTemplate:
    return ChatTemplate.build(tokenizer(SMOLLM2), name=SMOLLM2)


def conversation(system: bool = False) -> list[dict]:
    msgs = [{"role": "system", "content": "be brief"}] if system else []
    return msgs + [{"role": "user", "content": "what is k7?"},
                   {"role": "assistant", "content": "<think>look</think>call k7"},
                   {"role": "tool", "content": "k7 = 42"},
                   {"role": "assistant", "content": "<think>got it</think>42"},
                   {"role": "user", "content": "and k3?"},
                   {"role": "assistant", "content": "<think>again</think>call k3"}]


def test_the_shipped_templates_are_append_only_and_their_boundaries_are_found(smol):
    tok = smol.tokenizer
    assert (smol.name, smol.eot_id, smol.boundary_ids) == (SMOLLM2, tok.convert_tokens_to_ids("<|im_end|>"), (198,))
    assert tok.decode(smol.observation_ids([{"role": "tool", "content": "k7 = 42"}])) == (
        "\n<|im_start|>tool\nk7 = 42<|im_end|>\n<|im_start|>assistant\n")
    char = ChatTemplate.build(tokenizer(TINY_CHAR))
    assert char.name == resolve_model(TINY_CHAR) and char.boundary_ids == ()  # its default name: the tokenizer's path
    assert char.tokenizer.decode(char.observation_ids([{"role": "tool", "content": "k7 = 42"}])) == (
        "<|im_start|>t:k7 = 42<|im_end|><|im_start|>a:")


def test_a_template_that_strips_earlier_reasoning_fails_the_check_in_one_line_naming_it():
    tok = tokenizer(SMOLLM2)
    tok.chat_template = STRIPS_THINK.read_text()
    with pytest.raises(TemplateNotAppendOnly) as e:
        ChatTemplate.build(tok, name="strips_think.jinja")
    assert str(e.value).startswith("chat template of strips_think.jinja is not append-only: rendering the probe "
                                   "conversation through message 5 (user) changes token ")
    assert "\n" not in str(e.value) and "<think>" in str(e.value)
    with pytest.raises(TemplateNotAppendOnly, match=f"^chat template of {resolve_model(SMOLLM2)} is not append-only"):
        ChatTemplate.build(tok)  # named by the tokenizer by default
    msgs = conversation()  # what it does: the user turn re-renders the earlier assistant turns without <think>
    before, after = render(tok, msgs[:4], False), render(tok, msgs[:5], False)
    assert after[:len(before)] != before


def test_a_template_that_cannot_render_a_tool_message_fails_naming_it():
    tok = tokenizer(SMOLLM2)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                         "{{ raise_exception('roles are system, user and assistant') }}{% endif %}"
                         "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(TemplateNotAppendOnly,
                       match=r"^chat template of user-only cannot render the multi-turn probe "
                             r"conversation \(TemplateError: roles are system, user and assistant\)$"):
        ChatTemplate.build(tok, name="user-only")
    assert ChatTemplate.build(tok, name="user-only", obs_roles=("user",)).boundary_ids == (198,)  # user turns only


def canonical_sampled(template: ChatTemplate, msgs: list[dict], i: int) -> list[int]:
    """Assistant message i as the template renders it after messages[:i] (with its end-of-turn id, without the
    boundary): what a sampler that wrote exactly this text in the template's tokens sampled."""
    whole, before = render(template.tokenizer, msgs[:i + 1], False), render(template.tokenizer, msgs[:i], True)
    return whole[len(before):len(whole) - len(template.boundary_ids)]


@pytest.mark.parametrize("name", [SMOLLM2, TINY_CHAR])
@pytest.mark.parametrize("system", [False, True])
def test_a_stream_built_turn_by_turn_is_the_templates_own_rendering(name, system):
    template = ChatTemplate.build(tokenizer(name))
    msgs = conversation(system)
    first = 2 if system else 1
    rollout = Rollout(template, max_total_tokens=4096, max_obs_tokens=64)
    sampled = []
    for i in range(first, len(msgs)):
        if msgs[i]["role"] == "assistant":
            sampled.append(rollout.add_sampled(canonical_sampled(template, msgs, i)).ids)
        else:
            rollout.add_observation([msgs[i]])
    prompt = template.prompt_ids(msgs[:first])
    assert prompt + rollout.ids + list(template.boundary_ids) == render(template.tokenizer, msgs, False)
    flagged = [t for t, f in zip(rollout.ids, rollout.trainable) if f]
    assert flagged == [t for ids in sampled for t in ids] and len(rollout.trainable) == len(rollout.ids)


def test_sampled_ids_survive_verbatim_where_decode_then_encode_would_change_them(smol):
    tok = smol.tokenizer
    first = tok.encode("the answer is", add_special_tokens=False) + [704, 5365] + [smol.eot_id]  # " hel" + "lo"
    assert tok.decode([704, 5365]) == " hello" and tok.encode(" hello", add_special_tokens=False) == [33662]
    assert tok.encode(tok.decode(first), add_special_tokens=False) != first  # re-tokenizing would change them
    second = [704, 5365, 704, 5365, smol.eot_id]
    rollout = Rollout(smol, max_total_tokens=256, max_obs_tokens=64)
    rollout.add_sampled(first)
    obs = rollout.add_observation([{"role": "user", "content": "say it again"}])
    rollout.add_sampled(second)
    assert rollout.ids == first + obs.ids + second
    assert rollout.trainable == [1] * len(first) + [0] * len(obs.ids) + [1] * len(second)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": tok.decode(first[:-1])},
            {"role": "user", "content": "say it again"}, {"role": "assistant", "content": tok.decode(second[:-1])}]
    rerendered = render(tok, msgs, False)[len(smol.prompt_ids(msgs[:1])):]
    assert rerendered[:-1] != rollout.ids  # what re-rendering the history would have trained on


def test_boundary_and_environment_tokens_are_not_trainable(smol):
    tok = smol.tokenizer
    rollout = Rollout(smol, max_total_tokens=256, max_obs_tokens=64)
    rollout.add_sampled(tok.encode("<lookup>K7</lookup>", add_special_tokens=False))  # cut by a stop string: no eot
    obs = rollout.add_observation([{"role": "tool", "content": "K7 = 42"}])
    assert obs.ids[:2] == [smol.eot_id, 198] and obs.trainable == [0] * len(obs.ids)  # the template closes the turn
    assert tok.decode(obs.ids).startswith("<|im_end|>\n<|im_start|>tool\nK7 = 42")
    rollout.add_sampled(tok.encode("42", add_special_tokens=False) + [smol.eot_id])
    obs = rollout.add_observation([{"role": "user", "content": "sure?"}])
    assert obs.ids[0] == 198 and tok.decode(obs.ids) == "\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n"
    assert sum(rollout.trainable) == len(rollout.ids) - sum(len(t.ids) for t in rollout.turns[1::2])


def test_observations_are_cut_to_max_obs_tokens_on_either_side(smol):
    tok = smol.tokenizer
    text = "one two three four five six seven eight"
    assert len(tok.encode(text, add_special_tokens=False)) == 8
    msgs = [{"role": "tool", "content": text}]

    def cut(messages, n, side):
        ids, cut = truncate_contents(smol, messages, n, side)
        return tok.decode(ids), cut

    head, tail = "\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n"
    assert cut(msgs, 3, "right") == (f"{head}one two three{tail}", 5)
    assert cut(msgs, 3, "left") == (f"{head} six seven eight{tail}", 5)
    two = [{"role": "tool", "content": "one two"}, {"role": "user", "content": "three four"}]
    assert cut(two, 3, "right")[0] == f"{head}one two<|im_end|>\n<|im_start|>user\nthree{tail}"
    assert cut(two, 3, "left")[0] == f"{head} two<|im_end|>\n<|im_start|>user\nthree four{tail}"
    assert cut(msgs, 8, "right") == (f"{head}{text}{tail}", 0)
    with pytest.raises(ValueError, match="side='middle'"):
        truncate_contents(smol, msgs, 3, "middle")
    rollout = Rollout(smol, max_total_tokens=256, max_obs_tokens=3, obs_truncation="left")
    rollout.add_sampled([smol.eot_id])
    obs = rollout.add_observation(msgs)
    assert tok.decode(obs.ids) == "\n<|im_start|>tool\n six seven eight<|im_end|>\n<|im_start|>assistant\n"
    assert rollout.obs_tokens_cut == 5


def test_the_rollout_stays_within_max_total_tokens(smol):
    rollout = Rollout(smol, max_total_tokens=20, max_obs_tokens=64)
    rollout.add_sampled([504] * 14 + [smol.eot_id])
    assert rollout.remaining == 5
    assert rollout.add_observation([{"role": "tool", "content": "k7 = 42"}]) is None  # 16 ids: nothing appended
    assert len(rollout.ids) == 15 and rollout.remaining == 5
    with pytest.raises(ValueError, match="6 sampled ids exceed the 5 tokens left of max_total_tokens 20"):
        rollout.add_sampled([504] * 6)
    rollout.add_sampled([504] * 5)
    assert rollout.remaining == 0 and len(rollout.ids) == len(rollout.trainable) == 20


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_cut_inside_a_multibyte_character_keeps_the_observations_own_ids(smol, side):
    # 22 ids; the 16th ends inside 🎉 and the 7th from the end starts inside 二: decoding the kept ids gives U+FFFD,
    # which the template would re-encode as id 24211 (the defect: 0 of 8 episodes exact on CJK/emoji text)
    text = "值 = 四十二 🙂 表格 🎉 记住"
    own = smol.tokenizer.encode(text, add_special_tokens=False)
    assert len(own) == 22 and 24211 not in own
    kept = own[:16] if side == "right" else own[-16:]
    full = Rollout(smol, max_total_tokens=256, max_obs_tokens=64)
    full.add_sampled([smol.eot_id])
    whole = full.add_observation([{"role": "tool", "content": text}]).ids
    at = next(i for i in range(len(whole)) if whole[i:i + len(own)] == own)   # the content among the template's ids
    rollout = Rollout(smol, max_total_tokens=256, max_obs_tokens=16, obs_truncation=side)
    rollout.add_sampled([smol.eot_id])
    obs = rollout.add_observation([{"role": "tool", "content": text}])
    assert obs.ids == whole[:at] + kept + whole[at + len(own):]
    assert rollout.obs_tokens_cut == 6


def test_a_content_the_template_merges_with_its_header_is_cut_on_the_rendered_ids(smol):
    # "tool\n" + "\n\none two ..." renders the template's newline and the content's into other ids than the
    # content encoded alone: the content's ids are the 7 that differ from the same message with an empty content
    msgs = [{"role": "tool", "content": "\n\none two three four five"}]
    whole = smol.observation_ids(msgs)
    own = smol.tokenizer.encode(msgs[0]["content"], add_special_tokens=False)
    assert not any(whole[i:i + len(own)] == own for i in range(len(whole)))
    ids, cut = truncate_contents(smol, msgs, 3, "right")
    empty = smol.observation_ids([{"role": "tool", "content": ""}])
    assert whole[:3] == empty[:3] and whole[10:] == empty[4:] and len(whole) == 16   # the content: whole[3:10]
    assert len(whole) - len(ids) == cut == 4 and ids == whole[:6] + whole[10:]
    assert smol.tokenizer.decode(ids) == "\n<|im_start|>tool\n\n\none<|im_end|>\n<|im_start|>assistant\n"
