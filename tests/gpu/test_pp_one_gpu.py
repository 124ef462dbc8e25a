"""One GPU, several ranks: DSpark on PP=2 and PP=3 targets through real NCCL (issue 25).

Every PP stage is its own vLLM launcher (``vllm serve --nnodes N --node-rank R``, node R > 0
headless; dspark_dev/pp_launch.py). By default all stages share GPU 0, each launcher with its
own ``NCCL_HOSTID`` so NCCL treats them as hosts and joins them over loopback sockets;
``DSPARK_GPU_PP_LAYOUT=per-stage`` puts stage R on GPU R instead (a several-GPU machine), with no
other change. Model: the trained tiny pair (models/tiny-pair, k=7, ``DSPARK_GPU_PAIR_DTYPE``,
float32 by default), CUDA graphs on (decode graphs for 4 and 8 requests) unless a case says
eager, three waves of 3, 5 and 7 held-out prompts (every decode batch is padded to a captured
size; the warm-up captured sizes no wave has).

Jobs, all started at once on the GPU (``DSPARK_GPU_PP_JOBS=a,b`` selects some):

* ``ref``: PP=1 without speculation, eager, top-2 logprobs (the parity reference);
* ``pp1_async`` / ``pp1_sync``: PP=1 DSpark (the acceptance references);
* ``pp2_async``, ``pp2_sync``, ``pp3_async``, ``pp3_sync``: the plugin's PP DSpark; ``pp2_async``
  also takes a client abort mid-stream and then serves the first wave again;
* ``pp2_fixed8``: PP=2 async with ``dspark_pp_fixed_graph_batch`` 8;
* ``pp3_taps_dict`` / ``pp3_taps_side`` (not started by default; group ``tap_partials``): PP=3
  async with the aux taps as one partial sum of the drafter's first linear in the intermediate
  tensors (``VLLM_DSPARK_PP_TAP_PARTIALS=1``) / straight to the last stage on the side channel
  (``=side``), under CUDA graphs and NCCL: the same greedy and acceptance checks as every served
  job, and the keys each stage logs at its first send (issue 44 item 4);
* ``pp3_taps_wrong`` (group ``tap_partials``; the control of the tap jobs' acceptance check):
  ``pp3_taps_dict`` with tests/support/tap_probe on PYTHONPATH and
  ``DSPARK_TEST_TAP_WRONG_BLOCK=1``, so every stage before the last relays its partial from a
  zero column block (the drafter loses the early stages' taps): greedy must still equal PP=1
  without speculation (the target's tensors are untouched), and the acceptance check must FAIL
  on its counters (a wrong partial that check could not see would make the tap jobs' pass
  worthless);
* ``stock_async`` / ``stock_sync``: the same PP=2 DSpark launchers with the plugin left out
  (``VLLM_PLUGINS``), the control: what stock vLLM 0.34.0 does here is recorded (answers
  correctly, corrupts, crashes, or hangs: then every process's stacks, via faulthandler);
* ``fault``: node 1 without the plugin: node 0 must fail at start naming PP rank 1.

Every launcher preloads a recording copy of the GPU kit's NCCL stub
(dspark_dev/multi_gpu.py ``NcclStubGuard``) and runs with ``NCCL_DEBUG=INFO``: the checks
read NCCL's own init lines (ranks, nodes, transport), the plugin's line naming the exchange's
backend, and the list of stubbed NCCL functions that were called (must be empty).

A JSON record ``pp.json`` (commit, source fingerprint, date, GPU, command, the selected jobs, each
job's shape, counters, token count, ready time and evidence: handshake, rank lines, NCCL lines,
pinned-dispatch counts, drafts digests when logged; every check's verdict, set before its assert)
is written when the module's jobs shut down, to ``$DSPARK_GPU_PP_OUT`` (run_groups.sh:
``OUTDIR/pp/pp.json``), else ``$DSPARK_GPU_ARTIFACTS``, else the launcher log folder.

    source /tmp/site/env.sh && bash tools/gpu/run_groups.sh $OUT pp
"""

from __future__ import annotations

import datetime
import http.client
import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path

import pytest
from gpu_common import (
    CPU_DRYRUN_ENV,
    CPU_DRYRUN_LLM,
    DRYRUN_CPU,
    GRAPH_COMPILATION_CONFIG,
    PAIR_DTYPE,
    PAIR_SAMPLING,
    GpuRecord,
    Jobs,
    job_summary,
    require_cuda,
    select_jobs,
)
from support import tiny_pair

from dspark_dev import pp_launch, serve_demo
from dspark_dev.metrics import EMPTY, counter_sum
from dspark_dev.parity import compare_tokens, counters_close
from dspark_dev.proc import live_group_members
from dspark_dev.serve import GPU_CHILD_ENV
from vllm_dspark_pp.protocol import draft_digest, graph_batch, handshake

