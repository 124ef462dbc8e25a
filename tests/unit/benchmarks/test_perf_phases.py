"""CPU tests of benchmarks/perf_real_shapes.py's phase selection, budget schedule and result
merging (issue 15: the first H200 run spent its budget on the DSpark engines and skipped the
no-speculation and producer engines). No engine is started and no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
import time as real_time
from pathlib import Path

import pytest
from support.perf_records import run_record

from benchmarks import perf_real_shapes as perf
from benchmarks import plot_perf, pp_projection

REPO = Path(__file__).resolve().parents[3]


def test_parse_phases_keeps_order_and_rejects_unknown_or_repeated():
    assert perf.parse_phases("nospec, producer") == ["nospec", "producer"]
    assert perf.parse_phases(perf.DEFAULT_PHASES) == ["producer", "nospec", "dspark", "off"]
    for bad in ("nospec,spec", "off,off", " , "):
        with pytest.raises(ValueError):
            perf.parse_phases(bad)


def test_allotment_reserves_the_later_phases_minimums():
    mins = [190.0, 90.0, 190.0]
    assert perf.phase_allotment(600.0, mins) == 600.0 - 280.0
    assert perf.phase_allotment(300.0, mins) == 190.0  # own minimum first (priority order)
    assert perf.phase_allotment(189.0, mins) == 0.0  # not even its own minimum: skip
    assert perf.phase_allotment(90.0, [90.0]) == 90.0


@pytest.mark.parametrize(
    "phases", [["producer", "nospec", "dspark", "off"], ["dspark", "off", "nospec", "producer"]]
)
def test_a_phase_that_uses_all_it_may_never_starves_a_later_one(phases):
    budget = sum(perf.PHASE_MIN_S[p] for p in phases) + 37.0
    left = budget
    for i, p in enumerate(phases):
        allot = perf.phase_allotment(left, [perf.PHASE_MIN_S[x] for x in phases[i:]])
        assert allot >= perf.PHASE_MIN_S[p], (p, left)
        left -= allot + 0.0  # worst case: the phase runs to its deadline
    assert left >= 0.0


def test_short_budget_skips_the_last_phases_and_the_schedule_says_so():
    rows = perf.schedule(400.0, ["producer", "nospec", "dspark", "off"])
    assert [r["allot_s"] > 0 for r in rows] == [True, True, False, False]
    text = perf.schedule_text(400.0, ["producer", "nospec", "dspark", "off"])
    assert "dspark" in text and "SKIPPED" in text and "WARNING" in text
    ok = perf.schedule_text(330.0, ["nospec", "producer"])
    assert "SKIPPED" not in ok and "WARNING" not in ok


def _perf_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m benchmarks.perf_real_shapes ARGS`` from the checkout's root (where ``-m`` finds
    benchmarks and this checkout); no engine starts for ``--print-schedule``."""
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.perf_real_shapes", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_print_schedule_cli_runs_no_engine():
    proc = _perf_cli("--print-schedule", "--phases", "nospec,producer", "--budget-s", "330")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.index("nospec") < proc.stdout.index("producer")
    bad = _perf_cli("--print-schedule", "--phases", "nospec,bogus")
    assert bad.returncode == 2 and "bogus" in bad.stderr


class _Clock:
    """perf's ``time`` module with a settable wall clock (the parent's budget arithmetic)."""

    def __init__(self):
        self.now = 1_000_000.0

    def time(self):
        return self.now

    def __getattr__(self, name):
        return getattr(real_time, name)


