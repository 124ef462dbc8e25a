#!/usr/bin/env bash
# Runs named groups of the one-GPU tier CONCURRENTLY on one GPU (each group's engines are small and
# set their own memory share), under one wall-clock budget, on the GPU machine after the kit is
# booted (tools/gpu/README.md). Used when a lease is too short to run the groups one after another.
#
#   source /tmp/site/env.sh && bash tools/gpu/run_groups.sh OUTDIR GROUP [GROUP ...]
#
# Groups: pd_mooncake (issue 13: PD over Mooncake, async + sync, with its aggregated references),
#         dsv4k3 (issue 16: DeepSeek-V4 / Kimi-K3 engines), nixl (issue 18: PD over NIXL),
#         pp (issue 25: PP=2/3 on one GPU, several ranks through NCCL; tests/gpu/test_pp_one_gpu.py;
#         its JSON record in OUTDIR/pp/pp.json, the launchers' logs in artifacts.tgz),
#         tp_pp (issue 40: TP=2 x PP=2 on one GPU, one launcher per rank; tests/gpu/
#         test_tp_pp_one_gpu.py; jobs by DSPARK_GPU_TP_PP_JOBS (default ref,pp1_async,tp2pp2_async,
#         tp2pp2_sync_eager; `all` adds TP=2 alone, PP=2 alone, the other corners and the stock
#         control); its JSON record in OUTDIR/tp_pp/tp_pp.json, the launchers' logs in artifacts.tgz),
#         pd_pp (issue 25: PD with a PP=2 producer on one GPU; tests/gpu/test_pd_pp_producer.py;
#         its JSON record in OUTDIR/pd_pp/pd_pp.json, as OUTDIR/GROUP/pd_pp.json for the next three),
#         pd_pp_dsv4 / pd_pp_k3 (issue 26 "also at PP=2": the same PD with a PP=2 producer for the
#         trained DeepSeek-V4 / Kimi-K3 pair, DSPARK_GPU_PD_PP_PAIR=dsv4|k3, with the subtle
#         control; a failing run's server logs in artifacts.tgz under the group's name),
#         pd_pp_dsv41 (issue 42: the same for the trained DeepSeek-V4.1 pair, DSPARK_GPU_PD_PP_PAIR=
#         dsv41, plus its PD with a PP=1 producer, job pd_pp1),
#         pd_tp_pp (issue 40 item 2: PD with a TP=2 x PP=2 producer, four launchers, into a TP=2
#         decoder, two launchers, all on GPU 0; test_pd_pp_producer.py's opt-in jobs, chosen by
#         DSPARK_GPU_PD_TP_PP_JOBS (default pair_baseline,pair_spec,pd_tp2pp2_tp2; also
#         pd_tp2pp2_tp1, pd_tp2pp2_tp2_control, pd_tp2pp2_tp2_subtle, and the module's other
#         jobs, e.g. pd_pp2_sync); its JSON record in OUTDIR/pd_tp_pp/pd_tp_pp.json (a PP
#         producer job's in OUTDIR/pd_tp_pp/pd_pp.json), a failing run's server logs in artifacts.tgz),
#         dsv4k3_pp (issue 25: DeepSeek-V4 / Kimi-K3 at PP=2 on one GPU; tests/gpu/test_dsv4_k3_pp.py),
#         dsv41_pp (issue 42: the trained DeepSeek-V4.1 pair at PP=1 and PP=2 on one GPU, graphs,
#         eager and sync eager, stock vLLM's refusal as the control; tests/gpu/test_dsv41_pp.py;
#         jobs by DSPARK_DSV41_PP_JOBS; its JSON record in OUTDIR/dsv41_pp/dsv41_pp.json),
#         router (issue 26: the DSV4 router at 256/384 experts; tests/gpu/test_dsv4_router_256.py),
#         dsv4_router (issue 26: vLLM's DSV4 MoE layer at 256 experts, padded decode batches, eager
#         and CUDA graphs, through dsv4_topk; tests/gpu/test_dsv4_router_gpu.py),
#         producer_memory (issue 29 item 4: the producer's drafter at the Qwen3-8B shape by the
#         allocator, beside producer_kv: its context KV bitwise equal to the full drafter's, and
#         producer_mla: the DeepSeek-V4 / Kimi-K3 context-only drafters on CUDA),
#         tap_partials (issue 44 item 4: the aux taps as one partial sum of the drafter's first
#         linear at PP=3 under CUDA graphs and NCCL, in the intermediate tensors and on the side
#         channel straight to the last stage, beside raw taps and the PP=1 references, and the
#         control pp3_taps_wrong (zero partials from the early stages: its acceptance must fail);
#         tests/gpu/test_pp_one_gpu.py's jobs by DSPARK_GPU_TAP_PARTIALS_JOBS; its JSON record in
#         OUTDIR/tap_partials/pp.json, the launchers' logs in artifacts.tgz),
#         pp_adaptive (issue 30: PP=2 adaptive verification on one GPU, with its control),
#         lost_stage / lost_stage_control / lost_stage_stock (issue 28 case 3b: PP rank 1 killed
#         across two launchers; tests/gpu/test_pp_lost_stage_gpu.py, the control with the peer
#         watch off, stock vLLM without the plugin and without speculation),
#         load (issue 28 case 1: vllm bench serve against PP=2 DSpark on two launchers, three runs;
#         tests/gpu/test_load_gpu.py), pd_kill (issue 28 case 3, PD part: the DSpark prefiller
#         SIGKILLed with transfers pending; tests/gpu/test_pd_kill_gpu.py), pd_decoder_kill (issue
#         28 case 3, PD part: the decoder SIGKILLed while the producer holds KV for it, then
#         restarted; tests/gpu/test_pd_decoder_kill_gpu.py), sampling (issue 28 case 4:
#         PP=2 DSpark's sampling against the target's distribution, with power against temperature
#         0.8; tests/gpu/test_sampling_gpu.py; its JSON in OUTDIR/sampling),
#         acceptance (issue 26: both trained tiny pairs' served acceptance and lossless check, bf16,
#         k=7, 64 held-out prompts, beside their training simulation; benchmarks/
#         tiny_pair_acceptance.py as acceptance_k3 and acceptance_dsv4, JSON in OUTDIR),
#         dsv4_check (issue 26: the DeepSeek-V4 engine against the pure-torch reference, with
#         DSpark; dspark_dev/training/dsv4_check.py, OUTDIR/dsv4_check.json),
#         gsm8k_k3 / gsm8k_dsv4 / gsm8k_dsv41 (issues 26, 42: the family's GSM8K YAMLs, PP=1 no-spec
#         and DSpark offline, PP=2 DSpark through `eval gsm8k --launchers`, all three side by side;
#         reports in OUTDIR/gsm8k; they exit 1 while their thresholds are null, and the reports fill
#         them).
# Writes OUTDIR/GROUP.log per group, OUTDIR/rc.txt (each group's exit status) and
# OUTDIR/artifacts.tgz (logs of failing engines/servers); kills every GPU process left behind
# (servers run in their own sessions and would outlive the command); prints the verdict lines last.
# Knobs: DSPARK_GPU_GROUPS_BUDGET_S (default 540), each group's limit; DSPARK_GPU_GROUPS_STAGGER_S
# (default 0): seconds between group starts, so the first group's engines compile ahead of the
# others' (the call then lasts up to BUDGET + (groups - 1) x STAGGER); DSPARK_GPU_LOST_STAGE_READY_S
# (default BUDGET - 200): the lost_stage groups' start-up deadline; DSPARK_GPU_ADAPTIVE_READY_S
# (default BUDGET - 200): pp_adaptive's; DSPARK_GPU_TAP_PARTIALS_READY_S (default BUDGET - 200):
# tap_partials'; DSPARK_GPU_TP_PP_READY_S (default BUDGET - 170) and
# DSPARK_GPU_TP_PP_STOCK_READY_S (default BUDGET - 150): tp_pp's start-up deadlines (plugin, stock);
# DSPARK_GPU_PD_TP_PP_JOBS and DSPARK_GPU_PD_TP_PP_READY_S (default BUDGET - 120): pd_tp_pp's;
# DSPARK_GPU_DSV41_PP_READY_S (default BUDGET - 200): dsv41_pp's (plugin and stock);
# DSPARK_GPU_DSV4K3_PP_READY_S (default BUDGET - 200): dsv4k3_pp's.
# DSPARK_GPU_GROUPS_SERIAL_S (unset: the groups run side by side): the whole call's seconds; the
# groups then run one after another, each under min(BUDGET, what is left of the call) with its
# deadlines derived from that, its leftover processes killed before the next starts; a group with
# less than DSPARK_GPU_GROUPS_MIN_S (default 200) left is not started (`rc=not-started` in
# rc.txt). One call then runs several groups without the machine idling between calls.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 2
OUTDIR=$1
shift
BUDGET=${DSPARK_GPU_GROUPS_BUDGET_S:-540}
STAGGER=${DSPARK_GPU_GROUPS_STAGGER_S:-0}
SERIAL_S=${DSPARK_GPU_GROUPS_SERIAL_S:-}
MIN_S=${DSPARK_GPU_GROUPS_MIN_S:-200}
FULL_BUDGET=$BUDGET
KNOWN=(pd_mooncake dsv4k3 nixl pp tap_partials tp_pp pd_pp pd_pp_dsv4 pd_pp_k3 pd_pp_dsv41 pd_tp_pp dsv4k3_pp
  dsv41_pp router dsv4_router producer_memory pp_adaptive lost_stage lost_stage_control
  lost_stage_stock load pd_kill pd_decoder_kill sampling acceptance dsv4_check gsm8k_k3 gsm8k_dsv4
  gsm8k_dsv41)
