"""The house's structural rules, checked on the package code (actors, learner, broker, compressors, deploy):

- no import cycle between modules (module-level and function-level imports of the project's own modules);
- every function or method <= 60 code lines (its body without the docstring, comments and blank lines), except
  any listed in KNOWN_LONG (none now), which may not grow;
- no reference to an internal issue ("issue 41", "(issue #12)") or to the seeds ("seed 002 §6") in the package code,
  tests/ or bench/: a reader cannot open them, so cite docs/SPEC.md §, docs/ARCHITECTURE.md, docs/results.md N.M
  or an arXiv § instead. A peer project's issue stays (`verl#7495`, `PR#12`, "sglang issue #1234": PEERS). docs/
  is not checked: docs/results.md's lab log keeps the issue numbers its runs were made under.

    python scripts/check_house.py            # exit 1 listing each cycle, long function and reference, else 0

The first two rules skip bench/ and tests/ (measurement scripts and tests). docs/ARCHITECTURE.md describes the layers;
tests/test_layering.py checks that lower packages never import higher ones.
"""
from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("actors", "learner", "broker", "compressors", "deploy")
MAX_CODE_LINES = 60
KNOWN_LONG: dict[str, int] = {}
"""Functions over the limit on the day this check came in, at their length then: each may shrink, none may grow,
and no other function may pass the limit. Remove an entry once its function is split (the last two, the torch
engine's TorchEngine._generate and _forward, went with the batch cache as a type: actors/engines/batch_cache.py)."""


REF_DIRS = (*PACKAGES, "tests", "bench")
REF_SUFFIXES = {".py", ".sh", ".md", ".json", ".jsonl", ".jinja", ".yaml", ".yml", ".sbatch", ".toml", ".txt"}
PEERS = {"sglang", "verl", "vllm", "slime", "ms-swift", "transformers", "pytorch", "torch", "deepspeed", "ray",
         "redis", "redis-py", "mlflow", "triton", "flashinfer", "areal", "trl", "openrlhf", "prime-rl", "upstream"}
INTERNAL_REF = re.compile(r"(?<![\w-])(?:(?P<before>[\w./-]+) )?(?:issues? ?#?\d+|seeds? 00\d)", re.IGNORECASE)


def internal_refs(path: Path) -> list[str]:
    """'line: text' of each internal issue or seed reference in `path` (one preceded by a PEERS name is a peer's)."""
    out = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        for m in INTERNAL_REF.finditer(line):
            if (m.group("before") or "").lower().rsplit("/", 1)[-1] not in PEERS:
                out.append(f"{n}: {m.group(0)}")
    return out


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports (absolute and relative, at any depth of the file)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import sub` depends on pkg.sub where that is a module, on pkg otherwise
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def code_lines(source_lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of `node`'s body holding code: not blank, not only a comment, not its docstring."""
    body = node.body
    start = body[0].lineno
    if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        start = body[0].end_lineno + 1
    text = "".join(source_lines[start - 1:node.end_lineno])
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines)


def long_functions(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, first line, code lines) of each function in `path` over MAX_CODE_LINES."""
    source = path.read_text()
    lines = source.splitlines(keepends=True)
    out = []

    def walk(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = code_lines(lines, child)
                if n > MAX_CODE_LINES:
                    out.append((f"{prefix}{child.name}", child.lineno, n))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
    walk(ast.parse(source, str(path)), "")
    return out


def main() -> int:
    mods = modules()
    graph = {name: imports(name, path, set(mods)) for name, path in mods.items()}
    problems = [f"import cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    for path in mods.values():
        for fn, line, n in long_functions(path):
            allowed = KNOWN_LONG.get(f"{path.relative_to(ROOT)}:{fn}", MAX_CODE_LINES)
            if n > allowed:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {fn} has {n} code lines (> {allowed})")
    for path in sorted(p for d in REF_DIRS for p in (ROOT / d).rglob("*") if p.suffix in REF_SUFFIXES
                       and "__pycache__" not in p.parts and "results" not in p.relative_to(ROOT).parts[1:2]):
        problems += [f"{path.relative_to(ROOT)}:{ref} (an internal reference: cite docs/ instead)"
                     for ref in internal_refs(path)]
    for p in problems:
        print(p)
    print(f"check_house: {len(mods)} modules, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
