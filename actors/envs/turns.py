"""Token-exact turns of a multi-turn rollout: the sampled ids are kept verbatim, and only the environment's new
messages are rendered through the chat template and tokenized, as the suffix of the template over a fixed base
conversation (verl's ToolAgentLoop / SkyRL-gym's approach; docs/multi-turn.md).

Why: decode -> encode does not give back the sampled ids (BPE is not a bijection: "hel" + "lo" re-encodes as
"hello"), so re-rendering the history and re-tokenizing it would train on ids the sampler never produced. The
suffix rule holds only for a template that is append-only (every earlier turn renders the same whatever follows);
`ChatTemplate.build` checks that on a probe conversation and raises `TemplateNotAppendOnly` naming the template
when it does not hold (e.g. Qwen3's, which strips earlier `<think>` blocks), never a silent re-tokenization.

One rollout's token stream, prompt excluded: sampled ids (trainable 1), then the template's boundary after the
assistant's end-of-turn token and the rendered environment messages with the next generation prompt (trainable
0), then sampled ids again, ... `Rollout` assembles it under the episode's token limits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

Message = dict
"""A chat message: {"role": str, "content": str} (the shape transformers' apply_chat_template takes)."""

_BASE = ({"role": "user", "content": "U"}, {"role": "assistant", "content": "A"})
"""The fixed base conversation the environment's messages are rendered after (it ends with an assistant turn,
as every observation in a rollout does)."""


def _probe(system: bool, obs_roles: Sequence[str]) -> list[Message]:
    """system?, user, assistant, <obs role>, assistant, ..., each assistant turn with a <think> block (the
    reasoning a non-append-only template strips from earlier turns)."""
    msgs = [{"role": "system", "content": "You answer with tools."}] if system else []
    msgs.append({"role": "user", "content": "Find the value of K7."})
    for i, role in enumerate([*obs_roles, *obs_roles]):
        msgs.append({"role": "assistant", "content": f"<think>step {i}</think><lookup>K{i}</lookup>"})
        msgs.append({"role": role, "content": f"K{i} = {40 + i}"})
    msgs.append({"role": "assistant", "content": "<think>done</think>42"})
    return msgs


class TemplateNotAppendOnly(ValueError):
    """The tokenizer's chat template re-renders earlier turns when messages are added (or it cannot render the
    probe conversation), so token-exact multi-turn rollouts are impossible with it. str() is one line naming
    the template and the first token that changed."""


def render(tokenizer, messages: Sequence[Message], generation_prompt: bool) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template (transformers' apply_chat_template,
    `add_generation_prompt=generation_prompt`): list[int]. Raises what apply_chat_template raises."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=True,
                                        return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer's chat template, checked append-only, with what a rollout needs to extend a token stream.

    `eot_id`: the token that ends an assistant turn (the sampler's stop token); `boundary_ids`: the tokens the
    template writes after it (SmolLM2: "\\n", id 198), which the sampler did not produce; `base_ids`: the fixed
    base conversation rendered (no generation prompt). Build it with `ChatTemplate.build`."""
    tokenizer: Any
    name: str
    eot_id: int
    boundary_ids: tuple[int, ...]
    base_ids: tuple[int, ...]

    @classmethod
    def build(cls, tokenizer, name: str = "", eot_id: int | None = None,
              obs_roles: Sequence[str] = ("tool", "user")) -> "ChatTemplate":
        """The template of `tokenizer` (named `name`, default its `name_or_path`), after checking it is
        append-only on the probe conversations (with and without a system message; environment messages of
        each role in `obs_roles`). `eot_id`: default `tokenizer.eos_token_id`.

        Raises TemplateNotAppendOnly (one line naming the template) when an assistant turn does not end with
        `eot_id`, when a rendered conversation does not start with the stream built turn by turn, or when the
        template raises on the probe."""
        name = name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        eot = tokenizer.eos_token_id if eot_id is None else eot_id
        try:
            prompt, base = render(tokenizer, _BASE[:1], True), render(tokenizer, _BASE, False)
            template = cls(tokenizer, name, eot, _boundary(name, prompt, base, eot), tuple(base))
            for system in (True, False):
                template._check(_probe(system, obs_roles))
        except TemplateNotAppendOnly:
            raise
        except Exception as e:  # jinja2's TemplateError, a role the template refuses, no template at all
            raise TemplateNotAppendOnly(f"chat template of {name} cannot render the multi-turn probe conversation "
                                        f"({type(e).__name__}: {' '.join(str(e).split())})") from None
        return template

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first prompt of an episode: `messages` (the environment's reset) rendered with the generation
        prompt, list[int]."""
        return render(self.tokenizer, messages, True)

    def observation_ids(self, messages: Sequence[Message], closed: bool = True) -> list[int]:
        """The ids that follow a sampled assistant turn when the environment answers `messages`: the template's
        boundary after the end-of-turn token, the messages, the next generation prompt (list[int], none of
        them trainable). `closed`: the sampled ids end with `eot_id`; False (a turn cut by a stop string or a
        length limit) puts `eot_id` first.

        Rendered as the suffix of base + messages over the fixed base; raises TemplateNotAppendOnly if the base
        is not a prefix (a template that re-renders earlier turns when these roles follow)."""
        full = render(self.tokenizer, [*_BASE, *messages], True)
        if tuple(full[:len(self.base_ids)]) != self.base_ids:
            raise TemplateNotAppendOnly(f"chat template of {self.name} is not append-only: adding "
                                        f"{[m.get('role') for m in messages]} messages changes the conversation "
                                        f"before them (at token {_first_difference(full, self.base_ids)})")
        return ([] if closed else [self.eot_id]) + list(self.boundary_ids) + full[len(self.base_ids):]

    def _check(self, messages: list[Message]) -> None:
        """Build `messages`' stream turn by turn (assistant turns as the template renders them, as if sampled;
        the rest through `observation_ids`) and compare it with the whole conversation rendered at every turn."""
        start = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        stream = render(self.tokenizer, messages[:start], True)
        i = start
        while i < len(messages):
            if messages[i]["role"] == "assistant":
                whole = render(self.tokenizer, messages[:i + 1], False)
                self._expect(whole, stream, messages, i)
                sampled = whole[len(stream):len(whole) - len(self.boundary_ids)]
                if not sampled or sampled[-1] != self.eot_id or whole[len(whole) - len(self.boundary_ids):] != list(
                        self.boundary_ids):
                    raise TemplateNotAppendOnly(f"chat template of {self.name}: assistant turn {i} of the probe does "
                                                f"not end with end-of-turn id {self.eot_id} and the boundary "
                                                f"{list(self.boundary_ids)} the base conversation ends with")
                stream, i = stream + sampled, i + 1
            else:
                j = next((k for k in range(i, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
                stream = stream + self.observation_ids(messages[i:j])
                self._expect(render(self.tokenizer, messages[:j], True), stream, messages, j - 1)
                i = j

    def _expect(self, whole: list[int], stream: list[int], messages: list[Message], i: int) -> None:
        """Raise TemplateNotAppendOnly unless `whole` (messages[:i + 1] rendered) starts with `stream`."""
        if whole[:len(stream)] != stream:
            at = _first_difference(whole, stream)
            raise TemplateNotAppendOnly(
                f"chat template of {self.name} is not append-only: rendering the probe conversation through message "
                f"{i} ({messages[i]['role']}) changes token {at} of the turns before it (expected "
                f"{stream[at:at + 4]}, rendered {whole[at:at + 4]}); multi-turn rollouts keep sampled ids verbatim and "
                "need a template whose earlier turns render the same whatever follows (e.g. one that does not strip "
                "earlier <think> blocks): set another chat template or model")


def _boundary(name: str, prompt: list[int], base: list[int], eot_id: int) -> tuple[int, ...]:
    """The ids after the last `eot_id` of the base's assistant turn (base[len(prompt):])."""
    tail = base[len(prompt):] if base[:len(prompt)] == prompt else []
    if eot_id not in tail:
        raise TemplateNotAppendOnly(f"chat template of {name}: the base conversation's assistant turn does not follow "
                                    f"its generation prompt and end with end-of-turn id {eot_id}")
    return tuple(tail[len(tail) - tail[::-1].index(eot_id):])


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def truncate_contents(template: ChatTemplate, messages: Sequence[Message], max_tokens: int, side: str = "right",
                      closed: bool = True) -> tuple[list[int], int]:
    """`template.observation_ids(messages, closed)` with the messages' contents cut to at most `max_tokens` ids
    together, and how many ids were cut: list[int], int. A content's ids are those the template renders for it
    (the rendering's difference from the same messages with that content empty: the content's own encoding on an
    append-only template such as SmolLM2's, merged with a neighbour where the template's text runs into it), and
    the cut removes ids from the rendering: nothing is decoded and re-encoded, so a cut inside a multi-byte
    character keeps its partial byte ids (re-encoding would put U+FFFD's id there). Template ids around the
    contents are not counted. `side` "right" keeps the first ids (later messages emptied first), "left" the
    last (earlier messages emptied first). Raises ValueError for another `side`, TemplateNotAppendOnly as
    observation_ids does."""
    if side not in ("left", "right"):
        raise ValueError(f"truncate_contents: side={side!r}: expected left | right")
    rendered = template.observation_ids(messages, closed)
    out, left, cut = list(rendered), max_tokens, 0
    for k in list(range(len(messages)))[::-1 if side == "left" else 1]:
        a, b = _content_span(template, messages, k, rendered, closed)
        if b - a > left:
            drop = range(a, b - left) if side == "left" else range(a + left, b)
            out[drop.start:drop.stop] = [None] * len(drop)
            cut += len(drop)
        left -= min(left, b - a)
    return [t for t in out if t is not None], cut


def _content_span(template: ChatTemplate, messages: Sequence[Message], k: int, rendered: list[int],
                  closed: bool) -> tuple[int, int]:
    """[start, end) of message k's content in `rendered`: what differs from the rendering with that content empty."""
    empty = template.observation_ids([*messages[:k], {**messages[k], "content": ""}, *messages[k + 1:]], closed)
    start = _first_difference(rendered, empty)
    tail = 0
    while tail < min(len(rendered), len(empty)) - start and rendered[-1 - tail] == empty[-1 - tail]:
        tail += 1
    return start, len(rendered) - tail


@dataclass
class Turn:
    """One stretch of a rollout's token stream: `ids` (list[int]) and `trainable` (list[int], one 0/1 per id:
    1 = sampled by the policy, 0 = template boundary or environment token)."""
    ids: list[int]
    trainable: list[int]


@dataclass
class Rollout:
    """The token stream of one multi-turn episode after its prompt, turn by turn, under its limits:
    `max_total_tokens` for the whole rollout (sampled + observation tokens, the prompt excluded) and
    `max_obs_tokens` of environment text per observation (cut on `obs_truncation`'s side, see
    `truncate_contents`). `ids` / `trainable`: list[int] each, the same length."""
    template: ChatTemplate
    max_total_tokens: int
    max_obs_tokens: int
    obs_truncation: str = "right"
    turns: list[Turn] = field(default_factory=list)
    obs_tokens_cut: int = 0
    """Environment tokens cut by max_obs_tokens so far."""

    @property
    def ids(self) -> list[int]:
        return [t for turn in self.turns for t in turn.ids]

    @property
    def trainable(self) -> list[int]:
        return [f for turn in self.turns for f in turn.trainable]

    @property
    def remaining(self) -> int:
        """Tokens left under max_total_tokens (the next turn's `max_new_tokens` is at most this)."""
        return self.max_total_tokens - sum(len(t.ids) for t in self.turns)

    def add_sampled(self, ids: Sequence[int]) -> Turn:
        """Append the sampler's ids verbatim (trainable 1). Raises ValueError when they exceed `remaining`."""
        if len(ids) > self.remaining:
            raise ValueError(f"{len(ids)} sampled ids exceed the {self.remaining} tokens left of max_total_tokens "
                             f"{self.max_total_tokens}: generate at most `remaining` tokens")
        return self._add(Turn(list(ids), [1] * len(ids)))

    def add_observation(self, messages: Sequence[Message]) -> Turn | None:
        """Append the environment's `messages` after the last sampled turn (trainable 0): rendered by
        `ChatTemplate.observation_ids` (closed when the last sampled id is the end-of-turn id), their contents'
        own ids then cut to max_obs_tokens (`truncate_contents`). Returns the Turn, or None when it does not fit in
        `remaining` with at least one token left to generate (nothing is appended: the episode ends on its token
        limit). Raises
        TemplateNotAppendOnly as observation_ids and truncate_contents do."""
        last = self.turns[-1].ids[-1:] if self.turns else []
        ids, cut = truncate_contents(self.template, messages, self.max_obs_tokens, self.obs_truncation,
                                     closed=last == [self.template.eot_id])
        if len(ids) >= self.remaining:
            return None
        self.obs_tokens_cut += cut
        return self._add(Turn(ids, [0] * len(ids)))

    def _add(self, turn: Turn) -> Turn:
        self.turns.append(turn)
        return turn
