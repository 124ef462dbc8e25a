"""Sustained served load at the issue's scale (issue 28, case 1; group ``load``).

PP=2 DSpark served by two launchers on GPU 0 (dspark_dev/pp_launch.py: node 0 ``vllm serve
--nnodes 2 --node-rank 0`` with the API server, node 1 ``--headless``, each its own
``NCCL_HOSTID``, NCCL over loopback sockets), the trained tiny pair (models/tiny-pair, k=7), CUDA
graphs (decode graphs up to 32 requests), async scheduling. ``vllm bench serve`` (vLLM's own
client: random dataset, streaming) sends ``DSPARK_GPU_LOAD_PROMPTS`` (500) requests at
``--max-concurrency`` 32, random input and output lengths (128 and 64 tokens, range ratio 0.5:
at most 288 tokens, inside ``max_model_len`` 512; ``DSPARK_GPU_LOAD_INPUT_LEN`` /
``_OUTPUT_LEN``), greedy, ``ignore_eos``, three runs against the same server, each run's
deadline the group's time left divided by the runs left (``DSPARK_GPU_LOAD_BUDGET_S``). During
the second run a greedy client sends a fixed sample (8 held-out questions, where the pair accepts
about 7.5 tokens a step, and 8 random token prompts) into the load.

Checked: every request of every run completed (0 failed); no ERROR or traceback line in either
launcher's log; KV-cache usage and running requests back to 0 after each run (``/metrics``);
the sample's greedy tokens equal PP=1 without speculation (a plain ``vllm serve`` started in the
same group; dspark_dev/parity.py: identical except at a proven near-tie); DSpark drafted
under the load. Recorded (growth stated, bounded only generously by
``DSPARK_GPU_LOAD_GROWTH_MIB``): the RSS of both launchers' process groups and their GPU memory
(nvidia-smi) when ready and after each run. Control: stock vLLM 0.34.0 under the same launchers
(plugin left out through ``VLLM_PLUGINS``, no speculation, async), the same runs at the same
time; recorded, not asserted.

    source /tmp/site/env.sh && DSPARK_GPU_GROUPS_BUDGET_S=330 bash tools/gpu/run_groups.sh \\
        $OUT load

``load.json`` (the summary) and trimmed launcher logs come back in ``$OUT/artifacts.tgz``
(``DSPARK_GPU_LOAD_LOGS`` sets that folder when run by hand); the group log prints the summary
after ``LOAD RESULT``.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gpu_common import DRYRUN_CPU, PAIR_DTYPE, require_cuda
from support import served_load, tiny_pair

from dspark_dev import pp_launch
from dspark_dev.parity import compare_tokens
from dspark_dev.serve import GPU_CHILD_ENV, Server, free_port, http_json
from dspark_dev.serve_demo import serve_argv, spec_metrics

pytestmark = pytest.mark.gpu


def _env_num(name: str, default, kind=int):
    return kind(os.environ.get(name, default))


PROMPTS = _env_num("DSPARK_GPU_LOAD_PROMPTS", 8 if DRYRUN_CPU else 500)
CONCURRENCY = _env_num("DSPARK_GPU_LOAD_CONCURRENCY", 4 if DRYRUN_CPU else 32)
RUNS = _env_num("DSPARK_GPU_LOAD_RUNS", 3)
INPUT_LEN = _env_num("DSPARK_GPU_LOAD_INPUT_LEN", 32 if DRYRUN_CPU else 128)
OUTPUT_LEN = _env_num("DSPARK_GPU_LOAD_OUTPUT_LEN", 8 if DRYRUN_CPU else 64)
RANGE_RATIO = 0.5
BUDGET_S = _env_num("DSPARK_GPU_LOAD_BUDGET_S", 1800 if DRYRUN_CPU else 320, float)
READY_S = _env_num("DSPARK_GPU_PP_READY_S", 900 if DRYRUN_CPU else 200, float)
GROWTH_BOUND_MIB = _env_num("DSPARK_GPU_LOAD_GROWTH_MIB", 2048, float)
STOCK = os.environ.get("DSPARK_GPU_LOAD_STOCK", "1") == "1"
SAMPLE_TOKENS = 8 if DRYRUN_CPU else 64
MAX_MODEL_LEN = 512
KV_BYTES = 1 << 30
LOG_DIR = Path(
    os.environ.get("DSPARK_GPU_LOAD_LOGS") or tempfile.mkdtemp(prefix="dspark-load-gpu-")
)
COMPILATION = {
    "decode_cudagraph_capture_request_sizes": [1, 2, 4, 8, 16, 32],
    "prefill_cudagraph_capture_token_sizes": [8, 16, 32, 64, 128, 256, 512],
}


def _base_args(*, eager: bool = False) -> list[str]:
    if DRYRUN_CPU:
        return ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
                "--max-num-seqs", str(CONCURRENCY), "--seed", "0"]  # fmt: skip
    args = [
        "--dtype", PAIR_DTYPE, "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(max(CONCURRENCY, 16)), "--seed", "0",
        "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(KV_BYTES),
        "--async-scheduling",
    ]  # fmt: skip
    graphs = ["--compilation-config", json.dumps(COMPILATION)]
    return args + (["--enforce-eager"] if eager else graphs)


def sample_prompts() -> list[list[int]]:
    """The fixed greedy sample: 8 held-out questions and 8 seeded random token prompts of 64-192
    tokens (ids 4..447: no special ids, inside the pair's 448-token vocabulary)."""
    rng = random.Random(2828)
    randoms = [[rng.randrange(4, 448) for _ in range(rng.randrange(64, 193))] for _ in range(8)]
    if DRYRUN_CPU:
        randoms = [p[:24] for p in randoms[:2]]
    return tiny_pair.heldout_prompts(2 if DRYRUN_CPU else 8) + randoms


def _greedy(url: str, prompts: list[list[int]], *, logprobs: int | None) -> dict:
    """Every prompt as its own greedy request, all at once; token ids (and top logprobs by id)."""

    def one(p):
        body = {"model": tiny_pair.TARGET, "prompt": p, "max_tokens": SAMPLE_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        if logprobs:
            body.update(logprobs=logprobs, return_tokens_as_token_ids=True)
        return http_json(url + "/v1/completions", body, timeout=180)["choices"][0]

    with ThreadPoolExecutor(max_workers=len(prompts)) as ex:
        choices = list(ex.map(one, prompts))
    return {
        "tokens": [list(c["token_ids"]) for c in choices],
        "logprobs": [served_load.top_logprobs_by_id(c) for c in choices] if logprobs else None,
    }


def _pgids(nodes) -> list[int]:
    return [n.proc.pid for n in nodes if n.proc is not None]


def _trim_logs(nodes, keep_lines: int = 400) -> None:
    """Keep each launcher log's head, its error lines and its tail (the artifacts are small)."""
    for n in nodes:
        text = n.log_path.read_text(errors="replace") if n.log_path.exists() else ""
        lines = text.splitlines()
        if len(lines) <= 3 * keep_lines:
            continue
        errs = served_load.error_lines(text)[:200]
        cut = [*lines[:keep_lines], "... [trimmed: error lines follow] ...", *errs,
               "... [trimmed: last lines follow] ...", *lines[-keep_lines:]]  # fmt: skip
        n.log_path.write_text("\n".join(cut) + "\n")


def _side(box: dict, fn, i: int) -> None:
    box.update(fn(i))


def _load_runs(name: str, nodes, port: int, url: str, deadline: float, during=None) -> dict:
    """RUNS ``vllm bench serve`` runs against one server; after each: the outcome, KV usage and
    running requests once idle, RSS and GPU memory of the launchers' groups. ``during(i)`` runs
    beside run ``i`` (the greedy sample) and its result is kept."""
    pg = _pgids(nodes)
    rec: dict = {"rss_mib_ready": served_load.group_rss_mib(pg),
                 "gpu_mib_ready": served_load.gpu_memory_mib(pg),
                 "gpu_device_mib_ready": served_load.gpu_device_used_mib(), "runs": []}  # fmt: skip
    for i in range(RUNS):
        left = deadline - time.monotonic()
        if left < 20:
            rec["runs"].append({"run": i, "skipped": f"group budget spent ({left:.0f} s left)"})
            continue
        res_dir = Path(tempfile.mkdtemp(prefix=f"dspark-load-{name}-{i}-"))
        argv = served_load.bench_argv(
            base_url=url, model=tiny_pair.TARGET, num_prompts=PROMPTS, concurrency=CONCURRENCY,
            input_len=INPUT_LEN, output_len=OUTPUT_LEN, range_ratio=RANGE_RATIO, seed=i,
            result_dir=res_dir, max_model_len=MAX_MODEL_LEN,
        )  # fmt: skip
        side: dict = {}
        th = None
        if during is not None:
            th = threading.Thread(target=_side, args=(side, during, i), daemon=True)
            th.start()
        per_run_s = left / (RUNS - i) - 5
        b = served_load.run_bench(argv, res_dir / "bench.json", LOG_DIR / f"{name}_bench{i}.log",
                                  per_run_s)  # fmt: skip
        if th is not None:
            th.join(timeout=max(5.0, deadline - time.monotonic()))
        usage, running = served_load.wait_idle(port, timeout_s=30)
        row = {"run": i, "rc": b["rc"], "seconds": b["seconds"], "timeout_s": round(per_run_s),
               **served_load.bench_outcome(b["result"], PROMPTS),
               "kv_usage_after": usage, "running_after": running,
               "rss_mib_after": served_load.group_rss_mib(pg),
               "gpu_mib_after": served_load.gpu_memory_mib(pg),
               "gpu_device_mib_after": served_load.gpu_device_used_mib()}  # fmt: skip
        if side:
            row["side"] = side
        rec["runs"].append(row)
        print(f"{name} run {i}: {json.dumps({k: v for k, v in row.items() if k != 'side'})}")
    return rec


def _deployment(name: str, spec, env: dict) -> pp_launch.Deployment:
    return pp_launch.deployment(
        name, tiny_pair.TARGET, pp=2, spec=spec, log_dir=LOG_DIR,
        device="cpu" if DRYRUN_CPU else "gpu", base_args=_base_args(), env=env,
    )  # fmt: skip


def _serve_deployment(name: str, dep, deadline: float, during=None) -> dict:
    rec: dict = {"name": name}
    try:
        dep.start()
        rec["ready_s"] = round(dep.wait_ready(READY_S), 1)
        rec.update(_load_runs(name, dep.nodes, dep.head.port, dep.url, deadline, during))
        rec["spec"] = spec_metrics(dep.url, settle_s=3.0)
        rec["nodes_alive"] = not dep.dead_nodes()
    except Exception as e:  # noqa: BLE001 - recorded; the tests read it
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["log_tail"] = dep.logs(3000)
    finally:
        # errors while serving: the logs before the stop (a stop by SIGTERM makes vLLM's API
        # server log EngineDeadError as its engine goes away: recorded apart)
        served = [n.log_tail(10**8) for n in dep.nodes]
        rec["error_lines"] = [served_load.error_lines(t)[:20] for t in served]
        rec["left_running"] = dep.stop(grace_s=10.0)
        rec["stop_error_lines"] = [
            len(served_load.error_lines(n.log_tail(10**8))) - len(served_load.error_lines(t))
            for n, t in zip(dep.nodes, served, strict=True)
        ]
        _trim_logs(dep.nodes)
    return rec


@pytest.fixture(scope="module")
def load():
    require_cuda()
    ok, why = tiny_pair.available()
    if not ok:
        pytest.skip(why)
    try:
        import vllm.benchmarks.serve  # noqa: F401
    except ImportError as e:  # a missing client package fails at once, before any engine starts
        pytest.fail(f"vllm bench serve cannot be imported on this machine: {e}")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = t0 + BUDGET_S - 15
    cpu = "cpu" if DRYRUN_CPU else "gpu"
    env = dict(GPU_CHILD_ENV)
    ours = _deployment("load", tiny_pair.spec_config(), env)
    stock = _deployment("stock", None, {**env, "VLLM_PLUGINS": "no-such-plugin"}) if STOCK else None
    ref_port = free_port()
    ref = Server(
        serve_argv(tiny_pair.TARGET, pp=1, port=ref_port, base=_base_args(eager=True)),
        LOG_DIR / "ref_pp1.log", env=env, port=ref_port, name="PP=1 no-spec", cpu=cpu == "cpu",
    )  # fmt: skip
    prompts = sample_prompts()
    sample: dict = {}

    def reference() -> dict:
        try:
            ref.start()
            ref.wait_ready(READY_S)
            return _greedy(ref.url, prompts, logprobs=2)
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}", "log_tail": ref.log_tail(3000)}
        finally:
            ref.stop(grace_s=5.0)

    def during(i: int) -> dict:
        if i != min(1, RUNS - 1):
            return {}
        time.sleep(2.0)  # the bench's requests are in
        try:
            sample.update(_greedy(ours.url, prompts, logprobs=None))
            return {"sample_sent_during_run": i}
        except Exception as e:  # noqa: BLE001
            sample["error"] = f"{type(e).__name__}: {e}"
            return {"sample_error": sample["error"]}

    with ThreadPoolExecutor(max_workers=3) as ex:
        f_ref = ex.submit(reference)
        f_stock = ex.submit(_serve_deployment, "stock", stock, deadline) if stock else None
        rec = _serve_deployment("load", ours, deadline, during)
        ref_out = f_ref.result()
        stock_rec = f_stock.result() if f_stock else {"skipped": "DSPARK_GPU_LOAD_STOCK=0"}
    parity = None
    if "tokens" in sample and "tokens" in ref_out:
        rep = compare_tokens(ref_out["tokens"], sample["tokens"], ref_out["logprobs"])
        parity = {"ok": rep.ok, "identical": rep.identical, "describe": rep.describe()}
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wall_s": round(time.monotonic() - t0, 1),
        "device": cpu,
        "settings": {
            "prompts": PROMPTS,
            "concurrency": CONCURRENCY,
            "runs": RUNS,
            "input_len": INPUT_LEN,
            "output_len": OUTPUT_LEN,
            "range_ratio": RANGE_RATIO,
            "dtype": "float32" if DRYRUN_CPU else PAIR_DTYPE,
            "sample": len(prompts),
            "sample_tokens": SAMPLE_TOKENS,
        },  # fmt: skip
        "ours": rec,
        "stock": stock_rec,
        "reference": {k: v for k, v in ref_out.items() if k not in ("tokens", "logprobs")},
        "parity": parity,
        "sample_error": sample.get("error"),
    }
    summary["growth"] = served_load.load_growth(rec, GROWTH_BOUND_MIB)
    (LOG_DIR / "load.json").write_text(json.dumps(summary, indent=1, default=str))
    printable = {**summary, "ours": {k: v for k, v in rec.items() if k != "log_tail"}}
    print("LOAD RESULT " + json.dumps(printable, indent=1, default=str))
    return summary


