"""learner.policy_target (SPEC §2.4) at config check and preflight: the SGLang engine is accepted (it records too), a
dense run says it has nothing to replay, the actors are told to record, the queue counts the
records."""
from __future__ import annotations

import pytest

from deploy.config import ConfigError, load_config, rollout_config
from deploy.model_cache import TINY_LLAMA, resolve_model
from deploy.preflight import preflight


def test_sglang_backend_with_replay_is_accepted_and_its_actors_record():
    """learner.policy_target=sparse on the SGLang engine: its sparse_rl_kv backend records the evictions
    (actors/engines/sglang/records.py), so the config check accepts it and the actors are told to record."""
    cfg = load_config("tiny", ["learner.policy_target=sparse", "actors.engine.backend=sglang", "eval.modes=[sparse]"],
                      check_files=False)
    assert cfg.learner.policy_target == "sparse" and rollout_config(cfg).record_evictions


def test_bad_policy_target_and_distill_without_replay_name_the_field():
    with pytest.raises(ConfigError, match=r"learner\.policy_target"):
        load_config("tiny", ["learner.policy_target=compressed"], check_files=False)
    with pytest.raises(ConfigError, match=r"learner\.distill_coef"):
        load_config("tiny", ["learner.distill_coef=0.5"], check_files=False)
    for value in ("inf", "1e400", ".inf"):   # YAML and Python spellings of infinity: refused, not trained to NaN
        with pytest.raises(ConfigError, match=r"learner\.distill_coef=inf: expected a finite value >= 0$"):
            load_config("tiny", ["learner.policy_target=sparse", f"learner.distill_coef={value}"], check_files=False)


def test_actors_record_only_when_the_learner_replays():
    assert rollout_config(load_config("tiny-decode", ["learner.policy_target=sparse"],
                                      check_files=False)).record_evictions
    assert not rollout_config(load_config("tiny-decode", check_files=False)).record_evictions
    dense = load_config("tiny-decode", ["learner.policy_target=sparse", "actors.engine.compressor.method=full"],
                        check_files=False)
    assert not rollout_config(dense).record_evictions


def test_preflight_counts_the_records_and_says_a_dense_run_trains_dense():
    base = ["actors.sampling.max_new_tokens=32", "preflight.max_prompt_tokens=101", "preflight.kv_memory_gb=1"]
    model = resolve_model(TINY_LLAMA)
    plain = preflight(load_config("tiny", base), model_path=model)
    replay = preflight(load_config("tiny", base + ["learner.policy_target=sparse"]), model_path=model)
    rows = plain.shape.layers * plain.shape.kv_heads
    assert replay.group_bytes - plain.group_bytes == 2 * 2 * rows * (101 + 32)     # G=2 samples, uint16 per token
    assert "eviction records included" in replay.table()
    dense = preflight(load_config("tiny", base + ["learner.policy_target=sparse",
                                                  "actors.engine.compressor.method=full"]),
                      model_path=model)
    assert any("nothing to replay" in w for w in dense.warnings)
    assert (not any("nothing to replay" in w for w in replay.warnings)
            and not any("distill" in w for w in dense.warnings))
    taught = preflight(load_config("tiny", base + ["learner.policy_target=sparse", "learner.distill_coef=0.5",
                                                   "actors.engine.compressor.method=full"]), model_path=model)
    assert any("learner.distill_coef=0.5 is not applied" in w for w in taught.warnings), taught.warnings
