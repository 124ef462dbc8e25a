#!/usr/bin/env bash
# The project's test command (README, CI): the pre-commit hooks (ruff check and format, codespell,
# the shell linter, mypy on vllm_dspark_pp), then the CPU tiers (unit, collective, end to end),
# slowest tests listed.
# tests/gpu is skipped with a visible reason on machines without CUDA (tools/gpu/run_gpu_suite.sh).
# The e2e tier is required: without vLLM's CPU kernel library its tests FAIL (not skip).
# Extra arguments go to pytest, e.g. the developer loop: bash tools/run_tests.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PY")
export PATH="$BIN:$PATH"  # the hooks run the venv's ruff, codespell, shellcheck and mypy
echo "[tests] pre-commit (local hooks: ruff check, ruff format --check, codespell, shellcheck, mypy)"
"$PY" -m pre_commit run --all-files --show-diff-on-failure
echo "[tests] pytest"
export DSPARK_PP_REQUIRE_E2E=1
exec "$PY" -m pytest -ra --durations=25 tests "$@"