def test_parent_runs_each_phase_in_its_own_child_in_order(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(perf, "time", clock)
    calls = []

    def fake_run_child(spec, work, env, timeout_s, log_path, records):
        allot = spec["deadline_unix"] - clock.now
        calls.append(
            (spec["phases"][0]["engine"], spec["plugin"], env["VLLM_PLUGINS"], allot, timeout_s)
        )
        clock.now += allot  # worst case: every phase runs to its deadline
        return "ok"

    monkeypatch.setattr(perf, "run_child", fake_run_child)
    monkeypatch.setattr(perf, "_versions", lambda: {})
    rc = perf.main(
        [
            "--shape",
            "qwen3-8b",
            "--out",
            str(tmp_path),
            "--phases",
            "nospec,producer,off",
            "--budget-s",
            "600",
        ]
    )
    assert rc == 1  # no rows: the fake children measured nothing
    assert [(c[0], c[1]) for c in calls] == [
        ("nospec", "on"),
        ("producer", "on"),
        ("dspark", "off"),
    ]
    assert calls[0][2] == "dspark_pp,dspark_bench" and calls[2][2] == "dspark_bench"
    # nospec may use the budget minus what producer and off need; those still get theirs
    assert calls[0][3] == pytest.approx(600 - 90 - 190, abs=1)
    assert calls[1][3] >= 90 and calls[2][3] >= 190
    assert all(c[4] == pytest.approx(c[3] + perf.GRACE_S) for c in calls)
    res = json.loads((tmp_path / "perf_qwen3-8b.json").read_text())
    assert set(res["child_status"]) == {"nospec/on", "producer/on", "dspark/off"}

    # a budget too short for the last phase: it is recorded as skipped, not silently dropped
    calls.clear()
    rc = perf.main(
        [
            "--shape",
            "qwen3-8b",
            "--out",
            str(tmp_path),
            "--phases",
            "nospec,producer",
            "--budget-s",
            "250",
        ]
    )
    assert [c[0] for c in calls] == ["nospec"]
    res = json.loads((tmp_path / "perf_qwen3-8b.json").read_text())
    assert [(s["engine"], s["plugin"]) for s in res["skipped"]] == [("producer", "on")]


def _run(engine, plugin, al, c, rep, tok_s):
    return run_record(
        engine,
        plugin,
        al,
        c,
        rep,
        tok_s,
        tpot=2.0,
        tgt=5.0,
        step=7.0 if al else 5.5,
        measured=al or 1.0,
    )


def _first_run():
    """Like the 2026-12-03 H200 run: DSpark on and off measured, producer and nospec skipped
    (old-style skip records without engine/plugin fields)."""
    recs = [
        _run("dspark", p, 3.99, c, 0, v * c)
        for p, v in (("on", 500.0), ("off", 505.0))
        for c in (1, 4)
    ]
    recs += [
        {
            "type": "memory",
            "engine": "dspark/on",
            "draft_load": {"allocated_delta_bytes": 4831979520, "param_bytes_own": 2252860932},
        },
        {"type": "skip", "what": "producer engine (plugin on)", "why": "budget: 34 s left"},
        {"type": "skip", "what": "nospec engine (plugin on)", "why": "budget: 34 s left"},
        {"type": "skip", "what": "dspark/on rep 2 AL 6.1 C 1 and later", "why": "budget"},
    ]
    meta = {
        "shape": "qwen3-8b",
        "shape_config": {"name": "qwen3-8b", "intermediate_size": 1},
        "k": 7,
        "command": "perf_real_shapes.py --shape qwen3-8b",
        "date_utc": "d1",
    }
    res = perf.build_result(meta, recs)
    res.update(child_status={"on": "ok", "off": "ok"}, wall_s=374.1)
    return res


def _second_run():
    recs = [_run("nospec", "on", None, c, 0, 180.0 * c) for c in (1, 4)]
    recs.append(
        {
            "type": "memory",
            "engine": "producer/on",
            "draft_load": {"allocated_delta_bytes": 335_000_000, "gc_collected": True},
        }
    )
    meta = {
        "shape": "qwen3-8b",
        "k": 7,
        "command": "perf_real_shapes.py --phases nospec,producer",
        "date_utc": "d2",
    }
    res = perf.build_result(meta, recs)
    res.update(child_status={"nospec/on": "ok", "producer/on": "ok"}, wall_s=300.0)
    return res


def test_merge_combines_calls_and_drops_skips_another_call_filled():
    a, b = _first_run(), _second_run()
    assert perf.result_records(a) and len(perf.result_records(a)) == 4 + 1 + 3
    m = perf.merge_results([a, b])
    assert m["merged_from"] == 2 and m["command"].count("perf_real_shapes.py") == 2
    assert {(r["engine"], r["plugin"]) for r in m["rows"]} == {
        ("dspark", "on"),
        ("dspark", "off"),
        ("nospec", "on"),
    }
    assert {s["concurrency"]: s["speedup"] for s in m["speedup"]} == pytest.approx(
        {1: 500.0 / 180.0, 4: 500.0 / 180.0}
    )
    assert [p["ratio"] for p in m["plugin_ratio"]] == pytest.approx([500 / 505] * 2)
    assert set(m["memory"]) == {"dspark/on", "producer/on"}
    # the two phase skips were filled by the second call; the repeat-level skip stays
    assert [s["what"] for s in m["skipped"]] == ["dspark/on rep 2 AL 6.1 C 1 and later"]
    assert m["wall_s"] == pytest.approx(674.1)
    assert perf.merge_results([a]) is a
    with pytest.raises(ValueError):
        perf.merge_results([a, dict(b, shape="qwen3-4b")])


def test_merge_cli_and_plot_load_merge_same_shape(tmp_path):
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(_first_run()))
    pb.write_text(json.dumps(_second_run()))
    assert perf.main(["--merge", str(pa), str(pb), "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "perf_qwen3-8b.json").read_text())
    assert len(merged["runs"]) == 6
    loaded = plot_perf.load([pa, pb])
    assert len(loaded) == 1 and loaded[0]["merged_from"] == 2
    md = plot_perf.shape_markdown(loaded[0])
    assert "| no speculation | 4 | 720.0 |" in md and "2.78x" in md


def test_memory_table_compares_the_allocator_with_plan():
    from benchmarks import real_shapes
    from vllm_dspark_pp.producer.memory import draft_load_bytes

    res = perf.merge_results([_first_run(), _second_run()])
    res["shape_config"] = real_shapes.SHAPES["qwen3-8b"].__dict__
    pred = draft_load_bytes(
        real_shapes.draft_config(real_shapes.SHAPES["qwen3-8b"]), 2, own_embed=False, own_head=False
    )
    assert plot_perf.plan_bytes(res) == pred
    table = plot_perf.memory_table(res)
    full = next(x for x in table.splitlines() if x.startswith("| full DSpark"))
    assert "no (first run)" in full and f"{pred['full'] / 2**20:.1f} MiB" in full
    assert f"{4831979520 / pred['full']:.3f}" in full
    prod = next(x for x in table.splitlines() if x.startswith("| context-KV-only"))
    assert "| yes |" in prod and f"{pred['context_only'] / 2**20:.1f} MiB" in prod
    assert plot_perf.plan_bytes({"shape_config": {"name": "tiny"}}) is None


def test_projection_says_when_no_spec_rows_are_missing_and_uses_them_when_present():
    only_dspark = _first_run()
    only_dspark["shape_config"] = {
        "name": "qwen3-8b",
        "num_layers": 36,
        "hidden_size": 4096,
        "target_layer_ids": [1, 9, 17, 25, 33],
    }
    p = pp_projection.project(only_dspark)
    assert p["nospec_rows"] == []
    assert "cannot be computed yet" in pp_projection.markdown(p)
    both = perf.merge_results([only_dspark, _second_run()])
    p = pp_projection.project(both)
    n = {r["concurrency"]: r for r in p["nospec_rows"]}
    assert n[4]["pp1_tok_s_model"] == pytest.approx(4 / 5.5 * 1e3)
    assert n[4]["pp2_two_waves_tok_s"] > n[4]["pp2_one_wave_tok_s"]
    md = pp_projection.markdown(p)
    assert "cannot be computed" not in md and "DSpark/no-spec PP=2 2 waves" in md


def test_phase_env_plugin_off_modes_and_skipped_patches():
    from vllm_dspark_pp.patches import SKIP_ENV, registry

    both = f"{perf.PLUGIN},{perf.BENCH_PLUGIN}"
    assert perf.phase_env("on") == {"VLLM_PLUGINS": both, SKIP_ENV: ""}
    assert perf.phase_env("on", skip_patches="v1_engine_core")[SKIP_ENV] == "v1_engine_core"
    assert perf.phase_env("off") == {"VLLM_PLUGINS": perf.BENCH_PLUGIN, SKIP_ENV: ""}
    skip = perf.phase_env("off", "skip")
    # same VLLM_PLUGINS as plugin on (vLLM's compile cache key), every patch but config_vllm off
    assert skip["VLLM_PLUGINS"] == both
    names = [i.name for i in registry()]
    assert skip[SKIP_ENV].split(",") == [n for n in names if n != "config_vllm"]
    with pytest.raises(ValueError):
        perf.phase_env("off", "nope")


def test_parse_phase_mins():
    assert perf.parse_phase_mins("off=110, dspark=120.5") == {"off": 110.0, "dspark": 120.5}
    assert perf.parse_phase_mins("") == {}
    for bad in ("spec=10", "off", "off="):
        with pytest.raises(ValueError):
            perf.parse_phase_mins(bad)


def test_print_schedule_honours_phase_min_overrides():
    out = _perf_cli(
        "--phases",
        "off,dspark",
        "--off-mode",
        "skip",
        "--phase-min-s",
        "off=110,dspark=110",
        "--budget-s",
        "280",
        "--print-schedule",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SKIPPED" not in out.stdout and "off" in out.stdout and "dspark" in out.stdout
