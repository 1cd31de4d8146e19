"""scripts/gen_config_docs.py: docs/config.md is what the script writes from the config's dataclasses, it lists every
dotted name an override can set, and the check fails when a docstring changes (in a copy of the tree) or a field
has none."""
import ast
import dataclasses
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from deploy.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

PACKAGES = ("actors", "learner", "broker", "compressors", "deploy")
"""What a copy of the tree needs for the script to run in it: the packages, the script and the page."""


def override_keys(node, prefix: str = "", optional: dict | None = None) -> list[str]:
    """Every dotted name `key=value` can set, as omegaconf resolves them (deploy.config.load_config): the leaves of
    the structured RunConfig (a dict-typed field, such as actors.engine.sglang.engine_kwargs, is one leaf). A config
    class that is None by default (eval.sparse_compressor) is one leaf too, put in `optional` with its class: its
    own fields are set as `<key>.<field>`."""
    keys = []
    for key in node.keys():
        child = node._get_node(key)
        if OmegaConf.is_dict(child) and child._metadata.object_type not in (None, dict):
            keys += override_keys(child, f"{prefix}{key}.", optional)
        else:
            keys.append(f"{prefix}{key}")
            if OmegaConf.is_dict(child) and child._is_none() and dataclasses.is_dataclass(child._metadata.ref_type):
                optional[f"{prefix}{key}"] = child._metadata.ref_type
    return keys


def page_rows(text: str) -> dict[str, str]:
    """{dotted name: description} of the page's field rows."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w.]+)` \| .*? \| .*? \| (.*) \|$", text, re.M)}


def test_the_page_is_what_the_script_writes(capsys):
    assert gen.main(["--check"]) == 0, capsys.readouterr().out


def test_the_page_lists_every_field_an_override_can_set_with_its_docstring():
    rows, optional = page_rows(gen.PAGE.read_text()), {}
    keys = override_keys(OmegaConf.structured(RunConfig), optional=optional)
    assert len(keys) > 100 and sorted(rows) == sorted(keys)
    assert all(doc.strip() for doc in rows.values())
    assert optional  # eval.sparse_compressor: its row links to the group listing its class's fields
    for key, cls in optional.items():
        link = re.search(r"Its fields: \[`([\w.]+)`\]", rows[key])
        assert link, f"{key}'s row does not link to the group of {cls.__name__}'s fields"
        assert {f"{link.group(1)}.{f.name}" for f in dataclasses.fields(cls)} <= set(rows), key


def lr_docstring_end(source: str) -> tuple[int, int]:
    """(line index, byte offset in that line's UTF-8) of the closing quotes of `lr`'s attribute docstring in
    learner/config.py's source."""
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "LearnerConfig")
    body = cls.body
    doc = next(after for stmt, after in zip(body, body[1:])
               if isinstance(stmt, ast.AnnAssign) and stmt.target.id == "lr")
    return doc.end_lineno - 1, doc.end_col_offset - 3


def test_a_changed_docstring_makes_the_check_fail_naming_the_page(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "scripts").mkdir()
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "scripts" / "gen_config_docs.py", tmp_path / "scripts")
    shutil.copy(gen.PAGE, tmp_path / "docs" / "config.md")
    source = tmp_path / "learner" / "config.py"
    lines = source.read_bytes().splitlines(keepends=True)
    row, col = lr_docstring_end(source.read_text())
    lines[row] = lines[row][:col] + b" Changed in the copy." + lines[row][col:]
    source.write_bytes(b"".join(lines))

    script = [sys.executable, str(tmp_path / "scripts" / "gen_config_docs.py")]
    written = subprocess.run([*script, "--page", str(tmp_path / "new.md")], capture_output=True, text=True)
    assert written.returncode == 0, written.stderr
    old, new = page_rows(gen.PAGE.read_text()), page_rows((tmp_path / "new.md").read_text())
    assert {k for k in old if old[k] != new[k]} == {"learner.lr"}  # the copy's code was used, and only lr changed
    assert new["learner.lr"].endswith("Changed in the copy.")

    done = subprocess.run([*script, "--check"], capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith("docs/config.md is stale") and len(done.stdout.splitlines()) == 1


@dataclasses.dataclass
class Inner:
    size: int = 3
    """How big."""


@dataclasses.dataclass
class Outer:
    name: str = "x"
    """The name."""
    inner: Inner = dataclasses.field(default_factory=Inner)
    """The inner group."""


@dataclasses.dataclass
class Undocumented:
    ok: int = 1
    """Documented."""
    bare: float = 0.5


def test_groups_nest_and_a_field_without_a_docstring_fails_naming_it(capsys):
    found = gen.groups(Outer)
    assert [(g.path, [f.name for f in g.fields]) for g in found] == [("", ["name"]), ("inner", ["inner.size"])]
    assert found[1].intro == ["The inner group."] and found[1].fields[0].default == "`3`"
    with pytest.raises(ValueError, match=r"Undocumented\.bare \(bare\) has no docstring"):
        gen.groups(Undocumented)
    assert gen.main(["--check"], root=Undocumented) == 1
    assert "Undocumented.bare (bare) has no docstring" in capsys.readouterr().err
