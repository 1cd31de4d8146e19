"""Run identity: unique run ids and atomically created run directories (docs/ARCHITECTURE.md, "Run record")."""
from __future__ import annotations

import re
import threading

from deploy.config import load_config, make_run_dir, new_run_id


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path):
    cfg = load_config("tiny", [f"run_dir={tmp_path}"])
    made: list[tuple[str, object]] = []
    start = threading.Barrier(8)

    def start_run():
        start.wait()  # all eight in the same moment
        made.append(make_run_dir(cfg))

    threads = [threading.Thread(target=start_run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [run_id for run_id, _ in made]
    assert len(set(ids)) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(ids)
    assert all(re.fullmatch(r"tiny-\d{8}-\d{6}-[0-9a-f]{4}", i) for i in ids), ids


def test_a_drawn_id_whose_directory_exists_is_drawn_again(tmp_path):
    cfg = load_config("tiny", [f"run_dir={tmp_path}"])
    taken = new_run_id(cfg)
    (tmp_path / taken).mkdir()
    (tmp_path / taken / "summary.json").write_text("{}")  # another run's directory
    draws = iter([taken, taken, "tiny-fresh"])
    run_id, run_dir = make_run_dir(cfg, draw=lambda run: next(draws))
    assert (run_id, run_dir) == ("tiny-fresh", tmp_path / "tiny-fresh") and run_dir.is_dir()
    assert (tmp_path / taken / "summary.json").read_text() == "{}"  # the other run's directory is untouched
