"""benchmarks/interleaved_page.py: docs/results/perf_interleaved_gpu.md from the interleaved
served records (issue 44)."""

from __future__ import annotations

import copy
import json

import pytest

from benchmarks import interleaved_page as page

RECORD = page.RESULTS / "serve_interleaved_gpu_2026-12-06_pd_mc_ipc.json"


@pytest.fixture
def record() -> dict:
    return json.loads(RECORD.read_text())


def _md(rec: dict) -> str:
    return page.markdown([(RECORD.name, rec)])


def _row(md: str, start: str) -> str:
    return next(x for x in md.splitlines() if x.startswith(start))


def test_the_committed_page_is_the_generators_output():
    assert RECORD.name in [n for n, _ in page.load()]
    assert page.PAGE.read_text() == page.text(), "run: python -m benchmarks.interleaved_page"


def test_every_repeat_its_mean_spread_and_the_ratios_come_from_the_record(record):
    md = _md(record)
    row = _row(md, "| `pd_mc_ipc_dspark` | 3 |")
    assert "| 2829, 2653, 2776 | 2753 | 6.4% |" in row
    assert "| `pd_mc_ipc_dspark/agg_dspark_kv` | 3 | 0.748 (0.730-0.759) |" in md
    planted = copy.deepcopy(record)
    pt = planted["interleaved"][0]
    pt["configs"]["pd_mc_ipc_dspark"]["repeats"][1]["output_throughput"] = 1000.0
    assert "| 2829, 1000, 2776 |" in _row(_md(planted), "| `pd_mc_ipc_dspark` | 3 |")


def test_the_failed_run_and_the_shortened_points_are_named(record):
    md = _md(record)
    assert "* `pd_dspark` AL 3.99 C = 32 repeat 1: bench failed: cut after 20 s" in md
    assert md.count("shortened: budget:") == 2
    planted = copy.deepcopy(record)
    planted["skipped"] = []
    assert "No run failed or was cut." in _md(planted)


def test_runs_shorter_than_asked_are_said_with_why():
    """The 2026-12-07 adaptive_stock record asked for 10 s runs and got 3.7-4.7 s (the guessed
    TPOT set the prompt count); the page says so where the budget did not shorten them."""
    name = "serve_interleaved_gpu_2026-12-07_adaptive_stock_graphs.json"
    rec = json.loads((page.RESULTS / name).read_text())
    [pt] = rec["interleaved"]
    said = "Runs lasted 3.7-4.7 s, under the 10 s asked (`--min-run-s`): the prompt count came "
    assert (
        page.short_runs(rec, pt) == f" {said}from the guessed TPOT (no probe wave in this record)."
    )
    assert said in page.markdown([(name, rec)])
    probed = copy.deepcopy(rec)
    probe = {"probe": True, "config": "pp1_dspark_k7", "point_al": 3.99, "concurrency": 32}
    probed["points"].insert(0, probe)
    assert page.short_runs(probed, pt).endswith("from the probe's TPOT, before this point.")
    # a later point: its count came from the points before it, probe or not
    later = copy.deepcopy(rec)
    later["points"].insert(0, {**later["points"][0], "concurrency": 16})
    probe["concurrency"] = 16
    later["points"].insert(0, probe)
    assert page.short_runs(later, pt).endswith(
        "from the TPOT and calibration of the points before it."
    )
    assert page.short_runs(rec, {**pt, "trimmed": "budget: 1 of 4 waves"}) == ""
    rec["meta"]["interleave"]["min_run_s"] = 3.7
    assert page.short_runs(rec, pt) == ""


def test_the_servers_show_the_transport_mooncake_logged(record):
    md = _md(record)
    line = _row(md, "* `pd_mc_ipc_dspark`: 3 launcher(s)")
    assert "protocol `nvlink_intra`" in line and "`MC_INTRANODE_NVLINK=1`" in line
    assert line.endswith("transports in Mooncake's log lines: `nvlink_intra`")
    planted = copy.deepcopy(record)
    planted["servers"]["pd_mc_ipc_dspark"]["mooncake_transport"]["transports"] = []
    assert _row(_md(planted), "* `pd_mc_ipc_dspark`: 3").endswith("log lines: none logged")


