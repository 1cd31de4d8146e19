"""learner.lora in the run config (broker/lora.py): off by default, passed to the actors, and bad input refused at the
config check in one line naming the dotted fields."""
from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from deploy.config import ConfigError, check_lora_targets, load_config, rollout_config
from deploy.preflight import lora_warnings

LORA = ["learner.lora.rank=8"]


def test_lora_is_off_by_default_and_reaches_the_actors_when_on():
    assert load_config("tiny", check_files=False).learner.lora.rank == 0
    cfg = load_config("tiny", LORA + ["learner.lora.target_modules=[q_proj,v_proj]"], check_files=False)
    assert (cfg.learner.lora.rank, cfg.learner.lora.alpha, cfg.learner.lora.dropout) == (8, 32.0, 0.0)
    sent = rollout_config(cfg).lora
    assert (sent.rank, sent.target_modules) == (8, ["q_proj", "v_proj"])


@pytest.mark.parametrize("override,message", [
    ("learner.lora.rank=-1", r"^learner\.lora\.rank=-1: expected >= 0 \(0 = off\)$"),
    ("learner.lora.alpha=0", r"^learner\.lora\.alpha=0\.0: expected a finite value > 0$"),
    ("learner.lora.dropout=1.5", r"^learner\.lora\.dropout=1\.5: expected 0 <= dropout < 1$"),
    ("learner.lora.target_modules=[]", r"^learner\.lora\.target_modules=\[\]: expected at least one module name$"),
])
def test_bad_lora_fields_are_refused_naming_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", [override], check_files=False)


@pytest.mark.parametrize("overrides,names", [
    (["learner.policy_target=sparse", "learner.fuse_logp_old=false"], ["learner.policy_target=sparse"]),
    ([], ["learner.fuse_logp_old=true"]),                                    # fuse_logp_old's default
    (["learner.policy_target=sparse"], ["learner.policy_target=sparse", "learner.fuse_logp_old=true"]),
])
def test_lora_dropout_is_refused_where_the_trained_forward_must_be_deterministic(overrides, names):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", LORA + ["learner.lora.dropout=0.1"] + overrides, check_files=False)
    line = str(e.value)
    assert "\n" not in line and line.startswith("learner.lora.dropout=0.1 with "), line
    assert all(name in line for name in names), line


def test_lora_dropout_loads_where_nothing_needs_the_forward_deterministic():
    """Control: dense target, logp_old recomputed by a separate no-grad forward."""
    cfg = load_config("tiny", LORA + ["learner.lora.dropout=0.1", "learner.fuse_logp_old=false"], check_files=False)
    assert cfg.learner.lora.dropout == 0.1


def test_target_modules_not_in_the_model_are_refused_listing_its_linear_modules(tmp_path):
    """The model's linear modules come from its config.json alone (built on the meta device)."""
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    bad = load_config("tiny", LORA + [f"model={tmp_path}", "learner.lora.target_modules=[q_proj,qkv,dense]"],
                      check_files=False)
    with pytest.raises(ConfigError, match=r"^learner\.lora\.target_modules=\['q_proj', 'qkv', 'dense'\]: not linear "
                                          r"modules of the model: qkv, dense; its linear modules: down_proj, "
                                          r"gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj$"):
        check_lora_targets(bad)
    check_lora_targets(load_config("tiny", LORA + [f"model={tmp_path}"], check_files=False))   # the defaults fit


def test_lora_on_sglang_loads():
    """The SGLang engine applies each adapter version through SGLang's LoRA manager (actors/engines/sglang/lora.py;
    tests/sglang/test_sglang_lora.py), dense and sparse."""
    for method, mode in (("full", "dense"), ("rkv", "sparse")):
        run = load_config("tiny", LORA + ["actors.engine.backend=sglang", f"actors.engine.compressor.method={method}",
                                          f"eval.modes=[{mode}]"], check_files=False)
        assert (run.learner.lora.rank, run.actors.engine.backend) == (8, "sglang")


def test_the_preflight_warns_when_lr_is_left_at_full_fine_tunings_default():
    assert lora_warnings(load_config("tiny", LORA + ["learner.lr=1e-6"], check_files=False)) == [
        "learner.lora.rank=8 with learner.lr=1e-06, full fine-tuning's default: LoRA's best learning rate is about "
        "10x full fine-tuning's; set learner.lr (e.g. 1e-05)"]
    assert lora_warnings(load_config("tiny", LORA, check_files=False)) == []            # tiny sets lr 1e-4
    assert lora_warnings(load_config("tiny", ["learner.lr=1e-6"], check_files=False)) == []   # full fine-tuning


def test_the_preflight_checks_the_targets_of_a_preset_model():
    """A preset model has no directory at the config check; the preflight, which resolves it, checks its targets."""
    from deploy.preflight import preflight

    cfg = load_config("tiny", LORA + ["learner.lora.target_modules=[qkv]"], check_files=False)
    with pytest.raises(ConfigError, match=r"^learner\.lora\.target_modules=\['qkv'\]: not linear modules of the "
                                          r"model: qkv; its linear modules: down_proj, "):
        preflight(cfg)
    assert preflight(load_config("tiny", LORA + ["learner.lr=1e-6"], check_files=False)).warnings[-1].startswith(
        "learner.lora.rank=8 with learner.lr=1e-06")
