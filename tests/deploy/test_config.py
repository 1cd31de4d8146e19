"""Run config: presets load, overrides apply, bad values fail at start naming the field (also via the CLI)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from deploy.config import CONFIG_DIR, ConfigError, load_config


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_every_preset_loads(preset):
    cfg = load_config(preset)
    assert cfg.model and cfg.actors.count >= 1


def test_overrides_apply():
    cfg = load_config("tiny", ["actors.count=3", "actors.engine.compressor.method=snapkv", "learner.lr=2e-6"])
    assert (cfg.actors.count, cfg.actors.engine.compressor.method, cfg.learner.lr) == (3, "snapkv", 2e-6)


def test_main_job_defaults():
    cfg = load_config("smollm2-gsm8k")
    assert cfg.model == "smollm2-135m-instruct"
    assert cfg.actors.engine.compressor.method == "rkv" and cfg.actors.count == 2
    assert cfg.eval.data == "gsm8k_test" and cfg.eval.limit == 100 and list(cfg.eval.modes) == ["dense", "sparse"]


@pytest.mark.parametrize("override, field", [
    ("actors.engine.compressor.method=lru", "compressor.method"),
    ("actors.engine.compressor.kv_budget=8", "kv_budget"),
    ("actors.sampling.top_p=0.9", "top_p"),
    ("actors.sampling.top_k=20", "top_k"),
    ("learner.lr=fast", "learner.lr"),
    ("learner.rejection=maybe", "rejection"),
    ("actors.cont=2", "actors.cont"),
    ("actors.count=0", "actors.count"),
    ("eval.modes=[dense,fuzzy]", "eval.modes"),
])
def test_bad_config_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("tiny", [override])


def test_cli_bad_config_exits_2_naming_the_field():
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "train", "--config", "tiny",
                           "actors.engine.compressor.method=lru"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "compressor.method='lru'" in proc.stderr


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="smollm2-gsm8k"):
        load_config("no-such-preset")