def _with_c64(record: dict, low: float) -> dict:
    planted = copy.deepcopy(record)
    pt = copy.deepcopy(planted["interleaved"][1])
    pt["concurrency"] = 64
    r = pt["ratios"]["pd_mc_ipc_dspark/agg_dspark_kv"]["output_throughput"]
    r.update(ratio_of_means=low + 0.01, per_rotation=[low, low + 0.02], min=low, max=low + 0.02)
    planted["interleaved"].append(pt)
    return planted


def test_the_pd_goal_is_met_missed_or_not_measured_from_the_ratios(record):
    goal = _row(_md(record), "* `pd_mc_ipc_dspark` against `agg_dspark_kv`")
    assert "**not measured at C = 64**" in goal and "C = 8: 0.748 (0.730-0.759" in goal
    met = _row(_md(_with_c64(record, 0.55)), "* `pd_mc_ipc_dspark` against")
    assert "**met** at C = 64 (lowest rotation 0.550)" in met
    missed = _row(_md(_with_c64(record, 0.45)), "* `pd_mc_ipc_dspark` against")
    assert "**missed** at C = 64 (lowest rotation 0.450)" in missed


@pytest.mark.parametrize(
    "plant",
    [
        lambda r: r["meta"].pop("commit"),
        lambda r: r["meta"]["interleave"].pop("baseline"),
        lambda r: r.update(interleaved=[]),
        lambda r: r["interleaved"][0]["ratios"]["pd_dspark/agg_dspark_kv"].pop("output_throughput"),
        lambda r: r["interleaved"][0]["configs"]["agg_dspark_kv"].pop("stats"),
    ],
    ids=["commit", "baseline", "not interleaved", "ratio", "stats"],
)
def test_a_record_without_a_field_the_page_needs_is_refused(tmp_path, record, plant):
    plant(record)
    (tmp_path / RECORD.name).write_text(json.dumps(record))
    with pytest.raises(page.RecordError):
        page.load(tmp_path)


def test_no_record_says_so(tmp_path):
    assert "No record yet." in page.markdown(page.load(tmp_path))


def test_the_figure_is_deterministic_text_with_every_configuration(tmp_path, record):
    pytest.importorskip("matplotlib")
    a, b = tmp_path / "a.svg", tmp_path / "b.svg"
    assert page.figure([(RECORD.name, record)], a) and page.figure([(RECORD.name, record)], b)
    assert a.read_bytes() == b.read_bytes()
    svg = a.read_text()
    assert all(cfg in svg for cfg in record["meta"]["configs"])


def _pp_record(tps: dict[str, list[float]], concurrency=(16,)) -> dict:
    """A minimal interleaved record of the four goal (b) configurations: ``tps[cfg]`` the output
    tok/s of each rotation."""
    cfgs = list(page.GOAL_B_CONFIGS)
    meta = {"commit": "abc", "date": "2026-12-07 00:00:00 UTC", "command": "x", "configs": cfgs,
            "shape": "qwen3-8b", "workload": {"name": "decode"},
            "interleave": {"baseline": "pp1_dspark"}, "versions": {"gpu": "H100"}}  # fmt: skip
    points = []
    for c in concurrency:
        configs = {}
        for cfg in cfgs:
            runs = [{"repeat": i, "output_throughput": v} for i, v in enumerate(tps[cfg])]
            configs[cfg] = {"repeats": runs, "stats": {}}
        ratio = {"ratio_of_means": 1.0, "per_rotation": [1.0], "min": 1.0, "max": 1.0}
        points.append({"acceptance_length": 3.99, "concurrency": c, "num_prompts": [64],
                       "configs": configs,
                       "ratios": {f"{x}/pp1_dspark": {"output_throughput": ratio}
                                  for x in cfgs if x != "pp1_dspark"}})  # fmt: skip
    return {"meta": meta, "servers": {}, "interleaved": points, "skipped": []}


