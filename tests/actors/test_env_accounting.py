"""How an episode its environment failed is scored and counted (actors/rollout_actor.py): reward 0, status
env_error, counted once under the names docs/multi-turn.md and deploy/metric_names.py document (rollout/env_errors,
rollout/env_timeouts, rollout/env_lost), never as a reward-function error."""
import numpy as np
import pytest

from actors.envs.episode import EpisodeSample
from actors.rollout_actor import episode_reward, group_counts
from deploy.metric_names import mlflow_name


def episode(finish: str, reward: float = 1.0, finish_reason: str = "stop") -> EpisodeSample:
    return EpisodeSample(prompt_ids=[1], response_ids=[2, 3], logp_sparse=np.zeros(2, np.float32),
                         finish_reason=finish_reason, kv_retained_tokens=3, kv_peak_bytes=0, reward=reward,
                         finish=finish)


@pytest.mark.parametrize("finish", ["error", "timeout", "lost"])
def test_a_failed_episode_scores_0_as_an_environment_failure_not_a_reward_error(finish):
    result = episode_reward(episode(finish, reward=1.0), truncated=None)
    assert (result.reward, result.status) == (0.0, "env_error")


def test_finished_episodes_keep_the_environments_reward_or_the_truncated_one():
    assert episode_reward(episode("done", 1.0), None).status == "correct"
    assert episode_reward(episode("done", 0.5), None).status == "wrong"
    assert episode_reward(episode("max_total_tokens", 1.0, "length"), truncated=0.25).reward == 0.25


def test_a_groups_counts_name_each_failure_once_as_documented():
    samples = [episode("done"), episode("lost"), episode("lost"), episode("timeout"), episode("error")]
    statuses = [episode_reward(s, None).status for s in samples]
    counts = group_counts(samples, statuses)
    assert counts == {"rollout_groups": 1, "reward_errors": 0, "env_errors": 1, "env_timeouts": 1, "env_lost": 2}
    assert [mlflow_name(k) for k in counts] == ["rollout/groups", "rollout/reward_errors", "rollout/env_errors",
                                                "rollout/env_timeouts", "rollout/env_lost"]


def test_single_turn_groups_count_reward_errors_only():
    assert group_counts([object()], ["error", "correct"]) == {"rollout_groups": 1, "reward_errors": 1}
