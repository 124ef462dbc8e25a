"""CPU tests of the served PP benchmark (issue 29): benchmarks/serve_pp_one_gpu.py's argument
handling, launcher commands and environments (--dry-run), budget trimming, per-point JSON;
benchmarks/shape_tokenizer.py; benchmarks/plot_pp_one_gpu.py's tables, ratios, goal (b) and PNG
from small recorded samples. Nothing is timed and no server starts."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
from support.perf_records import dry_run_launchers as _launchers
from support.perf_records import serve_point, serve_run

from benchmarks import plot_pp_one_gpu as plot
from benchmarks import pp_projection, shape_tokenizer
from benchmarks import serve_pp_one_gpu as serve


# --------------------------------------------------------------------------- arguments
def test_groups_expand_in_order_without_repeats():
    names = [c.name for c in serve.select_configs("pp1,pp2_nospec,pp2")]
    assert names == ["pp1_nospec", "pp1_dspark", "pp2_nospec", "pp2_dspark"]
    stock = serve.select_configs("stock")
    assert [(c.name, c.pp, c.plugin) for c in stock] == [
        ("pp2_nospec_stock", 2, False),
        ("pp2_nospec", 2, True),
    ]


def test_an_unknown_configuration_is_refused_naming_the_choices():
    with pytest.raises(SystemExit, match="unknown name 'pp3'.*pp1_nospec"):
        serve.select_configs("pp1,pp3")
    with pytest.raises(SystemExit, match="--concurrency"):
        serve.parse_args(["--concurrency", "0,4"])
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        serve.parse_args(["--env", "NOEQUALS"])


def test_no_two_points_repeats_or_probes_share_a_seed():
    """Every (AL index, C, repeat) and every point's probe gets prompts of its own (C = 128 at
    AL 0 and C = 28 at AL 1 shared theirs before 2026-12-07)."""
    cs = [*range(1, 130), 256, 512, 1024]
    seeds = [serve.point_seed(i, c, r) for i in range(12) for c in cs for r in range(6)]
    probes = [serve.point_seed(i, c) + serve.PROBE_SEED_OFFSET for i in range(12) for c in cs]
    assert len(set(seeds + probes)) == len(seeds) + len(probes)
    with pytest.raises(ValueError, match="no distinct seed"):
        serve.point_seed(0, 10_000)


def test_seeds_match_across_configurations_and_differ_within_a_server():
    a = serve.parse_args(["--configs", "pp1"])
    seeds = {}
    for cfg, ali, _al in serve.plan_sweeps(a):
        for c in a.cs:
            seeds.setdefault(cfg.name, []).append((ali or 0, c, serve.point_seed(ali or 0, c)))
    dspark = seeds["pp1_dspark"]
    assert len({s for *_, s in dspark}) == len(dspark)  # no prompt set twice on one server
    nospec = {(i, c): s for i, c, s in seeds["pp1_nospec"]}
    assert all(nospec[(0, c)] == s for i, c, s in dspark if i == 0)  # same prompts at AL 0


# --------------------------------------------------------------------------- dry run
def _dry(capsys, *args) -> str:
    assert serve.main(["--dry-run", "--out", "/nonexistent-not-written", *args]) == 0
    return capsys.readouterr().out


def test_dry_run_composes_two_launchers_on_gpu0_with_distinct_nccl_hosts(capsys):
    out = _dry(capsys, "--configs", "pp2")
    nodes = _launchers(out)
    assert set(nodes) == {
        "pp2_nospec node 0",
        "pp2_nospec node 1 (headless)",
        "pp2_dspark node 0",
        "pp2_dspark node 1 (headless)",
    }
    for name in ("pp2_nospec", "pp2_dspark"):
        n0, n1 = nodes[f"{name} node 0"], nodes[f"{name} node 1 (headless)"]
        assert n0["env"]["CUDA_VISIBLE_DEVICES"] == n1["env"]["CUDA_VISIBLE_DEVICES"] == "0"
        assert n0["env"]["NCCL_HOSTID"] != n1["env"]["NCCL_HOSTID"]
        assert n0["env"]["NCCL_SOCKET_IFNAME"] == "lo"
        # NCCL's init lines are the transport evidence the results record
        assert n0["env"]["NCCL_DEBUG"] == n1["env"]["NCCL_DEBUG"] == "INFO"
        assert n0["env"]["VLLM_SERVER_DEV_MODE"] == "1"  # /collective_rpc
        assert n0["env"]["VLLM_PLUGINS"] == "dspark_pp,dspark_bench"
        assert n0["env"]["VLLM_ENGINE_READY_TIMEOUT_S"] == "330"  # the PP groups keep theirs
        for node, rank in ((n0, "0"), (n1, "1")):
            argv = " ".join(node["argv"])
            assert f"--nnodes 2 --node-rank {rank} --master-addr 127.0.0.1" in argv
            assert "-pp 2" in argv and "--load-format dummy" in argv
            assert "--kv-cache-memory-bytes 8589934592" in argv  # 16 GiB split over 2 stages
        assert "--headless" in n1["argv"] and "--port" not in n1["argv"]
    dspark = " ".join(nodes["pp2_dspark node 0"]["argv"])
    assert '"rejection_sample_method": "synthetic"' in dspark.replace("\\", "")
    assert '"synthetic_acceptance_length": 3.99' in dspark.replace("\\", "")


def test_dry_run_per_stage_layout_puts_each_stage_on_its_gpu(capsys):
    nodes = _launchers(_dry(capsys, "--configs", "pp2_nospec", "--gpu-layout", "per-stage"))
    assert nodes["pp2_nospec node 0"]["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert nodes["pp2_nospec node 1 (headless)"]["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert "NCCL_HOSTID" not in nodes["pp2_nospec node 0"]["env"]


def test_dry_run_stock_leaves_the_plugin_out_and_bench_commands_are_vllms(capsys):
    out = _dry(capsys, "--configs", "stock", "--concurrency", "1,64")
    nodes = _launchers(out)
    assert nodes["pp2_nospec_stock node 0"]["env"]["VLLM_PLUGINS"] == "dspark_bench"
    assert nodes["pp2_nospec node 0"]["env"]["VLLM_PLUGINS"] == "dspark_pp,dspark_bench"
    bench = [line for line in out.splitlines() if line.startswith("vllm bench serve ")]
    assert len(bench) == 4  # two servers x two concurrencies, no AL switch without DSpark
    assert not [line for line in out.splitlines() if line.startswith("POST ")]
    c64 = shlex.split(bench[1])
    opt = {c64[i]: c64[i + 1] for i in range(3, len(c64) - 1) if c64[i].startswith("--")}
    assert opt["--max-concurrency"] == "64" and opt["--num-prompts"] == "256"
    assert opt["--dataset-name"] == "random" and opt["--random-input-len"] == "1024"
    assert opt["--random-output-len"] == "256" and "--ignore-eos" in c64
    # vLLM's own parser accepts the command
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(c64[3:])
    assert args.max_concurrency == 64 and args.ignore_eos and args.save_result


def test_dry_run_switches_the_acceptance_length_per_sweep(capsys):
    out = _dry(capsys, "--configs", "pp1_dspark", "--acceptance-lengths", "3.99,6.1")
    lines = [line for line in out.splitlines() if line.startswith("POST ")]
    rpcs = [json.loads(line.split(" ", 2)[2]) for line in lines]
    assert [r["args"] for r in rpcs] == [
        ["set_acceptance_length", "3.99"],
        ["set_acceptance_length", "6.1"],
    ]
    assert all(r["method"] == "dspark_bench_ctl" for r in rpcs)
    assert '"args": ["enable"]} before, ["collect"] after' in out  # the step timers
    quiet = _dry(capsys, "--configs", "pp1_dspark", "--no-step-times")
    assert '["enable"]' not in quiet
    assert serve.rpc_applied({"results": [{"applied": False}, {"applied": True}]})
    assert not serve.rpc_applied({"results": [{"applied": False}, None]})
    assert not serve.rpc_applied({"error": "connection refused"})


# --------------------------------------------------------------------------- budget, records
def _model(**kw):
    base = dict(tpot_ms=5.0, output_len=200, prefill_ms=0.0, point_s=0.0)  # a wave: 1 s
    return serve.CostModel(**{**base, **kw})


def test_trimming_keeps_whole_waves_and_skips_when_none_fits():
    assert serve.trim_point(16, 64, _model(), time_for_point_s=100.0) == (64, None)
    n, why = serve.trim_point(16, 64, _model(point_s=1.0), time_for_point_s=3.5)
    assert n == 32 and "2 of 4 waves" in why  # whole waves of C, after the fixed part
    n, why = serve.trim_point(64, 256, _model(calib=2.0), time_for_point_s=1.9)
    assert n == 0 and "one wave of 64" in why


def test_the_time_left_is_shared_in_proportion_to_cost():
    assert serve.time_for_point(100.0, 10.0, [20.0, 30.0]) == 100.0  # everything fits
    assert serve.time_for_point(30.0, 10.0, [20.0, 30.0]) == pytest.approx(5.0)
    assert serve.time_for_point(-5.0, 10.0, [20.0]) == 0.0
    m = _model(tpot_ms=5.0, output_len=256, prefill_ms=40.0, point_s=4.0, calib=1.5)
    assert m.point_cost_s(4, 16) == pytest.approx(1.5 * (4.0 + 4 * (1.28 + 0.16)))


def test_a_short_budget_trims_every_point_alike_and_the_last_sweep_is_not_starved():
    def prompts(c):
        return max(16, 4 * c)

    m = _model(point_s=1.0)  # a point: 1 s + 4 waves of 1 s (16 at C=1)
    cs = [1, 4, 16, 32, 64]
    # the whole plan (3 sweeps of 17 + 4 x 5 = 37 s) fits in 200 s: nothing is cut
    assert serve.plan_point(1, cs[1:], 2, cs, 200.0, m, prompts) == (16, None)
    # with 55.5 s for 111 s of work the first point gets half of its 17 s: 7 of 16 waves
    n, why = serve.plan_point(1, cs[1:], 2, cs, 55.5, m, prompts)
    assert n == 7 and "7 of 16 waves" in why
    # the last point of the last sweep gets all that is left, whole waves only
    assert serve.plan_point(64, [], 0, cs, 3.5, m, prompts)[0] == 128
    assert serve.plan_point(64, [], 0, cs, 1.5, m, prompts)[0] == 0


def test_every_point_is_on_disk_as_soon_as_it_is_added(tmp_path):
    res = serve.Results(tmp_path / "r.json", {"meta": {}, "points": []})
    res.save()
    res.add("points", {"config": "pp1_nospec", "concurrency": 1})
    assert json.loads((tmp_path / "r.json").read_text())["points"] == [
        {"config": "pp1_nospec", "concurrency": 1}
    ]
    assert not list(tmp_path.glob("*.tmp"))


def test_bench_summary_keeps_scalars_and_drops_per_request_lists():
    s = serve.bench_summary(
        {"output_throughput": 1.5, "ttfts": list(range(100)), "label": "x", "errors": [""] * 4,
         "latencies": [1.0, 2.0],
         "spec_decode_per_position_acceptance_rates": [0.9, 0.5], "nested": {"a": 1}}
    )  # fmt: skip
    assert s == {
        "output_throughput": 1.5,
        "label": "x",
        "spec_decode_per_position_acceptance_rates": [0.9, 0.5],
    }
    assert serve.measured_acceptance_length({"num_drafts": 4, "num_accepted_tokens": 12}) == 4.0
    assert serve.measured_acceptance_length({"num_drafts": 0}) is None


def test_a_run_with_failed_requests_is_a_failed_run():
    assert serve.bench_failure({"completed": 448, "failed": 0}, "") is None
    assert serve.bench_failure({"completed": 132, "failed": 316}, "") == (
        "316 of 448 requests failed"
    )
    assert serve.bench_failure({"completed": 0, "failed": 0}, "") == "no request completed"
    assert serve.bench_failure(None, "cut after 12 s (server stopped)").startswith("cut after")


class _Dep:
    url = "http://127.0.0.1:9"
    stop_calls = 0

    def dead_nodes(self):
        return []

    def stop(self):
        self.stop_calls += 1


@pytest.mark.parametrize("failed, counted", [(0, True), (316, False)])
def test_measure_keeps_a_run_only_when_no_request_failed(tmp_path, monkeypatch, failed, counted):
    """Runner.measure with the bench and the counters stood in: the 2026-12-06 record's PP=2 PD
    run (132 answered, 316 failed after the producer ran out of memory) entered the comparison
    at 344 tok/s; a run with failed requests is now skipped and ends that server's runs."""
    import dspark_dev.serve_demo as serve_demo

    a = serve.parse_args(["--configs", "pp1_dspark,pp2_dspark", "--no-step-times"])
    cfg = serve.CONFIGS["pp2_dspark"]
    bench = {"completed": 448 - failed, "failed": failed, "output_throughput": 344.0}
    monkeypatch.setattr(serve, "run_bench_in_process", lambda argv, t, stop: (dict(bench), ""))
    monkeypatch.setattr(serve_demo, "spec_metrics", lambda url, settle_s=0.0: {})
    res = serve.Results(tmp_path / "r.json", {"meta": {}, "points": [], "skipped": []})
    paths = type("P", (), {"target": str(tmp_path / "target")})()
    rn = serve.Runner(a, {cfg.name: _Dep()}, paths, res, serve.Log(None), 1e12)
    point, stop = rn.measure(cfg, 3.99, 0, 64, 448, why=None, n_full=448, repeat=0)
    assert (point is not None, stop) == (counted, not counted)
    assert len(res.data["points"]) == int(counted)
    if not counted:
        [skip] = res.data["skipped"]
        assert skip["why"] == "bench failed: 316 of 448 requests failed" and skip["repeat"] == 0


