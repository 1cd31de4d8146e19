"""The SGLang engine's KV counts (`SGLangEngine._kv_tokens`, what `Sample.kv_retained_tokens` reports) against the
torch engine's schedule (`actors.engines.batch_cache.SlotPlan`: `filled` after the prefill, then `compact_to` at
every decode step), under budget_schedule length (Sparrow, arXiv 2606.08446 §3.2) and constant, both
`compressor.phase` values, prompts shorter and longer than the start budget. Plain Python, no SGLang: the count is
a function of the config (tests/sglang/test_sglang_length_schedule.py checks it on the real engines)."""
from __future__ import annotations

import dataclasses
import itertools
import types

import pytest

from actors.engines.batch_cache import SlotPlan
from actors.engines.sglang.engine import SGLangEngine
from compressors import CompressorConfig

LENGTH = CompressorConfig(method="rkv", kv_budget=12, window=4, interval=8, budget_schedule="length",
                          budget_growth=0.5, kv_budget_final=26)
CONSTANT = dataclasses.replace(LENGTH, budget_schedule="constant", budget_growth=0.0, kv_budget_final=0)


def torch_retained(cfg: CompressorConfig, start: int, prompt: int, response: int, joined_at: int) -> int:
    """Slots a torch engine row (one row: no left padding) holds when its `response`-token response ends: its call's
    SlotPlan run step by step, the engine's decode_steps = joined_at + step (the forward of the last token never
    runs: the row ends when it is sampled)."""
    call = dataclasses.replace(cfg, kv_budget=start, budget_schedule="constant", budget_growth=0.0,
                               kv_budget_final=0)
    plan = SlotPlan.of(call, cfg, kept=0, new=prompt, max_new=response)
    filled = plan.filled
    for step in range(1, response):
        compacted = plan.compact_to(step, joined_at + step, filled)
        filled = filled + 1 if compacted is None else compacted
    return filled


def sglang_retained(cfg: CompressorConfig, start: int, prompt: int, response: int, joined_at: int) -> int:
    engine = types.SimpleNamespace(sparse=True, compressor_cfg=cfg)
    return SGLangEngine._kv_tokens(engine, prompt, response, start, joined_at)[0]


@pytest.mark.parametrize("phase", ["request", "aligned"])
@pytest.mark.parametrize("cfg", [LENGTH, CONSTANT], ids=["length", "constant"])
def test_sglang_kv_counts_follow_the_torch_engines_schedule(cfg, phase):
    cfg = dataclasses.replace(cfg, phase=phase)
    cases = itertools.product((5, 20, 40), (12, 16, 26), (1, 9, 40, 100), (0, 3, 8) if phase == "aligned" else (0,))
    for prompt, start, response, joined_at in cases:
        want = torch_retained(cfg, start, prompt, response, joined_at)
        assert sglang_retained(cfg, start, prompt, response, joined_at) == want, (prompt, start, response, joined_at)


def test_length_schedule_grows_the_count():
    """20-token prompt, start budget 12, 40 tokens, interval 8: compressed to 12 at the prefill, then to 16, 20, 24,
    26 (the cap) at steps 8, 16, 24, 32, + 7 tokens = 33; a constant budget of 12 ends at 12 + 7 = 19
    (tests/sglang/test_sglang_length_schedule.py sees the same 33 on both engines)."""
    assert sglang_retained(LENGTH, 12, 20, 40, 0) == torch_retained(LENGTH, 12, 20, 40, 0) == 33
    assert sglang_retained(CONSTANT, 12, 20, 40, 0) == 19
    assert sglang_retained(LENGTH, 16, 20, 40, 0) == 33 and sglang_retained(CONSTANT, 16, 20, 40, 0) == 23


@pytest.mark.parametrize("protect", [True, False])
def test_later_turns_count_the_kept_cache_as_the_torch_engine(protect):
    """A later turn of an episode: `kept` tokens of the kept cache, `prefilled` new ids (the last sampled token with
    the observation); with compressor.protect_observation the kept part alone is compressed at the prefill (the
    torch engine's SlotPlan with kept > 0: filled = budget + new), without it the whole row."""
    cfg = dataclasses.replace(CONSTANT, protect_observation=protect)
    for kept, prefilled, start, response in itertools.product((5, 12, 19), (1, 6, 14), (12, 16), (1, 9, 40)):
        call = dataclasses.replace(cfg, kv_budget=start)
        plan = SlotPlan.of(call, cfg, kept=kept, new=prefilled, max_new=response)
        filled = plan.filled
        for step in range(1, response):
            compacted = plan.compact_to(step, step, filled)
            filled = filled + 1 if compacted is None else compacted
        engine = types.SimpleNamespace(sparse=True, compressor_cfg=cfg)
        got = SGLangEngine._kv_tokens(engine, prefilled, response, start, 0, kept)[0]
        assert got == filled, (kept, prefilled, start, response)