def test_goal_b_is_computed_per_rotation_and_met_or_missed():
    # PP=1 speed-up 3.0 in both rotations; PP=2 2.85 (0.95) and 2.55 (0.85)
    rec = _pp_record({"pp1_nospec": [100, 100], "pp1_dspark": [300, 300],
                      "pp2_nospec": [50, 60], "pp2_dspark": [142.5, 153]})  # fmt: skip
    page.check("x.json", rec)
    lines = page.goal_b(rec)
    assert lines[0].endswith("**missed** (lowest rotation 0.850)"), lines
    assert "* AL 3.99, C = 16: 0.900 (rotations 0.850-0.950, 2)" in lines
    rec = _pp_record({"pp1_nospec": [100, 100], "pp1_dspark": [300, 300],
                      "pp2_nospec": [50, 60], "pp2_dspark": [142.5, 171]})  # fmt: skip
    assert page.goal_b(rec)[0].endswith("**met** (lowest rotation 0.950)")
    rec["meta"]["configs"] = ["pp1_dspark", "pp2_dspark"]  # no no-spec arms: no goal (b) line
    assert page.goal_b(rec) == []


GOAL_RECORD = page.RESULTS / "serve_interleaved_gpu_2026-12-06_pd_mc_ipc_goal.json"


def test_a_run_with_failed_requests_leaves_the_comparison():
    """The 2026-12-06 goal record: the PP=2-producer PD run answered 132 of 448 requests (its
    producer ran out of memory) and the benchmark of that day still put its 344 tok/s into the
    ratios (0.048 of aggregated, a "missed" goal). The page recomputes the comparison without
    it; with the run's failures zeroed (the control) it is counted again."""
    raw = json.loads(GOAL_RECORD.read_text())
    [bad] = page.failed_request_runs(raw)
    got = (bad["config"], bad["repeat"], bad["bench"]["failed"])
    assert got == ("pd_pp2_mc_ipc_dspark", 0, 316)
    md = page.markdown([(GOAL_RECORD.name, page.without_failed_runs(raw))])
    assert "| `pd_pp2_mc_ipc_dspark` | 0 | - |" in md
    assert "repeat 0: 316 of 448 requests failed: left out of the tables and ratios" in md
    goal = _row(md, "* `pd_pp2_mc_ipc_dspark` against")
    assert "**not measured at C = 64**" in goal
    assert "**met** at C = 64 (lowest rotation 0.773)" in _row(md, "* `pd_mc_ipc_dspark` against")
    control = copy.deepcopy(raw)
    bad_point = next(p for p in control["points"] if p["bench"].get("failed"))
    bad_point["bench"]["failed"] = 0
    md_control = page.markdown([(GOAL_RECORD.name, page.without_failed_runs(control))])
    assert "**missed** at C = 64 (lowest rotation 0.048)" in md_control


SPLIT_RECORD = page.RESULTS / "serve_interleaved_gpu_2026-12-06_split_mps.json"


def test_the_split_goal_needs_mps_and_reads_both_splits_per_rotation():
    rec = json.loads(SPLIT_RECORD.read_text())
    head, _, *lines = page.split_goal(rec)
    assert "plan's layer split [25, 11]" in head and "MPS thread shares [50, 50]" in head
    assert head.endswith("**missed** (lowest rotation 1.013)")
    assert "* AL 3.99, C = 16: 1.022 (rotations 1.013-1.029, 3)" in lines
    planted = copy.deepcopy(rec)  # plan's split 20% faster in every rotation: met
    for pt in planted["interleaved"]:
        even = pt["configs"]["pp2_dspark"]["repeats"]
        by = {r["repeat"]: r["output_throughput"] for r in even}
        for r in pt["configs"]["pp2_dspark_balanced"]["repeats"]:
            r["output_throughput"] = 1.2 * by.get(r["repeat"], 0.0)
    assert page.split_goal(planted)[0].endswith("**met** (lowest rotation 1.200)")
    planted["meta"]["mps"] = {"used": False, "problem": "no daemon"}
    assert "**not settled**: the stages time-sliced the GPU" in page.split_goal(planted)[0]
    planted["meta"]["configs"] = ["pp1_dspark", "pp2_dspark"]
    assert page.split_goal(planted) == []


