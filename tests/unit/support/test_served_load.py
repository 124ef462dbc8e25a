"""The non-serving parts of the sustained-load runs (tests/support/served_load.py) and of the
PD prefiller kill (tests/support/pd_fault.py): what the GPU groups ``load`` and ``pd_kill``
compose and parse, checked on CPU without starting anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from support import pd_fault, served_load

from dspark_dev.proc import kill_group, start_in_session


def _bench_args(**kw):
    base = dict(base_url="http://127.0.0.1:9", model="/m/target", num_prompts=500,
                concurrency=32, input_len=128, output_len=128, range_ratio=0.5, seed=2,
                result_dir="/tmp/r", max_model_len=512)  # fmt: skip
    return served_load.bench_argv(**{**base, **kw})


def test_bench_argv_is_what_vllm_bench_serve_parses():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    a = parser.parse_args(_bench_args())
    assert (a.num_prompts, a.max_concurrency, a.seed) == (500, 32, 2)
    assert (a.random_input_len, a.random_output_len) == (128, 128)
    assert float(a.random_range_ratio) == 0.5
    assert a.dataset_name == "random" and a.backend == "vllm" and a.ignore_eos
    assert a.save_result and a.save_detailed and a.result_dir == "/tmp/r"
    assert a.ready_check_timeout_sec == 0 and a.temperature == 0.0


def test_bench_lengths_beyond_max_model_len_are_refused_before_anything_starts():
    _bench_args(input_len=170, output_len=170)  # 255 + 255 = 510 fits
    with pytest.raises(ValueError, match="exceed max_model_len 512"):
        _bench_args(input_len=200, output_len=200)  # 300 + 300


def test_bench_outcome_counts_failed_and_lost_requests():
    ok = {"completed": 500, "failed": 0, "errors": [""] * 500, "duration": 12.34,
          "output_throughput": 99.9, "total_output_tokens": 64000}  # fmt: skip
    assert served_load.bench_outcome(ok, 500)["failed"] == 0
    bad = {"completed": 497, "failed": 2, "errors": ["", "boom", "boom"]}
    out = served_load.bench_outcome(bad, 500)
    assert (out["completed"], out["failed"], out["errors"]) == (497, 3, ["boom"])  # 1 lost
    assert served_load.bench_outcome(None, 500)["failed"] == 500


def test_gpu_apps_are_summed_per_pid_and_unreadable_lines_skipped():
    text = "123, 2048\n456, [N/A]\n\n123, 512\nNo running processes found\n789, 100\n"
    assert served_load.parse_gpu_apps(text) == {123: 2560.0, 789: 100.0}


def test_gpu_memory_of_our_processes_is_none_when_nvidia_smi_lists_none_of_them():
    apps = {123: 2560.0, 789: 100.0}
    assert served_load.apps_memory_mib(apps, {123, 5}) == 2560.0
    assert served_load.apps_memory_mib(apps, {5, 6}) is None  # not 0: another PID namespace


def test_group_rss_counts_only_live_members_of_the_groups():
    # the memory is held by a child of each group's leader: members, not just leaders, count
    holder = "import time; x = bytearray(64 << 20); time.sleep(60)"
    leader = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {holder!r}])"
    procs = [start_in_session([sys.executable, "-c", leader]) for _ in range(2)]
    try:
        time.sleep(3.0)
        one = served_load.group_rss_mib([procs[0].pid])
        both = served_load.group_rss_mib([p.pid for p in procs])
        assert one >= 64 and both >= one + 64, (one, both)
    finally:
        for p in procs:
            kill_group(p)
    assert served_load.group_rss_mib([p.pid for p in procs]) == 0.0


def test_error_lines_take_vllm_errors_and_tracebacks_not_warnings():
    log = "\n".join([
        "(APIServer pid=1) INFO 12-04 [api.py:1] Route: /v1/completions",
        "(EngineCore pid=2) ERROR 12-04 [core.py:9] EngineCore failed to start.",
        "(APIServer pid=1) WARNING 12-04 [x.py:3] an ERROR-prone setting",
        "Traceback (most recent call last):",
        "ERROR 12-04 14:00:00 [serve.py:1] bare error line",
        "INFO: 127.0.0.1 - \"POST /v1/completions HTTP/1.1\" 200 OK",
    ])  # fmt: skip
    got = served_load.error_lines(log)
    assert len(got) == 3 and "WARNING" not in "".join(got)


def test_growth_states_the_steps_and_bounds_the_total():
    g = served_load.growth([100.0, 130.0, 145.0], bound=50)
    assert g["steps"] == [30.0, 15.0] and g["total"] == 45.0 and g["within"]
    assert not served_load.growth([100.0, 130.0, 175.0], bound=50)["within"]
    rec = {"rss_mib_ready": 90.0, "gpu_mib_ready": None,
           "runs": [{"rss_mib_after": 100.0, "gpu_mib_after": None},
                    {"rss_mib_after": 120.0, "gpu_mib_after": None},
                    {"run": 2, "skipped": "budget"}]}  # fmt: skip
    lg = served_load.load_growth(rec, 50)
    assert lg["rss"]["first_run_warmup"] == 10.0 and lg["rss"]["total"] == 20.0
    assert lg["gpu"] is None


def test_top_logprobs_are_keyed_by_token_id():
    choice = {"logprobs": {"top_logprobs": [{"token_id:5": -0.1, "token_id:9": -2.5},
                                            {"token_id:7": -0.01}]}}  # fmt: skip
    assert served_load.top_logprobs_by_id(choice) == [{5: -0.1, 9: -2.5}, {7: -0.01}]
    assert served_load.top_logprobs_by_id({"logprobs": None}) is None
    with pytest.raises(ValueError, match="token_id"):
        served_load.top_logprobs_by_id({"logprobs": {"top_logprobs": [{"hello": -0.1}]}})


def test_run_bench_ends_a_client_that_passes_its_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(
        served_load,
        "bench_command",
        lambda argv: [sys.executable, "-c", "import time; time.sleep(30)"],
    )
    t0 = time.monotonic()
    r = served_load.run_bench([], tmp_path / "r.json", tmp_path / "b.log", timeout_s=1.0)
    assert r["rc"] == "timeout" and r["result"] is None and time.monotonic() - t0 < 10
    assert "cut after 1 s" in (tmp_path / "b.log").read_text()


def test_run_bench_reads_the_result_json(tmp_path, monkeypatch):
    res = tmp_path / "r.json"
    code = f"import json; json.dump({{'completed': 3, 'failed': 0}}, open({str(res)!r}, 'w'))"
    monkeypatch.setattr(served_load, "bench_command", lambda argv: [sys.executable, "-c", code])
    r = served_load.run_bench([], res, tmp_path / "b.log", timeout_s=30)
    assert r["rc"] == 0 and r["result"] == {"completed": 3, "failed": 0}


# ------------------------------------------------------------------ the PD prefiller kill
def test_pd_outcomes_name_each_ending():
    ok = {"status": 200, "done": True, "token_ids": list(range(300)), "error": None}
    assert pd_fault.outcome(ok, 300)["kind"] == pd_fault.COMPLETED
    short = {**ok, "token_ids": list(range(12))}
    assert pd_fault.outcome(short, 300)["kind"] == pd_fault.CLOSED
    err = {"status": 200, "done": True, "token_ids": [], "error": {"message": "KV load failed"}}
    o = pd_fault.outcome(err, 300)
    assert o["kind"] == pd_fault.ERROR and "KV load failed" in o["detail"]
    assert pd_fault.outcome({"status": 500, "error": "x"}, 300)["kind"] == pd_fault.ERROR
    silent = {"exception": "TimeoutError: timed out", "seconds": 40.0}
    assert pd_fault.outcome(silent, 300) == {
        "kind": pd_fault.STALLED, "detail": "TimeoutError: timed out", "seconds": 40.0}  # fmt: skip
    reset = {"exception": "ConnectionResetError: [Errno 104] Connection reset by peer"}
    assert pd_fault.outcome(reset, 300)["kind"] == pd_fault.CLOSED
    outs = [pd_fault.outcome(x, 300) for x in (ok, ok, silent, err)]
    assert pd_fault.tally(outs) == {"completed": 2, "stalled": 1, "error": 1}


def test_connector_lines_keep_the_decoders_words_about_the_producer():
    log = "\n".join([
        "(EngineCore pid=3) INFO 12-04 [mooncake_connector.py:1] Mooncake prefill ready",
        "(EngineCore pid=3) WARNING 12-04 [mooncake_connector.py:2760] Mooncake recv failed: "
        "transfer failed: Resource temporarily unavailable",
        "(EngineCore pid=3) ERROR 12-04 [scheduler.py:9] Failing 4 requests whose KV load failed",
        "(APIServer pid=1) ERROR 12-04 [serving.py:1] unrelated error in the tokenizer",
    ])  # fmt: skip
    got = pd_fault.connector_lines(log)
    assert len(got) == 2 and "Mooncake recv failed" in got[0] and "KV load" in got[1]


def test_stream_completion_reports_each_event_to_its_caller():
    """The hook the PD kill test waits on (group A streaming before the kill), against a tiny
    server that streams three events."""
    from support.reliability import stream_completion

    code = (
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_POST(self):\n"
        "        self.rfile.read(int(self.headers['Content-Length']))\n"
        "        self.send_response(200); self.end_headers()\n"
        "        for i in range(3):\n"
        "            self.wfile.write(b'data: ' + (b'{\"choices\": [{\"token_ids\": [%d]}]}' % i)"
        " + b'\\n\\n')\n"
        "        self.wfile.write(b'data: [DONE]\\n\\n')\n"
        "    def log_message(self, *a): pass\n"
        "s = http.server.HTTPServer(('127.0.0.1', 0), H)\n"
        "print(s.server_address[1], flush=True)\n"
        "s.handle_request()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ})  # fmt: skip
    try:
        port = int(proc.stdout.readline())
        seen: list[int] = []
        out = stream_completion(port, {"prompt": [1]}, timeout_s=10, on_event=seen.append)
        assert seen == [1, 2, 3] and out["token_ids"] == [0, 1, 2] and out["done"]
        assert json.dumps(out)  # a plain record
    finally:
        proc.kill()
        proc.wait()


def test_expired_requests_read_the_producers_free_lines():
    log = "\n".join([
        "(EngineCore pid=7) INFO 12-04 16:00:00 [core.py:1] step",
        "(EngineCore pid=7) WARNING 12-04 16:00:45 [mooncake_connector.py:2565] Request "
        "cmpl-b1-0 timed out after 45 seconds without being sent. Freeing its blocks on the "
        "producer side.",
        "(EngineCore pid=7) WARNING 12-04 16:00:46 [mooncake_connector.py:2571] KV lease of "
        "request cmpl-b2-0 expired before the decoder pulled it.",
        "(EngineCore pid=7) WARNING 12-04 16:00:46 [mooncake_connector.py:2565] Request "
        "cmpl-b3-0 timed out after 480 seconds without being sent. Freeing its blocks ...",
    ])  # fmt: skip
    assert pd_fault.expired_requests(log) == [("cmpl-b1-0", 45), ("cmpl-b3-0", 480)]
    assert pd_fault.expired_requests("no such line") == []


def test_first_zero_is_the_free_after_a_hold_not_an_empty_start():
    assert pd_fault.first_zero([(0.0, 0.003), (1.0, None), (2.0, 0.003), (3.1, 0.0)]) == 3.1
    assert pd_fault.first_zero([(0.0, 0.0), (1.0, 0.0)]) is None  # nothing was ever held
    assert pd_fault.first_zero([(0.0, 0.0), (1.0, 0.002), (2.0, 0.002)]) is None  # still held
    assert pd_fault.first_zero([]) is None


def test_the_mooncake_timeouts_the_pd_fault_groups_state_are_vllms(monkeypatch):
    """docs/results/reliability.md (limit 4) and tests/gpu/test_pd_*_kill_gpu.py state vLLM
    0.34.0's Mooncake waits: a producer frees unpulled KV after
    VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (480 s by default), with the line expired_requests
    reads; a decoder waits that + 60 s for a dead producer's answer."""
    import importlib.util
    from pathlib import Path

    import vllm.envs as envs
    from support import pd_pair

    monkeypatch.delenv(pd_pair.ABORT_ENV, raising=False)
    assert getattr(envs, pd_pair.ABORT_ENV) == 480
    monkeypatch.setenv(pd_pair.ABORT_ENV, "30")
    assert getattr(envs, pd_pair.ABORT_ENV) == 30
    spec = importlib.util.find_spec("vllm.distributed.kv_transfer.kv_connector.v1.mooncake")
    src = (Path(spec.submodule_search_locations[0]) / "mooncake_connector.py").read_text()
    assert "(envs.VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60) * 1000" in src  # the pull's RCVTIMEO
    # the producer's warning, its format string split over two literals in the source
    assert '"Request %s timed out after %d seconds without "' in src
    assert '"being sent. Freeing its blocks on the producer side."' in src
    assert '"kv_lease_duration"' in src


