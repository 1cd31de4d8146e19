"""Every reference to a section of docs/results.md in the tree resolves to one of its headings.

docs/results.md keeps its section numbers as anchors (6.12 stays 6.12): code, configs and docs cite them as
"docs/results.md 6.12", "results.md section 8", "results.md §7" (also wrapped onto the next line of a comment)
and ranges such as "results.md 6.10-6.12", and link to its headings as "results.md#<anchor>". This script reads
the tracked files (`git ls-files`; a folder that is not a repository is walked) with the suffixes in SUFFIXES,
and checks that

- every cited section number is the number of a heading of docs/results.md ("## 6." or "### 6.12 ...");
- every "results.md#<anchor>" link, and every "](#<anchor>)" link inside docs/results.md itself, is the
  GitHub anchor of one of its headings.

    python scripts/check_results_refs.py [--root DIR]   # exit 1 listing file:line of each that does not resolve
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "docs/results.md"
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".sh")
_NUMBER = r"\d+(?:\.\d+)?"
# the file's name, then a space or a line break (with the next line's comment or quote marker), an optional
# "section"/"§", a number and an optional range's end
SECTION_REF = re.compile(
    r"(?<![\w-])results\.md(?:'s)?,?"
    r"(?:[ \t]*\n[ \t]*(?:(?:#+|//|>|\*)[ \t]*)?|[ \t]+)"
    r"(?:(?:sections?|§§?)[ \t]*)?"
    rf"({_NUMBER})(?:[ \t]*[-–][ \t]*({_NUMBER}))?"
)
ANCHOR_REF = re.compile(r"(?<![\w-])results\.md#([\w-]+)")
LOCAL_ANCHOR = re.compile(r"\]\(#([\w-]+)\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$")
HEADING_NUMBER = re.compile(rf"^({_NUMBER})\.?(?:\s|$)")


def slug(text: str, seen: dict[str, int]) -> str:
    """GitHub's anchor for a heading's text: markdown marks and punctuation dropped, lower case, each space a
    hyphen; the n-th repeat of an anchor gets "-n"."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    text = re.sub(r"[`*]", "", text).strip().lower()
    base = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
    count = seen.get(base, 0)
    seen[base] = count + 1
    return base if count == 0 else f"{base}-{count}"


def headings(markdown: str) -> tuple[set[str], set[str]]:
    """(section numbers, anchors) of a markdown text's headings, code fences skipped."""
    sections, anchors, seen, fenced = set(), set(), {}, False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if not match:
            continue
        text = match.group(2)
        anchors.add(slug(text, seen))
        number = HEADING_NUMBER.match(text)
        if number:
            sections.add(number.group(1))
    return sections, anchors


def tracked_files(root: Path) -> list[Path]:
    """The files to read: git's tracked files under `root`, or every file where `root` is not a repository."""
    done = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True)
    if done.returncode == 0:
        names = [name for name in done.stdout.split("\0") if name]
    else:
        names = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]  # .git, .venv
            names += [os.path.relpath(os.path.join(folder, name), root) for name in files]
    return sorted(root / name for name in names if name.endswith(SUFFIXES) and (root / name).is_file())


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def unresolved(path: Path, text: str, sections: set[str], anchors: set[str], own: bool) -> list[tuple[int, str]]:
    """(line, reference) for each reference in `text` that does not resolve; `own`: `text` is docs/results.md,
    whose bare "#anchor" links are checked too."""
    bad = []
    for match in SECTION_REF.finditer(text):
        for number in filter(None, match.groups()):
            if number not in sections:
                bad.append((_line(text, match.start()), f"results.md {number}"))
    links = [(m, "results.md#") for m in ANCHOR_REF.finditer(text)]
    links += [(m, "results.md#") for m in LOCAL_ANCHOR.finditer(text)] if own else []
    for match, prefix in links:
        if match.group(1) not in anchors:
            bad.append((_line(text, match.start()), prefix + match.group(1)))
    return sorted(bad)


def check(root: Path) -> tuple[int, list[str]]:
    """(references checked, one message per reference that does not resolve) for the tree at `root`."""
    results = root / RESULTS
    sections, anchors = headings(results.read_text()) if results.is_file() else (set(), set())
    checked, messages = 0, []
    for path in tracked_files(root):
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        own = path == results
        checked += len(SECTION_REF.findall(text)) + len(ANCHOR_REF.findall(text))
        checked += len(LOCAL_ANCHOR.findall(text)) if own else 0
        for line, ref in unresolved(path, text, sections, anchors, own):
            name = path.relative_to(root).as_posix()
            kind = "anchor" if "#" in ref else "section"
            messages.append(f"{name}:{line}: {ref} does not resolve (no such {kind} in {RESULTS})")
    return checked, messages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree to check (default: this repository)")
    args = parser.parse_args(argv)
    checked, messages = check(args.root.resolve())
    for message in messages:
        print(message)
    if messages:
        print(f"{len(messages)} of {checked} references to {RESULTS} do not resolve")
        return 1
    print(f"{checked} references to {RESULTS} resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
