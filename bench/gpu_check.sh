#!/usr/bin/env bash
# SGLang engine GPU check (docs/sglang.md, "GPU check"): on one H200 with no network, in under 8 minutes, runs the
# SGLang rollout engine dense and sparse (R-KV, kv_budget 512) on a randomly initialised Qwen2.5-1.5B-shaped model at
# response length 4096, batch 64; prints tokens/s and peak KV memory for both and the equivalence check
# against the torch engine, then ONE JSON line. Needs sglang (pip install -e .[gpu]) in $PYTHON's env.
#   bash bench/gpu_check.sh                  # the check
#   bash bench/gpu_check.sh --dry-run        # CPU: args + tiny model files + plan, no SGLang
#   PYTHON=.venv-sglang/bin/python bash bench/gpu_check.sh --tiny   # CPU lane: whole flow, tiny model
#   bash bench/gpu_check.sh --bare           # bare GPU machine: torch + transformers only, the torch
#                                            # engine dense vs R-KV 512 with preflight's prediction (bench/torch_gpu_check.py)
#   bash bench/gpu_check.sh --bare --tiny    # CPU smoke test of the bare mode
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [[ "${1:-}" == "--bare" ]]; then
  shift
  exec timeout "${GPU_CHECK_TIMEOUT_S:-470}" "$PYTHON" bench/torch_gpu_check.py "$@"
fi
for arg in "$@"; do
  if [[ "$arg" == "--tiny" ]]; then export SGLANG_USE_CPU_ENGINE=1 TRITON_INTERPRET=1; fi
done
exec timeout "${GPU_CHECK_TIMEOUT_S:-470}" "$PYTHON" bench/sglang_gpu_check.py "$@"