pytestmark = pytest.mark.gpu  # the time limit: run_groups.sh --timeout (its budget)

WAVE_SIZES = (3, 5, 7)
MAX_TOKENS = PAIR_SAMPLING["max_tokens"]
READY_S = float(os.environ.get("DSPARK_GPU_PP_READY_S", "330"))
REQUEST_S = 120.0
STOCK_READY_S = float(os.environ.get("DSPARK_GPU_PP_STOCK_READY_S", "420"))
STOCK_REQUEST_S = 90.0
FAULT_HANDSHAKE_S = 15.0
KV_BYTES = 512 << 20
# only for vLLM's start-up check (free memory >= this share): the KV budget is fixed
MEM_SHARE = "0.05"
SERVED = {
    "pp2_async": (2, True, {}),
    "pp2_sync": (2, False, {}),
    "pp3_async": (3, True, {}),
    "pp3_sync": (3, False, {}),
    "pp2_fixed8": (2, True, {graph_batch.KEY: 8}),
    "pp3_taps_dict": (3, True, {}),
    "pp3_taps_side": (3, True, {}),
}
#: the served jobs' VLLM_DSPARK_PP_TAP_PARTIALS (the others keep the default, raw taps)
TAP_JOBS = {"pp3_taps_dict": "1", "pp3_taps_side": "side"}
REPO = Path(__file__).resolve().parents[2]
#: the control of the tap jobs' acceptance check (zero column blocks before the last stage)
TAP_CONTROL = "pp3_taps_wrong"
TAP_PROBE_DIR = REPO / "tests" / "support" / "tap_probe"
JOBS_ENV = "DSPARK_GPU_PP_JOBS"
ALL_JOBS = ("ref", "pp1_async", "pp1_sync", *SERVED, TAP_CONTROL, "stock_async", "stock_sync",
            "fault")  # fmt: skip
DEFAULT_JOBS = tuple(j for j in ALL_JOBS if j not in TAP_JOBS and j != TAP_CONTROL)
ONLY = select_jobs(os.environ.get(JOBS_ENV, ""), JOBS_ENV, ALL_JOBS, DEFAULT_JOBS)
LOG_DIR = Path(os.environ.get("DSPARK_GPU_PP_LOGS") or tempfile.mkdtemp(prefix="dspark-pp-gpu-"))
RECORD = GpuRecord("pp.json")


def _waves() -> list[list[list[int]]]:
    prompts = tiny_pair.heldout_prompts(sum(WAVE_SIZES))
    out, i = [], 0
    for n in WAVE_SIZES:
        out.append(prompts[i : i + n])
        i += n
    return out


def _flat(waves):
    return [p for w in waves for p in w]


def _base_args(
    async_scheduling: bool, *, eager: bool = False, dtype: str = PAIR_DTYPE
) -> list[str]:
    """Every launcher's ``vllm serve`` settings; ``eager``: no CUDA graphs (the TP x PP tier's
    eager variants), ``dtype`` (the TP x PP tier runs bf16)."""
    if DRYRUN_CPU:
        return ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
                "--max-num-seqs", "8", "--seed", "0"]  # fmt: skip
    graphs = ["--compilation-config", json.dumps(GRAPH_COMPILATION_CONFIG)]
    return [
        "--dtype", dtype, "--max-model-len", "512", "--max-num-seqs", "8", "--seed", "0",
        "--gpu-memory-utilization", MEM_SHARE, "--kv-cache-memory-bytes", str(KV_BYTES),
        *(["--enforce-eager"] if eager else graphs),
        "--async-scheduling" if async_scheduling else "--no-async-scheduling",
    ]  # fmt: skip


def _launcher_env(guard) -> dict:
    env = dict(GPU_CHILD_ENV)
    if not DRYRUN_CPU:
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", **guard.env())
    return env


def _deployment(name: str, pp: int, spec: dict | None, async_scheduling: bool, guard, **kw):
    """``kw``: ``eager`` / ``dtype`` for :func:`_base_args`, the rest (``tp``, ``env``, ...) for
    :func:`pp_launch.deployment`."""
    base = _base_args(
        async_scheduling, eager=kw.pop("eager", False), dtype=kw.pop("dtype", PAIR_DTYPE)
    )
    return pp_launch.deployment(
        name,
        tiny_pair.TARGET,
        pp=pp,
        spec=spec,
        log_dir=LOG_DIR,
        device="cpu" if DRYRUN_CPU else "gpu",
        base_args=base,
        env={**_launcher_env(guard), **kw.pop("env", {})},
        **kw,
    )


