"""scripts/check_house.py: the tree passes, and each rule can fail (a made-up cycle, a made-up long function, a
made-up internal issue reference)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_house", ROOT / "scripts" / "check_house.py")
house = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(house)


def test_the_tree_has_no_cycle_and_no_new_long_function():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_house.py")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_a_cycle_is_found_and_a_chain_is_not():
    assert house.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert house.cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_resolve_submodules_and_relative_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from pkg import sub\nfrom . import other\nimport pkg.sub.deep\n\ndef f():\n    from pkg.x import y\n"
    )
    known = {"pkg", "pkg.sub", "pkg.other", "pkg.x", "pkg.m"}
    assert house.imports("pkg.m", module, known) == {"pkg.sub", "pkg.other", "pkg.x"}


def test_code_lines_skip_the_docstring_comments_and_blank_lines(tmp_path):
    body = "".join(f"    x{i} = {i}\n    # a comment\n\n" for i in range(61))
    module = tmp_path / "long.py"
    module.write_text(f'def f():\n    """Doc\n    string."""\n{body}\n\ndef g():\n    return 1\n')
    assert house.long_functions(module) == [("f", 1, 61)]


def test_an_internal_issue_reference_is_found_and_a_peers_is_not(tmp_path):
    see, cap, seed = "see issue" + " 41", "Issue" + " 23", "seed" + " 002"   # split: this file passes the check too
    module = tmp_path / "m.py"
    module.write_text(f'"""Bounded ({see})."""\n# verl#7495, PR#12, sglang issue #1234, sgl-project/sglang issue 99\n'
                      f"# {cap}: x; {seed} §6\n")
    assert house.internal_refs(module) == [f"1: {see}", f"3: {cap}", f"3: {seed}"]