def test_stage_rows_average_each_ranks_timers_over_the_repeats():
    rec = json.loads(SPLIT_RECORD.read_text())
    pt = next(p for p in rec["interleaved"] if p["concurrency"] == 16)
    rows = page.stage_rows(rec, pt)
    last = next(r for r in rows if r.startswith("| `pp2_dspark_balanced` | 1 | 3 |"))
    assert last.endswith("| 6.44 | 3.84 | 2.05 | 3.0% | 98% |")  # the last stage never rests
    first = next(r for r in rows if r.startswith("| `pp2_dspark` | 0 | 3 |"))
    assert first.endswith("| 0.1% | 65% |")
    planted = copy.deepcopy(rec)
    for p in planted["points"]:
        if p["config"] == "pp2_dspark_balanced" and p["concurrency"] == 16:
            for v in p["step_times"][1]["per_num_reqs"].values():
                v["draft_ms"] = 9.0
    rows = page.stage_rows(planted, pt)
    last = next(r for r in rows if r.startswith("| `pp2_dspark_balanced` | 1"))
    assert "| 9.00 |" in last
    for p in planted["points"]:
        p["bench"].pop("duration", None)
    assert all(r.endswith("| - |") for r in page.stage_rows(planted, pt)[2:])  # no run length
    assert "graph most steps ran" not in page.stage_rows(rec, pt)[0]  # older records: no column
    for p in planted["points"]:  # a record whose hook named each step's graph
        for w in p["step_times"]:
            w["graphs"] = {"full varlen q<=8": {"steps": 3, "graph_reqs": 32},
                           "eager": {"steps": 1, "graph_reqs": None}}  # fmt: skip
    rows = page.stage_rows(planted, pt)
    assert rows[0].endswith("| graph most steps ran |")
    assert all(r.endswith("| full varlen q<=8, 32 slots (75%) |") for r in rows[2:])
    for p in planted["points"]:
        p.pop("step_times", None)
    assert page.stage_rows(planted, pt) == []


def _ksweep_record(adaptive: list[float], confidences: str = "draft") -> dict:
    """A record as the benchmark writes it for ``--configs ksweep_pp2`` at C = 4 and 16 (its own
    summary from planted runs): fixed k = 3 the best (100 tok/s), k = 7 80, adaptive as given."""
    from benchmarks.serve_pp_one_gpu import interleave_summary

    names = ["pp2_dspark_k3", "pp2_dspark_k7", "pp2_dspark_adaptive"]
    tok_s = {"pp2_dspark_k3": [100.0] * 3, "pp2_dspark_k7": [80.0] * 3,
             "pp2_dspark_adaptive": adaptive}  # fmt: skip
    points = [{"config": n, "concurrency": c, "repeat": r, "point_al": 3.99, "num_prompts": 64,
               "bench": {"output_throughput": tok_s[n][r]}}
              for c in (4, 16) for r in range(3) for n in names]  # fmt: skip
    meta = {"commit": "abc", "date": "2026-12-07 00:00:00 UTC", "command": "x",
            "configs": names, "shape": "tiny-pair", "workload": {"name": "decode"},
            "adaptive_confidences": confidences, "versions": {"gpu": "H100"},
            "interleave": {"baseline": names[0], "repeats": 3}}  # fmt: skip
    return {"meta": meta, "servers": {}, "points": points,
            "interleaved": interleave_summary(points, names, 3), "skipped": []}  # fmt: skip


