"""deploy.model_cache: processes that resolve the same preset model at once on an empty cache (two runs started
together on a fresh machine, a test beside a run) all get the built model; it is built once."""
import os
import subprocess
import sys
from pathlib import Path

RESOLVE = """
import sys, time
from deploy.model_cache import TINY_CHAR, resolve_model
while time.time() < float(sys.argv[1]):  # start together
    time.sleep(0.01)
print(resolve_model(TINY_CHAR))
"""


def test_concurrent_builds_of_one_preset_model_all_succeed(tmp_path):
    import time
    env = {**os.environ, "SPARSE_RL_CACHE": str(tmp_path / "cache")}
    start = str(time.time() + 8)  # after the imports of all three
    procs = [subprocess.Popen([sys.executable, "-c", RESOLVE, start], env=env, cwd=Path(__file__).parents[2],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    for rc, out, err in results:
        assert rc == 0, err[-2000:]
        assert out.strip().endswith("cache/tiny-char")
    model = tmp_path / "cache" / "tiny-char"
    assert (model / "config.json").exists() and not (tmp_path / "cache" / "tiny-char.tmp").exists()
