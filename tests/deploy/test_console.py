"""The console says which policy the learner trains and, on a replaying run, shows the replay's exactness on each
step line (a newcomer's trial found neither on the console)."""
from __future__ import annotations

import io

from rich.console import Console as RichConsole

from deploy.config import load_config
from deploy.console import Console, training_target


def target_of(overrides: list[str]) -> str:
    run = load_config("tiny", overrides, check_files=False)
    return training_target(run.learner, run.actors.engine.compressor.method)


def test_the_training_target_line_names_the_policy_trained():
    dense = target_of([])
    assert dense.startswith("training target: the dense policy, the Sparse-RL correction on") and "replay" not in dense
    replay = target_of(["learner.policy_target=sparse"])
    assert replay.startswith("training target: the compressed sampler's policy (learner.policy_target=sparse")
    assert "teacher" not in replay and "compare the sampler with the dense policy" in replay
    assert "dense-teacher term x 0.5 (learner.distill_coef)" in target_of(["learner.policy_target=sparse",
                                                                            "learner.distill_coef=0.5"])
    full = target_of(["learner.policy_target=sparse", "actors.engine.compressor.method=full"])
    assert full.startswith("training target: the dense policy (compressor full: nothing evicted, nothing to replay)")


def test_a_replaying_step_line_shows_the_exactness_and_a_dense_one_does_not():
    console = Console()
    console.out = RichConsole(file=io.StringIO(), width=400)
    console.step(1, 2, 1, {"reward_mean": 0.5, "mismatch_kl": 0.02, "replay_logp_max_abs": 4.6e-5})
    console.step(2, 2, 2, {"reward_mean": 0.5, "mismatch_kl": 0.02})
    console.step(3, 3, 3, {"reward_mean": 0.5, "replay_logp_max_abs": float("nan")})   # every row stale
    first, second, third = console.out.file.getvalue().splitlines()
    assert "mismatch_kl 2.00e-02  replay |dlogp| 4.6e-05" in first
    assert "replay" not in second
    assert third.endswith("replay |dlogp| n/a"), third


def test_the_start_line_gives_the_trainable_parameters():
    """LearnerWorker.parameter_counts at start: LoRA's share of the model, or full fine-tuning's everything."""
    console = Console()
    console.out = RichConsole(file=io.StringIO(), width=400)
    console.learner({"trainable": 16_384, "total": 3_238_208, "lora_rank": 8})
    console.learner({"trainable": 3_221_824, "total": 3_221_824, "lora_rank": 0})
    assert console.out.file.getvalue().splitlines() == [
        "learner: LoRA rank 8: 16,384 trainable parameters of 3,238,208 (0.51%)",
        "learner: full fine-tuning: 3,221,824 trainable parameters of 3,221,824 (100.00%)"]
