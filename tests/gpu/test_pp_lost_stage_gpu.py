"""A PP stage lost across launchers on the GPU: node 0 ends within seconds naming it (issue 28,
case 3b; the CPU run is tests/e2e/test_process_faults.py, docs/results/reliability.md).

Two launchers on GPU 0 (dspark_dev/pp_launch.py: node 0 ``--nnodes 2 --node-rank 0`` with the
API server, node 1 ``--headless`` with PP rank 1, each its own ``NCCL_HOSTID``, NCCL over
loopback sockets), the trained tiny pair with DSpark (k=7), CUDA graphs, async scheduling.
8 greedy streams of 400 tokens run when PP rank 1's worker gets SIGKILL. Checked: node 0's
``vllm serve`` exits within ``DSPARK_GPU_LOST_STAGE_BOUND_S`` (default 30 s; vLLM 0.34.0 alone
waits ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, 300 s), its log names the stage (``DSpark PP: lost
PP rank 1 (...node 1...)``) and says why the engine stops, every stream ended with an error, no
process of either launcher is left. ``DSPARK_GPU_LOST_STAGE_CONTROL=1``: the same with the watch
off (``VLLM_DSPARK_PP_PEER_TIMEOUT_S=0``, execute timeout 60 s): must time out instead (about
60 s) and name no stage. ``DSPARK_GPU_LOST_STAGE_STOCK=1`` (group ``lost_stage_stock``): stock vLLM
0.34.0, the plugin left out (``VLLM_PLUGINS``), PP=2 without speculation, async scheduling,
execute timeout 60 s: records how long node 0 takes to exit and whether anything names the lost
stage (the stock column of case 3b on the GPU); asserted: node 0 exits within the limit, no
process is left, every stream ended with an error, no line of the plugin in the log.

    source /tmp/site/env.sh && DSPARK_GPU_GROUPS_BUDGET_S=540 bash tools/gpu/run_groups.sh \\
        $OUT lost_stage lost_stage_control lost_stage_stock

(``result.json`` and the launchers' logs come back in ``$OUT/artifacts.tgz``;
``DSPARK_GPU_LOST_STAGE_LOGS`` sets that folder when run by hand.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gpu_common import DRYRUN_CPU, GRAPH_COMPILATION_CONFIG, PAIR_DTYPE, require_cuda
from support import reliability, tiny_pair

from dspark_dev import pp_launch
from dspark_dev.serve import GPU_CHILD_ENV
from vllm_dspark_pp.protocol import liveness

pytestmark = pytest.mark.gpu

READY_S = float(os.environ.get("DSPARK_GPU_PP_READY_S", "330"))
BOUND_S = float(os.environ.get("DSPARK_GPU_LOST_STAGE_BOUND_S", "30"))
CONTROL = os.environ.get("DSPARK_GPU_LOST_STAGE_CONTROL") == "1"
STOCK = os.environ.get("DSPARK_GPU_LOST_STAGE_STOCK") == "1"
# Both the control and stock wait for vLLM's RPC timeout: 60 s keeps the group under 120 s from
# the kill (vLLM's default is 300 s).
BOUNDED_TIMEOUT = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "60"}
EXIT_LIMIT_S = 120.0
KV_BYTES = 512 << 20


def _base_args() -> list[str]:
    if DRYRUN_CPU:
        return ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
                "--max-num-seqs", "8", "--seed", "0"]  # fmt: skip
    return [
        "--dtype", PAIR_DTYPE, "--max-model-len", "512", "--max-num-seqs", "8", "--seed", "0",
        "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(KV_BYTES),
        "--compilation-config", json.dumps(GRAPH_COMPILATION_CONFIG), "--async-scheduling",
    ]  # fmt: skip


def test_lost_stage_across_launchers_ends_node0_naming_it(tmp_path):
    require_cuda()
    ok, why = tiny_pair.available()
    if not ok:
        pytest.skip(why)
    env = dict(GPU_CHILD_ENV)
    if CONTROL:
        env.update({liveness.TIMEOUT_ENV: "0", **BOUNDED_TIMEOUT})
    if STOCK:
        env.update({"VLLM_PLUGINS": "no-such-plugin", **BOUNDED_TIMEOUT})
    log_dir = Path(os.environ.get("DSPARK_GPU_LOST_STAGE_LOGS") or tmp_path / "lost_stage")
    log_dir.mkdir(parents=True, exist_ok=True)
    dep = pp_launch.deployment(
        "lost",
        tiny_pair.TARGET,
        pp=2,
        spec=None if STOCK else tiny_pair.spec_config(),
        log_dir=log_dir,
        device="cpu" if DRYRUN_CPU else "gpu",
        base_args=_base_args(),
        env=env,
    )
    r = reliability.kill_stage_mid_generation(dep.nodes, READY_S, EXIT_LIMIT_S)
    summary = reliability.lost_stage_summary(r)
    print(summary)
    record = {k: v for k, v in r.items() if k not in ("head_log", "victim_log")}
    named = "DSpark PP: lost PP rank 1 (" in r["head_log"]
    record["named"] = named
    record["plugin_lines"] = sum("DSpark PP" in ln for ln in r["head_log"].splitlines())
    record["timeout_line"] = next(  # vLLM's "TimeoutError: RPC call to ... timed out."
        (ln.strip()[:300] for ln in r["head_log"].splitlines() if "TimeoutError: " in ln), None
    )
    meta = {"control": CONTROL, "stock": STOCK, "speculation": not STOCK}
    (log_dir / "result.json").write_text(json.dumps({**meta, **record}, indent=1))
    assert r["rc"] is not None, f"node 0 still up {EXIT_LIMIT_S:.0f} s after the kill"
    assert not r["head_group_left"], f"orphans: {r['head_group_left']}"
    assert all(c.get("error") or c.get("exception") for c in r["clients"]), r["clients"]
    if STOCK:
        print(f"STOCK vLLM 0.34.0 PP=2 (no plugin, no speculation) lost stage: node 0 exit "
              f"{r['exit_s']} s after the kill, stage named: {named}")  # fmt: skip
        assert record["plugin_lines"] == 0, "the plugin was loaded: not a stock run"
        return
    if CONTROL:
        assert not named and r["exit_s"] > BOUND_S, summary
        return
    assert named and ", node 1, pid " in r["head_log"], summary
    assert "DSpark PP: stopping the engine: " in r["head_log"], summary
    assert r["exit_s"] <= BOUND_S, summary
    assert not r["other_nodes_running"], summary
