#!/usr/bin/env bash
# The one-GPU suite in one command, on the GPU machine after the kit is booted (tools/gpu/README.md):
#
#   source /tmp/site/env.sh && bash tools/gpu/run_gpu_suite.sh [OUTDIR] [extra pytest args]
#
# Checks that the kit provides what the suite needs (pytest is on the machine; pytest-timeout and
# the `vllm serve` wheels come from the shared kit's `deps` group, ../shared/device/prepare.sh),
# installs the project into the kit's site (/tmp/site: gives vLLM the plugin's entry point), runs tests/gpu with
# per-test timeouts under a hard total budget, writes into OUTDIR (default $OUT, else
# /tmp/dspark-gpu-out):
#   gpu_suite.log        full log           gpu_junit.xml    junit (xunit2)
#   gpu_summary.txt      the table          gpu_artifacts.tar.gz  logs of failed engines/servers (if any)
# and prints the short pass/fail/skip table LAST. Exit status: pytest's (124 on the budget), or 1
# when pytest passed but no test did (everything skipped).
# Knobs: DSPARK_GPU_BUDGET_S (default 560), DSPARK_SITE (default /tmp/site), DSPARK_GPU_PD_EAGER=1.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 2
OUTDIR=${1:-${OUT:-/tmp/dspark-gpu-out}}
[ $# -gt 0 ] && shift
mkdir -p "$OUTDIR"
LOG=$OUTDIR/gpu_suite.log
JUNIT=$OUTDIR/gpu_junit.xml
SUMMARY=$OUTDIR/gpu_summary.txt
SITE=${DSPARK_SITE:-/tmp/site}
BUDGET=${DSPARK_GPU_BUDGET_S:-560}
ART=$(mktemp -d /tmp/dspark-gpu-artifacts.XXXX)
PGIDS=$(mktemp -d /tmp/dspark-gpu-pgids.XXXX)
# DSPARK_PP_TEST_DEVICE=gpu: tests/conftest.py must not switch this run to the CPU platform
export DSPARK_GPU_ARTIFACTS=$ART DSPARK_PGID_DIR=$PGIDS PYTHONUNBUFFERED=1 DSPARK_PP_TEST_DEVICE=gpu
: > "$LOG"
say() { echo "[gpu-suite $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
T0=$(date +%s)

if [ -z "${PYTHONPATH:-}" ] || [[ ":$PYTHONPATH:" != *":$SITE:"* ]]; then
  if [ -f "$SITE/env.sh" ]; then
    say "sourcing $SITE/env.sh (the kit's environment)"
    # shellcheck disable=SC1091
    source "$SITE/env.sh"
  else
    say "WARNING: $SITE/env.sh not found: the GPU kit is not booted here; using the plain python3"
  fi
fi
mkdir -p "$SITE"

# pytest is on the GPU machine; pytest-timeout and the serve wheels (aiohttp, uvloop, orjson, the
# prometheus packages, ...) come from the shared kit's `deps` group. Nothing is installed from here.
if ! python3 - <<'PY' 2>&1 | tee -a "$LOG"; then
import importlib.util, sys
need = ["pytest", "pytest_timeout", "aiohttp", "uvloop", "orjson", "prometheus_client",
        "prometheus_fastapi_instrumentator", "watchfiles"]
missing = [n for n in need if importlib.util.find_spec(n) is None]
print("[gpu-suite] test/serve packages:", "all present" if not missing else "MISSING " + ", ".join(missing))
sys.exit(1 if missing else 0)
PY
  say "FATAL: the GPU kit lacks packages the suite needs: boot the kit with its deps group (../shared/device/prepare.sh)"
  exit 3
fi

if [ -f "$SITE/env.sh" ]; then # a booted kit: torch and vLLM must come from it
  python3 tools/gpu/check_kit.py "$SITE" 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || exit 3
fi

say "installing the project into $SITE (entry point vllm.general_plugins -> dspark_pp)"
rm -rf build ./*.egg-info
python3 -m pip install -q --no-deps --no-index --no-build-isolation --upgrade --target "$SITE" . 2>&1 \
  | grep -v "^WARNING: Target directory" | tee -a "$LOG"
rm -rf build ./*.egg-info
# If pip could not build the project (an old setuptools, say), install it by hand: the package
# plus a minimal dist-info whose entry_points.txt is what vLLM's plugin loader reads.
python3 - "$SITE" <<'PY' 2>&1 | tee -a "$LOG"
import importlib.metadata as md, pathlib, shutil, sys, tomllib
site = pathlib.Path(sys.argv[1])
def eps():
    return {e.name: e.value for e in md.entry_points(group="vllm.general_plugins")}
if eps().get("dspark_pp") != "vllm_dspark_pp:register":
    meta = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
    shutil.rmtree(site / "vllm_dspark_pp", ignore_errors=True)
    shutil.copytree("vllm_dspark_pp", site / "vllm_dspark_pp", ignore=shutil.ignore_patterns("__pycache__"))
    di = site / f"vllm_dspark_pp-{meta['version']}.dist-info"
    di.mkdir(exist_ok=True)
    (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    ep = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in d.items()) + "\n"
                 for g, d in meta.get("entry-points", {}).items())
    (di / "entry_points.txt").write_text(ep)
    print("[gpu-suite] pip did not install the entry point; installed the package + dist-info by hand")
e = eps()
print("[gpu-suite] vllm.general_plugins:", e)
if e.get("dspark_pp") != "vllm_dspark_pp:register":
    print("[gpu-suite] WARNING: the plugin's entry point is missing: vLLM will not load the plugin")
PY
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1 | sed 's/^/[gpu-suite] nvidia-smi: /' | tee -a "$LOG"

say "running tests/gpu (budget ${BUDGET} s)"
timeout -k 15 "$BUDGET" python3 -m pytest tests/gpu -p no:cacheprovider -v -rA --durations=15 \
  --timeout=300 --junitxml="$JUNIT" -o junit_family=xunit2 "$@" >>"$LOG" 2>&1
RC=$?
[ "$RC" = 124 ] && say "BUDGET EXCEEDED: pytest was killed after ${BUDGET} s (results below come from the log)"

# engines/servers run in their own sessions: kill any the tests could not (pytest killed, say)
left=0
for f in "$PGIDS"/*; do
  [ -f "$f" ] || continue
  pg=$(cat "$f"); left=$((left + 1))
  kill -KILL -- "-$pg" 2>/dev/null
done
[ "$left" -gt 0 ] && say "killed $left leftover engine process group(s)"
rm -rf "$PGIDS"

if [ -n "$(ls -A "$ART" 2>/dev/null)" ]; then
  tar -czf "$OUTDIR/gpu_artifacts.tar.gz" -C "$ART" . && say "failure logs: $OUTDIR/gpu_artifacts.tar.gz ($(find "$ART" -mindepth 1 -maxdepth 1 -printf "%f "))"
fi
rm -rf "$ART"
WALL=$(( $(date +%s) - T0 ))
say "done in ${WALL} s, pytest exit ${RC}; full log $LOG"
echo
echo "================ GPU suite summary ($(date -u +%Y-%m-%dT%H:%MZ)) ================"
python3 -m dspark_dev.gpu_summary --junit "$JUNIT" --log "$LOG" --wall "$WALL" --out "$SUMMARY"
SRC=$?
# pytest's status, or the summary's when pytest says 0 but nothing passed (all skipped is no pass)
[ "$RC" = 0 ] && RC=$SRC
exit "$RC"