def _metrics(url: str) -> dict:
    return serve_demo.spec_metrics(url, settle_s=3.0)


def _serve_waves(url: str, waves) -> tuple[list, list[dict]]:
    return pp_launch.serve_waves(url, tiny_pair.TARGET, waves, MAX_TOKENS, timeout_s=REQUEST_S)


def _running(url: str) -> float:
    from dspark_dev.metrics import parse_prometheus
    from dspark_dev.serve import http_text

    m = parse_prometheus(http_text(url + "/metrics"))
    return sum(v for k, v in m.items() if k.startswith("vllm:num_requests_running"))


def _abort_mid_stream(url: str, prompt: list[int], after_chunks: int = 4) -> dict:
    """Stream one long request, read a few chunks, close the socket; then wait until the server
    runs no request."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_S)
    body = {"model": tiny_pair.TARGET, "prompt": prompt, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    chunks = 0
    while chunks < after_chunks:
        line = resp.fp.readline()
        if not line:
            break
        if line.startswith(b"data: ") and b"[DONE]" not in line:
            chunks += 1
    conn.close()  # the client goes away mid-stream
    t0 = time.monotonic()
    running = _running(url)
    while running > 0 and time.monotonic() - t0 < 30:
        time.sleep(0.5)
        running = _running(url)
    return {"chunks_read": chunks, "running_after_s": round(time.monotonic() - t0, 1),
            "running": running}  # fmt: skip


def _evidence(dep, pp: int, tp: int = 1) -> dict:
    logs = [n.log_tail(10**8) for n in dep.nodes]
    text = "\n".join(logs)
    nccl_init = sorted(set(re.findall(r"nRanks (\d+) nNodes (\d+)", text)))
    sizes = pp_launch.handshake_sizes(logs)  # N of "PP handshake: N ranks agree" (PP or TP x PP)
    return {
        "handshake": bool(sizes) and set(sizes) <= {pp, tp * pp},
        "handshake_sizes": sizes,
        "ranks": pp_launch.rank_assignments(logs),
        "nccl_comms_per_log": [
            sorted(set(re.findall(r"nRanks (\d+) nNodes (\d+)", log))) for log in logs
        ],
        "exchange_backends": [
            re.findall(r"DSpark PP exchange: .*? over (\S+)", log)[-1:] for log in logs
        ],
        "nccl_comms": nccl_init,
        "nccl_socket": "NET/Socket" in text,
        "pinned": [int(x) for x in re.findall(r"(\d+) pinned dispatches so far", text)],
        "pinned_per_log": [
            [int(x) for x in re.findall(r"(\d+) pinned dispatches so far", log)] for log in logs
        ],
        # VLLM_DSPARK_PP_DRAFT_DIGEST's lines (the TP x PP jobs set it): {rank: {posts: digest}}
        "draft_digests": draft_digest.parse_lines(text),
        # tap partials (protocol/tap_partials.py): the mode line, and per stage the keys (bytes
        # per token row) it sent to the next stage and on the side channel at its first send
        "tap_mode": sorted(set(re.findall(r"DSpark tap partials (on, side channel|on|off)", text))),
        "tap_sent": _tap_rows(text, r"DSpark PP stage (\d+) sends per token row: (.*)"),
        "tap_side": _tap_rows(
            text, r"DSpark PP stage (\d+) sends on the side channel per token row: (.*)"
        ),
        # TapSideChannel.connect: every sender-last link made at start-up, before any step
        "tap_connected": sorted(
            re.findall(r"DSpark tap partials: side channel connected \((.*?)\)", text)
        ),
    }


def _tap_rows(text: str, pattern: str) -> dict[str, dict[str, int]]:
    return {
        stage: {k: int(b) for k, b in re.findall(r"(\w+) (\d+) B\b", rows.split(" (to ")[0])}
        for stage, rows in re.findall(pattern, text)
    }


def _served(name, pp, async_scheduling, extra_spec, waves, guard, *, abort=False, **kw):
    """One launcher deployment serving the waves; ``kw``: ``tp``, ``eager``, ``dtype``."""
    spec = {**tiny_pair.spec_config(), **extra_spec}
    tp = kw.get("tp", 1)
    dep = _deployment(name, pp, spec, async_scheduling, guard, **kw)
    out: dict = {"name": name, "pp": pp, "tp": tp}
    try:
        dep.start()
        out["ready_s"] = round(dep.wait_ready(READY_S), 1)
        out["tokens"], out["per_wave"] = _serve_waves(dep.url, waves)
        if abort:
            out["abort"] = _abort_mid_stream(dep.url, waves[-1][0])
            out["after_abort_tokens"], _ = _serve_waves(dep.url, waves[:1])
        out["alive_after"] = not dep.dead_nodes()
    finally:
        out["leftover_pids"] = dep.stop()
        out["evidence"] = _evidence(dep, pp, tp)
        out["log_dir"] = str(LOG_DIR)
    return out


def _signal_members(dep, sig) -> None:
    for node in dep.nodes:
        if node.proc is None:
            continue
        for pid in live_group_members(node.proc.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _stock(name, async_scheduling, waves, guard, *, pp: int = 2, **kw) -> dict:
    """PP=2 DSpark under the same launchers with the plugin left out: record what happens.
    Stock processes have no SIGUSR1 handler (the plugin installs it), so a hang is diagnosed
    with Python's faulthandler on SIGABRT (PYTHONFAULTHANDLER=1): every thread's stack, then
    the process ends. ``pp`` and ``kw`` (``tp``, ``eager``, ``dtype``): another shape."""
    env = {"VLLM_PLUGINS": "no-such-plugin", "PYTHONFAULTHANDLER": "1"}
    dep = _deployment(name, pp, tiny_pair.spec_config(), async_scheduling, guard, env=env, **kw)
    rec: dict = {"name": name, "scheduling": "async" if async_scheduling else "sync"}
    phase = "start-up"
    try:
        dep.start()
        deadline = time.monotonic() + STOCK_READY_S
        import urllib.request

        while True:
            if dep.dead_nodes():
                rec["outcome"] = f"CRASH during {phase}: {', '.join(dep.dead_nodes())}"
                return rec
            try:
                with urllib.request.urlopen(dep.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                # not a verdict: on 2026-12-03 the stacks showed stock still compiling kernels at
                # 270 s while the plugin's deployments of the same run needed 291-303 s
                rec["outcome"] = (
                    f"UNDETERMINED: not ready after {STOCK_READY_S:.0f} s (a hang or a slow start:"
                    " read the faulthandler stacks in its logs)"
                )
                _signal_members(dep, signal.SIGABRT)
                time.sleep(3)
                return rec
            time.sleep(1)
        phase = "generation"
        rec["ready_s"] = round(time.monotonic() - dep.started_at, 1)
        try:
            tokens = []
            for wave in waves:
                out = serve_demo.complete(
                    dep.url, tiny_pair.TARGET, wave, MAX_TOKENS, timeout_s=STOCK_REQUEST_S
                )
                tokens += [c["token_ids"] for c in out]
        except TimeoutError:
            rec["outcome"] = f"HANG during {phase} (no answer in {STOCK_REQUEST_S:.0f} s)"
            _signal_members(dep, signal.SIGABRT)
            time.sleep(3)
            return rec
        except Exception as exc:  # noqa: BLE001 - recorded
            dead = dep.dead_nodes()
            rec["outcome"] = f"CRASH during {phase}: {type(exc).__name__}: {str(exc)[:200]}" + (
                f"; {', '.join(dead)}" if dead else ""
            )
            return rec
        rec["tokens"] = tokens
        rec["metrics"] = _metrics(dep.url)
        rec["outcome"] = "ANSWERED"
        return rec
    finally:
        dep.stop(grace_s=5)
        text = dep.logs()
        errors = [
            line.strip()[:240]
            for line in text.splitlines()
            if re.search(r"Error|error:|Traceback|Fatal Python error|File \"", line)
            and "WARNING" not in line
        ]
        rec["log_excerpt"] = errors[:60]
        rec["log_dir"] = str(LOG_DIR)


def _fault(guard) -> dict:
    env = {handshake.TIMEOUT_ENV: str(FAULT_HANDSHAKE_S)}
    dep = _deployment(
        "fault",
        2,
        tiny_pair.spec_config(),
        True,
        guard,
        env=env,
        env_per_rank={1: {"VLLM_PLUGINS": "no-such-plugin"}},
    )
    limit = FAULT_HANDSHAKE_S + handshake.verdict_grace_s(FAULT_HANDSHAKE_S) + READY_S
    t0 = time.monotonic()
    try:
        dep.start()
        rc = dep.head.wait_exit(limit)
    finally:
        took = time.monotonic() - t0
        dep.stop(grace_s=5)
    log0 = dep.head.log_tail(10**8)
    return {
        "rc": rc,
        "took_s": round(took, 1),
        "limit_s": round(limit, 1),
        "names_rank": "PP rank 1 (last) sent no verdict" in log0,
        "names_fix": "install the same vllm-dspark-pp on every node" in log0,
        "node1_had_no_plugin": "PP handshake" not in dep.nodes[1].log_tail(10**8),
        "tail": log0[-2500:],
    }


def _llm(name: str, cfg: dict, waves, *, logprobs: int | None = None, dtype: str = PAIR_DTYPE):
    """One PP=1 engine (``LLM``, the references) over the waves."""
    from support.gpu import run_llm

    llm_cfg = {"model": tiny_pair.TARGET, "dtype": dtype, "gpu_memory_utilization": 0.05, **cfg}
    kw = {"env": dict(CPU_DRYRUN_ENV)} if DRYRUN_CPU else {}
    if DRYRUN_CPU:
        llm_cfg.update(CPU_DRYRUN_LLM)
    return run_llm(
        name, llm_cfg, waves, timeout_s=READY_S + 120, sampling=PAIR_SAMPLING, logprobs=logprobs,
        **kw,
    )  # fmt: skip


def _guard_and_waves(guard_dir: str):
    """What a PP module's jobs start from (skipped without a GPU or the trained pair): the NCCL
    stub guard (built, but on the CPU dry run) in ``LOG_DIR / guard_dir``, and the waves."""
    require_cuda()
    ok, why = tiny_pair.available()
    if not ok:
        pytest.skip(why)
    from dspark_dev.multi_gpu import NcclStubGuard

    guard = NcclStubGuard(LOG_DIR / guard_dir)
    if not DRYRUN_CPU:
        guard.build()
    return guard, _waves()


def _shape(name: str) -> dict:
    """A job's deployment for the record: PP size, scheduling, graphs or eager, plugin or stock."""
    if name.startswith("stock_"):
        return {**_shape(f"pp2_{name.removeprefix('stock_')}"), "plugin": False}
    if name == "fault":
        return {**_shape("pp2_async"), "plugin": "node 0 only"}
    if name == TAP_CONTROL:
        return {**_shape("pp3_taps_dict"), "probe": "DSPARK_TEST_TAP_WRONG_BLOCK=1"}
    if name in SERVED:
        pp, flag, extra = SERVED[name]
    else:
        pp, flag, extra = 1, name != "pp1_sync", {}
    return {
        "pp": pp, "scheduling": "vLLM's default" if name == "ref" else "async" if flag else "sync",
        "cuda_graphs": not (name == "ref" or DRYRUN_CPU), "dtype": PAIR_DTYPE,
        "speculation": name != "ref", "plugin": True, **extra,
        **({"tap_partials": TAP_JOBS[name]} if name in TAP_JOBS else {}),
    }  # fmt: skip