def _ours(load) -> dict:
    rec = load["ours"]
    assert "error" not in rec, f"PP=2 DSpark failed: {rec['error']}\n{rec.get('log_tail')}"
    return rec


def test_every_request_of_every_run_completes(load):
    rows = _ours(load)["runs"]
    assert len(rows) == RUNS and all("skipped" not in r for r in rows), rows
    bad = [r for r in rows if r["rc"] != 0 or r["completed"] != PROMPTS or r["failed"] != 0]
    assert not bad, f"runs with failed or missing requests: {bad}"


def test_no_error_line_in_either_launcher_log(load):
    rec = _ours(load)
    assert not any(rec["error_lines"]), rec["error_lines"]
    assert not rec["left_running"], f"processes left after the stop: {rec['left_running']}"


def test_kv_cache_and_running_requests_return_to_zero_after_each_run(load):
    rows = _ours(load)["runs"]
    bad = [r for r in rows if (r.get("kv_usage_after"), r.get("running_after")) != (0.0, 0.0)]
    assert not bad, f"runs after which the server was not idle: {bad}"


def test_memory_growth_run_over_run_is_recorded_and_bounded(load):
    g = load["growth"]
    print(f"memory growth (MiB): {json.dumps(g)}")
    assert g["rss"]["values"] and g["rss"]["within"], g
    if g["gpu"] is not None:
        assert g["gpu"]["within"], g


def test_greedy_sample_under_load_equals_pp1_without_speculation(load):
    assert load["sample_error"] is None, load["sample_error"]
    assert load["parity"] is not None, f"no reference: {load['reference']}"
    print(f"sample under load vs PP=1 no-spec: {load['parity']['describe']}")
    assert load["parity"]["ok"], load["parity"]["describe"]


def test_dspark_drafted_and_accepted_under_load(load):
    m = _ours(load)["spec"]
    print(f"spec-decode counters of the whole load: {m}")
    assert m["num_drafts"] > 0 and m["num_accepted_tokens"] > 0, m


def test_stock_vllm_control_is_recorded(load):
    st = load["stock"]
    shown = {k: v for k, v in st.items() if k != "log_tail"}
    print(f"STOCK vLLM 0.34.0 PP=2 no-spec under the same load: {json.dumps(shown, default=str)}")
    assert st, "no stock record"