def test_transport_evidence_and_useful_lines_from_launcher_logs():
    log0 = (
        "h:1:2 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>\n"
        "h:1:2 [0] NCCL INFO comm 0x1 rank 0 nRanks 2 nNodes 2 localRanks 1 - Init COMPLETE\n"
        "INFO 12-04 11:00:01 [x.py:1] DSpark PP exchange: rank 0 of 2 over nccl\n"
        "INFO 12-04 11:00:02 [y.py:2] something routine\n"
        "INFO 12-04 11:00:03 [z.py:3] PP handshake: 2 ranks agree\n"
    )
    log1 = log0.replace("rank 0", "rank 1")
    ev = serve.transport_evidence([log0, log1])
    assert ev == {
        "nccl_comms": [(2, 2)],
        "nccl_socket": True,
        "exchange_backends": ["nccl"],
        "handshake": True,
    }
    assert serve.transport_evidence(["no nccl here"])["nccl_comms"] == []
    lines = serve.useful_lines(log0 + log0.replace("11:00:0", "11:09:0"))
    assert len(lines) == 4 and not any("routine" in x for x in lines)


# --------------------------------------------------------------------------- tokenizer
def test_the_shape_tokenizer_has_the_configs_vocabulary_and_round_trips(tmp_path):
    from benchmarks import real_shapes

    paths = real_shapes.write_shape("qwen3-8b", tmp_path)
    info = shape_tokenizer.write(paths.target)
    assert info["vocab_size"] == info["config_vocab_size"] == 151936
    assert info["special_tokens"] == {"151643": "<|endoftext|>", "151645": "<|im_end|>"}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths.target)
    assert len(tok) == tok.vocab_size == 151936
    assert tok.eos_token_id == 151645 and tok.bos_token is None
    # special in tokenizer.json too: vLLM's incremental detokenizer decodes with the backend
    assert tok.backend_tokenizer.decode([151645, 5, 151643], skip_special_tokens=True) == "w5"
    assert set(tok.all_special_ids) == {151643, 151645}  # the random dataset leaves them out
    assert tok.encode("w7 w151935", add_special_tokens=False) == [7, 151935]
    n, bad = shape_tokenizer.round_trip_failures(paths.target, n=3, length=1024)
    assert n == 3 and bad == []
    # one token at a time (the incremental detokenizer) gives the whole text
    ids = [5, 151000, 42]
    assert "".join(tok.decode(ids[: i + 1])[len(tok.decode(ids[:i])) :] for i in range(3)) == (
        tok.decode(ids)
    )


# --------------------------------------------------------------------------- plot
def _write(tmp_path: Path, name: str, run: dict) -> str:
    p = tmp_path / name
    p.write_text(json.dumps(run))
    return str(p)


def _sample(pp2_dspark_c4: float) -> list[dict]:
    """PP=1: no-spec 100 / 400 tok/s, DSpark 300 / 1000 (3.00x, 2.50x); PP=2: no-spec 90 / 360,
    DSpark 270 at C=1 (3.00x) and ``pp2_dspark_c4`` at C=4."""
    return [
        serve_point("pp1_nospec", None, 1, 100.0),
        serve_point("pp1_nospec", None, 4, 400.0),
        serve_point("pp1_dspark", 3.99, 1, 300.0, measured=3.98),
        serve_point("pp1_dspark", 3.99, 4, 1000.0),
        serve_point("pp2_nospec", None, 1, 90.0),
        serve_point("pp2_nospec", None, 4, 360.0),
        serve_point("pp2_dspark", 3.99, 1, 270.0),
        serve_point("pp2_dspark", 3.99, 4, pp2_dspark_c4),
    ]