def test_goal_g_reads_adaptive_against_the_best_fixed_k_per_rotation():
    rec = _ksweep_record([101.0, 99.0, 104.0])
    page.check("x.json", rec)
    head, _, *lines = page.goal_g(rec)
    assert head.endswith("**missed** (lowest rotation 0.990)"), head
    assert "* `pp2_dspark_adaptive` AL 3.99, C = 16: 1.013 of `pp2_dspark_k3` (k = 3; " in lines[1]
    assert lines[0].endswith("(outside the goal)")  # C = 4
    assert page.goal_g(_ksweep_record([101.0, 100.0, 104.0]))[0].endswith(
        "**met** (lowest rotation 1.000)"
    )
    oracle = page.goal_g(_ksweep_record([101.0, 100.0, 104.0], "synthetic"))[0]
    assert "**not settled**: confidences `synthetic`" in oracle
    assert page.goal_g(_pp_record({c: [1.0] for c in page.GOAL_B_CONFIGS})) == []


def _taps_record(side_wait: float, side_keys=("hidden_states", "residual")) -> dict:
    """A record as the benchmark writes it for ``--configs tap_partials`` at C = 4 and 16: the
    last stage's exchange per repeat (bytes per key as the hook counts them, 104 rows a step),
    raw taps with five keys, the partial in the dict with three, on the side channel with two
    (and the partial's bytes there); stage 0's exchange has no receives."""
    from benchmarks.serve_pp_one_gpu import interleave_summary

    row = 5120  # bytes per row and key at hidden 2560, bf16
    aux = [f"aux_hidden_states_{i}" for i in range(3)]
    keys = {"pp2_dspark": ["hidden_states", "residual", *aux],
            "pp2_dspark_taps_dict": ["hidden_states", "residual", "dspark_tap_partial"],
            "pp2_dspark_taps_side": list(side_keys)}  # fmt: skip
    wait = {"pp2_dspark": 0.05, "pp2_dspark_taps_dict": 0.04, "pp2_dspark_taps_side": side_wait}
    names = list(keys)
    points = []
    for c in (4, 16):
        for r in range(2):
            for n in names:
                med = {f"pp_recv_bytes:{k}": 104.0 * row for k in keys[n]}
                med["pp_recv_rows"] = 104.0
                if n.endswith("side"):
                    med["side_recv_bytes:dspark_tap_partial"] = 104.0 * row
                stage0 = {"exchange": {"median": {"pp_send_host_ms": 0.4}, "stall_share": 0.3}}
                last = {"exchange": {"median": med, "stall_share": wait[n] + 0.001 * r}}
                points.append({"config": n, "concurrency": c, "repeat": r, "point_al": 3.99,
                               "num_prompts": 32, "bench": {"output_throughput": 100.0},
                               "step_times": [stage0, last]})  # fmt: skip
    meta = {"commit": "abc", "date": "2026-12-07 00:00:00 UTC", "command": "x",
            "configs": names, "shape": "qwen3-4b", "workload": {"name": "decode"},
            "versions": {"gpu": "H100"},
            "interleave": {"baseline": names[0], "repeats": 2}}  # fmt: skip
    return {"meta": meta, "servers": {}, "points": points,
            "interleaved": interleave_summary(points, names, 2), "skipped": []}  # fmt: skip


def test_goal_e_reads_bytes_per_row_and_the_last_stages_wait_from_the_exchange():
    rec = _taps_record(side_wait=0.02)
    page.check("x.json", rec)
    head, _, *lines = page.goal_e(rec)
    assert head.endswith("**met** by `pp2_dspark_taps_side`"), head
    assert len(lines) == 3  # C = 4 is below the goal's C
    raw, dict_, side = lines
    assert "25600 B per row on the critical path" in raw and "1.00 of raw taps'" in raw
    assert "15360 B per row" in dict_ and "0.60 of raw taps'" in dict_  # 3 of 5 keys: missed
    assert "10240 B per row" in side and "0.40 of raw taps', 5120 B per row on the side" in side
    assert "wait 2.1% of a step (repeats 2.0%-2.1%, 2)" in side
    # controls: a wait at 3 % in one repeat, and side launchers that kept raw taps
    assert page.goal_e(_taps_record(side_wait=0.029))[0].endswith(
        "**missed** by every tap-partials deployment"
    )
    raw_keys = ("hidden_states", "residual", "aux_hidden_states_0", "aux_hidden_states_1",
                "aux_hidden_states_2")  # fmt: skip
    kept = page.goal_e(_taps_record(side_wait=0.02, side_keys=raw_keys))
    assert "**missed**" in kept[0] and "1.00 of raw taps'" in kept[-1]
    assert "Issue 44 goal (e)" in page.markdown([("x.json", rec)])
    assert page.goal_e(_ksweep_record([1.0] * 3)) == []
    assert "exposed transfer" not in page.goal_e(rec)[-1]  # no send span recorded: none said


