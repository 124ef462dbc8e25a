#!/usr/bin/env bash
# README command 1: set up a CPU venv, then serve the bundled trained pair (models/tiny-pair) with
# DSpark on a PP=2 target through `vllm serve` on vLLM's CPU platform, ask it one held-out question
# through the OpenAI API, print the answer and the acceptance, and stop the server (its whole
# process group). No GPU, no model downloads. Exit code 0 only if all of that worked.
# Serve-and-ask logic: dspark_dev/serve_demo.py (`python -m dspark_dev demo`), also run by
# tests/e2e/test_quickstart.py.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[quickstart] $(date +%H:%M:%S) $*"; }
say "step 1/3: set up .venv (vLLM 0.34.0, CPU torch; tools/setup_cpu_env.sh)"
bash tools/setup_cpu_env.sh .venv
PAIR=models/tiny-pair
SPEC="{\"method\":\"dspark\",\"model\":\"$PAIR/dspark-draft\",\"num_speculative_tokens\":7}"
say "step 2/3: deployment plan of $PAIR/target -pp 2 with DSpark (configs only)"
.venv/bin/vllm-dspark-pp plan "$PAIR/target" --speculative-config "$SPEC" -pp 2 2>/dev/null \
  | grep -v '^(MainProcess' || true
say "step 3/3: vllm serve $PAIR/target -pp 2 --speculative-config '$SPEC' (CPU, float32)"
exec .venv/bin/python -m dspark_dev demo --pair "$PAIR" -pp 2
