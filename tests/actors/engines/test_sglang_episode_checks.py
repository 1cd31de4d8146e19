"""What `SGLangEngine.generate(..., episodes=)` refuses before anything reaches SGLang, and which engines offer
`release_episodes` (docs/sglang.md, "The compressed cache across turns on SGLang"). Plain Python, no SGLang: the
checks read only the engine's settings and its held episodes (tests/sglang/test_sglang_episodes.py runs them)."""
from __future__ import annotations

import types

import pytest

from actors.engines.base import SamplingParams
from actors.engines.sglang.engine import EpisodeState, SGLangEngine

BOS = 7


def engine(keeps: bool = True, record: bool = False, held: dict | None = None):
    """The fields `_check_turns` and `release_episodes` read, of a sparse `sparse_rl_kv` engine (keeps episodes)."""
    return types.SimpleNamespace(keeps_episodes=keeps, record_evictions=record, _episodes=dict(held or {}),
                                 tokenizer=types.SimpleNamespace(bos_token_id=BOS), _release_episodes=lambda k: 0)


def check(eng, prompts, keys, **params):
    return SGLangEngine._check_turns(eng, prompts, SamplingParams(max_new_tokens=8, **params), keys)


def test_a_new_and_a_held_episode_are_told_apart():
    held = EpisodeState(first_prompt=5, tokens=30, held=20)
    assert check(engine(held={"a": held}), [[1, 2], [BOS, 3]], ["a", "b"]) == [held, None]   # a first turn may


@pytest.mark.parametrize("prompts,keys,params,match", [
    ([[1], [2]], ["a"], {}, r"1 keys \(1 distinct\) for 2 prompts"),
    ([[1], [2]], ["a", "a"], {}, r"2 keys \(1 distinct\)"),
    ([[1]], ["a"], {"n": 2}, r".*SamplingParams\.n=2"),
    ([[BOS, 1]], ["held"], {}, r".*episode .held..*BOS id 7"),
])
def test_what_episodes_refuse(prompts, keys, params, match):
    eng = engine(held={"held": EpisodeState(first_prompt=5, tokens=30, held=20)})
    with pytest.raises(ValueError, match=r"^episodes: " + match):
        check(eng, prompts, keys, **params)


def test_an_episode_too_long_for_its_record_is_refused():
    """Its record counts steps after the first prompt in uint16: 65,520 tokens after it + 8 ids + 8 new reach 65,536."""
    long = EpisodeState(first_prompt=5, tokens=5 + 65_520, held=20)
    with pytest.raises(ValueError, match=r"episode 'a' could reach 65536 tokens"):
        check(engine(record=True, held={"a": long}), [[1] * 8], ["a"])
    check(engine(record=False, held={"a": long}), [[1] * 8], ["a"])      # no record, no limit


def test_only_an_engine_that_keeps_episodes_offers_release():
    """A dense (or `sparse_rl_kv_torch`) engine has release_episodes None, so actors/envs/episode.py re-sends each
    turn's history; its generate refuses episodes."""
    assert SGLangEngine.release_episodes.fget(engine(keeps=True)) is not None
    assert SGLangEngine.release_episodes.fget(engine(keeps=False)) is None
    with pytest.raises(ValueError, match=r"^episodes: this SGLang engine keeps no episode caches"):
        check(engine(keeps=False), [[1]], ["a"])