def test_goal_e_bounds_the_link_by_the_smaller_of_the_wait_and_the_send_span():
    """With stage 0's ``pp_send_ms`` in the record: the link's time is at most the smaller of
    the last stage's wait and stage 0's send span (whoever came second waited for nothing)."""
    rec = _taps_record(side_wait=0.23)
    for p in rec["points"]:
        stage0, last = p["step_times"]
        last["main"] = {"step_ms": 10.0}
        last["exchange"]["median"]["pp_recv_wait_ms"] = 2.3  # waits for stage 0's forward...
        stage0["exchange"]["median"]["pp_send_ms"] = 0.25  # ...whose sends then take 0.25 ms
    head, _, *lines = page.goal_e(rec)
    assert "**missed**" in head  # the goal is stated on the wait, as the issue asks
    side = lines[-1]
    assert "of a step (repeats 23.0%-23.1%, 2)" in side
    assert side.endswith("stage 0's sends 0.25 ms from its forward's end, the exposed "
                         "transfer at most 2.5% of a step (repeats 2.5%-2.5%)")  # fmt: skip
    for p in rec["points"]:  # the receiver came second: its wait bounds the link
        p["step_times"][0]["exchange"]["median"]["pp_send_ms"] = 4.0
    assert "the exposed transfer at most 23.0% of a step" in page.goal_e(rec)[-1]
    for p in rec["points"]:  # PP=3: the first and last workers are not one link's two ends
        p["pp"] = 3
    assert "exposed transfer" not in page.goal_e(rec)[-1]


def test_performance_md_quotes_the_goals_as_generated_from_the_records(monkeypatch, tmp_path):
    """docs/results/performance.md's issue 44 block is the generator's (a stale block fails);
    every goal gets a row per record that states it, and one saying no record does otherwise."""
    assert page.PERFORMANCE.read_text() == page.performance_text(), (
        "run: python -m benchmarks.interleaved_page"
    )
    rows = page.goals_table([("k.json", _ksweep_record([101.0, 100.0, 104.0]))])
    g = next(r for r in rows if r.startswith("| (g):"))
    assert "[k.json](k.json) (2026-12-07, `abc`, no MPS) | **met** (lowest rotation 1.000)" in g
    assert "`pp2_dspark_adaptive` AL 3.99, C = 16: 1.017 of `pp2_dspark_k3`" in g
    assert next(r for r in rows if r.startswith("| (b):")).endswith(
        "| none | **no record states it** | - |"
    )
    # a verdict with a colon in it reaches the table whole (the table used to re-parse the page's
    # head line at its last ": " and dropped "**not settled**")
    oracle = page.goals_table([("k.json", _ksweep_record([101.0, 100.0, 104.0], "synthetic"))])
    assert "| **not settled**: confidences `synthetic` (the goal asks for the drafter's own) |" in (
        next(r for r in oracle if r.startswith("| (g):"))
    )
    taps = page.goals_table([("t.json", _taps_record(side_wait=0.02))])
    assert "**met** by `pp2_dspark_taps_side`" in next(r for r in taps if r.startswith("| (e):"))
    # control: a page without the markers is refused, not silently left as it was
    bare = tmp_path / "performance.md"
    bare.write_text("# no block\n")
    monkeypatch.setattr(page, "PERFORMANCE", bare)
    with pytest.raises(page.RecordError, match="BEGIN ISSUE44_GOALS"):
        page.performance_text()
