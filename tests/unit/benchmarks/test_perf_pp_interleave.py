"""CPU tests of benchmarks/serve_pp_one_gpu.py's interleaved comparison, workloads and CUDA MPS
option (issue 44 items 1-2) and of benchmarks/mps.py: the rotation order and the equal prompt
counts (the driver's own loop with its measurements stood in), the steady-state prompt count and
its budget trim, the per-point statistics and same-call ratios from fake ``vllm bench serve``
results, the workload selection, and the MPS daemon's start, probe and stop against a fake
``nvidia-cuda-mps-control`` on PATH. No server or GPU; nothing is timed."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.perf_records import dry_run_launchers as _launchers

from benchmarks import mps
from benchmarks import serve_pp_one_gpu as serve

PAIR = ["--configs", "pp1_dspark,pp2_dspark"]


# --------------------------------------------------------------------------- arguments
def test_workloads_set_the_dataset_shape_and_the_result_name():
    a = serve.parse_args(PAIR)
    assert (a.workload, a.input_len, a.output_len) == ("mixed", 1024, 256)
    assert a.guess_prefill_ms == pytest.approx(40.0) and a.tag == "pp1_dspark-pp2_dspark"
    d = serve.parse_args([*PAIR, "--workload", "decode", "--interleave", "--repeats", "3"])
    assert (d.input_len, d.output_len) == serve.WORKLOADS["decode"] == (128, 1024)
    assert d.guess_prefill_ms == pytest.approx(5.0)  # 40 ms per 1024 prompt tokens
    assert d.tag == "pp1_dspark-pp2_dspark_decode_x3"  # two calls to one $OUT: two files
    o = serve.parse_args([*PAIR, "--workload", "decode", "--output-len", "512"])
    assert (o.input_len, o.output_len) == (128, 512)  # an explicit length overrides its part
    with pytest.raises(SystemExit):
        serve.parse_args([*PAIR, "--workload", "prefill"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--interleave", "--repeats", "2"], "at least 3"),
        (["--interleave"], "at least 3"),
        (["--repeats", "3"], "only with --interleave"),
        (["--interleave", "--repeats", "3", "--start", "sequential"], "start together"),
        (["--mps", "50"], "one percentage per PP stage"),
        (["--mps", "50,0"], "1-100"),
        (["--mps", "fifty,50"], "1-100"),
    ],
)
def test_refused_interleave_and_mps_arguments(args, message):
    with pytest.raises(SystemExit, match=message):
        serve.parse_args([*PAIR, *args])


def test_interleave_needs_two_configurations_and_mps_no_pd():
    with pytest.raises(SystemExit, match="two configurations"):
        serve.parse_args(["--configs", "pp2_dspark", "--interleave", "--repeats", "3"])
    with pytest.raises(SystemExit, match="PD configurations"):
        serve.parse_args(["--configs", "pd", "--mps", "50,50"])
    a = serve.parse_args([*PAIR, "--mps", "60,40", "--interleave", "--repeats", "4"])
    assert a.mps_shares == [60, 40] and a.tag.endswith("_x4_mps60-40")


# --------------------------------------------------------------------------- rotation, prompts
def test_rotation_order_fixed_and_alternate():
    assert serve.rotation_order(["A", "B"], 3) == [
        (0, "A"), (0, "B"), (1, "A"), (1, "B"), (2, "A"), (2, "B"),
    ]  # fmt: skip
    assert [n for _r, n in serve.rotation_order(["A", "B"], 4, "alternate")] == list("ABBAABBA")
    three = serve.rotation_order(["A", "B", "C"], 3)
    assert [r for r, _n in three] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def _model(tpot_ms=5.0, **kw):
    base = dict(output_len=200, prefill_ms=0.0, point_s=0.0)
    return serve.CostModel(tpot_ms=tpot_ms, **{**base, **kw})  # a wave: tpot_ms / 5 seconds


def test_steady_prompts_last_the_minimum_on_the_fastest_configuration():
    assert serve.steady_prompts(8, 60.0, 2.0, 16) == 240  # 30 waves of 8
    assert serve.steady_prompts(8, 1.0, 2.0, 16) == 16  # the minimum prompt count wins
    assert serve.steady_prompts(32, 0.0, 0.0, 1) == 32  # at least one wave
    fast, slow = _model(5.0), _model(10.0)  # waves of 1 s and 2 s
    assert serve.wanted_prompts(16, [slow, fast], 60.0, 16) == 60 * 16
    assert serve.interleaved_cost_s(16, 160, [fast, slow], 3) == pytest.approx(3 * 30.0)


def test_an_interleaved_point_is_trimmed_to_whole_waves_for_every_run_or_skipped():
    models = [_model(5.0, point_s=1.0), _model(10.0, point_s=1.0)]  # runs: 1 + waves x (1, 2) s
    assert serve.plan_interleaved_point(8, models, 3, 80, 1000.0) == (80, None)
    n, why = serve.plan_interleaved_point(8, models, 3, 80, 66.0)  # 6 s fixed, 9 s per wave
    assert n == 6 * 8 and "6 of 10 waves per run" in why and "3 x 2 runs" in why
    n, why = serve.plan_interleaved_point(8, models, 3, 80, 10.0)
    assert n == 0 and "one wave of 8 per run" in why


def test_bench_argv_asks_for_the_percentiles_the_repeats_record():
    argv = serve.bench_argv(
        url="U", model="M", label="L", concurrency=8, prompts=16, seed=1, input_len=128,
        output_len=1024, result_dir="D", result_name="R",
    )  # fmt: skip
    opt = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert {"ttft", "tpot", "itl"} <= set(opt["--percentile-metrics"].split(","))
    assert {"50", "99"} <= set(opt["--metric-percentiles"].split(","))
    # vLLM names them median_<metric>_ms and p99_<metric>_ms (vllm/benchmarks/serve.py)
    assert all(
        m == "output_throughput" or m == "duration" or m.split("_")[0] in ("median", "p99")
        for m in serve.REPEAT_METRICS
    )


# --------------------------------------------------------------------------- statistics
def _point(config, c, repeat, tok_s, *, al=3.99, n=64, tpot=5.0, trimmed=None):
    return {
        "config": config, "acceptance_length": al, "point_al": al, "concurrency": c,
        "repeat": repeat, "slot": None, "num_prompts": n, "full_prompts": 80, "trimmed": trimmed,
        "measured_acceptance_length": al,
        "bench": {"output_throughput": tok_s, "median_ttft_ms": 40.0, "p99_ttft_ms": 90.0,
                  "median_tpot_ms": tpot, "p99_tpot_ms": 2 * tpot, "median_itl_ms": tpot,
                  "p99_itl_ms": 3 * tpot, "duration": 61.0},
    }  # fmt: skip


def test_summary_statistics_and_same_call_ratios_from_fake_results():
    a_tps, b_tps = [100.0, 110.0, 90.0], [90.0, 88.0, 81.0]
    points = [_point("pp1_dspark", 16, r, t, tpot=2.0) for r, t in enumerate(a_tps)]
    points += [_point("pp2_dspark", 16, r, t, tpot=4.0) for r, t in enumerate(b_tps)]
    points.append({"config": "pp1_dspark", "concurrency": 16, "num_prompts": 64})  # not a repeat
    [entry] = serve.interleave_summary(points, ["pp1_dspark", "pp2_dspark"], 3)
    assert (entry["acceptance_length"], entry["concurrency"]) == (3.99, 16)
    assert entry["equal_prompts"] and entry["num_prompts"] == [64]
    assert entry["wanted_prompts"] == [80] and entry["trimmed"] is None
    a = entry["configs"]["pp1_dspark"]
    assert [x["repeat"] for x in a["repeats"]] == [0, 1, 2]
    assert a["repeats"][1]["output_throughput"] == 110.0 and a["repeats"][0]["p99_itl_ms"] == 6.0
    st = a["stats"]["output_throughput"]
    assert (st["n"], st["mean"], st["min"], st["max"]) == (3, 100.0, 90.0, 110.0)
    assert st["spread"] == pytest.approx(0.2)
    r = entry["ratios"]["pp2_dspark/pp1_dspark"]
    assert r["rotations"] == 3
    tp = r["output_throughput"]
    assert tp["ratio_of_means"] == pytest.approx(sum(b_tps) / sum(a_tps))
    assert tp["per_rotation"] == pytest.approx([0.9, 0.8, 0.9])
    assert (tp["min"], tp["max"]) == (pytest.approx(0.8), pytest.approx(0.9))
    assert r["median_tpot_ms"]["ratio_of_means"] == pytest.approx(2.0)
    assert "duration" not in r  # a run's length is no comparison


def test_unequal_counts_and_a_missing_repeat_show_in_the_summary():
    points = [_point("A", 8, r, 100.0 + r) for r in range(3)]
    points += [_point("B", 8, 0, 50.0, trimmed="budget: x"), _point("B", 8, 2, 60.0, n=32)]
    [entry] = serve.interleave_summary(points, ["A", "B"], 3)
    assert not entry["equal_prompts"] and entry["num_prompts"] == [32, 64]
    assert entry["trimmed"] == "budget: x"
    r = entry["ratios"]["B/A"]
    assert r["rotations"] == 2  # only rotations that measured both
    assert r["output_throughput"]["per_rotation"] == pytest.approx([0.5, 60.0 / 102.0])
    assert serve.spread_stats([]) is None and serve.spread_stats([None, 2.0])["n"] == 1


# --------------------------------------------------------------------------- the loop
class _Calls:
    """Stands in for the Runner methods that talk to servers; records the measurements."""

    def __init__(self, monkeypatch, tok_s: dict[str, list[float]], tpot: dict | None = None):
        """``tpot``: what a probe measures per configuration (None: a probe measures nothing,
        as a failed TPOT read would, and the guess stays)."""
        self.measured: list[tuple] = []
        self.probes: list[tuple] = []
        self.al_set: list[tuple] = []
        calls = self

        def measure(rn, cfg, al, ali, c, n, *, why, n_full, repeat=None, extra=None):
            if extra.get("probe"):
                seed = serve.point_seed(ali or 0, c) + serve.PROBE_SEED_OFFSET
                calls.probes.append((cfg.name, al, c, n, repeat, seed))
                if tpot:
                    rn.tpot[cfg.name] = tpot[cfg.name]
                return None, False
            seed = serve.point_seed(ali or 0, c, repeat or 0)
            calls.measured.append((cfg.name, al, c, n, repeat, extra["slot"], seed))
            p = _point(cfg.name, c, repeat, tok_s[cfg.name][repeat], al=al, n=n, trimmed=why)
            p.update(extra, full_prompts=n_full)
            rn.res.add("points", p)
            return p, False

        monkeypatch.setattr(serve.Runner, "start", lambda rn, names: None)
        monkeypatch.setattr(serve.Runner, "ready", lambda rn, name: True)
        monkeypatch.setattr(serve.Runner, "lost", lambda rn, cfg: False)
        monkeypatch.setattr(
            serve.Runner, "set_al", lambda rn, cfg, al: calls.al_set.append((cfg.name, al))
        )
        monkeypatch.setattr(serve.Runner, "measure", measure)


def _run(tmp_path, args, budget_s=10_000.0, configs=PAIR[1], deps=None):
    a = serve.parse_args(["--configs", configs, "--interleave", "--repeats", "3", *args])
    res = serve.Results(tmp_path / "r.json", {"meta": {}, "servers": {}, "points": [],
                                              "skipped": []})  # fmt: skip
    rc = serve.run_interleaved(
        a,
        deps or {},
        None,
        res,
        serve.Log(None),
        time.monotonic() + serve.STOP_RESERVE_S + budget_s,
    )
    return rc, res.data


def test_the_loop_rotates_configurations_with_equal_prompts_per_point(tmp_path, monkeypatch):
    calls = _Calls(monkeypatch, {"pp1_dspark": [100.0, 104.0, 96.0], "pp2_dspark": [90.0] * 3})
    rc, data = _run(tmp_path, ["--acceptance-lengths", "3.99,6.1", "--concurrency", "8,16"])
    assert rc == 0 and not data["skipped"]
    assert calls.al_set == [("pp1_dspark", 3.99), ("pp2_dspark", 3.99),
                            ("pp1_dspark", 6.1), ("pp2_dspark", 6.1)]  # fmt: skip
    assert len(calls.measured) == 2 * 2 * 3 * 2  # ALs x Cs x repeats x configurations
    for i in range(0, len(calls.measured), 6):
        point = calls.measured[i : i + 6]
        names = [m[0] for m in point]
        assert names == ["pp1_dspark", "pp2_dspark"] * 3  # A B A B A B
        assert [m[4] for m in point] == [0, 0, 1, 1, 2, 2] and [m[5] for m in point] == [*range(6)]
        assert len({m[3] for m in point}) == 1  # one prompt count for every run of the point
        assert len({(m[1], m[2]) for m in point}) == 1
        seeds = [m[6] for m in point]
        assert seeds[0] == seeds[1] != seeds[2] == seeds[3]  # same prompts within a rotation
    # with the guessed TPOT a run must last --min-run-s: 6 ms x 256 + 8 x 40 ms per wave of 8
    assert calls.measured[0][3] == 8 * 33
    assert len({m[6] for m in calls.measured if m[0] == "pp2_dspark"}) == 12  # never twice
    summary = data["interleaved"]
    assert [(e["acceptance_length"], e["concurrency"]) for e in summary] == [
        (3.99, 8), (3.99, 16), (6.1, 8), (6.1, 16),
    ]  # fmt: skip
    tp = summary[0]["ratios"]["pp2_dspark/pp1_dspark"]["output_throughput"]
    assert tp["ratio_of_means"] == pytest.approx(0.9)
    assert tp["per_rotation"] == pytest.approx([0.9, 90 / 104, 90 / 96])


def test_a_probe_wave_sets_the_prompt_count_from_the_measured_tpot(tmp_path, monkeypatch):
    """The 2026-12-07 adaptive_stock call asked for runs of 10 s; the prompt count came from the
    guessed 6 ms TPOT, the tiny pair's was 1.2 ms, and every run lasted 4 s. With the probe, each
    server serves one wave of C on prompts of its own before its first point, and the point's
    count comes from what the probe measured."""
    args = ["--acceptance-lengths", "3.99", "--concurrency", "32,64", "--workload", "decode",
            "--output-len", "768", "--min-run-s", "10"]  # fmt: skip
    calls = _Calls(monkeypatch, {"pp1_dspark": [1.0] * 3, "pp2_dspark": [1.0] * 3},
                   tpot={"pp1_dspark": 1.2, "pp2_dspark": 2.0})  # fmt: skip
    rc, _data = _run(tmp_path, args)
    assert rc == 0
    # one wave on each server, at the first point only, before any measured run
    assert calls.probes == [
        ("pp1_dspark", 3.99, 32, 32, None, serve.point_seed(0, 32) + serve.PROBE_SEED_OFFSET),
        ("pp2_dspark", 3.99, 32, 32, None, serve.point_seed(0, 32) + serve.PROBE_SEED_OFFSET),
    ]  # fmt: skip
    repeats_seeds = {m[6] for m in calls.measured}
    assert not repeats_seeds & {p[5] for p in calls.probes}  # never a measured run's prompts
    # the fastest server's wave: 768 x 1.2 ms + 32 prompts x 5 ms prefill = 1.08 s: 10 waves
    # for 10 s; from the guess (768 x 6 ms + 0.16 s = 4.8 s) it would have been 4 waves
    wave = (768 * 1.2 + 32 * 40.0 * 128 / 1024) / 1e3
    n32 = {m[3] for m in calls.measured if m[2] == 32}
    assert n32 == {32 * -(-10 // wave)} == {320}
    # without the probe the guess sets it, as before
    calls = _Calls(monkeypatch, {"pp1_dspark": [1.0] * 3, "pp2_dspark": [1.0] * 3},
                   tpot={"pp1_dspark": 1.2, "pp2_dspark": 2.0})  # fmt: skip
    rc, _data = _run(tmp_path, [*args, "--no-probe"])
    assert rc == 0 and not calls.probes
    assert {m[3] for m in calls.measured if m[2] == 32} == {128}


def _real_measure(monkeypatch, walls: list[float], fail: set[int] = frozenset()):
    """Runner.measure as the driver runs it, with ``vllm bench serve`` and the counters stood
    in: run i lasts ``walls[i]`` (its TPOT 1.2 ms) and fails when i is in ``fail``. Returns the
    argv of every run."""
    import dspark_dev.metrics as metrics
    import dspark_dev.serve_demo as serve_demo

    argvs: list[list[str]] = []
    clock = [0.0]

    def bench(argv, timeout_s, on_timeout):
        i = len(argvs)
        argvs.append(argv)
        clock[0] += walls[i]
        if i in fail:
            return None, "cut after 5 s, at the budget's deadline (server stopped)"
        n = int(argv[argv.index("--num-prompts") + 1])
        return {"output_throughput": 100.0, "median_tpot_ms": 1.2, "duration": walls[i],
                "completed": n, "failed": 0}, ""  # fmt: skip

    monkeypatch.setattr(serve, "run_bench_in_process", bench)
    monkeypatch.setattr(serve.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(serve_demo, "spec_metrics", lambda url, settle_s: {})
    monkeypatch.setattr(metrics, "counter_delta", lambda a, b: {})
    return argvs


def _runner(tmp_path, args, budget_s=10_000.0):
    a = serve.parse_args(["--configs", "pp1_dspark,pp2_dspark", "--interleave", "--repeats", "3",
                          "--no-step-times", *args])  # fmt: skip
    res = serve.Results(tmp_path / "r.json", {"meta": {}, "servers": {}, "points": [],
                                              "skipped": []})  # fmt: skip
    dep = SimpleNamespace(url="http://x", dead_nodes=lambda: [], stop=lambda: None)
    deps = {n: dep for n in ("pp1_dspark", "pp2_dspark")}
    paths = SimpleNamespace(target="/m")
    return serve.Runner(a, deps, paths, res, serve.Log(None), budget_s + serve.STOP_RESERVE_S)


def test_a_real_probe_sets_the_tpot_not_the_calibration_on_prompts_of_its_own(
    tmp_path, monkeypatch
):
    """Through Runner.measure itself: the probe's run asks ``vllm bench serve`` for one wave
    on the probe's seed, records ``probe`` and no repeat, and leaves the calibration alone (a
    one-wave run is mostly the guessed fixed part: its ratio would scale the later waves)."""
    argvs = _real_measure(monkeypatch, walls=[1.5, 12.0])
    rn = _runner(tmp_path, ["--workload", "decode", "--output-len", "768"])
    cfg = serve.CONFIGS["pp1_dspark"]
    assert rn.probe(cfg, 3.99, 0, 32) is False
    opt = {argvs[0][i]: argvs[0][i + 1] for i in range(len(argvs[0]) - 1)}
    assert opt["--num-prompts"] == "32"
    assert int(opt["--seed"]) == serve.point_seed(0, 32) + serve.PROBE_SEED_OFFSET
    assert opt["--result-filename"].endswith("_probe.json")
    [p] = rn.res.data["points"]
    assert p["probe"] is True and "repeat" not in p
    assert rn.tpot == {"pp1_dspark": 1.2} and rn.calib == {}
    rn.measure(cfg, 3.99, 0, 32, 320, why=None, n_full=320, repeat=0, extra={"slot": 0})
    assert "pp1_dspark" in rn.calib  # a measured run calibrates
    assert int(argvs[1][argvs[1].index("--seed") + 1]) == serve.point_seed(0, 32, 0)


def test_probes_alone_are_no_successful_call_and_a_failed_probe_says_it_was_one(
    tmp_path, monkeypatch
):
    _real_measure(monkeypatch, walls=[1.0, 1.0], fail={1})
    rn = _runner(tmp_path, [])
    for name in ("pp1_dspark", "pp2_dspark"):
        rn.res.data["servers"][name] = {"outcome": "ok"}
    rn.probe(serve.CONFIGS["pp1_dspark"], 3.99, 0, 8)
    assert rn.probe(serve.CONFIGS["pp2_dspark"], 3.99, 0, 8) is True  # cut: measure no more
    [skip] = rn.res.data["skipped"]
    assert skip["probe"] is True and skip["why"].startswith("bench failed: cut after")
    assert rn.outcome() == 1  # one probe recorded, nothing measured


def test_no_probe_where_it_would_leave_the_point_no_wave_per_run(tmp_path, monkeypatch):
    """A probe must not eat the point's budget: where the probes and one wave per run of the
    point do not fit the time left by the guess, no server is probed and the guess sets the
    count (the point then runs, shortened, as before the probe existed)."""
    # by the guess one run of a wave of 8 costs 4 s + 256 x 6 ms + 8 x 40 ms = 5.86 s: the
    # point's 3 x 2 runs 35.1 s, the two probes 11.7 s more
    args = ["--acceptance-lengths", "3.99", "--concurrency", "8"]
    tok_s, tpot = (
        {"pp1_dspark": [1.0] * 3, "pp2_dspark": [1.0] * 3},
        {"pp1_dspark": 1.2, "pp2_dspark": 2.0},
    )
    calls = _Calls(monkeypatch, tok_s, tpot=tpot)
    rc, data = _run(tmp_path, args, 40.0)
    assert not calls.probes and rc == 0 and len(calls.measured) == 6
    assert data["interleaved"][0]["trimmed"].startswith("budget:")
    calls = _Calls(monkeypatch, tok_s, tpot=tpot)
    rc, _data = _run(tmp_path, args, 60.0)
    assert [p[0] for p in calls.probes] == ["pp1_dspark", "pp2_dspark"] and rc == 0


def test_no_spec_against_dspark_rotates_in_every_als_point(tmp_path, monkeypatch):
    calls = _Calls(monkeypatch, {"pp2_nospec": [50.0] * 3, "pp2_dspark": [100.0, 90.0, 110.0]})
    a = ["--acceptance-lengths", "3.99,6.1", "--concurrency", "16"]
    rc, data = _run(tmp_path, a, configs="pp2_nospec,pp2_dspark")
    assert rc == 0 and calls.al_set == [("pp2_dspark", 3.99), ("pp2_dspark", 6.1)]
    nospec = [m for m in calls.measured if m[0] == "pp2_nospec"]
    assert [m[1] for m in nospec] == [None] * 6  # no AL of its own, measured at every AL's point
    assert len({m[6] for m in nospec}) == 6  # its server never sees one AL's prompts again
    by_point = {(e["acceptance_length"], e["concurrency"]): e for e in data["interleaved"]}
    assert set(by_point) == {(3.99, 16), (6.1, 16)}
    tp = by_point[(6.1, 16)]["ratios"]["pp2_dspark/pp2_nospec"]["output_throughput"]
    assert tp["ratio_of_means"] == pytest.approx(2.0) and tp["max"] == pytest.approx(2.2)


def test_a_short_budget_shortens_every_run_of_a_point_alike(tmp_path, monkeypatch):
    calls = _Calls(monkeypatch, {"pp1_dspark": [1.0] * 3, "pp2_dspark": [1.0] * 3})
    rc, data = _run(tmp_path, ["--acceptance-lengths", "3.99", "--concurrency", "8"], 120.0)
    assert rc == 0 and len(calls.measured) == 6
    n = calls.measured[0][3]
    assert {m[3] for m in calls.measured} == {n} and n % 8 == 0 and 0 < n < 8 * 33
    [entry] = data["interleaved"]
    assert entry["trimmed"].startswith("budget:") and entry["wanted_prompts"] == [8 * 33]
    calls = _Calls(monkeypatch, {"pp1_dspark": [1.0] * 3, "pp2_dspark": [1.0] * 3})
    rc, data = _run(tmp_path, ["--acceptance-lengths", "3.99", "--concurrency", "8"], 5.0)
    assert rc == 1 and not calls.measured  # not even one wave per run fits: skipped, said why
    assert {s["config"] for s in data["skipped"]} == {"pp1_dspark", "pp2_dspark"}
    assert all("one wave of 8" in s["why"] for s in data["skipped"])


def test_dry_run_prints_each_points_rotation_with_one_prompt_count(capsys):
    assert serve.main(["--dry-run", "--out", "/nonexistent-not-written", *PAIR, "--interleave",
                       "--repeats", "3", "--concurrency", "8,16", "--acceptance-lengths", "3.99",
                       "--workload", "decode"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    bench = [shlex.split(x)[3:] for x in out.splitlines() if x.startswith("vllm bench serve ")]
    probes = [b for b in bench if b[-1].endswith("_probe.json")]
    bench = [b for b in bench if b not in probes]
    assert len(bench) == 2 * 3 * 2
    # one probe wave on each server before the first point, on prompts no run uses
    assert [(b[b.index("--label") + 1], b[b.index("--num-prompts") + 1]) for b in probes] == [
        ("pp1_dspark", "8"),
        ("pp2_dspark", "8"),
    ]
    run_seeds = {b[b.index("--seed") + 1] for b in bench}
    assert not run_seeds & {b[b.index("--seed") + 1] for b in probes}
    opts = [{b[i]: b[i + 1] for i in range(len(b) - 1) if b[i].startswith("--")} for b in bench]
    assert [o["--label"] for o in opts[:6]] == ["pp1_dspark", "pp2_dspark"] * 3
    assert len({o["--num-prompts"] for o in opts[:6]}) == 1
    assert {(o["--random-input-len"], o["--random-output-len"]) for o in opts} == {("128", "1024")}
    assert "# workload decode: 128 in / 1024 out" in out


# --------------------------------------------------------------------------- MPS
FAKE_CONTROL = """#!/bin/sh
echo "argv=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_CALLS"
if [ "$1" = "-d" ]; then
  if [ -n "$FAKE_MPS_FAIL" ]; then echo "$FAKE_MPS_FAIL" >&2; exit 1; fi
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
fi
read -r cmd
echo "stdin=$cmd" >> "$FAKE_MPS_CALLS"
if [ "$cmd" = quit ]; then rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"; fi
"""
#: attaches only where the daemon's pipe folder holds its control file
PROBE = [
    sys.executable,
    "-c",
    "import os, sys; sys.exit(0 if os.path.exists("
    "os.environ['CUDA_MPS_PIPE_DIRECTORY'] + '/control') else 3)",
]


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / mps.CONTROL
    tool.write_text(FAKE_CONTROL)
    tool.chmod(0o755)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("PATH", f"{bindir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_MPS_CALLS", str(calls))
    monkeypatch.delenv("FAKE_MPS_FAIL", raising=False)
    monkeypatch.setattr(mps, "PROBE", PROBE)
    return calls


def test_stage_env_gives_each_launcher_its_share_and_the_daemons_folders():
    env = mps.stage_env([70, 30], "/tmp/x/pipe", "/tmp/x/log")
    assert env == {
        0: {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/x/pipe", "CUDA_MPS_LOG_DIRECTORY": "/tmp/x/log",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70"},
        1: {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/x/pipe", "CUDA_MPS_LOG_DIRECTORY": "/tmp/x/log",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"},
    }  # fmt: skip
    assert mps.parse_percentages("50, 50") == [50, 50]


def test_the_daemon_starts_probes_and_stops_under_its_own_folders(tmp_path, fake_control):
    d = mps.MpsDaemon(tmp_path / "mps")
    assert d.start() and d.used and d.problem is None
    assert (d.pipe_dir / "control").exists()
    assert d.stop() == "quit sent" and not (d.pipe_dir / "control").exists()
    lines = fake_control.read_text().splitlines()
    assert lines == [
        f"argv=-d pipe={d.pipe_dir} log={d.log_dir}",
        f"argv= pipe={d.pipe_dir} log={d.log_dir}",
        "stdin=quit",
    ]
    assert d.stop() is None  # once only
    rec = d.record([50, 50])
    assert rec["used"] and rec["requested"] == [50, 50] and rec["tested_on_gpu"] is False
    assert str(d.root).startswith(str(tmp_path))
    assert str(mps.MpsDaemon().root).startswith("/tmp/dspark-mps-")  # never /tmp/nvidia-mps


def test_a_daemon_that_cannot_start_is_reported_and_nothing_is_left(
    tmp_path, fake_control, monkeypatch
):
    monkeypatch.setenv("FAKE_MPS_FAIL", "An instance of this daemon is already running; "
                       "permission denied")  # fmt: skip
    d = mps.MpsDaemon(tmp_path / "mps")
    assert not d.start() and not d.used
    assert "exit 1" in d.problem and "permission denied" in d.problem
    assert "running without MPS" in d.problem
    assert d.stop() is None and "stdin" not in fake_control.read_text()
    missing = mps.MpsDaemon(tmp_path / "m2", binary="no-such-mps-control")
    assert not missing.start() and "not found on PATH" in missing.problem


def test_a_probe_that_cannot_attach_stops_the_daemon(tmp_path, fake_control):
    d = mps.MpsDaemon(tmp_path / "mps", probe=[sys.executable, "-c", "raise SystemExit(5)"])
    assert not d.start() and not d.used
    assert "could not attach (exit 5)" in d.problem and "daemon stopped" in d.problem
    assert fake_control.read_text().splitlines()[-1] == "stdin=quit"


def test_the_driver_stops_the_daemon_when_the_run_fails(tmp_path, fake_control, monkeypatch):
    seen = {}

    def failing(a, *rest):
        seen["env"] = a.mps_env_per_rank
        raise RuntimeError("a server died")

    monkeypatch.setattr(serve, "_main", failing)
    with pytest.raises(RuntimeError, match="a server died"):
        serve.main([*PAIR, "--mps", "50,50", "--out", str(tmp_path / "out")])
    assert [e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for e in seen["env"].values()] == ["50", "50"]
    assert fake_control.read_text().splitlines()[-1] == "stdin=quit"
    log = next((tmp_path / "out").glob("*.log")).read_text()
    assert "MPS daemon started" in log and "MPS daemon: quit sent" in log


def test_a_sigterm_during_the_run_still_stops_the_daemon(tmp_path, fake_control, monkeypatch):
    import signal

    before = signal.getsignal(signal.SIGTERM)

    def killed(a, *rest):
        os.kill(os.getpid(), signal.SIGTERM)  # what a command's time limit sends
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM did not end the run")

    monkeypatch.setattr(serve, "_main", killed)
    with pytest.raises(SystemExit) as e:
        serve.main([*PAIR, "--mps", "50,50", "--out", str(tmp_path / "out")])
    assert e.value.code == 128 + signal.SIGTERM
    assert fake_control.read_text().splitlines()[-1] == "stdin=quit"
    assert signal.getsignal(signal.SIGTERM) == before  # the driver's handler is gone again


def test_the_driver_runs_without_mps_when_it_cannot_start(tmp_path, fake_control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL", "permission denied")
    seen = {}
    monkeypatch.setattr(
        serve, "_main", lambda a, *rest: seen.setdefault("env", a.__dict__.get("mps_env_per_rank"))
    )
    serve.main([*PAIR, "--mps", "50,50", "--out", str(tmp_path / "out")])
    assert seen["env"] is None  # the launchers get no MPS variables; the run goes on
    log = next((tmp_path / "out").glob("*.log")).read_text()
    assert "MPS NOT USED" in log and "permission denied" in log


def test_dry_run_with_mps_composes_the_stage_envs_and_starts_nothing(capsys, fake_control):
    assert serve.main(["--dry-run", "--out", "/nonexistent-not-written", *PAIR,
                       "--mps", "60,40"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    nodes = _launchers(out)
    n0, n1 = nodes["pp2_dspark node 0"]["env"], nodes["pp2_dspark node 1 (headless)"]["env"]
    assert n0["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "60"
    assert n1["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert n0["CUDA_MPS_PIPE_DIRECTORY"] == n1["CUDA_MPS_PIPE_DIRECTORY"]
    assert "CUDA_MPS_PIPE_DIRECTORY" not in nodes["pp1_dspark"]["env"]  # PP=1 outside MPS
    assert "nvidia-cuda-mps-control -d" in out and "echo quit |" in out
    assert not fake_control.exists()  # the dry run ran no daemon


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(
    os.environ.get("DSPARK_SERVE_INTERLEAVE_HAND") != "1",
    reason="hand run (about 60 s, vLLM's bench client in process): DSPARK_SERVE_INTERLEAVE_HAND=1",
)
def test_interleaved_run_end_to_end_against_stand_in_servers(tmp_path, monkeypatch):
    """``--configs pp1_dspark,pp2_dspark --interleave --repeats 3 --workload decode`` with
    tests/support/fake_vllm_serve.py in place of every ``vllm serve`` (the PP=2 node 1 headless):
    start together, readiness, the AL switch on both, every run through ``vllm bench serve`` in
    rotation, the JSON's repeats, statistics and ratios."""
    import json

    from support.fake_vllm_serve import use_instead_of_vllm_serve

    import dspark_dev.serve_demo as serve_demo
    from dspark_dev import pp_launch

    use_instead_of_vllm_serve(monkeypatch, serve_demo, pp_launch)
    out = tmp_path / "out"
    rc = serve.main([*PAIR, "--interleave", "--repeats", "3", "--workload", "decode",
                     "--output-len", "32", "--concurrency", "1,4", "--acceptance-lengths", "3.99",
                     "--min-run-s", "1", "--budget-s", "300", "--out", str(out)])  # fmt: skip
    res = json.loads((out / "serve_pp_one_gpu_pp1_dspark-pp2_dspark_decode_x3.json").read_text())
    assert rc == 0, res["skipped"]
    assert res["meta"]["workload"] == {"name": "decode", "input_len": 128, "output_len": 32}
    assert res["meta"]["interleave"]["baseline"] == "pp1_dspark"
    assert res["meta"]["commit"] and not res["meta"]["commit"].startswith("unknown")
    probes = [p for p in res["points"] if p.get("probe")]
    assert [(p["config"], p["concurrency"], p["num_prompts"]) for p in probes] == [
        ("pp1_dspark", 1, 1), ("pp2_dspark", 1, 1),
    ]  # fmt: skip
    assert res["points"][:2] == probes and all("repeat" not in p for p in probes)
    assert {p["seed"] for p in probes} == {serve.point_seed(0, 1) + serve.PROBE_SEED_OFFSET}
    res["points"] = res["points"][2:]
    assert not {p["seed"] for p in res["points"]} & {p["seed"] for p in probes}
    assert [(p["config"], p["repeat"], p["slot"]) for p in res["points"][:6]] == [
        ("pp1_dspark", 0, 0), ("pp2_dspark", 0, 1), ("pp1_dspark", 1, 2),
        ("pp2_dspark", 1, 3), ("pp1_dspark", 2, 4), ("pp2_dspark", 2, 5),
    ]  # fmt: skip
    assert len(res["points"]) == 12 and not res["skipped"]
    for entry in res["interleaved"]:
        assert entry["equal_prompts"]
        for cfg in PAIR[1].split(","):
            reps = entry["configs"][cfg]["repeats"]
            assert len(reps) == 3 and all(r["output_throughput"] > 0 for r in reps)
            assert all(r["median_ttft_ms"] and r["p99_itl_ms"] for r in reps)
            assert all(r["measured_acceptance_length"] == pytest.approx(4.0) for r in reps)
        ratio = entry["ratios"]["pp2_dspark/pp1_dspark"]
        assert ratio["rotations"] == 3 and len(ratio["output_throughput"]["per_rotation"]) == 3


