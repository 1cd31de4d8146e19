"""The held-out draw at the run config (docs/ARCHITECTURE.md, "Rewards and tasks"): a task with fewer distinct held-out
questions than eval.limit fails at the config check, exit 2, one line naming eval.limit and the number available,
nothing started; eval.draw is checked; a record written before the draw was versioned resumes with its old draw."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from deploy.config import ConfigError, load_config
from deploy.record import resume_config

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "actors" / "tasks"  # held_out_tasks.py: 12 distinct questions per seed
TWELVE = ["actors.data.source=function", "actors.data.function=held_out_tasks:twelve", "actors.data.size=8",
          "actors.reward.function=actors.tasks:digits_reward", "eval.data=train_task"]


def test_fewer_distinct_held_out_items_than_eval_limit_fails_naming_it(monkeypatch):
    monkeypatch.syspath_prepend(str(TASKS))
    with pytest.raises(ConfigError, match=r"^eval\.limit=16: only 12 distinct held-out problems .*set eval\.limit=12 "
                                          r"or lower"):
        load_config("tiny", [*TWELVE, "eval.limit=16"])
    assert load_config("tiny", [*TWELVE, "eval.limit=12"]).eval.limit == 12
    assert load_config("tiny", [*TWELVE, "eval.limit=16", "eval.draw=1"]).eval.draw == 1  # the old draw: repeats


def test_cli_exits_2_before_anything_starts(tmp_path):
    path = os.pathsep.join([str(TASKS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "train", "--config", "tiny", *TWELVE, "eval.limit=16",
                           f"run_dir={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("sparse-rl: ")]
    assert len(lines) == 1 and lines[0].startswith("sparse-rl: bad config: eval.limit=16: only 12 distinct held-out "
                                                   "problems"), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def test_eval_draw_is_checked():
    with pytest.raises(ConfigError, match=r"^eval\.draw=3: expected 1 .* or 2 "):
        load_config("tiny", ["eval.draw=3"])
    assert load_config("tiny").eval.draw == 2


def test_the_main_jobs_held_out_items_are_the_same_in_both_draws():
    """The main job's 32 held-out items have no repeated question: the new draw gives the same items, so README's
    figures stand."""
    from actors.tasks.data import load_eval_items

    cfg = load_config("smollm2-count-warm", check_files=False)
    new, old = (load_eval_items("train_task", cfg.eval.limit, train=cfg.actors.data, seed=cfg.seed, draw=d)
                for d in (2, 1))
    assert [(p.prompt_id, p.question) for p in new] == [(p.prompt_id, p.question) for p in old]
    assert len({p.question for p in new}) == 32


def test_a_record_from_before_the_versioned_draw_resumes_with_the_old_draw(tmp_path):
    yaml = OmegaConf.create(OmegaConf.to_yaml(OmegaConf.structured(load_config("tiny"))))
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(yaml))
    assert resume_config(tmp_path).eval.draw == 2  # written by this code: its own draw
    del yaml.eval["draw"]
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(yaml))
    assert resume_config(tmp_path).eval.draw == 1
    assert resume_config(tmp_path, ["eval.draw=2"]).eval.draw == 2  # an override still wins
