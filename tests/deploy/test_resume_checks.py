"""A resume or fork whose prompt order (seed, actors.data) differs from its checkpoint's data position fails when
the run record is opened (deploy/record.py), naming the fields, before any directory is made (real DeepSpeed
checkpoint of a tiny Llama)."""
import pytest
from omegaconf import OmegaConf

from broker.lora import LoraConfig
from broker.prompts import DataPosition
from deploy.config import ConfigError, load_config
from deploy.record import open_record
from learner.checkpoint import save_checkpoint
from learner.config import LearnerConfig
from learner.learner import Learner
from tests.learner.conftest import tiny_llama


def test_a_fork_with_another_prompt_order_fails_at_record_open(tmp_path):
    cfg = load_config("tiny", [f"run_dir={tmp_path / 'runs'}", "train.steps=3"])
    data = OmegaConf.to_container(OmegaConf.structured(cfg.actors.data))
    ckpt = tmp_path / "parent" / "checkpoints"
    save_checkpoint(Learner(tiny_llama(), LearnerConfig(kl_coef=0.0)), ckpt, [], {},
                    data_position=DataPosition(next_index=4, seed=cfg.seed, data=data).to_dict())
    same = load_config("tiny", [f"run_dir={tmp_path / 'runs'}", "train.steps=3", f"learner.resume_from={ckpt}"])
    assert open_record(same).start_version == 0               # the same order: the fork opens
    other = load_config("tiny", [f"run_dir={tmp_path / 'other'}", "train.steps=3", f"learner.resume_from={ckpt}",
                                 "seed=5", "actors.data.size=32"])
    with pytest.raises(ConfigError, match=r"prompt order differs .*seed=5 \(checkpoint: 0\); "
                                          r"actors\.data\.size=32 \(checkpoint: 64\)"):
        open_record(other)
    assert not (tmp_path / "other").exists()                   # nothing was made


def test_a_fork_in_the_other_mode_or_with_other_lora_settings_fails_at_record_open(tmp_path):
    """learner.lora against the checkpoint's client state (deploy/record.py _check_lora): the base's hash is the
    learner's check (tests/learner/test_checkpoint.py)."""
    ckpt = tmp_path / "parent" / "checkpoints"
    save_checkpoint(Learner(tiny_llama(), LearnerConfig(kl_coef=0.0, lora=LoraConfig(rank=4))), ckpt, [], {})
    fork = [f"learner.resume_from={ckpt}", "train.steps=3"]
    same = load_config("tiny", [f"run_dir={tmp_path / 'runs'}", "learner.lora.rank=4"] + fork)
    assert open_record(same).start_version == 0
    saved = (r"the checkpoint in .* was trained with learner\.lora\.rank=4, learner\.lora\.alpha=32\.0, learner\.lora"
             r"\.target_modules=\['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]: a "
             r"checkpoint resumes with the mode and adapter it was trained with")
    for lora, now in ((["learner.lora.rank=0"], r"learner\.lora\.rank=0 \(full fine-tuning\)"),
                      (["learner.lora.rank=8"], r"learner\.lora\.rank=8, learner\.lora\.alpha=32\.0, .*")):
        other = load_config("tiny", [f"run_dir={tmp_path / 'other'}"] + lora + fork)
        with pytest.raises(ConfigError, match=rf"^resume: {now}, but {saved}"):
            open_record(other)
    assert not (tmp_path / "other").exists()                   # nothing was made


def test_a_resume_with_another_kv_quantizer_is_refused_and_an_older_record_reads_the_default(tmp_path):
    """compressor.kv_dtype / kv_scale are MUST_MATCH (deploy/record.py): the run's groups carry the quantizer and its
    learner dead-letters another, so a --resume that changes it is refused naming the field and both values before
    anything is written; a config.yaml written before the fields existed reads as kv_dtype model, token_head."""
    from deploy.record import _check_unchanged
    from deploy.scale import RUN_INFO
    run_dir = tmp_path / "runs" / "r1"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("version_1")
    (run_dir / RUN_INFO).write_text('{"run_id": "r1"}')
    saved = load_config("tiny", [f"run_dir={tmp_path / 'runs'}"])
    saved.actors.engine.compressor.kv_dtype = "int8"
    OmegaConf.save(OmegaConf.structured(saved), run_dir / "config.yaml")
    now = load_config("tiny", [f"run_dir={tmp_path / 'runs'}", "train.steps=3"])
    with pytest.raises(ConfigError, match=rf"^--resume {run_dir}: actors\.engine\.compressor\.kv_dtype='model' "
                                          r"\(the checkpoint's: 'int8'\): the checkpoint's prompt order, shards and "
                                          r"KV quantizer need the values it was trained with"):
        open_record(now, resume=run_dir)
    older = OmegaConf.to_container(OmegaConf.structured(now))
    del older["actors"]["engine"]["compressor"]["kv_dtype"], older["actors"]["engine"]["compressor"]["kv_scale"]
    OmegaConf.save(OmegaConf.create(older), run_dir / "config.yaml")
    _check_unchanged(run_dir, now, "--resume")                  # model / token_head: nothing changed