def test_the_pd_fault_groups_run_ours_and_stock_at_once_and_save_one_summary(tmp_path, capsys):
    from support import pd_pair

    started: dict[str, float] = {}

    def scenario(name, spec, env, deadline):
        started[name] = time.monotonic()
        time.sleep(1.0)
        tails = {"log_tails": {"x": "long"}} if name == "dspark" else {}
        return {"name": name, "spec": spec, "env": env, "deadline": deadline, **tails}

    t0 = time.monotonic()
    out = tmp_path / "g" / "g.json"
    summary = pd_pair.run_beside_stock(
        scenario, {"k": 7}, 20.0, True, "off", out, "GROUP RESULT", {"bound_s": 5}
    )
    ours, stock = summary["ours"], summary["stock"]
    # Both sides ran, ours with the plugin and the spec, stock without either, at the same time,
    # both ending by the budget less 10 s.
    assert ours["name"] == "dspark" and ours["spec"] == {"k": 7} and ours["env"] == {}
    assert stock["name"] == "stock" and stock["spec"] is None
    assert stock["env"] == {"VLLM_PLUGINS": "no-such-plugin"}
    assert ours["deadline"] == stock["deadline"] and abs(ours["deadline"] - t0 - 10.0) < 0.2
    # at the same time: one after the other would take at least 2 s (two 1 s scenarios)
    assert abs(started["dspark"] - started["stock"]) < 0.8 and time.monotonic() - t0 < 1.8
    assert summary["bound_s"] == 5 and summary["wall_s"] < 1.8
    assert json.loads(out.read_text()) == json.loads(json.dumps(summary))  # the file keeps tails
    printed = capsys.readouterr().out
    assert printed.startswith("GROUP RESULT ") and "log_tails" not in printed
    assert pd_pair.ours_record(summary) is ours
    off = pd_pair.run_beside_stock(scenario, {}, 20.0, False, "stock off by env", out, "T", {})
    assert off["stock"] == {"skipped": "stock off by env"}
    with pytest.raises(AssertionError, match="boom"):
        pd_pair.ours_record({"ours": {"error": "boom"}})