def test_goal_b_is_computed_from_the_ratios(tmp_path):
    runs = plot.load([_write(tmp_path, "a.json", serve_run(_sample(pp2_dspark_c4=720.0)))])
    rows = plot.table_rows(plot.merge(runs))
    ratios = plot.speedup_ratios(rows)
    assert [(r["c"], r["pp1"], r["pp2"]) for r in ratios] == [(1, 3.0, 3.0), (4, 2.5, 2.0)]
    g = plot.goal_b(ratios, [1, 4], [3.99])
    assert g["verdict"] == "missed" and g["below"] == [(3.99, 4, pytest.approx(0.8))]
    good = plot.load([_write(tmp_path, "b.json", serve_run(_sample(pp2_dspark_c4=900.0)))])
    met = plot.goal_b(plot.speedup_ratios(plot.table_rows(plot.merge(good))), [1, 4], [3.99])
    assert met["verdict"] == "met" and met["min"] == pytest.approx(1.0)
    partial = plot.goal_b(ratios[:1], [1, 4], [3.99])
    assert partial["verdict"] == "met where measured (incomplete)"
    assert partial["missing"] == [(3.99, 4)]


def test_markdown_and_png_from_recorded_runs(tmp_path):
    first = serve_run(
        _sample(pp2_dspark_c4=720.0),
        skipped=[{"config": "pp2_dspark", "acceptance_length": 3.99, "concurrency": 64,
                  "why": "budget: one wave of 64 needs about 9 s"}],
        servers={"pp2_dspark": {"transport": {"nccl_comms": [[2, 2]], "nccl_socket": True,
                                              "exchange_backends": ["nccl"]}}},
    )  # fmt: skip
    step = {"main_num_reqs": 4, "main": {"target_ms": 3.0, "draft_ms": None, "step_ms": 4.0}}
    last = {"main_num_reqs": 4, "main": {"target_ms": 2.5, "draft_ms": 1.0, "step_ms": 4.0}}
    first["points"][-1]["step_times"] = [step, last]  # pp2_dspark C=4
    repeat = serve_run(
        [serve_point("pp1_nospec", None, 1, 110.0), serve_point("pp2_nospec", None, 16, 360.0)]
    )
    stock = serve_run(
        [
            serve_point("pp2_nospec_stock", None, 1, 100.0),
            serve_point("pp2_nospec_stock", None, 16, 400.0),
            serve_point("pp2_nospec", None, 16, 396.0),  # the same run's plugin on
        ]
    )
    files = [
        _write(tmp_path, "serve_pp_one_gpu_all.json", first),
        _write(tmp_path, "serve_pp_one_gpu_rep.json", repeat),
        _write(tmp_path, "serve_pp_one_gpu_stock.json", stock),
    ]
    dest = tmp_path / "docs"
    md_path, png = dest / "perf.md", dest / "perf.png"
    argv = [*files, "--md", str(md_path), "--png", str(png), "--copy-to", str(dest)]
    assert plot.main(argv) == 0
    md = md_path.read_text()
    assert sorted(p.name for p in dest.glob("*.json")) == sorted(Path(f).name for f in files)
    # pp1 no-spec C=1 has two repeats: median 105, spread 10/105
    assert "| pp1_nospec | 1 | 105.0 | 50.0 | 90.0 | 5.00 | 6.00 | - | 16 | 2 | 9.5% |" in md
    assert "| 3.99 | 4 | 2.50x | 2.00x | 0.800 |" in md
    # PP=1 ratio at C=1 uses the median no-spec (105): 300 / 105
    assert "| 3.99 | 1 | 2.86x | 3.00x | 1.050 |" in md
    assert "**missed**" in md and "AL 3.99 C=4 (0.800)" in md
    assert "| nospec | 1 | 0.857 | 1.000 |" in md  # PP=2 / PP=1 at equal work: 90 / 105
    # plugin on / off at PP=2: C=1 only across runs (90 / 100); C=16 over the medians
    # (median(360, 396) = 378 / 400) and within the stock run (396 / 400)
    assert "| pp2_nospec | 1 | 0.900 | - | 1 / 1 |" in md
    assert "| pp2_nospec | 16 | 0.945 | 0.990 | 2 / 1 |" in md
    assert "2 ranks on 2 nodes; socket transport (`NET/Socket`): yes" in md
    assert "pp2_dspark AL 3.99 C=64: budget" in md
    assert "| pp2_dspark AL 3.99 | 4 | 0 | 4 | 3.000 | - | 4.000 | - |" in md
    assert "| pp2_dspark AL 3.99 | 4 | 1 | 4 | 2.500 | 1.000 | 4.000 | 25.0% |" in md
    assert md.count(plot.CAVEAT) >= 4
    assert png.stat().st_size > 10_000 and "![served curves](perf.png)" in md


# --------------------------------------------------------------------------- PD vs aggregated
def test_the_pd_group_sweeps_al_3_99_and_both_sides_hold_the_same_kv():
    a = serve.parse_args(["--configs", "pd"])
    # the aggregated reference runs first (a stalled PD side cannot take its time)
    assert [c.name for c in a.cfgs] == ["agg_dspark_kv", "pd_dspark"] and a.als == [3.99]
    assert serve.parse_args(["--configs", "pd,pp1"]).als == [3.99, 6.1]  # mixed: the usual
    agg, pd = (serve.kv_plan(c, 16.0, 24.0, 0.75) for c in a.cfgs)
    assert agg == {"engine": 24 << 30}
    assert pd == {"producer": 6 << 30, "decoder": 18 << 30}
    # an odd share rounds the decoder down to whole MiB and the producer takes the rest
    pd_odd = serve.kv_plan(serve.CONFIGS["pd_dspark"], 16.0, 10.0, 0.333)
    assert sum(pd_odd.values()) == 10 << 30 and pd_odd["decoder"] % (1 << 20) == 0
    assert serve.kv_plan(serve.CONFIGS["pp2_dspark"], 16.0, 24.0, 0.75) == {
        "stage0": 8 << 30,
        "stage1": 8 << 30,
    }
    with pytest.raises(SystemExit, match="--pd-decoder-share"):
        serve.parse_args(["--configs", "pd", "--pd-decoder-share", "1"])


def test_dry_run_composes_producer_decoder_and_proxy(capsys):
    out = _dry(capsys, "--configs", "pd", "--concurrency", "1,64")
    nodes = _launchers(out)
    assert set(nodes) == {
        "pd_dspark producer",
        "pd_dspark decoder",
        "pd_dspark proxy",
        "agg_dspark_kv",
    }

    def opt(argv, flag):
        return argv[argv.index(flag) + 1]

    def json_opt(who, flag):
        """A JSON option of a launcher, read from its printed command line."""
        line = next(x for x in out.splitlines() if x.startswith(f"  {who}: /"))
        return json.JSONDecoder().raw_decode(line, line.index(flag + " ") + len(flag) + 1)[0]

    pre, dec, proxy = (nodes[f"pd_dspark {r}"] for r in ("producer", "decoder", "proxy"))
    agg = nodes["agg_dspark_kv"]
    pre_kv = json_opt("pd_dspark producer", "--kv-transfer-config")
    dec_kv = json_opt("pd_dspark decoder", "--kv-transfer-config")
    assert pre_kv["kv_role"] == "kv_producer" and dec_kv["kv_role"] == "kv_consumer"
    assert pre_kv["kv_connector"] == dec_kv["kv_connector"] == "MooncakeConnector"
    assert pre_kv["kv_connector_extra_config"] == {"mooncake_protocol": "tcp"}
    assert "--kv-transfer-config" not in agg["argv"]
    # the same total KV: producer + decoder == the aggregated engine, each set exactly once
    kv = {n: [a for a in x["argv"] if a == "--kv-cache-memory-bytes"] for n, x in nodes.items()}
    assert kv == {"pd_dspark producer": ["--kv-cache-memory-bytes"],
                  "pd_dspark decoder": ["--kv-cache-memory-bytes"], "pd_dspark proxy": [],
                  "agg_dspark_kv": ["--kv-cache-memory-bytes"]}  # fmt: skip
    total = int(opt(pre["argv"], "--kv-cache-memory-bytes")) + int(
        opt(dec["argv"], "--kv-cache-memory-bytes")
    )
    assert total == int(opt(agg["argv"], "--kv-cache-memory-bytes")) == 24 << 30
    # both engines: the same DSpark config, their own ports; the proxy joins them
    spec = json_opt("pd_dspark producer", "--speculative-config")
    assert spec == json_opt("pd_dspark decoder", "--speculative-config")
    assert spec["method"] == "dspark" and spec["synthetic_acceptance_length"] == 3.99
    assert pre["env"]["VLLM_PORT"] != dec["env"]["VLLM_PORT"]
    # three engines start at once: vLLM's start-up deadline follows the driver's (450 s)
    for node in (pre, dec, agg):
        assert node["env"]["VLLM_ENGINE_READY_TIMEOUT_S"] == "450"
    boot = pre["env"]["VLLM_MOONCAKE_BOOTSTRAP_PORT"]
    assert dec["env"]["VLLM_MOONCAKE_BOOTSTRAP_PORT"] != boot
    assert proxy["argv"][1:3] == ["-m", "dspark_dev.pd_proxy"]
    assert opt(proxy["argv"], "--prefill") == f"http://127.0.0.1:{opt(pre['argv'], '--port')}"
    assert opt(proxy["argv"], "--decode") == f"http://127.0.0.1:{opt(dec['argv'], '--port')}"
    assert opt(proxy["argv"], "--bootstrap") == f"http://127.0.0.1:{boot}"
    assert opt(proxy["argv"], "--engine-id") == pre_kv["engine_id"]
    # the acceptance switch goes to the decoder, the client to the proxy
    posts = [line for line in out.splitlines() if line.startswith("POST ")]
    assert posts[0].startswith("POST URL(agg_dspark_kv)/collective_rpc")
    assert posts[1].startswith("POST URL(pd_dspark decoder)/collective_rpc")
    bench = [line for line in out.splitlines() if line.startswith("vllm bench serve ")]
    assert len(bench) == 4 and "--base-url URL(pd_dspark proxy) " in bench[2]
    # the same prompts on both sides
    seeds = [shlex.split(b)[shlex.split(b).index("--seed") + 1] for b in bench]
    assert seeds[:2] == seeds[2:]


