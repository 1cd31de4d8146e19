"""Tasks and rewards: the built-in synthetic tasks (builtin.py), the reward scorer (reward.py), the prompt data
(data.py).

The built-in task generators and reward functions are re-exported here by name, so that the dotted paths the
presets and saved run configs use keep working: `actors.tasks:count_numbers`, `actors.tasks:copy_reward`, ...
(their module was actors/tasks.py)."""
from actors.tasks.builtin import (
    copy_numbers,
    copy_reward,
    count_numbers,
    count_reward,
    digits,
    digits_reward,
)

__all__ = ["copy_numbers", "copy_reward", "count_numbers", "count_reward", "digits", "digits_reward"]