def _failing(monkeypatch, fails: set[tuple[str, int, int]]):
    """_Calls whose measure fails (no point, stop) for the (config, C, repeat) in ``fails``."""
    names = ("pp1_dspark", "pp2_dspark", "pp2_nospec")
    calls = _Calls(monkeypatch, {n: [100.0] * 3 for n in names})
    ok = serve.Runner.measure

    def measure(rn, cfg, al, ali, c, n, *, why, n_full, repeat=None, extra=None):
        if (cfg.name, c, repeat) in fails:
            calls.measured.append((cfg.name, al, c, n, repeat, extra["slot"], None))
            rn.skip(cfg, al, c, "bench failed: 316 of 448 requests failed", repeat=repeat)
            return None, True
        return ok(rn, cfg, al, ali, c, n, why=why, n_full=n_full, repeat=repeat, extra=extra)

    monkeypatch.setattr(serve.Runner, "measure", measure)

    def start(rn, names):  # what Runner.start and .ready record for servers that came up
        for name in names:
            rn.res.data["servers"][name] = {"launchers": 1, "outcome": "ok"}

    monkeypatch.setattr(serve.Runner, "start", start)
    calls.stopped = []

    class Dep:
        def __init__(self, name):
            self.name = name

        def stop(self):
            calls.stopped.append(self.name)

    calls.deps = {n: Dep(n) for n in names}
    return calls


