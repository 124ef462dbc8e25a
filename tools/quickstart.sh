#!/usr/bin/env bash
# README command 1: set up a CPU venv, make the bundled tiny models, and plan them as a PP=2 DSpark
# deployment (no GPU, no downloads of models). Prints the `vllm serve` line to use on GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_cpu_env.sh .venv
OUTDIR=${TINY_MODELS_DIR:-$PWD/.tiny-models}
.venv/bin/vllm-dspark-pp make-tiny-models "$OUTDIR"
TARGET="$OUTDIR/tiny-qwen3-target"; DRAFT="$OUTDIR/tiny-qwen3-dspark-draft"
SPEC="{\"method\":\"dspark\",\"model\":\"$DRAFT\",\"num_speculative_tokens\":4}"
.venv/bin/vllm-dspark-pp plan "$TARGET" --speculative-config "$SPEC" -pp 2 2>/dev/null | grep -v '^(MainProcess' || true
echo
echo "On GPUs, serve the same deployment with:"
echo "  vllm serve $TARGET --speculative-config '$SPEC' -pp 2"
