#!/usr/bin/env bash
# The project's test command (README, CI): the pre-commit hooks (ruff check and format, codespell,
# the shell linter, mypy on vllm_dspark_pp), then the CPU tiers (unit, collective, end to end),
# slowest tests listed.
# tests/gpu is skipped with a visible reason on machines without CUDA (tools/gpu/run_gpu_suite.sh).
# The e2e tier is required: without vLLM's CPU kernel library its tests FAIL (not skip).
# Extra arguments go to one pytest run over tests/, e.g. the developer loop:
#   bash tools/run_tests.sh -m "not slow"
# Without arguments (the README's command, CI) the suite runs in the two runs below.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PY")
export PATH="$BIN:$PATH"  # the hooks run the venv's ruff, codespell, shellcheck and mypy
echo "[tests] pre-commit (local hooks: ruff check, ruff format --check, codespell, shellcheck, mypy)"
"$PY" -m pre_commit run --all-files --show-diff-on-failure
export DSPARK_PP_REQUIRE_E2E=1
if [ $# -gt 0 ]; then
  # Your own selection: one pytest run, as typed.
  echo "[tests] pytest $*"
  exec "$PY" -m pytest -ra --durations=25 tests "$@"
fi
# The whole suite in two runs. The unit and collective tiers (no vLLM engine of their own to
# share) run on two pytest-xdist workers, each test file on one worker (`loadfile`: a file's
# module fixtures start once); the e2e tier runs in one process so its session-shared engines
# start once and two engines at a time use the two cores (support/e2e.py). On the 2-core machine,
# back to back: the first run 292 s serial, 205 s on two workers (docs/testing.md, Durations).
rc=0
echo "[tests] pytest, unit and collective tiers (-m 'not e2e', 2 workers)"
"$PY" -m pytest -ra --durations=15 -n 2 --dist loadfile -m "not e2e" tests || rc=$?
echo "[tests] pytest, e2e tier (-m e2e)"
"$PY" -m pytest -ra --durations=25 -m e2e tests || rc=$?
[ "$rc" = 0 ] && echo "[tests] both runs passed" || echo "[tests] FAILED (exit $rc; see above)"
exit "$rc"
