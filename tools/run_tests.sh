#!/usr/bin/env bash
# The test command (README): the CPU tiers (unit, collective, end to end). GPU tests are skipped on
# machines without CUDA with a visible reason; run tests/gpu through tools/gpu/run_gpu_suite.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m pytest -ra tests "$@"
