#!/usr/bin/env bash
# The project's test command (README, CI): lint, then the CPU tiers (unit, collective, end to end).
# tests/gpu is skipped with a visible reason on machines without CUDA (run it with tools/gpu/run_gpu_suite.sh).
# Extra arguments go to pytest (e.g. `bash tools/run_tests.sh -k plan`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
echo "[tests] ruff check"
"$PY" -m ruff check .
echo "[tests] pytest"
exec "$PY" -m pytest -ra --durations=15 tests "$@"