def test_a_failed_run_takes_its_configuration_out_and_the_others_go_on(tmp_path, monkeypatch):
    calls = _failing(monkeypatch, {("pp2_dspark", 8, 0)})
    args = ["--acceptance-lengths", "3.99", "--concurrency", "8,16"]
    rc, data = _run(tmp_path, args, configs="pp1_dspark,pp2_dspark,pp2_nospec", deps=calls.deps)
    runs = {(m[0], m[2]) for m in calls.measured}
    assert ("pp2_dspark", 16) not in runs  # gone for the rest of the call
    done = [m for m in calls.measured if m[0] != "pp2_dspark"]
    assert len(done) == 2 * 2 * 3  # the other two: every rotation of both points
    whys = [s["why"] for s in data["skipped"] if s["config"] == "pp2_dspark"]
    assert whys[0].startswith("bench failed") and "left the comparison" in whys[1]
    assert len(whys) == 3  # the failed run, then its two other rotations at C = 8
    by_c = {e["concurrency"]: e for e in data["interleaved"]}
    assert by_c[16]["ratios"]["pp2_nospec/pp1_dspark"]["rotations"] == 3
    assert data["servers"]["pp2_dspark"]["outcome"] == "left the comparison after a failed run"
    assert calls.stopped == ["pp2_dspark"]  # its GPU memory goes back to the others at once
    assert rc == 1  # the call had a failure


