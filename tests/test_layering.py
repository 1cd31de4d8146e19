"""The house layering (docs/ARCHITECTURE.md "Layout"): compressors and broker are below actors and learner,
which never import each other, and nothing below deploy/ imports deploy/. Checked on the source (every import
statement, also those inside functions), so a lazy import cannot slip through."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "compressors": {"actors", "learner", "broker", "deploy"},
    "broker": {"actors", "learner", "deploy"},
    "actors": {"learner", "deploy"},
    "learner": {"actors", "deploy"},
}


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (absolute imports only: the project uses no others)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_packages_never_import_higher_ones(package):
    bad = {f"{path.relative_to(ROOT)} imports {name}"
           for path in sorted((ROOT / package).rglob("*.py"))
           for name in imported_packages(path) & FORBIDDEN[package]}
    assert not bad, sorted(bad)


def test_the_check_sees_a_lazy_import(tmp_path):
    """Control: an import inside a function body is found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from deploy.config import RunConfig\n    return RunConfig\n")
    assert "deploy" in imported_packages(module)
