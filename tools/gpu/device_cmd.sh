#!/usr/bin/env bash
# Prints the exact device calls for one fresh run of the GPU suite (nothing is run here).
#
#   bash tools/gpu/device_cmd.sh [N_PIECES]
#
# N_PIECES is what `bash ../shared/device/prepare.sh .device torch vllm deps mooncake` printed
# ("ready: N pieces"); default: counted from .device/c[0-9][0-9] if present.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
N=${1:-$( (ls -d "$ROOT"/.device/c[0-9][0-9] 2>/dev/null || true) | wc -l)}
if [ "$N" -lt 1 ]; then
  cat <<EOF
No kit pieces under $ROOT/.device yet. Build them first (here, ~15 min the first time):
  cd $ROOT && grep -qx '/.device/' .git/info/exclude || echo /.device/ >> .git/info/exclude
  bash /work/shared/device/prepare.sh .device torch vllm deps mooncake
then run this script again.
EOF
  exit 1
fi
last=$((N - 1))
echo "# $N back-to-back device.run calls (the machine forgets /tmp after ~30 s idle); timeout_s 600 each."
for i in $(seq 0 $((N - 2))); do
  nn=$(printf %02d "$i")
  echo "run  carry=[\".device/ctl\", \".device/c$nn\"]  command='bash .device/ctl/boot.sh'"
done
nn=$(printf %02d "$last")
echo "run  carry=[\".device/ctl\", \".device/c$nn\"]  command='bash .device/ctl/boot.sh && source /tmp/site/env.sh && DSPARK_GPU_BUDGET_S=480 bash tools/gpu/run_gpu_suite.sh \$OUT'"
echo
echo "# If the last boot call should stay short, end it at boot.sh and send the suite as call N+1:"
echo "run  command='source /tmp/site/env.sh && bash tools/gpu/run_gpu_suite.sh \$OUT'"
echo
echo "# Comes back under \$OUT: gpu_suite.log, gpu_junit.xml, gpu_summary.txt, gpu_artifacts.tar.gz (only on failures)."
echo "# The table is the last thing printed; copy it into docs/results/gpu.md with the date, GPU, versions and GPU time."
