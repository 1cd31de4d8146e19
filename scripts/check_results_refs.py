"""Every reference to a section of docs/results.md in the tree resolves to a heading, in the front page or its log.

docs/results.md is a front page (the findings table and a section per question, unnumbered headings) and
docs/results-log.md its appendix, the lab log, which keeps the numbered sections in the order the work was done.
The section numbers stay as anchors (6.12 stays 6.12): code, configs and docs cite them as "docs/results.md 6.12",
"results.md section 8", "results.md §7" (also wrapped onto the next line of a comment) and ranges such as
"results.md 6.10-6.12", and the front page's table links each question to the log's sections by number. So a cited
number resolves when it is the number of a heading ("## 6." or "### 6.12 ...") of either file: the references need
not change when a section moves between them, and the front page need not repeat the log's numbering. This script
reads the tracked files (`git ls-files`; a folder that is not a repository is walked) with the suffixes in
SUFFIXES, and checks that

- every cited section number ("results.md N[.M]" or "results-log.md N[.M]") is the number of a heading of
  docs/results.md or docs/results-log.md;
- every "results.md#<anchor>" link is the GitHub anchor of a heading of docs/results.md, every
  "results-log.md#<anchor>" link one of docs/results-log.md (a link opens one file: here the file must match), and
  every "](#<anchor>)" link inside either file one of its own headings.

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
LOG = "docs/results-log.md"
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".sh")
_NUMBER = r"\d+(?:\.\d+)?"
# the file's name, then a space or a line break (with the next line's comment or quote marker), an optional
# "section"/"§", a number and an optional range's end
SECTION_REF = re.compile(
    r"(?<![\w-])results(?:-log)?\.md(?:'s)?,?"
    r"(?:[ \t]*\n[ \t]*(?:(?:#+|//|>|\*)[ \t]*)?|[ \t]+)"
    r"(?:(?:sections?|§§?)[ \t]*)?"
    rf"({_NUMBER})(?:[ \t]*[-–][ \t]*({_NUMBER}))?"
)
ANCHOR_REF = re.compile(r"(?<![\w-])(results(?:-log)?\.md)#([\w-]+)")
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


def unresolved(text: str, sections: set[str], anchors: dict[str, set[str]], own: str | None) -> list[tuple[int, str]]:
    """(line, reference) for each reference in `text` that does not resolve. `anchors`: file name ("results.md",
    "results-log.md") -> its headings' anchors; `own`: the name of the file `text` is, when it is one of them, whose
    bare "#anchor" links are checked against its own headings."""
    bad = []
    for match in SECTION_REF.finditer(text):
        for number in filter(None, match.groups()):
            if number not in sections:
                bad.append((_line(text, match.start()), f"results.md {number}"))
    links = [(m.start(), m.group(1), m.group(2)) for m in ANCHOR_REF.finditer(text)]
    links += [(m.start(), own, m.group(1)) for m in LOCAL_ANCHOR.finditer(text)] if own else []
    for start, name, anchor in links:
        if anchor not in anchors[name]:
            bad.append((_line(text, start), f"{name}#{anchor}"))
    return sorted(bad)


def check(root: Path) -> tuple[int, list[str]]:
    """(references checked, one message per reference that does not resolve) for the tree at `root`."""
    sections, anchors = set(), {}
    for rel in (RESULTS, LOG):
        path = root / rel
        numbers, names = headings(path.read_text()) if path.is_file() else (set(), set())
        sections |= numbers
        anchors[Path(rel).name] = names
    pages = {(root / rel).resolve(): Path(rel).name for rel in (RESULTS, LOG)}
    checked, messages = 0, []
    for path in tracked_files(root):
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        own = pages.get(path.resolve())
        checked += len(SECTION_REF.findall(text)) + len(ANCHOR_REF.findall(text))
        checked += len(LOCAL_ANCHOR.findall(text)) if own else 0
        for line, ref in unresolved(text, sections, anchors, own):
            name = path.relative_to(root).as_posix()
            where = f"{RESULTS} or {LOG}" if "#" not in ref else f"docs/{ref.split('#')[0]}"
            kind = "anchor" if "#" in ref else "section"
            messages.append(f"{name}:{line}: {ref} does not resolve (no such {kind} in {where})")
    return checked, messages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree to check (default: this repository)")
    args = parser.parse_args(argv)
    checked, messages = check(args.root.resolve())
    for message in messages:
        print(message)
    if messages:
        print(f"{len(messages)} of {checked} references to {RESULTS} and {LOG} do not resolve")
        return 1
    print(f"{checked} references to {RESULTS} and {LOG} resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