[ $# -gt 0 ] || {
  echo "run_groups.sh: name at least one group: ${KNOWN[*]}" >&2
  exit 2
}
for g in "$@"; do # a misspelt group fails the call before anything starts
  known=0
  for k in "${KNOWN[@]}"; do [ "$k" = "$g" ] && known=1; done
  if [ "$known" = 0 ]; then
    echo "run_groups.sh: unknown group '$g'; known groups: ${KNOWN[*]}" >&2
    exit 2
  fi
done
mkdir -p "$OUTDIR"
ART=$(mktemp -d /tmp/dspark-gpu-artifacts.XXXX)
PGIDS=$(mktemp -d /tmp/dspark-gpu-pgids.XXXX)
export DSPARK_PP_TEST_DEVICE=gpu PYTHONUNBUFFERED=1 DSPARK_GPU_ARTIFACTS=$ART DSPARK_PGID_DIR=$PGIDS
say() { echo "[gpu-groups $(date +%H:%M:%S)] $*"; }

if [ -f /tmp/site/env.sh ]; then # a booted kit: torch and vLLM must come from it
  python3 tools/gpu/check_kit.py /tmp/site || exit 3
fi
say "installing the project into /tmp/site (the plugin's entry point)"
rm -rf build ./*.egg-info
python3 -m pip install -q --no-deps --no-index --no-build-isolation --upgrade --target /tmp/site . 2>&1 \
  | grep -v "^WARNING: Target directory"
rm -rf build ./*.egg-info

reap() {  # kill what the groups left: their process groups, then any GPU process
  local left=0 f pid
  for f in "$PGIDS"/*; do
    [ -f "$f" ] || continue
    left=$((left + 1))
    kill -KILL -- "-$(cat "$f")" 2>/dev/null
    rm -f "$f"
  done
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    left=$((left + 1))
    kill -KILL "$pid" 2>/dev/null
  done
  [ "$left" -gt 0 ] && say "killed $left leftover process group(s)/GPU process(es)"
  return 0
}

run_cmd() {  # name, then a command line (not pytest); the environment comes from the caller
  local name=$1
  shift
  say "group $name: started"
  timeout -k 10 "$BUDGET" "$@" >"$OUTDIR/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" >>"$OUTDIR/rc.txt"
  say "group $name: exit $rc"
}

run_group() {  # name, then the pytest arguments; the environment comes from the caller
  local name=$1
  shift
  say "group $name: started"
  timeout -k 10 "$BUDGET" python3 -m pytest -v -s -rA -p no:cacheprovider "$@" >"$OUTDIR/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" >>"$OUTDIR/rc.txt"
  say "group $name: exit $rc"
}

: >"$OUTDIR/rc.txt"
for g in "$@"; do
  if [ -n "$SERIAL_S" ]; then # one group at a time, each under what is left of the call
    left_s=$((SERIAL_S - SECONDS))
    if [ "$left_s" -lt "$MIN_S" ]; then
      echo "$g rc=not-started ($left_s s of the call left, under DSPARK_GPU_GROUPS_MIN_S=$MIN_S)" >>"$OUTDIR/rc.txt"
      say "group $g: not started, $left_s s of the call left"
      continue
    fi
    BUDGET=$((left_s < FULL_BUDGET ? left_s : FULL_BUDGET))
  fi
  case $g in
  pd_mooncake)
    DSPARK_GPU_JOBS=pair_baseline,pair_spec,pair_spec_sync,pd \
      run_group "$g" tests/gpu/test_pd_mooncake_gpu.py --timeout=$((BUDGET - 20)) &
    ;;
  dsv4k3)
    DSPARK_DSV4K3_TIMEOUT_S=$((BUDGET - 90)) \
      run_group "$g" tests/gpu/test_dsv4_k3_engine.py --timeout=$((BUDGET - 20)) &
    ;;
  pp)
    mkdir -p "$ART/pp" "$OUTDIR/pp" # every launcher's log comes back in artifacts.tgz
    DSPARK_GPU_PP_LOGS="$ART/pp" DSPARK_GPU_PP_OUT="$OUTDIR/pp" DSPARK_GPU_PP_READY_S=$((BUDGET - 200)) DSPARK_GPU_PP_STOCK_READY_S=$((BUDGET - 120)) \
      run_group "$g" tests/gpu/test_pp_one_gpu.py --timeout=$((BUDGET - 20)) &
    ;;
  tap_partials)
    # the PP module's opt-in jobs: raw taps, the partial in the intermediate tensors and on the
    # side channel (PP=3: two stages make taps), with the PP=1 references they are checked against,
    # and the control (tests/support/tap_probe zeroes the early stages' blocks)
    mkdir -p "$ART/tap_partials" "$OUTDIR/tap_partials"
    DSPARK_GPU_PP_JOBS=${DSPARK_GPU_TAP_PARTIALS_JOBS:-ref,pp1_async,pp3_async,pp3_taps_dict,pp3_taps_side,pp3_taps_wrong} \
      DSPARK_GPU_PP_LOGS="$ART/tap_partials" DSPARK_GPU_PP_OUT="$OUTDIR/tap_partials" \
      DSPARK_GPU_PP_READY_S=${DSPARK_GPU_TAP_PARTIALS_READY_S:-$((BUDGET - 200))} \
      DSPARK_GPU_PP_STOCK_READY_S=$((BUDGET - 120)) \
      run_group "$g" tests/gpu/test_pp_one_gpu.py --timeout=$((BUDGET - 20)) &
    ;;
  tp_pp)
    # four launchers per TP=2 x PP=2 deployment (about 258 s to start with CUDA graphs, alone)
    mkdir -p "$ART/tp_pp" "$OUTDIR/tp_pp"
    DSPARK_GPU_PP_LOGS="$ART/tp_pp" DSPARK_GPU_TP_PP_OUT="$OUTDIR/tp_pp" \
      DSPARK_GPU_PP_READY_S=${DSPARK_GPU_TP_PP_READY_S:-$((BUDGET - 170))} \
      DSPARK_GPU_PP_STOCK_READY_S=${DSPARK_GPU_TP_PP_STOCK_READY_S:-$((BUDGET - 150))} \
      run_group "$g" tests/gpu/test_tp_pp_one_gpu.py --timeout=$((BUDGET - 20)) &
    ;;
  pd_pp)
    mkdir -p "$OUTDIR/pd_pp"
    DSPARK_GPU_PD_PP_OUT="$OUTDIR/pd_pp" DSPARK_GPU_PD_PP_READY_S=$((BUDGET - 120)) \
      run_group "$g" tests/gpu/test_pd_pp_producer.py --timeout=$((BUDGET - 20)) &
    ;;
  pd_pp_dsv4 | pd_pp_k3 | pd_pp_dsv41)
    # the same module and deadlines as pd_pp, the pair by its knob; its own artifacts folder, so
    # that two PD groups' server logs (same names) do not overwrite each other
    mkdir -p "$ART/$g" "$OUTDIR/$g"
    DSPARK_GPU_PD_PP_PAIR=${g#pd_pp_} DSPARK_GPU_ARTIFACTS="$ART/$g" DSPARK_GPU_PD_PP_OUT="$OUTDIR/$g" \
      DSPARK_GPU_PD_PP_READY_S=$((BUDGET - 120)) \
      run_group "$g" tests/gpu/test_pd_pp_producer.py --timeout=$((BUDGET - 20)) &
    ;;
  pd_tp_pp)
    # six launchers (producer 2 x 2, decoder 2) and the two PP=1 references at once
    mkdir -p "$ART/pd_tp_pp" "$OUTDIR/pd_tp_pp"
    DSPARK_GPU_PD_PP_JOBS=${DSPARK_GPU_PD_TP_PP_JOBS:-pair_baseline,pair_spec,pd_tp2pp2_tp2} \
      DSPARK_GPU_ARTIFACTS="$ART/pd_tp_pp" DSPARK_GPU_PD_TP_PP_OUT="$OUTDIR/pd_tp_pp" \
      DSPARK_GPU_PD_PP_OUT="$OUTDIR/pd_tp_pp" \
      DSPARK_GPU_PD_PP_READY_S=${DSPARK_GPU_PD_TP_PP_READY_S:-$((BUDGET - 120))} \
      run_group "$g" tests/gpu/test_pd_pp_producer.py --timeout=$((BUDGET - 20)) &
    ;;
  dsv4k3_pp)
    mkdir -p "$ART/dsv4k3_pp" "$OUTDIR/dsv4k3_pp"
    DSPARK_GPU_PP_LOGS="$ART/dsv4k3_pp" DSPARK_GPU_DSV4K3_PP_OUT="$OUTDIR/dsv4k3_pp" \
      DSPARK_GPU_PP_READY_S=${DSPARK_GPU_DSV4K3_PP_READY_S:-$((BUDGET - 200))} \
      run_group "$g" tests/gpu/test_dsv4_k3_pp.py --timeout=$((BUDGET - 20)) &
    ;;
  dsv41_pp)
    # five deployments at once (two PP=1 engines, three PP=2 pairs of launchers) and the stock
    # control, whose refusal comes when a stage loads the model
    mkdir -p "$ART/dsv41_pp" "$OUTDIR/dsv41_pp"
    DSPARK_GPU_PP_LOGS="$ART/dsv41_pp" DSPARK_GPU_DSV41_PP_OUT="$OUTDIR/dsv41_pp" \
      DSPARK_GPU_PP_READY_S=${DSPARK_GPU_DSV41_PP_READY_S:-$((BUDGET - 200))} \
      DSPARK_GPU_PP_STOCK_READY_S=${DSPARK_GPU_DSV41_PP_READY_S:-$((BUDGET - 200))} \
      run_group "$g" tests/gpu/test_dsv41_pp.py --timeout=$((BUDGET - 20)) &
    ;;
  router)
    run_group "$g" tests/gpu/test_dsv4_router_256.py --timeout=$((BUDGET - 20)) &
    ;;
  dsv4_router)
    run_group "$g" tests/gpu/test_dsv4_router_gpu.py --timeout=$((BUDGET - 20)) &
    ;;
  producer_memory)
    # three runs side by side (each about 150 s on a fresh machine): the Qwen3-8B producer engine
    # (its benchmark JSON, JSONL and logs come back in artifacts.tgz: 8 files at most come back),
    # the tiny pair's bitwise context-KV test (logged as producer_kv) and the DeepSeek-V4 / Kimi-K3
    # context-only drafters against vLLM's on CUDA (bitwise caches, held bytes; producer_mla)
    mkdir -p "$ART/producer_memory"
    DSPARK_GPU_PRODUCER_MEMORY=1 DSPARK_PRODUCER_MEMORY_OUT="$ART/producer_memory" \
      DSPARK_PRODUCER_MEMORY_BUDGET_S=$((BUDGET - 60)) \
      run_group "$g" tests/gpu/test_producer_memory_gpu.py --timeout=$((BUDGET - 20)) &
    run_group producer_kv "tests/gpu/test_producer_gpu.py::test_materialize_context_kv_writes_full_drafter_kv" \
      --timeout=$((BUDGET - 20)) &
    run_group producer_mla tests/gpu/test_context_kv_mla_gpu.py --timeout=$((BUDGET - 20)) &
    ;;
  nixl)
    mkdir -p "$OUTDIR/nixl"
    DSPARK_GPU_NIXL=1 DSPARK_NIXL_OUT="$OUTDIR/nixl" DSPARK_NIXL_READY_S=$((BUDGET / 2)) \
      run_group "$g" tests/gpu/test_pd_nixl.py --timeout=$((BUDGET - 20)) &
    ;;
  pp_adaptive)
    mkdir -p "$ART/pp_adaptive" # every launcher's log comes back in artifacts.tgz
    DSPARK_GPU_PP_LOGS="$ART/pp_adaptive" DSPARK_GPU_PP_READY_S=${DSPARK_GPU_ADAPTIVE_READY_S:-$((BUDGET - 200))} \
      run_group "$g" tests/gpu/test_pp_adaptive_one_gpu.py --timeout=$((BUDGET - 20)) &
    ;;
  lost_stage | lost_stage_control | lost_stage_stock)
    # result.json and both launchers' logs come back in artifacts.tgz (at most 8 files come back
    # from the GPU machine: one folder per group would pass that); the summary is in $g.log.
    mkdir -p "$ART/$g"
    DSPARK_GPU_LOST_STAGE_LOGS="$ART/$g" DSPARK_GPU_PP_READY_S=${DSPARK_GPU_LOST_STAGE_READY_S:-$((BUDGET - 200))} \
      DSPARK_GPU_LOST_STAGE_CONTROL=$([ "$g" = lost_stage_control ] && echo 1 || echo 0) \
      DSPARK_GPU_LOST_STAGE_STOCK=$([ "$g" = lost_stage_stock ] && echo 1 || echo 0) \
      run_group "$g" tests/gpu/test_pp_lost_stage_gpu.py --timeout=$((BUDGET - 20)) &
    ;;
  load)
    # load.json and the trimmed launcher and bench logs come back in artifacts.tgz
    mkdir -p "$ART/load"
    DSPARK_GPU_LOAD_LOGS="$ART/load" DSPARK_GPU_LOAD_BUDGET_S=$((BUDGET - 10)) \
      DSPARK_GPU_PP_READY_S=${DSPARK_GPU_LOAD_READY_S:-$((BUDGET * 6 / 10))} \
      run_group "$g" tests/gpu/test_load_gpu.py --timeout=$((BUDGET - 5)) &
    ;;
  pd_kill)
    mkdir -p "$ART/pd_kill"
    DSPARK_GPU_PD_KILL_LOGS="$ART/pd_kill" DSPARK_PD_KILL_BUDGET_S=$((BUDGET - 10)) \
      DSPARK_PD_KILL_READY_S=${DSPARK_PD_KILL_READY_S:-$((BUDGET * 6 / 10))} \
      run_group "$g" tests/gpu/test_pd_kill_gpu.py --timeout=$((BUDGET - 5)) &
    ;;
  pd_decoder_kill)
    mkdir -p "$ART/pd_decoder_kill"
    DSPARK_GPU_PD_DKILL_LOGS="$ART/pd_decoder_kill" DSPARK_PD_DKILL_BUDGET_S=$((BUDGET - 10)) \
      DSPARK_PD_DKILL_READY_S=${DSPARK_PD_DKILL_READY_S:-$((BUDGET * 55 / 100))} \
      run_group "$g" tests/gpu/test_pd_decoder_kill_gpu.py --timeout=$((BUDGET - 5)) &
    ;;
  sampling)
    mkdir -p "$OUTDIR/sampling" "$ART/sampling" # the JSON comes back as is, the logs in artifacts.tgz
    DSPARK_GPU_SAMPLING_OUT="$OUTDIR/sampling" DSPARK_GPU_SAMPLING_LOGS="$ART/sampling" DSPARK_GPU_SAMPLING_BUDGET_S=$((BUDGET - 20)) \
      run_group "$g" tests/gpu/test_sampling_gpu.py --timeout=$((BUDGET - 5)) &
    ;;
  acceptance)
    # two engines each (no speculation, then DSpark), one after the other: half the budget apiece
    for fam in k3 dsv4; do
      pair=models/k3-pair
      [ "$fam" = dsv4 ] && pair=models/dsv4-pair
      PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" run_cmd "acceptance_$fam" \
        python3 -m benchmarks.tiny_pair_acceptance --family "$fam" --pair "$pair" --k 7 \
        --num-prompts 64 --compare-training --timeout $(((BUDGET - 60) / 2)) \
        --out-json "$OUTDIR/${fam}_acceptance.json" &
    done
    ;;
  dsv4_check)
    run_cmd "$g" python3 -m dspark_dev.training.dsv4_check --spec --out /tmp/dsv4-check \
      --report "$OUTDIR/dsv4_check.json" --timeout $(((BUDGET - 60) / 3)) &
    ;;
  gsm8k_k3 | gsm8k_dsv4 | gsm8k_dsv41)
    fam=${g#gsm8k_}
    mkdir -p "$OUTDIR/gsm8k" "$ART/$g"
    for arm in pp1-nospec pp1-dspark pp2-dspark; do
      launch=()
      [ "$arm" = pp2-dspark ] && launch=(--launchers --launcher-logs "$ART/$g")
      run_cmd "$g-$arm" python3 -m dspark_dev eval gsm8k \
        --config "tests/evals/gsm8k/configs/$fam-$arm.yaml" "${launch[@]}" \
        --out-json "$OUTDIR/gsm8k/$fam-$arm.json" &
    done
    ;;
  *) say "group $g is in KNOWN but has no case here" ;;
  esac
  if [ -n "$SERIAL_S" ]; then
    wait
    reap
  fi
  [ "$STAGGER" -gt 0 ] && [ "$g" != "${*: -1}" ] && sleep "$STAGGER"
done
wait
reap
# At most 16 MiB per file comes back from the GPU machine: a launcher log over 1 MiB (NCCL INFO,
# compile chatter) is cut to its first 150 lines, every error/traceback/probe line, and its last
# 1500 lines (faulthandler stacks and the final traceback sit at the end).
while IFS= read -r -d '' f; do
  [ "$(stat -c %s "$f")" -gt 1048576 ] || continue
  {
    head -n 150 "$f"
    echo "... [cut by run_groups.sh: error lines of the middle follow] ..."
    grep -nE "Error|Traceback|K3_IDS_PROBE|Fatal Python|Thread 0x|File \"" "$f" | head -n 600
    echo "... [cut by run_groups.sh: the last 1500 lines follow] ..."
    tail -n 1500 "$f"
  } >"$f.cut" && mv "$f.cut" "$f"
done < <(find "$ART" -type f -print0)
[ -n "$(ls -A "$ART" 2>/dev/null)" ] && tar -czf "$OUTDIR/artifacts.tgz" -C "$ART" .
rm -rf "$PGIDS"

say "verdicts"
cat "$OUTDIR/rc.txt"
grep -hE '^(tests/gpu/\S+ (PASSED|FAILED|ERROR|SKIPPED))|PD acceptance:|subtle control \(|DSV4 ROUTER LAYER|PP acceptance:|STOCK vLLM|sample under load|producer KV: |restarted decoder: |sampling (first|after_accepted): n=|PP=2 vs PP=1 DSpark|memory growth|PRODUCER DRAFTER MEMORY|^group [AB] |^(FAILED|ERROR) |[0-9]+ (passed|failed)|^GSM8K \[|^  (accuracy|mean acceptance length|FAILED: )|"(mean_acceptance_length|lossless_ok|lossless_identical_outputs|passed)": ' \
  "$OUTDIR"/*.log | cut -c1-300 | tail -n 80
