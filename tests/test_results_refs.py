"""scripts/check_results_refs.py: every "results.md N[.M]" reference and every results.md anchor in the tree resolves
to a heading of docs/results.md or of its lab-log appendix docs/results-log.md, and a made-up tree with broken
references fails, naming each file:line; docs/results.md is a findings front page."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_results_refs.py"
MD = "results" + ".md"  # spelt in two, so that the check of this tree does not read the broken references below


def _load():
    spec = importlib.util.spec_from_file_location("check_results_refs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)], capture_output=True, text=True)


RESULTS = """# Results

| question | section |
|---|---|
| does it learn | [6.12](#612-eviction-replay-training-the-policy-pre-registered) |
| broken | [9](#9-not-a-heading) |

## 1. The learning test (`tests/deploy/test_learning.py`)

## 6. The paper's regime

### 6.12 Eviction replay: training the policy (pre-registered)

```
## 7. inside a code fence: not a heading
```
"""

CODE = '''"""Module.

Chosen by the comparison of docs/@MD@ 6.12 and docs/@MD@ section 1.
"""
# a broken one: docs/@MD@ 6.13, and a range, @MD@ 6.10-6.12
# wrapped onto the next line: docs/@MD@
# §7 (no section 7 outside the fence)
LINK = "docs/@MD@#1-the-learning-test-testsdeploytest_learningpy"
BAD = "docs/@MD@#no-such-heading"
'''.replace("@MD@", MD)


NOTES_MD = f"See {MD} section 6 and {MD} 1.\n"
SKIP_TXT = f"{MD} 99 is not read: not a suffix the check reads\n"


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results.md").write_text(RESULTS)
    (tmp_path / "mod.py").write_text(CODE)
    (tmp_path / "notes.md").write_text(NOTES_MD)
    (tmp_path / "skip.txt").write_text(SKIP_TXT)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    return tmp_path


def test_the_tree_resolves():
    done = _run(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_tree_with_broken_references_fails_and_names_each(tmp_path):
    done = _run(_tree(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    for broken in (f"mod.py:5: {MD} 6.13", f"mod.py:5: {MD} 6.10", f"mod.py:6: {MD} 7",
                   f"mod.py:9: {MD}#no-such-heading", f"docs/{MD}:6: {MD}#9-not-a-heading"):
        assert broken in out, out
    for fine in ("mod.py:3:", "mod.py:8:", "notes.md", "skip.txt", "docs/results.md:5:", "6.12 does not"):
        assert fine not in out, out
    assert len([line for line in out.splitlines() if f": {MD}" in line]) == 5, out


def test_sections_and_anchors_are_read_from_the_headings_outside_code_fences():
    refs = _load()
    sections, anchors = refs.headings(RESULTS)
    assert sections == {"1", "6", "6.12"}
    assert "612-eviction-replay-training-the-policy-pre-registered" in anchors
    assert "1-the-learning-test-testsdeploytest_learningpy" in anchors
    assert "6-the-papers-regime" in anchors


def test_slugs_follow_github_and_number_duplicates():
    refs = _load()
    seen: dict[str, int] = {}
    assert refs.slug("6.9 One forward fewer: the main job in 9 min 28 s (2026-12-02)", seen) == (
        "69-one-forward-fewer-the-main-job-in-9-min-28-s-2026-12-02")
    assert refs.slug("3. The main job: `sparse-rl train --config smollm2-copy`", seen) == (
        "3-the-main-job-sparse-rl-train---config-smollm2-copy")
    assert refs.slug("Notes", seen) == "notes"
    assert refs.slug("Notes", seen) == "notes-1"


LOG = "results" + "-log.md"
FRONT = f"""# Results

| question | log |
|---|---|
| replay | [6.12]({LOG}#612-eviction-replay) |
| broken | [6.13]({LOG}#613-not-in-the-log) |

## Replay
"""
LOG_TEXT = """# Lab log

## 6. The paper's regime

### 6.12 Eviction replay
"""
MOVED = f"""# moved to the log: docs/{MD} 6.12 resolves; a link to its anchor in the front page does not
LINK = "docs/{MD}#612-eviction-replay"
GOOD = "docs/{LOG}#612-eviction-replay"
BAD = "docs/{MD} 7"
"""


def test_a_number_resolves_in_either_file_an_anchor_only_in_its_own(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results.md").write_text(FRONT)
    (tmp_path / "docs" / LOG).write_text(LOG_TEXT)
    (tmp_path / "mod.py").write_text(MOVED)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    done = _run(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    for broken in (f"mod.py:2: {MD}#612-eviction-replay", f"mod.py:4: {MD} 7",
                   f"docs/{MD}:6: {LOG}#613-not-in-the-log"):
        assert broken in out, out
    for fine in ("mod.py:1:", "mod.py:3:", f"docs/{MD}:5:"):
        assert fine not in out, out
    assert len([line for line in out.splitlines() if "does not resolve" in line]) == 3, out


def test_the_front_page_opens_with_the_findings_table_and_cites_no_issue_or_seed():
    front = (ROOT / "docs" / MD).read_text()
    lines = front.splitlines()
    assert len(lines) < 150, len(lines)
    first_table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    assert lines[first_table].lower().startswith("| question | answer | status |"), lines[first_table]
    assert first_table < 15, first_table
    assert not re.search(r"\bissues? \d|\bseed 00\d", front, re.IGNORECASE)
    log = (ROOT / "docs" / LOG).read_text()
    assert "| issue " + "34 |" in log  # the appendix says what each issue number was
    for number in ("6.10", "6.11", "6.12", "8", "9", "10"):  # the log keeps the numbered sections
        assert re.search(rf"^#+ {re.escape(number)}\.? ", log, re.MULTILINE), number