def test_dry_run_pd_over_nixl_has_no_bootstrap_and_ucx_on_both_engines(capsys):
    out = _dry(capsys, "--configs", "pd_nixl", "--concurrency", "4")
    nodes = _launchers(out)
    assert set(nodes) == {
        "pd_nixl_dspark producer",
        "pd_nixl_dspark decoder",
        "pd_nixl_dspark proxy",
        "agg_dspark_kv",
    }
    pre, dec, proxy = (nodes[f"pd_nixl_dspark {r}"] for r in ("producer", "decoder", "proxy"))

    def kv_cfg(who):
        line = next(x for x in out.splitlines() if x.startswith(f"  {who}: /"))
        flag = "--kv-transfer-config "
        return json.JSONDecoder().raw_decode(line, line.index(flag) + len(flag))[0]

    pre_kv, dec_kv = kv_cfg("pd_nixl_dspark producer"), kv_cfg("pd_nixl_dspark decoder")
    assert pre_kv["kv_connector"] == dec_kv["kv_connector"] == "NixlConnector"
    assert (pre_kv["kv_role"], dec_kv["kv_role"]) == ("kv_producer", "kv_consumer")
    for node in (pre, dec):
        assert node["env"]["UCX_TLS"] == "cuda_ipc,cuda_copy,tcp"
        assert node["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" not in node["env"]
    assert pre["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] != dec["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    argv = proxy["argv"]
    assert argv[argv.index("--bootstrap") + 1] == "nixl:no-bootstrap"
    assert argv[argv.index("--engine-id") + 1] == pre_kv["engine_id"]
    with pytest.raises(ValueError, match="PP=1 producer"):
        from dspark_dev.pd_launch import pd_deployment

        pd_deployment("x", "/m", spec={}, base_args=[], producer_kv_bytes=1, decoder_kv_bytes=1,
                      log_dir=Path("/tmp"), env={}, producer_pp=2, connector="nixl")  # fmt: skip


def _pd_transport_lines(out: str) -> dict:
    """The ``# pd transport NAME: JSON`` lines of a dry run (what ``meta.pd_transport`` will
    record)."""
    head = "# pd transport "
    return {
        line[len(head) :].split(": ", 1)[0]: json.loads(line.split(": ", 1)[1])
        for line in out.splitlines()
        if line.startswith(head)
    }


def _mooncake(out: str, who: str) -> tuple[str, dict]:
    """A launcher's ``mooncake_protocol`` (its printed ``--kv-transfer-config``) and ``MC_*``
    variables."""
    line = next(x for x in out.splitlines() if x.startswith(f"  {who}: /"))
    flag = "--kv-transfer-config "
    kv = json.JSONDecoder().raw_decode(line, line.index(flag) + len(flag))[0]
    env = _launchers(out)[who]["env"]
    return kv["kv_connector_extra_config"]["mooncake_protocol"], {
        k: v for k, v in env.items() if k.startswith("MC_")
    }


def test_dry_run_pd_mc_ipc_compares_tcp_and_the_intra_node_transport(capsys, monkeypatch):
    """Group ``pd_mc_ipc``: the aggregated reference, PD over Mooncake TCP and PD over Mooncake's
    intra-node transport, interleaved; only the last one's engines name ``nvlink_intra`` and get
    ``MC_INTRANODE_NVLINK``, and the recorded transport says so per engine."""
    monkeypatch.delenv("DSPARK_PD_MOONCAKE_PROTOCOL", raising=False)
    assert [c.name for c in serve.select_configs("pd_mc_ipc")] == [
        "agg_dspark_kv", "pd_dspark", "pd_mc_ipc_dspark",
    ]  # fmt: skip
    out = _dry(capsys, "--configs", "pd_mc_ipc", "--interleave", "--repeats", "3",
               "--concurrency", "8,32", "--acceptance-lengths", "3.99", "--workload", "mixed",
               "--budget-s", "540")  # fmt: skip
    nodes = _launchers(out)
    assert {n for n in nodes if n.startswith("pd_mc_ipc_dspark")} == {
        "pd_mc_ipc_dspark producer", "pd_mc_ipc_dspark decoder", "pd_mc_ipc_dspark proxy",
    }  # fmt: skip
    for role in ("producer", "decoder"):
        assert _mooncake(out, f"pd_mc_ipc_dspark {role}") == (
            "nvlink_intra", {"MC_INTRANODE_NVLINK": "1"},
        )  # fmt: skip
        assert _mooncake(out, f"pd_dspark {role}") == ("tcp", {})
    assert not any(k.startswith("MC_") for k in nodes["agg_dspark_kv"]["env"])
    assert "--kv-transfer-config" not in nodes["agg_dspark_kv"]["argv"]
    recorded = _pd_transport_lines(out)
    assert set(recorded) == {"pd_dspark", "pd_mc_ipc_dspark"}
    ipc = recorded["pd_mc_ipc_dspark"]
    assert (ipc["connector"], ipc["mooncake_protocol"]) == ("mooncake", "nvlink_intra")
    assert ipc["engines"] == {
        f"pd_mc_ipc_dspark {r}": {
            "mooncake_protocol": "nvlink_intra", "env": {"MC_INTRANODE_NVLINK": "1"},
        }
        for r in ("producer", "decoder")
    }  # fmt: skip
    assert recorded["pd_dspark"]["mooncake_protocol"] == "tcp"
    # the same prompts for the three, in rotation
    slots = [x.split()[-1] for x in out.splitlines() if x.startswith("# slot ")]
    assert slots[:3] == ["agg_dspark_kv", "pd_dspark", "pd_mc_ipc_dspark"] and len(slots) == 18


def test_dry_run_pd_mc_ipc_goal_gives_the_pp2_producer_the_intra_node_transport(
    capsys, monkeypatch
):
    """Group ``pd_mc_ipc_goal`` (issue 44's PD goal point): aggregated, PD over the intra-node
    transport with a PP=1 and with a PP=2 producer; both producer launchers of the PP=2 one and
    its decoder name ``nvlink_intra`` and get ``MC_INTRANODE_NVLINK``; no TCP PD."""
    monkeypatch.delenv("DSPARK_PD_MOONCAKE_PROTOCOL", raising=False)
    assert [c.name for c in serve.select_configs("pd_mc_ipc_goal")] == [
        "agg_dspark_kv", "pd_mc_ipc_dspark", "pd_pp2_mc_ipc_dspark",
    ]  # fmt: skip
    out = _dry(capsys, "--configs", "pd_mc_ipc_goal", "--interleave", "--repeats", "3",
               "--concurrency", "32,64", "--acceptance-lengths", "3.99", "--workload", "mixed",
               "--budget-s", "540")  # fmt: skip
    nodes = _launchers(out)
    pp2 = sorted(n for n in nodes if n.startswith("pd_pp2_mc_ipc_dspark") and "proxy" not in n)
    assert pp2 == [
        "pd_pp2_mc_ipc_dspark decoder", "pd_pp2_mc_ipc_dspark producer node 0",
        "pd_pp2_mc_ipc_dspark producer node 1 (headless)",
    ]  # fmt: skip
    for who in pp2:
        assert _mooncake(out, who) == ("nvlink_intra", {"MC_INTRANODE_NVLINK": "1"}), who
    assert "-pp 2" in " ".join(nodes["pd_pp2_mc_ipc_dspark producer node 0"]["argv"])
    assert not any(n.startswith("pd_dspark") for n in nodes)
    assert set(_pd_transport_lines(out)) == {"pd_mc_ipc_dspark", "pd_pp2_mc_ipc_dspark"}


def test_dry_run_split_serves_plans_layer_split_on_the_balanced_launchers_only(capsys):
    """Group ``split`` (issue 44 item 3): PP=1, PP=2 with vLLM's even split and PP=2 with the
    split of vllm_dspark_pp.stage_balance (what ``plan`` recommends) for the served shape: only
    both launchers of ``pp2_dspark_balanced`` get ``VLLM_PP_LAYER_PARTITION``, the split the
    dry run prints (and the record keeps) moves layers off the drafter's stage and covers every
    target layer."""
    assert [c.name for c in serve.select_configs("split")] == [
        "pp1_dspark", "pp2_dspark", "pp2_dspark_balanced",
    ]  # fmt: skip
    out = _dry(capsys, "--configs", "split", "--interleave", "--repeats", "3", "--concurrency",
               "16", "--acceptance-lengths", "3.99", "--workload", "decode")  # fmt: skip
    line = next(x for x in out.splitlines() if x.startswith("# stage split pp2_dspark_balanced: "))
    split = json.loads(line.split(": ", 1)[1])
    layers = serve.SHAPES["qwen3-8b"].num_layers  # the default shape
    assert sum(split["partition"]) == sum(split["even_partition"]) == layers
    assert split["improves"] and split["partition"][-1] < split["even_partition"][-1]
    assert max(split["costs"]) < max(split["even_costs"])
    want = ",".join(map(str, split["partition"]))
    nodes = _launchers(out)
    for name, node in nodes.items():
        got = node["env"].get("VLLM_PP_LAYER_PARTITION")
        assert got == (want if name.startswith("pp2_dspark_balanced") else None), name
    assert sum(n.startswith("pp2_dspark_balanced") for n in nodes) == 2


def _group_launchers(capsys, group: str, names: list[str], concurrency: int) -> dict:
    """The dry run's launchers of one interleaved ``group`` (3 repeats, AL 3.99) after checking
    that the group selects ``names``, in order."""
    assert [c.name for c in serve.select_configs(group)] == names
    out = _dry(capsys, "--configs", group, "--interleave", "--repeats", "3",
               "--concurrency", str(concurrency), "--acceptance-lengths", "3.99")  # fmt: skip
    return _launchers(out)


def test_dry_run_stock_dspark_leaves_the_plugin_out_of_the_stock_launchers_only(capsys):
    """Group ``stock_dspark`` (issue 44 item 1: the plugin's cost at PP=2 with DSpark, same
    call): both launchers of ``pp2_dspark_stock`` load the benchmark hook only, both of
    ``pp2_dspark`` the plugin too; both serve DSpark with async scheduling."""
    nodes = _group_launchers(capsys, "stock_dspark", ["pp2_dspark_stock", "pp2_dspark"], 16)
    assert len(nodes) == 4, sorted(nodes)
    for name, node in nodes.items():
        plugins = node["env"]["VLLM_PLUGINS"].split(",")
        assert (serve.PLUGIN in plugins) is (not name.startswith("pp2_dspark_stock")), name
        assert "--speculative-config" in node["argv"] and "--async-scheduling" in node["argv"]


def test_dry_run_adaptive_stock_serves_vllms_own_adaptive_path_beside_the_plugins(capsys):
    """Group ``adaptive_stock`` (goal (g)'s PP=1 cost): k = 7, adaptive with the plugin and
    adaptive without it, each one launcher; only the stock one leaves the plugin out, both
    adaptive ones ask vLLM for adaptive verification."""
    names = ["pp1_dspark_k7", "pp1_dspark_adaptive", "pp1_dspark_adaptive_stock"]
    nodes = _group_launchers(capsys, "adaptive_stock", names, 32)
    assert len(nodes) == 3, sorted(nodes)
    for name, node in nodes.items():
        plugins = node["env"]["VLLM_PLUGINS"].split(",")
        assert (serve.PLUGIN in plugins) is (name != "pp1_dspark_adaptive_stock"), name
        assert node["spec"].get("enable_adaptive_verification", False) is ("adaptive" in name)
        assert node["spec"]["num_speculative_tokens"] == 7


def test_the_protocol_knob_reaches_pd_dspark_and_nixl_records_ucx(capsys, monkeypatch):
    monkeypatch.setenv("DSPARK_PD_MOONCAKE_PROTOCOL", "nvlink_intra")
    out = _dry(capsys, "--configs", "pd", "--concurrency", "4")
    for role in ("producer", "decoder"):
        assert _mooncake(out, f"pd_dspark {role}") == (
            "nvlink_intra", {"MC_INTRANODE_NVLINK": "1"},
        )  # fmt: skip
    assert _pd_transport_lines(out)["pd_dspark"]["mooncake_protocol"] == "nvlink_intra"
    nixl = _pd_transport_lines(_dry(capsys, "--configs", "pd_nixl", "--concurrency", "4"))
    rec = nixl["pd_nixl_dspark"]
    assert (rec["connector"], rec["mooncake_protocol"]) == ("nixl", None)
    assert rec["engines"]["pd_nixl_dspark decoder"]["env"]["UCX_TLS"] == "cuda_ipc,cuda_copy,tcp"


def test_a_nixl_deployment_starts_its_proxy_without_asking_a_bootstrap_server(monkeypatch):
    from dspark_dev import pd_launch

    def never(url, deadline):
        raise AssertionError("NIXL has no bootstrap server to ask")

    monkeypatch.setattr(pd_launch, "wait_engine_id", never)
    monkeypatch.setattr(pd_launch, "wait_ready", _fake_wait)
    proxy = _Node("proxy")
    dep = pd_launch.PDDeployment(
        "pd", [_Node("producer")], _Node("decoder", port=2), proxy, "nixl:no-bootstrap", "e",
        connector="nixl",
    )  # fmt: skip
    dep.start().wait_ready(5.0)
    assert proxy.started == 1 and dep.engine_id == "e"


class _Node:
    """A launcher as dspark_dev.serve's readiness checks see it."""

    def __init__(self, name, exit_code=None, port=1):
        self.name, self.code, self.port, self.started, self.argv = name, exit_code, port, 0, []
        self.log_path = f"{name}.log"

    url = property(lambda self: f"http://127.0.0.1:{self.port}")

    def start(self):
        self.started += 1

    def exited(self):
        return self.code

    def log_text(self):
        return f"{self.name}: last log line"


def _fake_wait(server, timeout_s, *, watch=()):
    """``serve.wait_ready`` without HTTP: the real liveness check of the server and the
    watched launchers, then ready."""
    from dspark_dev.serve import check_alive

    check_alive([server, *watch], server.name)
    return 0.0


def _pd(monkeypatch, seen="eng-1", decoder_exit=None):
    from dspark_dev import pd_launch

    monkeypatch.setattr(pd_launch, "wait_engine_id", lambda url, deadline: seen)
    monkeypatch.setattr(pd_launch, "wait_ready", _fake_wait)
    proxy = _Node("proxy")
    proxy.argv = ["python", "-m", "dspark_dev.pd_proxy", "--engine-id", "eng-1"]
    dep = pd_launch.PDDeployment(
        "pd", [_Node("producer")], _Node("decoder", decoder_exit, port=2), proxy, "boot", "eng-1"
    )
    return dep.start(), proxy


def test_pd_deployment_starts_the_proxy_only_when_both_engines_answer(monkeypatch):
    dep, proxy = _pd(monkeypatch)
    assert proxy.started == 0  # not with the engines
    dep.wait_ready(5.0)
    assert proxy.started == 1 and dep.control_url == "http://127.0.0.1:2"
    assert dep.url == proxy.url and dep.nodes[-1] is proxy
    dep, proxy = _pd(monkeypatch, seen="eng-registered")
    dep.wait_ready(5.0)  # the proxy names the engine the bootstrap server lists
    assert proxy.argv[-1] == "eng-registered" and dep.engine_id == "eng-registered"
    dep, proxy = _pd(monkeypatch, decoder_exit=1)
    died = "(?s)decoder exited with code 1.*decoder: last log line"  # named, with its log tail
    with pytest.raises(RuntimeError, match=died):
        dep.wait_ready(5.0)
    assert proxy.started == 0


def test_pd_deltas_are_after_minus_before():
    before = {
        "decoder_kv": {"vllm:external_prefix_cache_hits_total": 100.0},
        "producer_spec": {"num_draft_tokens": 0, "accepted_per_pos": [1, 2]},
        "proxy": {"requests": 3, "errors": ["old"]},
    }
    after = {
        "decoder_kv": {"vllm:external_prefix_cache_hits_total": 1124.0},
        "producer_spec": {"num_draft_tokens": 0, "accepted_per_pos": [1, 5]},
        "proxy": {"requests": 7, "errors": ["old", "new"]},
    }
    assert serve.pd_delta(before, after) == {
        "decoder_kv": {"vllm:external_prefix_cache_hits_total": 1024.0},
        "producer_spec": {"num_draft_tokens": 0, "accepted_per_pos": [0, 3]},
        "proxy": {"requests": 4, "errors": ["new"]},
    }
    gone = serve.pd_delta(before, {**after, "proxy": {"error": "URLError: refused"}})
    assert gone["proxy"] == {"error": "URLError: refused"}


def _pd_point(config, c, tok_s, ttft, tpot, *, pulled=1.0):
    p = serve_point(config, 3.99, c, tok_s, ttft=ttft, tpot=tpot, measured=3.98)
    if config == "pd_dspark":
        prompt = 1024.0 * p["num_prompts"]
        p["pd"] = {
            "decoder_kv": {"vllm:external_prefix_cache_hits_total": pulled * prompt,
                           "vllm:prompt_tokens_total": prompt},
            "producer_spec": {"num_draft_tokens": 0},
            "proxy": {"requests": p["num_prompts"], "errors": []},
        }  # fmt: skip
    return p


def test_pd_vs_aggregated_table_and_png_from_a_recorded_run(tmp_path):
    run = serve_run(
        [
            _pd_point("pd_dspark", 1, 500.0, (80.0, 120.0), (1.8, 2.0)),
            _pd_point("agg_dspark_kv", 1, 550.0, (40.0, 60.0), (1.7, 1.9)),
            _pd_point("pd_dspark", 4, 1500.0, (150.0, 300.0), (2.0, 2.5), pulled=0.5),
            _pd_point("agg_dspark_kv", 4, 2000.0, (100.0, 200.0), (1.75, 2.2)),
        ]
    )
    f = _write(tmp_path, "serve_pp_one_gpu_pd.json", run)
    md_path, png = tmp_path / "pd.md", tmp_path / "perf.png"
    assert plot.main([f, "--md", str(md_path), "--png", str(png)]) == 0
    md = md_path.read_text()
    assert "## PD vs aggregated, served" in md and plot.PD_NOTE in md
    assert (
        "| 3.99 | 1 | 80.0 / 40.0 | 120.0 / 60.0 | 1.80 / 1.70 | 2.00 / 1.90 | 500 / 550 | "
        "0.909 | 3.98 / 3.98 | 100.0% | 0 | 0 | 1 / 1 |"
    ) in md
    assert "| 3.99 | 4 | 150.0 / 100.0 | 300.0 / 200.0 |" in md and "| 0.750 |" in md
    assert "| 50.0% |" in md  # half the prompt tokens came over the connector
    # no PP rows: no PP figure, the PD figure is the PNG asked for
    assert png.stat().st_size > 10_000 and "![PD vs aggregated](perf.png)" in md
    assert "![served curves]" not in md and not (tmp_path / "perf_pd.png").exists()
    assert md.startswith("<!--") and "# PD vs aggregated, served, on one GPU" in md
    assert "Goal (b)" not in md and plot.CAVEAT not in md  # nothing about PP in a PD-only page


def _hop(t0, prefill, decode_first, stream, *, ok=True):
    """A proxy hop record (dspark_dev/pd_proxy.HOP_KEYS) with the given spans in ms."""
    pa = 1.0 + prefill
    return {"t0": t0, "stream": True, "ok": ok, "prefill_sent": 1.0, "prefill_answered": pa,
            "decode_sent": pa, "first_token": pa + decode_first,
            "last_token": pa + decode_first + stream}  # fmt: skip


def test_hop_summary_says_where_requests_queue():
    """Four requests 0.1 s apart, each 10 ms of prefill, 500 ms to the first token, 100 ms of
    stream, ending 0.911 s after the first arrival: about 2.2 requests wait for their first
    token on average, 0.04 are in prefill. A failed request is counted, not summarized."""
    recs = [_hop(0.1 * i, 10.0, 500.0 + i, 100.0) for i in range(4)]
    recs.append({**_hop(0.05, 10.0, 1.0, 1.0), "ok": False})
    s = serve.hop_summary(recs)
    assert s["requests"] == 5 and s["completed"] == 4
    assert s["window_s"] == pytest.approx(0.3 + 0.611 + 0.003)
    window_ms = s["window_s"] * 1e3
    assert s["decode_first"]["p50_ms"] == 501.0 and s["decode_first"]["p99_ms"] == 503.0
    assert s["decode_first"]["in_flight"] == pytest.approx(2006.0 / window_ms, abs=1e-3)
    assert s["prefill"]["in_flight"] == pytest.approx(40.0 / window_ms, abs=1e-3)
    assert s["handoff"]["mean_ms"] == 0.0 and s["stream"]["p50_ms"] == 100.0
    assert s["total"]["p99_ms"] == pytest.approx(1.0 + 10.0 + 503.0 + 100.0)
    assert serve.hop_summary([recs[-1]]) == {"requests": 1, "completed": 0}


def test_pd_hops_reads_the_proxys_records_from_the_points_start():
    """Against a real dspark_dev/pd_proxy.py with loopback fakes: the records after the
    snapshot's count, arrival times relative to the point's first."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dspark_dev import pd_proxy

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            data = b'{"choices": [{}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    fake = ThreadingHTTPServer(("127.0.0.1", 0), H)
    fake.daemon_threads = True
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    up = f"http://127.0.0.1:{fake.server_address[1]}"
    try:
        with pd_proxy.PDProxy(up, up, "http://127.0.0.1:1", engine_id="e") as proxy:
            for _ in range(3):
                urllib_post(proxy.url + "/v1/completions", {"prompt": [1]})
            start = serve.http_get_json(proxy.url + "/stats")["hops_recorded"] - 2
            got = serve.pd_hops(type("Dep", (), {"url": proxy.url})(), start)
        gone = serve.pd_hops(type("Dep", (), {"url": "http://127.0.0.1:1"})(), 0)
    finally:
        fake.shutdown()
        fake.server_close()
    assert len(got["records"]) == 2 and got["records"][0]["t0"] == 0.0
    assert got["records"][1]["t0"] >= 0.0 and got["summary"]["completed"] == 2
    assert "error" in gone


def urllib_post(url, body):
    import urllib.request

    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


def test_producer_transfer_counters_from_a_metrics_page():
    from dspark_dev.metrics import parse_prometheus
    from dspark_dev.pd_launch import xfer_counters

    page = "\n".join(
        [
            "# TYPE vllm:mooncake_xfer_time_seconds histogram",
            'vllm:mooncake_xfer_time_seconds_bucket{engine="0",le="+Inf"} 4.0',
            'vllm:mooncake_xfer_time_seconds_count{engine="0"} 4.0',
            'vllm:mooncake_xfer_time_seconds_sum{engine="0"} 0.8',
            "# TYPE vllm:mooncake_bytes_transferred histogram",
            'vllm:mooncake_bytes_transferred_bucket{engine="0",le="+Inf"} 4.0',
            'vllm:mooncake_bytes_transferred_count{engine="0"} 4.0',
            'vllm:mooncake_bytes_transferred_sum{engine="0"} 671088640.0',
            "",
        ]
    )
    got = xfer_counters(parse_prometheus(page))
    assert got["xfer_time_seconds_sum"] == pytest.approx(0.8)
    assert got["bytes_transferred_sum"] == 671088640.0
    assert got["num_descriptors_count"] == 0.0  # absent: 0
    nixl = xfer_counters(parse_prometheus(page.replace("mooncake", "nixl")), "nixl")
    assert (
        nixl == got and xfer_counters(parse_prometheus(page), "nixl")["bytes_transferred_sum"] == 0
    )


def test_pd_hop_table_from_a_recorded_point(tmp_path):
    """The per-hop section of the PD page from a point's hop summary and the producer's
    transfer counters; a run without them (the 14:53 one) has no such section."""
    p = _pd_point("pd_dspark", 4, 900.0, (400.0, 700.0), (2.5, 3.0))
    p["pd"]["hops"] = {"summary": serve.hop_summary(
        [_hop(0.1 * i, 30.0, 250.0, 500.0) for i in range(16)])}  # fmt: skip
    p["pd"]["kv_xfer"] = {
        "xfer_time_seconds_sum": 4.0,
        "xfer_time_seconds_count": 16.0,
        "bytes_transferred_sum": 16 * 164 * 2.0**20,
    }
    agg = _pd_point("agg_dspark_kv", 4, 1800.0, (100.0, 120.0), (1.7, 1.9))
    md = plot.markdown([{**serve_run([p, agg]), "_file": "x.json"}], ["x.json"])
    assert "## Where a PD request's time goes" in md
    assert (
        "| pd_dspark AL 3.99 | 4 | 30.0 / 30.0 (0.2) | 0.0 / 0.0 (0.0) | 250.0 / 250.0 (1.8) | "
        "500.0 / 500.0 (3.5) | 250.0 | 164.0 | 164.0 | 0.64 | 1 |"
    ) in md, md
    bare = plot.markdown([{**serve_run([_pd_point("pd_dspark", 4, 900.0, (1, 2), (1, 2))]),
                           "_file": "y.json"}], ["y.json"])  # fmt: skip
    assert "Where a PD request's time goes" not in bare


# --------------------------------------------------------------------------- projection vs served


def _steps(*ranks):
    """step_times of one point: (batch, draft_ms) per rank."""
    return [
        {"main_num_reqs": b, "main": {"target_ms": 3.0, "draft_ms": d, "step_ms": 6.0}}
        for b, d in ranks
    ]


def test_projection_beside_the_served_runs_splits_what_pp2_adds(tmp_path):
    proj = {
        "hidden_size": 1000,
        "rows": [
            {"acceptance_length": 4.0, "concurrency": 4, "pp1_tok_s_model": 1000.0,
             "pp2_one_wave_tok_s": 990.0, "pp2_two_waves_tok_s": 1500.0, "t_x_ms": 0.05,
             "t_tok_ms": 0.05, "bubble_share_one_wave": 0.25,
             "activation_bytes": 4_000_000 + 4 * 1000 * 2 * 2},
        ],
        "nospec_rows": [
            {"concurrency": 4, "pp1_tok_s_model": 400.0, "pp2_one_wave_tok_s": 396.0,
             "pp2_two_waves_tok_s": 750.0},
        ],
    }  # fmt: skip
    d1 = serve_point("pp1_dspark", 4.0, 4, 1000.0, tpot=(1.5, 2.0), measured=4.0)
    d2 = serve_point("pp2_dspark", 4.0, 4, 400.0, tpot=(4.0, 5.0), measured=4.0)
    d1["step_times"], d2["step_times"] = _steps((4, 1.0)), _steps((2, None), (2, 2.0))
    runs = [
        serve_run([serve_point("pp1_nospec", None, 4, 400.0, tpot=(5.0, 6.0)), d1]),
        serve_run([serve_point("pp2_nospec", None, 4, 200.0, tpot=(10.0, 11.0)), d2]),
    ]
    files = [_write(tmp_path, f"serve_pp_one_gpu_pp{i + 1}.json", r) for i, r in enumerate(runs)]
    (r,) = pp_projection.served_comparison(proj, files)["rows"]
    assert r["meas_quot"] == pytest.approx((400 / 200) / (1000 / 400))  # 0.8: goal (b) missed
    assert r["proj_quot_one_wave"] == pytest.approx((990 / 396) / (1000 / 400))
    assert r["meas_added_ms_nospec"] == pytest.approx(5.0)  # (10 - 5) ms x 1 token
    assert r["meas_added_ms_dspark"] == pytest.approx(10.0)  # (4 - 1.5) ms x 4 tokens
    assert r["micro_batches"] == 2 and r["extra_draft_ms"] == pytest.approx(3.0)  # 2 x 2 - 1
    assert r["rest_ms"] == pytest.approx(2.0) and r["more_bytes"] == 4_000_000
    assert r["implied_gbps"] == pytest.approx(2.0)
    md = pp_projection.served_markdown(pp_projection.served_comparison(proj, files))
    assert "| 4 | 4 | 2.50x / 2.50x | 2.50x / 2.00x / 2.00x | 1.000 / 0.800 / **0.800** |" in md
    assert "| 5.0 | 2 x 2.00 (1.00) | 3.0 | 2.0 | 4.0 | 2.00 |" in md
    assert "missed at: AL 4 C=4 (0.800)." in md


def test_the_docs_comparison_block_is_what_the_script_writes_from_the_recorded_json(tmp_path):
    root = Path(__file__).resolve().parents[3]
    doc = (root / "docs/performance-bound.md").read_text()
    block = doc.split("<!-- BEGIN SERVED_VS_PROJECTION -->\n", 1)[1].split("\n<!-- END", 1)[0]
    res = json.loads((root / "docs/results/perf_qwen3-8b.json").read_text())
    from benchmarks import perf_real_shapes as perf

    p = pp_projection.project(perf.merge_results([res]))
    served = [root / f"docs/results/serve_pp_one_gpu_pp{i}.json" for i in (1, 2)]
    assert block == pp_projection.served_markdown(pp_projection.served_comparison(p, served))


def test_dry_run_pd_with_a_pp2_producer(capsys):
    out = _dry(capsys, "--configs", "pd_pp2_dspark,agg_dspark_kv", "--concurrency", "4")
    nodes = _launchers(out)
    n0, n1 = (
        nodes["pd_pp2_dspark producer node 0"],
        nodes["pd_pp2_dspark producer node 1 (headless)"],
    )
    dec = nodes["pd_pp2_dspark decoder"]

    def opt(argv, flag):
        return argv[argv.index(flag) + 1]

    def kv_cfg(who):
        line = next(x for x in out.splitlines() if x.startswith(f"  {who}: /"))
        flag = "--kv-transfer-config "
        return json.JSONDecoder().raw_decode(line, line.index(flag) + len(flag))[0]

    a, b = (
        kv_cfg("pd_pp2_dspark producer node 0"),
        kv_cfg("pd_pp2_dspark producer node 1 (headless)"),
    )
    assert a == b and a["kv_role"] == "kv_producer" and a["engine_id"]  # one engine, two stages
    assert kv_cfg("pd_pp2_dspark decoder")["kv_role"] == "kv_consumer"
    for rank, node in enumerate((n0, n1)):
        argv = " ".join(node["argv"])
        assert "-pp 2" in argv and f"--nnodes 2 --node-rank {rank}" in argv
    assert "--headless" in n1["argv"] and "-pp 1" in " ".join(dec["argv"])
    assert n0["env"]["NCCL_HOSTID"] != n1["env"]["NCCL_HOSTID"] != dec["env"]["NCCL_HOSTID"]
    boot = n0["env"]["VLLM_MOONCAKE_BOOTSTRAP_PORT"]
    assert (
        n1["env"]["VLLM_MOONCAKE_BOOTSTRAP_PORT"]
        == boot
        != dec["env"]["VLLM_MOONCAKE_BOOTSTRAP_PORT"]
    )
    kv = [int(opt(x["argv"], "--kv-cache-memory-bytes")) for x in (n0, n1, dec)]
    assert sum(kv) == int(opt(nodes["agg_dspark_kv"]["argv"], "--kv-cache-memory-bytes"))
    assert kv[0] == kv[1] == 3 << 30  # the producer's 6 GiB over its two stages
    plan = serve.kv_plan(serve.CONFIGS["pd_pp2_dspark"], 16.0, 24.0, 0.75)
    assert plan["producer_stages"] == [3 << 30, 3 << 30] and plan["decoder"] == 18 << 30


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    os.environ.get("DSPARK_PD_SERVE_HAND") != "1",
    reason="hand run (about 30 s, vLLM's bench client in process): DSPARK_PD_SERVE_HAND=1",
)
def test_pd_group_end_to_end_against_stand_in_servers(tmp_path, monkeypatch):
    """The whole ``--configs pd`` run (start, readiness, bootstrap, proxy, acceptance switch on
    the decoder, ``vllm bench serve`` through the proxy, counters, PD evidence, shutdown) with
    tests/support/fake_vllm_serve.py in place of ``vllm serve``: what the GPU command does,
    minus the model."""
    from support.fake_vllm_serve import use_instead_of_vllm_serve

    import dspark_dev.serve_demo as serve_demo

    use_instead_of_vllm_serve(monkeypatch, serve_demo)
    out = tmp_path / "out"
    rc = serve.main(["--configs", "pd", "--budget-s", "150", "--concurrency", "1,8",
                     "--input-len", "64", "--output-len", "32", "--out", str(out)])  # fmt: skip
    res = json.loads((out / "serve_pp_one_gpu_pd.json").read_text())
    assert rc == 0, res
    assert {n: s["outcome"] for n, s in res["servers"].items()} == {
        "pd_dspark": "ok",
        "agg_dspark_kv": "ok",
    }
    assert all(res["servers"]["pd_dspark"]["producer_log_markers"].values())
    transport = res["meta"]["pd_transport"]["pd_dspark"]
    assert (transport["connector"], transport["mooncake_protocol"]) == ("mooncake", "tcp")
    assert set(res["servers"]["pd_dspark"]["mooncake_transport"]) == {"protocols", "transports"}
    assert not any(s.get("left_running") for s in res["servers"].values())
    points = {(p["config"], p["concurrency"]): p for p in res["points"]}
    assert set(points) == {(c, n) for c in ("pd_dspark", "agg_dspark_kv") for n in (1, 8)}
    for (config, _c), p in points.items():
        assert p["bench"]["completed"] == p["num_prompts"] and not p["bench"].get("failed")
        assert p["measured_acceptance_length"] == pytest.approx(4.0)  # the decoder's counters
        if config == "pd_dspark":
            pd = p["pd"]
            assert pd["proxy"]["requests"] >= p["num_prompts"] and not pd["proxy"]["errors"]
            hits = pd["decoder_kv"]["vllm:external_prefix_cache_hits_total"]
            assert hits == pd["decoder_kv"]["vllm:prompt_tokens_total"] > 0
            assert pd["producer_spec"]["num_draft_tokens"] == 0
            assert "error" not in pd["kv_xfer"], pd["kv_xfer"]
            hops = pd["hops"]
            # vllm bench serve's own test request before the run passes the proxy too
            assert len(hops["records"]) == hops["summary"]["completed"] >= p["num_prompts"]
            assert all(r["stream"] and r["ok"] for r in hops["records"])
    md = plot.markdown(plot.load([out / "serve_pp_one_gpu_pd.json"]), ["pd.json"])
    assert "| 3.99 | 8 |" in md and "| 100.0% | 0 | 0 | 1 / 1 |" in md


def test_dry_run_tap_partials_group_sets_the_mode_on_every_launcher(capsys, tmp_path):
    """Group ``tap_partials``: raw taps, the partial in the intermediate tensors and on the side
    channel, the knob on both launchers of its deployment only; a make_tiny_models folder (the
    wide pair's layout) is taken as the model folder."""
    from vllm_dspark_pp.tiny_models import DRAFT_DIR_NAME, TARGET_DIR_NAME

    for name in (TARGET_DIR_NAME, DRAFT_DIR_NAME):
        (tmp_path / name).mkdir()
    out = _dry(capsys, "--configs", "tap_partials", "--model-dir", str(tmp_path))
    launchers = _launchers(out)
    want = {"pp2_dspark": None, "pp2_dspark_taps_dict": "1", "pp2_dspark_taps_side": "side"}
    for cfg, mode in want.items():
        for node in (f"{cfg} node 0", f"{cfg} node 1 (headless)"):
            assert launchers[node]["env"].get("VLLM_DSPARK_PP_TAP_PARTIALS") == mode, node
            assert str(tmp_path / TARGET_DIR_NAME) in launchers[node]["argv"], node


def test_a_workload_longer_than_the_models_positions_is_refused_before_any_server(capsys):
    """2026-12-06 on the GPU: ``--configs ksweep_pp2 --model-dir models/tiny-pair --workload
    decode`` started sixteen launchers and every one died in vLLM's config check (1280 > 1024
    positions). The dry run now refuses it and names the output length that fits."""
    tiny = str(serve.REPO / "models" / "tiny-pair")
    args = ["--configs", "ksweep_pp2", "--model-dir", tiny, "--workload", "decode",
            "--interleave", "--repeats", "3"]  # fmt: skip
    with pytest.raises(SystemExit, match=r"max_position_embeddings 1024 .*--output-len 768"):
        _dry(capsys, *args)
    out = _dry(capsys, *args, "--output-len", "768")
    assert "--max-model-len 1024 " in out


def test_every_k_sweep_server_starts_with_a_synthetic_length_vllm_accepts(capsys):
    """2026-12-07 on the GPU: ``--configs ksweep_pp2 --acceptance-lengths 3.99`` started
    ``pp2_dspark_k1`` and ``k2`` with ``synthetic_acceptance_length`` 3.99, which vLLM refuses
    above ``1 + k`` (``must be in [1, 3]``): both never became ready. The start value now stops at
    ``1 + k`` (every point sets its own length through the hook). Checked here with vLLM's own
    resolver on every launcher's ``--speculative-config``."""
    from vllm.config import SpeculativeConfig

    tiny = str(serve.REPO / "models" / "tiny-pair")
    out = _dry(capsys, "--configs", "ksweep_pp2,ksweep_pp1", "--model-dir", tiny, "--workload",
               "decode", "--output-len", "768", "--acceptance-lengths", "3.99")  # fmt: skip
    specs = [node["spec"] for node in _launchers(out).values()]
    assert len(specs) == 2 * 8 + 8  # PP=2: two launchers per server, eight servers per sweep
    for spec in specs:
        k, length = spec["num_speculative_tokens"], spec["synthetic_acceptance_length"]
        SpeculativeConfig._resolve_synthetic_acceptance_rates(k, None, length)  # raises if not
        assert length == min(3.99, 1.0 + k)


def test_cache_root_keeps_each_launchers_cache_and_the_shape_at_fixed_paths(capsys, tmp_path):
    """``--cache-root``: the shape folder (its path is part of vLLM's compile-cache key) and one
    cache folder per configuration and launcher under the root, so that the next call's servers
    load their compiled graphs; without it every call gets fresh folders, as before."""
    root = tmp_path / "keep"
    args = ["--configs", "pp1_dspark,pp2_dspark"]

    def caches(nodes):
        return {name: v["env"]["VLLM_CACHE_ROOT"] for name, v in nodes.items()}

    nodes = _launchers(_dry(capsys, *args, "--cache-root", str(root)))
    assert caches(nodes) == {
        "pp1_dspark": str(root / "vllm-cache" / "pp1_dspark"),
        "pp2_dspark node 0": str(root / "vllm-cache" / "pp2_dspark" / "node0"),
        "pp2_dspark node 1 (headless)": str(root / "vllm-cache" / "pp2_dspark" / "node1"),
    }
    target = str(root / "shapes" / "qwen3-8b" / "target")
    assert all(v["argv"][2] == target for v in nodes.values())
    again = _launchers(_dry(capsys, *args, "--cache-root", str(root)))
    assert caches(again) == caches(nodes)  # the next call: the same folders
    fresh = caches(_launchers(_dry(capsys, *args)))
    assert not any(str(root) in path for path in fresh.values())
    assert len(set(fresh.values())) == 3
    line = "(EngineCore pid=1) INFO [decorators.py:326] [backbone] " + serve.CACHE_HIT_LINE + " /x"
    assert serve.compile_cache_hits([line + "\n" + line, "no hit", line]) == 3


def test_a_shape_gets_the_draft_fc_the_tap_partials_read(tmp_path):
    """At a dummy-weight shape the tap partials found no draft checkpoint and kept raw taps (the
    2026-12-06 list's goal (e) call would have measured raw taps three times):
    write_context_linear gives the shape's draft one random ``fc.weight`` that the stages' lookup
    takes (the control: the same folder without it answers why not)."""
    import dataclasses

    from benchmarks import real_shapes
    from vllm_dspark_pp.protocol import tap_partials as tp

    small = dataclasses.replace(real_shapes.SHAPES["qwen3-4b"], name="small", hidden_size=64)
    paths = real_shapes.write_shape(small, tmp_path)
    cols = len(small.target_layer_ids) * 64
    assert isinstance(tp.find_linear(paths.draft, "fc", cols), str)  # config only: raw taps
    info = real_shapes.write_context_linear(paths, small, write=False)
    assert not (tmp_path / "small" / "dspark-draft" / "model.safetensors").exists()
    assert info["shape"] == [64, cols] and info["bytes"] == 64 * cols * 2 and not info["written"]
    info = real_shapes.write_context_linear(paths, small)
    hit = tp.find_linear(paths.draft, "fc", cols)
    assert not isinstance(hit, str), hit
    assert (hit.key, hit.shape, hit.dtype) == ("fc.weight", (64, cols), "BF16")
    assert info["written"] and info["file"] == str(Path(paths.draft) / hit.file)
    again = tmp_path / "again"
    real_shapes.write_context_linear(real_shapes.write_shape(small, again), small)
    same = (again / "small" / "dspark-draft" / "model.safetensors").read_bytes()
    assert same == Path(info["file"]).read_bytes()  # seeded: every call writes the same W


def test_only_a_tap_partials_run_at_a_shape_writes_the_draft_fc(tmp_path):
    """The benchmark asks for the fc exactly when a selected configuration turns the partials on
    (a dry run describes it and writes nothing); raw-tap runs and ``--model-dir`` runs get none."""

    def prepared(*args):
        a = serve.parse_args(["--dry-run", "--out", str(tmp_path / "o"), *args])
        serve.prepare_models(a, tmp_path / "w")
        return getattr(a, "tap_weights", None)

    got = prepared("--configs", "tap_partials", "--shape", "qwen3-4b")
    assert got["shape"] == [2560, 5 * 2560] and got["written"] is False
    assert got["file"].endswith("shapes/qwen3-4b/dspark-draft/model.safetensors")
    assert prepared("--configs", "pp2_dspark", "--shape", "qwen3-4b") is None
    tiny = str(serve.REPO / "models" / "tiny-pair")
    assert prepared("--configs", "tap_partials", "--model-dir", tiny) is None
