"""Multi-turn settings at config check and preflight: bad input exits at the check in one line naming
the field, before anything starts; what multi-turn cannot do yet is refused naming both settings."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deploy.config import ConfigError, load_config, rollout_config
from deploy.model_cache import TINY_LLAMA, resolve_model
from deploy.preflight import preflight

TEMPLATES = Path(__file__).resolve().parents[1] / "actors" / "envs" / "templates"


@pytest.mark.parametrize("overrides,names", [
    (["eval.data=gsm8k_test"], ["eval.data='gsm8k_test'", "actors.env.factory"]),
    (["actors.env.max_turns=0"], ["actors.env.max_turns=0"]),
    (["actors.env.obs_truncation=middle"], ["actors.env.obs_truncation='middle'"]),
])
def test_what_multi_turn_cannot_do_is_refused_in_one_line(overrides, names):
    with pytest.raises(ConfigError) as err:
        load_config("tiny-lookup", overrides, check_files=False)
    assert all(name in str(err.value) for name in names) and "\n" not in str(err.value), str(err.value)


def test_sparse_episodes_and_their_replay_are_allowed_on_both_engines():
    """learner.policy_target=sparse with an environment: both engines keep each episode's compressed cache across
    turns and record its evictions (the SGLang engine through its streaming sessions, docs/sglang.md); SGLang's
    sparse settings are still checked (streaming sessions off is refused, naming the field)."""
    for backend in ("torch", "sglang"):
        assert rollout_config(load_config("tiny-lookup", ["learner.policy_target=sparse",
                                                          f"actors.engine.backend={backend}", "eval.enabled=false"],
                                          check_files=False)).record_evictions, backend
    with pytest.raises(ConfigError, match=r"actors\.engine\.sglang\.engine_kwargs\.enable_streaming_session=False"):
        load_config("tiny-lookup", ["actors.engine.backend=sglang", "eval.enabled=false",
                                    "actors.engine.sglang.engine_kwargs.enable_streaming_session=false"],
                    check_files=False)


def test_sglang_episodes_must_fit_its_request_rows():
    """Each open episode holds one SGLang request row between its turns: a batch of more episodes than
    actors.engine.sglang.max_running_requests is refused naming both; as many passes, and so does a dense run (its
    episodes hold no row between turns)."""
    base = ["actors.engine.backend=sglang", "eval.enabled=false", "actors.prompts_per_batch=2",
            "actors.sampling.samples_per_prompt=4"]
    with pytest.raises(ConfigError, match=r"max_running_requests=7 with actors\.env\.factory set: 8 episodes"):
        load_config("tiny-lookup", base + ["actors.engine.sglang.max_running_requests=7"], check_files=False)
    load_config("tiny-lookup", base + ["actors.engine.sglang.max_running_requests=8"], check_files=False)
    load_config("tiny-lookup", base + ["actors.engine.sglang.max_running_requests=7",
                                       "actors.engine.compressor.method=full"], check_files=False)


def test_an_environment_that_cannot_be_made_is_refused_at_the_check():
    with pytest.raises(ConfigError, match=r"^actors\.env\.factory='nope_xyz:Env'"):
        load_config("tiny-lookup", ["actors.env.factory=nope_xyz:Env"])
    with pytest.raises(ConfigError, match=r"^actors\.env\.factory=.*'colour'"):
        load_config("tiny-lookup", ["actors.env.options.colour=red"])
    load_config("tiny-lookup")   # the control: the shipped environment


def test_a_template_that_is_not_append_only_fails_the_preflight(tmp_path):
    """The shipped tiny model's directory with its chat template replaced by the vendored one that strips earlier
    <think> blocks: the preflight refuses it naming the template; the shipped one passes."""
    cfg = load_config("tiny-lookup", ["preflight.max_prompt_tokens=120"])
    model = resolve_model(TINY_LLAMA)
    preflight(cfg, model_path=model, prompt_tokens=120)
    bad = tmp_path / "model"
    shutil.copytree(model, bad)
    shutil.copy(TEMPLATES / "strips_think.jinja", bad / "chat_template.jinja")
    with pytest.raises(ConfigError) as err:
        preflight(cfg, model_path=str(bad), prompt_tokens=120)
    assert "not append-only" in str(err.value) and str(bad) in str(err.value) and "\n" not in str(err.value)


def test_the_preflight_sizes_a_kept_episode_by_its_longest_observation():
    """Torch engine and sparse SGLang, multi-turn: the sparse peak per episode is kv_budget + interval + the longest
    turn prefill (whatever actors.env.max_total_tokens), the dense one grows with the episode."""
    from transformers import AutoConfig, AutoTokenizer

    from actors.engines.kv_memory import ModelShape, episode_kv_peak_bytes_per_sequence, kv_peak_bytes_per_sequence
    from actors.envs.turns import ChatTemplate
    from deploy.preflight import longest_turn_prefill

    model = resolve_model(TINY_LLAMA)
    reports = [preflight(load_config("tiny-lookup", ["actors.engine.compressor.method=rkv",
                                                     "actors.engine.compressor.kv_budget=64",
                                                     "actors.engine.compressor.interval=16",
                                                     f"actors.env.max_total_tokens={total}"]),
                         model_path=model, prompt_tokens=120) for total in (512, 4096)]
    cfg = load_config("tiny-lookup", [])
    longest = longest_turn_prefill(cfg.actors.env, ChatTemplate.build(AutoTokenizer.from_pretrained(model)))
    assert longest > cfg.actors.env.max_obs_tokens + 1
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(model), cfg.actors.engine.dtype)
    expected = episode_kv_peak_bytes_per_sequence(shape, 120, cfg.actors.sampling.max_new_tokens, 512, longest, 64,
                                                  16, compress=True)
    assert reports[0].sparse_per_seq == reports[1].sparse_per_seq == expected
    assert reports[1].dense_per_seq > 4 * reports[0].dense_per_seq // 2 > reports[0].sparse_per_seq
    sglang = preflight(load_config("tiny-lookup", ["actors.engine.compressor.method=rkv", "eval.enabled=false",
                                                   "actors.engine.compressor.kv_budget=64",
                                                   "actors.engine.compressor.interval=16",
                                                   "actors.engine.backend=sglang", "actors.env.max_total_tokens=4096"]),
                       model_path=model, prompt_tokens=32)
    later = episode_kv_peak_bytes_per_sequence(shape, 32, cfg.actors.sampling.max_new_tokens, 4096, longest, 64, 16,
                                               compress=True)
    one_sequence = kv_peak_bytes_per_sequence(shape, 32, 4096, 64, 16, compress=True)   # as if it re-prefilled
    assert sglang.sparse_per_seq == later > one_sequence     # the sparse SGLang engine keeps the episode's cache too