def _result_summary(res, *, counters: bool = True) -> dict:
    """What a PP record keeps of a job's result: a launcher job's dict without its tokens (their
    count instead) and with its waves' counters summed; a PP=1 engine's times, token count and
    (``counters``: it speculated) counters. Shared with test_tp_pp_one_gpu.py."""
    if isinstance(res, dict):
        out = {k: v for k, v in res.items() if k not in ("tokens", "after_abort_tokens")}
        if "per_wave" in res:
            out["counters"] = _sum(res["per_wave"])
        if "tokens" in res:
            out["num_tokens"] = sum(len(t) for t in res["tokens"])
        return out
    return {
        "startup_s": res.startup_s, "wall_s": res.wall_s,
        "num_tokens": sum(len(t) for t in res.tokens),
        "counters": res.metrics() if counters else None,
    }  # fmt: skip


def _write_record(jobs: Jobs) -> Path:
    jobs_out = {
        name: job_summary(
            jobs,
            name,
            selected=name in ONLY,
            shape=_shape(name),
            summarize=lambda res, name=name: _result_summary(res, counters=name != "ref"),
        )  # fmt: skip
        for name in ALL_JOBS
    }
    fields = {
        "issue": 25,
        "layout": pp_launch.layout(),
        "selected_jobs": sorted(ONLY),
        "waves": list(WAVE_SIZES),
        "max_tokens": MAX_TOKENS,
        "spec": tiny_pair.spec_config(),
        "graph_config": GRAPH_COMPILATION_CONFIG,
        "jobs": jobs_out,
        "log_dir": str(LOG_DIR),
    }
    path = RECORD.write(
        REPO, "tests/gpu/test_pp_one_gpu.py", fields, out=os.environ.get("DSPARK_GPU_PP_OUT"),
        fallback=LOG_DIR, sources=("dspark_dev/pp_launch.py",),
    )  # fmt: skip
    print(f"PP record: {path}")
    return path