def test_a_failed_baseline_run_still_ends_the_comparison(tmp_path, monkeypatch):
    calls = _failing(monkeypatch, {("pp1_dspark", 8, 1)})
    args = ["--acceptance-lengths", "3.99", "--concurrency", "8,16"]
    _rc, data = _run(tmp_path, args, configs="pp1_dspark,pp2_dspark,pp2_nospec", deps=calls.deps)
    assert not calls.stopped  # the comparison ended; the driver's finally stops every server
    assert [m[0] for m in calls.measured] == ["pp1_dspark", "pp2_dspark", "pp2_nospec",
                                              "pp1_dspark"]  # fmt: skip
    assert {e["concurrency"] for e in data["interleaved"]} == {8}


def test_sigterm_reaches_the_cleanup_without_mps_too(tmp_path):
    """tools/gpu/span_calls.py stops a benchmark with SIGTERM; the servers (sessions of their
    own) are stopped only by the driver's finally clauses, so SIGTERM must end the run through
    them with or without ``--mps`` (before 2026-12-06 only an MPS run caught it: the process died
    at once, rc -15, and its servers ran on)."""
    import subprocess

    code = (
        "import os, signal, time, sys\n"
        "from benchmarks import serve_pp_one_gpu as serve\n"
        "def killed(a, *rest):\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
        "    finally:\n"
        "        print('servers stopped', flush=True)\n"
        "serve._main = killed\n"
        f"serve.main(['--configs', 'pp1_dspark,pp2_dspark', '--out', {str(tmp_path)!r}])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=serve.REPO)  # fmt: skip
    assert done.returncode == 128 + 15, done.stderr[-2000:]
    assert "servers stopped" in done.stdout
