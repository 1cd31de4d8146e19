"""A non-editable install works outside the repository: the presets ship in the package (deploy/configs).

The project is installed with pip (no dependencies: the test's own environment provides them) into a
throwaway folder, and `sparse-rl train --config tiny` runs from another directory with that folder first on
PYTHONPATH, one learner step, no evaluation.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system  # Ray, DeepSpeed, Redis (and MLflow) together: not in the quick lane

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "broker", "compressors", "deploy", "learner")


@pytest.mark.timeout(900)
def test_non_editable_install_trains_from_another_directory(tmp_path):
    # build from a copy: setuptools writes build/ and *.egg-info next to the sources, and a stale build/lib
    # of the repository would end up in the wheel
    src, site, work = tmp_path / "src", tmp_path / "site", tmp_path / "work"
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "runs", "mlruns", "__pycache__", ".*cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True, timeout=300)
    shutil.rmtree(src)
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}

    where = subprocess.run([sys.executable, "-c", f"import json, {', '.join(PACKAGES)}; print(json.dumps(["
                            + ", ".join(f"{p}.__file__" for p in PACKAGES) + "]))"],
                           cwd=work, env=env, capture_output=True, text=True, check=True, timeout=120)
    for module_file in json.loads(where.stdout.splitlines()[-1]):
        assert module_file.startswith(str(site)), module_file  # the installed copy, not the repository

    proc = subprocess.run([str(site / "bin" / "sparse-rl"), "train", "--config", "tiny",
                           "train.steps=1", "eval.enabled=false", "actors.count=1"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (work / "runs").iterdir()  # the default run_dir, relative to the working directory
    assert run_dir.name.startswith("tiny-") and run_dir.name in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert Path(summary["run_dir"]) == run_dir and summary["accounting"]["learner_version"] == 1