def _tap_control_env() -> dict:
    """``pp3_taps_dict``'s knob, and the probe that zeroes the early stages' column blocks."""
    path = os.pathsep.join(p for p in (str(TAP_PROBE_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"VLLM_DSPARK_PP_TAP_PARTIALS": "1", "DSPARK_TEST_TAP_WRONG_BLOCK": "1",
            "PYTHONPATH": path}  # fmt: skip


@pytest.fixture(scope="module")
def pp_jobs():
    guard, waves = _guard_and_waves("nccl-guard")
    # every job at once: they wait on engines, not on Python
    jobs = Jobs(only=ONLY, max_workers=16, knob=JOBS_ENV)

    def llm(name, cfg):
        return _llm(name, cfg, waves, logprobs=2 if name == "pp_ref" else None)

    graphs = {"compilation_config": GRAPH_COMPILATION_CONFIG}
    jobs.submit("ref", llm, "pp_ref", {"enforce_eager": True})
    for mode, flag in (("async", True), ("sync", False)):
        jobs.submit(
            f"pp1_{mode}",
            llm,
            f"pp1_{mode}",
            {**graphs, "speculative_config": tiny_pair.spec_config(), "async_scheduling": flag},
        )
    for name, (pp, flag, extra) in SERVED.items():
        env = {"VLLM_DSPARK_PP_TAP_PARTIALS": TAP_JOBS[name]} if name in TAP_JOBS else {}
        jobs.submit(
            name, _served, name, pp, flag, extra, waves, guard, abort=name == "pp2_async", env=env
        )
    jobs.submit(
        TAP_CONTROL, _served, TAP_CONTROL, 3, True, {}, waves, guard, env=_tap_control_env()
    )
    for mode, flag in (("async", True), ("sync", False)):
        jobs.submit(f"stock_{mode}", _stock, f"stock_{mode}", flag, waves, guard)
    jobs.submit("fault", _fault, guard)
    yield jobs, waves, guard
    try:
        _write_record(jobs)
    finally:
        jobs.shutdown()


def _ref(pp_jobs):
    jobs, _, _ = pp_jobs
    return jobs.result("ref", timeout=1200)


def _pp1(pp_jobs, async_scheduling: bool):
    jobs, _, _ = pp_jobs
    return jobs.result("pp1_async" if async_scheduling else "pp1_sync", timeout=1200)


def _sum(per_wave: list[dict]) -> dict:
    out = dict(EMPTY, accepted_per_pos=[])
    for m in per_wave:
        out = counter_sum(out, m)
    return out


@pytest.mark.parametrize("name", list(SERVED))
def test_pp_dspark_greedy_equals_pp1_without_speculation(pp_jobs, name):
    jobs, waves, _ = pp_jobs
    got = jobs.result(name, timeout=1200)
    ref = _ref(pp_jobs)
    rep = compare_tokens(ref.tokens, got["tokens"], ref.logprobs)
    desc = f"{name} (ready in {got['ready_s']} s) vs PP=1 no-spec: {rep.describe()}"
    problems = [] if got["alive_after"] else [f"{name}: a launcher died while serving"]
    if got["leftover_pids"]:
        problems.append(f"{name}: processes left behind {got['leftover_pids']}")
    RECORD.verdict(f"greedy[{name}]", rep.ok and not problems, "; ".join([desc, *problems]))
    print(desc)
    assert rep.ok, rep.describe()
    assert not problems, problems


@pytest.mark.parametrize("name", list(SERVED))
def test_pp_dspark_acceptance_equals_pp1_dspark(pp_jobs, name):
    jobs, _, _ = pp_jobs
    got = jobs.result(name, timeout=1200)
    pp, async_scheduling, _ = SERVED[name]
    ref = _pp1(pp_jobs, async_scheduling)
    mine, theirs = _sum(got["per_wave"]), ref.metrics()
    ok, desc = counters_close(mine, theirs)
    engaged = (
        bool(theirs["num_drafts"]) and 1 + theirs["num_accepted_tokens"] / theirs["num_drafts"] >= 3
    )
    mode = "async" if async_scheduling else "sync"
    line = (
        f"PP acceptance: PP={pp} {name} {mine['num_accepted_tokens']}/"
        f"{mine['num_draft_tokens']} vs PP=1 DSpark ({mode}) "
        f"{theirs['num_accepted_tokens']}/{theirs['num_draft_tokens']}, "
        f"{datetime.date.today().isoformat()}: {desc}"
    )
    RECORD.verdict(f"acceptance[{name}]", ok and engaged, line)
    print(line)
    assert engaged, f"the PP=1 DSpark reference accepted too little to compare with: {theirs}"
    assert ok, desc


def _stage_problems(ev: dict, pp: int) -> list[str]:
    """The handshake, the exchange over NCCL on every stage, NCCL's communicator of ``pp`` ranks
    (on ``pp`` 'nodes' when the stages share the GPU) over sockets."""
    problems = [] if ev["handshake"] else [f"no 'PP handshake: {pp} ranks agree' line"]
    backends = [b[0] if b else None for b in ev["exchange_backends"]]
    want = "gloo" if DRYRUN_CPU else "nccl"
    if backends != [want] * pp:
        problems.append(
            f"the sampled-token/draft broadcasts did not run over {want} on every stage: {backends}"
        )
    if DRYRUN_CPU:
        return problems
    shared = pp_launch.layout() == pp_launch.SHARED
    comm = (str(pp), str(pp) if shared else "1")
    if comm not in ev["nccl_comms"]:
        problems.append(
            f"no NCCL communicator of {pp} ranks on {comm[1]} 'nodes' in the logs: "
            f"{ev['nccl_comms']}"
        )
    if shared and not ev["nccl_socket"]:
        problems.append("NCCL did not report its socket transport (NET/Socket)")
    return problems


@pytest.mark.parametrize("name", list(SERVED))
def test_stages_talk_over_nccl(pp_jobs, name):
    jobs, _, _ = pp_jobs
    got = jobs.result(name, timeout=1200)
    ev, pp = got["evidence"], got["pp"]
    print(f"{name} evidence: {ev}")
    problems = _stage_problems(ev, pp)
    RECORD.verdict(f"nccl[{name}]", not problems, "; ".join(problems) or json.dumps(ev))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", list(TAP_JOBS))
def test_tap_partials_cross_the_stages_as_configured(pp_jobs, name):
    """``pp3_taps_dict``: stages 0 and 1 each send ``hidden_states``, ``residual`` and one
    ``dspark_tap_partial`` row (raw taps would be one and two tap rows); ``pp3_taps_side``: they
    send ``hidden_states`` and ``residual`` only, and each its own partial row on the side
    channel to the last stage."""
    jobs, _, _ = pp_jobs
    got = jobs.result(name, timeout=1200)
    ev = got["evidence"]
    side = TAP_JOBS[name] == "side"
    problems = []
    if ev["tap_mode"] != (["on, side channel"] if side else ["on"]):
        problems.append(f"mode lines {ev['tap_mode']}")
    for stage in ("0", "1"):
        keys = set(ev["tap_sent"].get(stage, {}))
        want = {"hidden_states", "residual"} | (set() if side else {"dspark_tap_partial"})
        if keys != want:
            problems.append(
                f"stage {stage} sent {sorted(keys)} to the next stage, not {sorted(want)}"
            )
        if side and set(ev["tap_side"].get(stage, {})) != {"dspark_tap_partial"}:
            problems.append(f"stage {stage} logged no side-channel partial: {ev['tap_side']}")
    # the links were made at start-up (a first contact inside a step waited on itself on an
    # H200, 2026-12-06: pp3_taps_side never became ready); TP = 1: global rank = PP stage
    connected = ev.get("tap_connected", [])
    want_links = ["from PP ranks 0, 1", "to PP rank 2", "to PP rank 2"] if side else []
    if connected != want_links:
        problems.append(f"side channel connect lines {connected}, not {want_links}")
    line = f"{name}: sent {ev['tap_sent']}, side channel {ev['tap_side']}, connected {connected}"
    RECORD.verdict(f"tap_partials[{name}]", not problems, "; ".join([line, *problems]))
    print(line)
    assert not problems, problems


def test_control_a_wrong_tap_partial_fails_the_acceptance_check(pp_jobs):
    """``pp3_taps_wrong``: the partials relayed from zero column blocks. The target's output
    must not change (its tensors are untouched), and the acceptance check the tap jobs pass must
    fail here: counters not close to PP=1 DSpark's. Run it beside ``pp3_taps_dict`` (the same
    deployment without the probe), whose own acceptance check must pass for this to mean
    anything."""
    jobs, _, _ = pp_jobs
    got = jobs.result(TAP_CONTROL, timeout=1200)
    ref = _ref(pp_jobs)
    rep = compare_tokens(ref.tokens, got["tokens"], ref.logprobs)
    mine, theirs = _sum(got["per_wave"]), _pp1(pp_jobs, True).metrics()
    close, desc = counters_close(mine, theirs)
    mode = got["evidence"]["tap_mode"]
    line = (
        f"{TAP_CONTROL}: mode {mode}; greedy vs PP=1 no-spec: {rep.describe()}; acceptance "
        f"{mine['num_accepted_tokens']}/{mine['num_draft_tokens']} vs PP=1 DSpark "
        f"{theirs['num_accepted_tokens']}/{theirs['num_draft_tokens']}: {desc} (must differ)"
    )
    ok = mode == ["on"] and rep.ok and not close
    RECORD.verdict(f"tap_control[{TAP_CONTROL}]", ok, line)
    print(line)
    assert mode == ["on"], f"the control did not relay partial sums: mode lines {mode}"
    assert rep.ok, f"a wrong draft input changed the target's output: {rep.describe()}"
    assert not close, (
        "the acceptance check passed a run whose early stages relayed zero partials: it cannot "
        f"see a wrong partial ({desc})"
    )


def test_fixed_graph_batch_dispatch_fired_inside_the_engine(pp_jobs):
    jobs, _, _ = pp_jobs
    got = jobs.result("pp2_fixed8", timeout=1200)
    pinned = got["evidence"]["pinned"]
    ok = bool(pinned) and max(pinned) >= 10
    RECORD.verdict("pinned", ok, f"pinned dispatch counts logged by the last stage: {pinned}")
    print(f"pinned dispatch counts logged by the last stage: {pinned}")
    assert ok, (
        "the DSpark drafter's dispatch was not pinned to the fixed graph batch (fewer than 10 "
        f"pinned dispatches logged): {pinned}"
    )


def test_abort_mid_stream_frees_the_request_and_serving_continues(pp_jobs):
    jobs, waves, _ = pp_jobs
    got = jobs.result("pp2_async", timeout=1200)
    ab = got["abort"]
    ref = _ref(pp_jobs)
    n = len(waves[0])
    rep = compare_tokens(ref.tokens[:n], got["after_abort_tokens"], ref.logprobs[:n])
    ok = ab["chunks_read"] >= 1 and ab["running"] == 0 and rep.ok
    RECORD.verdict("abort", ok, f"{ab}; first wave again: {rep.describe()}")
    print(f"abort: {ab}")
    print(f"first wave again after the abort: {rep.describe()}")
    assert ab["chunks_read"] >= 1, "the stream sent nothing before the client left"
    assert ab["running"] == 0, f"the aborted request still runs {ab['running_after_s']} s later"
    assert rep.ok, rep.describe()


def test_node_without_plugin_fails_at_start_naming_rank_1(pp_jobs):
    jobs, _, _ = pp_jobs
    r = jobs.result("fault", timeout=1200)
    short = {k: v for k, v in r.items() if k != "tail"}
    print(f"fault: {short}")
    ok = r["rc"] not in (None, 0) and r["names_rank"] and r["names_fix"]
    RECORD.verdict("fault", ok and r["node1_had_no_plugin"], json.dumps(short))
    assert r["rc"] is not None, f"node 0 still ran after {r['limit_s']} s: a HANG\n{r['tail']}"
    assert r["rc"] != 0 and r["names_rank"] and r["names_fix"], r["tail"]
    assert r["node1_had_no_plugin"]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_stock_vllm_under_the_same_launchers_is_recorded(pp_jobs, mode):
    """The control: stock vLLM 0.34.0 (plugin left out), same deployment. Its outcome is a record
    for docs/results/gpu.md, not a verdict on stock; the test fails only when the outcome could
    not be determined."""
    jobs, _, _ = pp_jobs
    rec = jobs.result(f"stock_{mode}", timeout=1200)
    verdict = rec.get("outcome", "")
    if verdict == "ANSWERED":
        ref = _ref(pp_jobs)
        rep = compare_tokens(ref.tokens, rec["tokens"], ref.logprobs)
        verdict = f"ANSWERED: {rep.describe().splitlines()[0]}; counters {rec['metrics']}"
    line = f"STOCK vLLM 0.34.0, PP=2 DSpark, two launchers on one GPU, {mode} scheduling: {verdict}"
    RECORD.verdict(f"stock[{mode}]", None, line)
    print(line)
    for log_line in rec.get("log_excerpt", [])[:40]:
        print(f"  stock log: {log_line}")
    assert verdict and not verdict.startswith("UNDETERMINED"), (
        f"the stock control reached no verdict: {verdict}; give it a longer start-up deadline "
        "(DSPARK_GPU_PP_STOCK_READY_S)"
    )


def test_no_run_reaches_the_kit_nccl_stubs(pp_jobs):
    jobs, _, guard = pp_jobs
    for name in [*SERVED, "fault"]:
        try:
            jobs.result(name, timeout=1200)
        except BaseException:  # noqa: BLE001 - their own tests report them
            pass
    if DRYRUN_CPU:
        pytest.skip("CPU dry run: no NCCL")
    if guard.so is None:
        RECORD.verdict(
            "nccl_stubs", False, f"the recording NCCL stub was not built: {guard.problem}"
        )
    assert guard.so is not None, f"the recording NCCL stub was not built: {guard.problem}"
    called = guard.calls()
    line = f"{len(guard.symbols)} stubbed NCCL symbols; called: {called}"
    RECORD.verdict("nccl_stubs", not called, line)
    print(line)
    assert not called, f"stubbed NCCL functions were called: {called}"
