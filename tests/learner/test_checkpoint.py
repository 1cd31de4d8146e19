"""Kill a real learner process after a checkpoint; resume here: version, consumed ids, counters and weights
continue."""
import os
import signal
import subprocess
import sys

import pytest
import torch

from broker.lora import LoraConfig, adapter_parameters
from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.config import LearnerConfig
from learner.learner import Learner
from tests.learner.conftest import make_groups, tiny_llama

CHILD = r"""
import sys, time, torch
torch.set_num_threads(1)
from learner.checkpoint import save_checkpoint
from learner.config import LearnerConfig
from learner.learner import Learner
from tests.learner.conftest import make_groups
model_dir, ckpt_dir, weights_out = sys.argv[1:4]
learner = Learner(model_dir, LearnerConfig(lr=1e-2, kl_coef=0.0))
consumed = []
for s in range(2):
    groups = make_groups(seed=s)
    learner.step(groups, staleness=[0] * len(groups))
    consumed += [g.group_id for g in groups]
save_checkpoint(learner, ckpt_dir, consumed, {"stale_dropped": 3, "groups_consumed": len(consumed)})
torch.save({n: t.clone() for n, t in learner.gather_buckets(0, keep=True).items()}, weights_out)
torch.save(torch.rand(4), weights_out + ".rng")
print("SAVED", learner.engine.global_steps, flush=True)
while True:                     # keep training until killed
    learner.step(make_groups(seed=9), staleness=[0, 0])
    time.sleep(0.1)
"""


def test_kill_after_checkpoint_and_resume(tmp_path):
    model_dir, ckpt_dir, weights_out = tmp_path / "model", tmp_path / "ckpt", tmp_path / "weights.pt"
    tiny_llama().save_pretrained(model_dir)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(model_dir), str(ckpt_dir), str(weights_out)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        line = child.stdout.readline()
        assert line.startswith("SAVED"), line
        child_global_steps = int(line.split()[1])
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    learner = Learner(str(model_dir), LearnerConfig(lr=1e-2, kl_coef=0.0))
    consumed, counters = load_checkpoint(learner, ckpt_dir)
    assert learner.version == 2
    assert consumed == [g.group_id for s in range(2) for g in make_groups(seed=s)]
    assert counters == {"stale_dropped": 3, "groups_consumed": 4}
    assert learner.engine.global_steps == child_global_steps
    saved = torch.load(weights_out)
    for name, t in learner.gather_buckets(0, keep=True).items():
        assert torch.equal(t, saved[name]), name
    assert torch.equal(torch.rand(4), torch.load(str(weights_out) + ".rng"))   # RNG continues where it stopped
    learner.step(make_groups(seed=5), staleness=[1, 1])
    assert learner.version == 3


def test_resume_from_empty_dir_fails(tmp_path):
    learner = Learner(tiny_llama(), LearnerConfig(kl_coef=0.0))
    with pytest.raises(FileNotFoundError):
        load_checkpoint(learner, tmp_path)


LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_a_lora_checkpoint_holds_the_adapter_alone_and_resumes_its_training(tmp_path, zero_stage):
    """DeepSpeed's exclude_frozen_parameters: the module state saved is the adapter's; a learner on the same base
    loads it and its next step equals the uninterrupted learner's (the optimizer state came back too)."""
    cfg = LearnerConfig(lr=1e-2, kl_coef=0.0, zero_stage=zero_stage, lora=LORA)
    learner = Learner(tiny_llama(), cfg)
    for s in range(2):
        learner.step(make_groups(seed=s), staleness=[0, 0])
    save_checkpoint(learner, tmp_path, ["g"], {})
    states = next((tmp_path / "version_2").glob("*mp_rank_00_model_states.pt"))
    module = set(torch.load(states, weights_only=False)["module"])
    # besides the adapter, the tied alias of the frozen embedding: DeepSpeed's filter (module_state_dict) walks
    # named_parameters(), which lists a tied parameter once, under its first name
    assert module - {"lm_head.weight"} == {n for n, _ in adapter_parameters(learner.engine.module)}
    resumed = Learner(tiny_llama(), cfg)
    assert load_checkpoint(resumed, tmp_path) == (["g"], {}) and resumed.version == 2
    for one in (learner, resumed):
        one.step(make_groups(seed=7), staleness=[0, 0])
    theirs, ours = learner.gather_buckets(0, keep=True), resumed.gather_buckets(0, keep=True)
    assert set(ours) == {n for n, _ in adapter_parameters(resumed.engine.module)}
    assert all(torch.allclose(ours[n], theirs[n], rtol=0, atol=1e-7) for n in ours)


def test_a_checkpoint_resumes_only_in_its_mode_and_onto_its_base(tmp_path):
    """A LoRA checkpoint into full fine-tuning, the reverse, and a LoRA checkpoint onto another base (its weights'
    hash) are refused in one line before anything is loaded."""
    lora = Learner(tiny_llama(), LearnerConfig(kl_coef=0.0, lora=LORA))
    full = Learner(tiny_llama(), LearnerConfig(kl_coef=0.0))
    save_checkpoint(lora, tmp_path / "lora", [], {})
    save_checkpoint(full, tmp_path / "full", [], {})
    trained = r"checkpoint .*lora was trained with learner\.lora\.rank=4, learner\.lora\.alpha=8, learner\.lora\." \
              r"target_modules=\[.*\] on base .* \(weights hash [0-9a-f]{32}\); this learner has "
    with pytest.raises(ValueError, match=trained + r"full fine-tuning \(learner\.lora\.rank=0\): learner\.lora "
                                                   r"differs; resume with the checkpoint's model and learner\.lora"):
        load_checkpoint(full, tmp_path / "lora")
    with pytest.raises(ValueError, match=r"checkpoint .*full was trained with full fine-tuning \(learner\.lora\.rank="
                                         r"0\); this learner has learner\.lora\.rank=4, .*: learner\.lora differs"):
        load_checkpoint(lora, tmp_path / "full")
    with pytest.raises(ValueError, match=trained + r"learner\.lora\.rank=4, .*: another base model \(model\)"):
        load_checkpoint(Learner(tiny_llama(seed=1), LearnerConfig(kl_coef=0.0, lora=LORA)), tmp_path / "lora")
    assert lora.version == full.version == 0
    load_checkpoint(Learner(tiny_llama(), LearnerConfig(kl_coef=0.0, lora=LORA)), tmp_path / "lora")   # control
