"""CPU tests of the adaptive-verification measurement (issue 30, item 4): the served-curve
driver's adaptive configurations and groups (benchmarks/serve_pp_one_gpu.py, --dry-run), the
benchmark hook's confidences, verified-draft totals and the graph each step replayed
(benchmarks/dspark_bench_hooks.py, on stand-in vLLM classes and vLLM's own graph dispatcher),
and the "adaptive verification" table (benchmarks/adaptive_bench.py through
benchmarks/plot_pp_one_gpu.py) from a small recorded sample. Nothing is timed and no server
starts."""

from __future__ import annotations

import json
import types

import pytest
import torch
from support.perf_records import dry_run_launchers, serve_point, serve_run

from benchmarks import adaptive_bench as adaptive
from benchmarks import dspark_bench_hooks as hooks
from benchmarks import plot_pp_one_gpu as plot
from benchmarks import serve_pp_one_gpu as serve

OPT_IN = "VLLM_DSPARK_PP_ADAPTIVE_PP"


# --------------------------------------------------------------------------- the driver
def test_adaptive_groups_pair_each_adaptive_deployment_with_its_baseline():
    for group, pp in (("adaptive_pp1", 1), ("adaptive_pp2", 2)):
        cfgs = serve.select_configs(group)
        assert [(c.name, c.pp, c.spec, c.adaptive) for c in cfgs] == [
            (f"pp{pp}_dspark", pp, True, False),
            (f"pp{pp}_dspark_adaptive", pp, True, True),
        ]


def test_adaptive_on_the_cpu_platform_or_unknown_confidences_are_refused_at_start():
    with pytest.raises(SystemExit, match="full CUDA graphs"):
        serve.parse_args(["--configs", "pp1_dspark_adaptive", "--cpu"])
    serve.parse_args(["--configs", "pp1_dspark", "--cpu"])  # the baseline alone runs on a CPU
    with pytest.raises(SystemExit, match="synthetic, draft"):
        serve.parse_args(["--configs", "adaptive_pp1", "--env", "DSPARK_BENCH_CONFIDENCES=oracle"])


def test_dry_run_sets_the_spec_key_and_the_opt_in_on_every_adaptive_launcher(capsys):
    args = ["--dry-run", "--out", "/nonexistent-not-written", "--configs", "adaptive_pp2"]
    assert serve.main(args) == 0
    nodes = dry_run_launchers(capsys.readouterr().out)
    adapt = {n: v for n, v in nodes.items() if n.startswith("pp2_dspark_adaptive ")}
    fixed = {n: v for n, v in nodes.items() if n.startswith("pp2_dspark node")}
    assert len(adapt) == 2 and len(fixed) == 2  # node 0 and the headless node 1 of each
    for node in adapt.values():
        assert node["env"][OPT_IN] == "1"
        assert node["env"][hooks.CONFIDENCES_ENV] == "synthetic"
        assert node["env"]["VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S"] == "300"  # the cost-curve wait
        assert node["spec"]["enable_adaptive_verification"] is True
        assert "--enforce-eager" not in node["argv"]  # adaptive verification needs full graphs
    for node in fixed.values():
        assert OPT_IN not in node["env"] and hooks.CONFIDENCES_ENV not in node["env"]
        assert node["spec"]["method"] == "dspark"
        assert "enable_adaptive_verification" not in node["spec"]
    assert serve.main([*args, "--configs", "pp1_dspark_adaptive",
                       "--env", "DSPARK_BENCH_CONFIDENCES=draft"]) == 0  # fmt: skip
    (node,) = dry_run_launchers(capsys.readouterr().out).values()
    assert node["env"][hooks.CONFIDENCES_ENV] == "draft" and node["env"][OPT_IN] == "1"
    assert "VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S" not in node["env"]  # PP=1: no stages to wait on


# --------------------------------------------------------------------------- the k sweep
def test_the_k_sweep_groups_every_fixed_k_with_the_adaptive_deployment():
    for pp in (1, 2):
        cfgs = serve.select_configs(f"ksweep_pp{pp}")
        assert [(c.name, c.pp, c.k, c.adaptive) for c in cfgs] == [
            *((f"pp{pp}_dspark_k{j}", pp, j, False) for j in range(1, 8)),
            (f"pp{pp}_dspark_adaptive", pp, None, True),
        ]


def test_dry_run_of_the_k_sweep_drafts_each_k_on_one_acceptance_profile(capsys):
    """Each fixed-k deployment drafts its own k, the adaptive one the driver's -k, and every
    server gets the 7-position profile (a k sweep); a run with one k gets none. Control: the
    adaptive pair (one k) has no profile variable."""
    args = ["--dry-run", "--out", "/nonexistent-not-written", "--interleave", "--repeats", "3",
            "--concurrency", "4", "--acceptance-lengths", "3.99"]  # fmt: skip
    assert serve.main([*args, "--configs", "ksweep_pp2"]) == 0
    nodes = dry_run_launchers(capsys.readouterr().out)
    assert len(nodes) == 16  # 8 deployments, two launchers each
    for name, node in nodes.items():
        spec = node["spec"]
        dep = name.split(" ")[0]
        want_k = 7 if dep.endswith("_adaptive") else int(dep.rsplit("_k", 1)[1])
        assert spec["num_speculative_tokens"] == want_k, name
        assert spec.get("enable_adaptive_verification", False) == dep.endswith("_adaptive")
        assert node["env"][hooks.PROFILE_ENV] == "7", name
    assert serve.main([*args, "--configs", "adaptive_pp2"]) == 0
    nodes = dry_run_launchers(capsys.readouterr().out)
    assert nodes and all(hooks.PROFILE_ENV not in n["env"] for n in nodes.values())


def test_a_shorter_k_keeps_the_first_positions_of_the_k_sweeps_profile(monkeypatch):
    """With the sweep's profile (7 positions) a server drafting 3 accepts positions 1..3 at the
    7-position geometric rate, so its mean acceptance length is below the AL asked for. Control:
    without the variable its profile is stretched over its own 3 positions (another rate)."""
    monkeypatch.setenv(hooks.SCHEDULE_ENV, "geometric")

    def runner(n):
        rates = torch.zeros(n)
        return types.SimpleNamespace(
            rejection_sampler=types.SimpleNamespace(synthetic_conditional_rates=rates)
        )

    monkeypatch.setenv(hooks.PROFILE_ENV, "7")
    k7 = hooks._set_acceptance_length(runner(7), 3.99)
    k3 = hooks._set_acceptance_length(runner(3), 3.99)
    assert k3["profile_positions"] == 7 and len(k3["unconditional_rates"]) == 3
    assert k3["conditional_rates"] == pytest.approx(k7["conditional_rates"][:3])
    assert 1 + sum(k3["unconditional_rates"]) < 3.99 - 0.5
    monkeypatch.delenv(hooks.PROFILE_ENV)
    own = hooks._set_acceptance_length(runner(3), 3.99)
    assert 1 + sum(own["unconditional_rates"]) == pytest.approx(3.99)
    assert own["conditional_rates"][0] > k7["conditional_rates"][0] + 0.05
    monkeypatch.setenv(hooks.PROFILE_ENV, "2")
    with pytest.raises(ValueError, match="fewer positions than this server drafts"):
        hooks._set_acceptance_length(runner(3), 3.99)


def _sweep_point(name: str, repeat: int, tok_s: float) -> dict:
    return {"config": name, "concurrency": 16, "point_al": 3.99, "repeat": repeat, "slot": repeat,
            "num_prompts": 64, "bench": {"output_throughput": tok_s}}  # fmt: skip


def test_the_sweeps_summary_names_the_best_fixed_k_and_adaptive_against_it():
    """Adaptive is compared with the fixed k of the highest mean output throughput at the point
    (here k = 4, not k = 7, the driver's -k), per rotation too."""
    names = [c.name for c in serve.select_configs("ksweep_pp2")]
    tok = {f"pp2_dspark_k{j}": 100.0 + 10 * min(j, 8 - j) for j in range(1, 8)}  # k4 best: 140
    tok["pp2_dspark_adaptive"] = 133.0
    points = [
        _sweep_point(n, r, tok[n] * (1.0 + 0.01 * r)) for r in range(3) for n in names
    ]  # fmt: skip
    [entry] = serve.interleave_summary(points, names, 3)
    got = entry["adaptive_vs_best_fixed"]["pp2_dspark_adaptive"]
    assert got["best_fixed"] == "pp2_dspark_k4" and got["best_fixed_k"] == 4
    assert got["ratio_of_means"] == pytest.approx(133.0 / 140.0)
    assert got["per_rotation"] == pytest.approx([133.0 / 140.0] * 3)
    assert set(got["fixed_means"]) == {f"pp2_dspark_k{j}" for j in range(1, 8)}
    # the baseline ratios stay against the first configuration named (k = 1)
    assert "pp2_dspark_adaptive/pp2_dspark_k1" in entry["ratios"]
    # no adaptive configuration: no such section
    fixed = names[:-1]
    [plain] = serve.interleave_summary([p for p in points if p["config"] in fixed], fixed, 3)
    assert "adaptive_vs_best_fixed" not in plain


# --------------------------------------------------------------------------- the hook
def _stand_in_manager():
    """A stand-in for vLLM's ``AdaptiveVerificationManager`` that keeps what it was given."""

    class Manager:
        def record_confidences(self, confidence_probs, input_batch):
            self.seen = confidence_probs.clone()

    return types.SimpleNamespace(AdaptiveVerificationManager=Manager)


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setitem(hooks._STATE, "rates", None)
    monkeypatch.setitem(hooks._STATE, "conf", None)
    return hooks._STATE


def _conf():
    return torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [9.0, 9.0, 9.0]])  # row 2: not in batch


def test_synthetic_mode_ranks_with_the_samplers_rates_and_records_the_drafts_own(
    monkeypatch, fresh_state
):
    monkeypatch.setenv(hooks.CONFIDENCES_ENV, "synthetic")
    sampler_mod = types.SimpleNamespace(
        RejectionSampler=type(
            "RS", (), {"__init__": lambda self: setattr(
                self, "synthetic_conditional_rates", torch.tensor([1.0, 1.0, 0.99, 0.0]))}
        )
    )  # fmt: skip
    hooks._patch_rejection_sampler(sampler_mod)
    sampler_mod.RejectionSampler()
    mod = _stand_in_manager()
    hooks._patch_adaptive(mod)
    m = mod.AdaptiveVerificationManager()
    conf = _conf()
    m.record_confidences(conf, types.SimpleNamespace(num_reqs=2))
    assert m.seen[:2].tolist() == [[1.0, 1.0, pytest.approx(0.99)]] * 2
    assert m.seen[2].tolist() == [9.0, 9.0, 9.0]  # rows past the batch untouched
    got = hooks.confidence_summary()
    assert got == {"steps": 1, "rows": 2, "mean_per_position": [0.5, 0.5, 0.5],
                   "min": 0.5, "max": 0.5}  # fmt: skip
    assert hooks.confidence_summary() is None  # reset by the read


def test_draft_mode_leaves_the_confidences_and_synthetic_without_rates_fails(
    monkeypatch, fresh_state
):
    monkeypatch.setenv(hooks.CONFIDENCES_ENV, "draft")
    mod = _stand_in_manager()
    hooks._patch_adaptive(mod)
    m = mod.AdaptiveVerificationManager()
    m.record_confidences(_conf(), types.SimpleNamespace(num_reqs=2))
    assert m.seen.tolist() == _conf().tolist()
    monkeypatch.setenv(hooks.CONFIDENCES_ENV, "synthetic")
    mod = _stand_in_manager()
    hooks._patch_adaptive(mod)
    with pytest.raises(RuntimeError, match="rejection_sample_method 'synthetic'"):
        mod.AdaptiveVerificationManager().record_confidences(
            _conf(), types.SimpleNamespace(num_reqs=1)
        )
    monkeypatch.setenv(hooks.CONFIDENCES_ENV, "oracle")
    with pytest.raises(ValueError, match="'synthetic' or 'draft'"):
        hooks.confidence_mode()


def test_verified_drafts_count_only_steps_that_verify():
    steps = [
        {"num_reqs": 4, "num_draft_tokens": 0, "target_ms": 9.0, "step_ms": 10.0},  # prefill
        {"num_reqs": 4, "num_draft_tokens": 12, "target_ms": 1.0, "step_ms": 2.0},
        {"num_reqs": 2, "num_draft_tokens": 8, "target_ms": 1.0, "step_ms": 2.0},
    ]
    v = hooks.summarize_steps(steps)["verify"]
    assert (v["verify_steps"], v["verify_rows"], v["verified_drafts"]) == (2, 6, 20)
    assert v["drafts_per_verify_step"] == 10.0
    assert v["drafts_per_request"] == pytest.approx(20 / 6, abs=1e-4)


def test_a_geometric_schedule_has_the_mean_and_one_conditional_rate(monkeypatch):
    runner = types.SimpleNamespace(
        rejection_sampler=types.SimpleNamespace(synthetic_conditional_rates=torch.zeros(7))
    )
    monkeypatch.delenv(hooks.SCHEDULE_ENV, raising=False)
    got = hooks._set_acceptance_length(runner, 3.99)
    assert got["schedule"] == "min-variance"
    assert got["unconditional_rates"] == pytest.approx([1.0, 1.0, 0.99, 0, 0, 0, 0])
    monkeypatch.setenv(hooks.SCHEDULE_ENV, "geometric")
    got = hooks._set_acceptance_length(runner, 3.99)
    assert got["schedule"] == "geometric"
    assert 1 + sum(got["unconditional_rates"]) == pytest.approx(3.99)
    p = got["conditional_rates"][0]
    assert 0.78 < p < 0.79 and got["conditional_rates"] == pytest.approx([p] * 7)
    assert runner.rejection_sampler.synthetic_conditional_rates.tolist() == pytest.approx([p] * 7)
    assert hooks.geometric_rates(8.0, 7) == pytest.approx([1.0] * 7)
    monkeypatch.setenv(hooks.SCHEDULE_ENV, "uniform")
    with pytest.raises(ValueError, match="'min-variance' or 'geometric'"):
        hooks.acceptance_schedule()


# --------------------------------------------------------------------------- the table
def _timed(point: dict, per_request: float, rows: int = 8, conf=None) -> dict:
    """``point`` with PP-rank step summaries whose last rank verified ``per_request`` drafts
    per request over ``rows`` requests in one verify step."""
    drafts = int(per_request * rows)
    last = {
        "main": None,
        "verify": hooks.verify_totals([{"num_reqs": rows, "num_draft_tokens": drafts}]),
        "confidences": conf,
        "confidence_mode": "synthetic" if conf else None,
    }
    stage0 = {"main": None, "verify": hooks.verify_totals([])}
    point["step_times"] = [stage0, last] if point["pp"] == 2 else [last]
    return point


def _adaptive_sample() -> list[dict]:
    conf = {"steps": 3, "rows": 24, "mean_per_position": [0.5] * 7, "min": 0.4999, "max": 0.5001}
    conf64 = {"steps": 1, "rows": 8, "mean_per_position": [0.3] * 7, "min": 0.2, "max": 0.6}
    return [
        _timed(serve_point("pp1_dspark", 3.99, 1, 300.0, tpot=(3.0, 4.0)), 7.0),
        _timed(
            serve_point("pp1_dspark_adaptive", 3.99, 1, 330.0, tpot=(2.7, 3.5), measured=3.97),
            3.0,
            conf=conf,
        ),  # fmt: skip
        _timed(serve_point("pp1_dspark_adaptive", 3.99, 64, 900.0), 2.0, conf=conf64),
        _timed(serve_point("pp2_dspark", 3.99, 64, 2000.0), 7.0),
        _timed(serve_point("pp2_dspark_adaptive", 3.99, 64, 2600.0), 2.5),
        serve_point("pp1_nospec", None, 1, 100.0),  # not part of the table
    ]


def test_the_adaptive_table_pairs_each_point_with_its_fixed_baseline(tmp_path):
    path = tmp_path / "serve_pp_one_gpu_adaptive_pp1.json"
    path.write_text(json.dumps(serve_run(_adaptive_sample(), concurrency=(1, 64))))
    merged = plot.merge(plot.load([path]))
    rows = adaptive.adaptive_rows(plot.table_rows(merged), merged)
    assert [(r["pp"], r["al"], r["c"]) for r in rows] == [
        (1, 3.99, 1),
        (1, 3.99, 64),
        (2, 3.99, 64),
    ]
    one, one_unpaired, two = rows
    assert one_unpaired["fixed"] is None and one_unpaired["tps_ratio"] is None
    assert one["fixed_verify"] == {"per_step": 56.0, "per_request": 7.0}
    assert one["adaptive_verify"] == {"per_step": 24.0, "per_request": 3.0}
    assert one["tps_ratio"] == pytest.approx(1.1) and one["tpot_ratio"] == pytest.approx(0.9)
    assert two["adaptive_verify"]["per_request"] == 2.5  # the last PP stage's totals
    assert two["tps_ratio"] == pytest.approx(1.3)
    md = plot.markdown(plot.load([path]), [path.name])
    assert "## Adaptive verification (with vs without, issue 30)" in md
    row = "| 1 | 3.99 | 1 | 56.0 | 24.0 | 7.00 | 3.00 | 300.0 | 330.0 | 1.100 | 3.00 | 2.70 |"
    assert row in md
    # one line per adaptive configuration and AL: row-weighted mean, lowest and highest
    assert "over 32 rows: mean per position [0.4500, 0.4500" in md
    assert "lowest 0.2000, highest 0.6000; ranked with: synthetic" in md


def test_no_adaptive_table_without_an_adaptive_configuration(tmp_path):
    path = tmp_path / "serve_pp_one_gpu_pp1.json"
    fixed_only = [p for p in _adaptive_sample() if not p["config"].endswith("_adaptive")]
    path.write_text(json.dumps(serve_run(fixed_only)))
    assert "Adaptive verification" not in plot.markdown(plot.load([path]), [path.name])


# --------------------------------------------------------------------------- --only (a baseline)
def test_only_keeps_the_named_files_selected_points_and_refuses_what_matches_nothing(tmp_path):
    a, b = tmp_path / "adaptive.json", tmp_path / "baseline.json"
    a.write_text(json.dumps(serve_run([p for p in _adaptive_sample() if p["pp"] == 1])))
    baseline = [serve_point("pp2_dspark", al, 64, 2000.0) for al in (3.99, 6.1)]
    b.write_text(json.dumps(serve_run([*baseline, serve_point("pp2_nospec", None, 64, 900.0)])))
    only = plot.parse_only(["baseline.json=pp2_dspark@3.99"])
    assert only == {"baseline.json": [("pp2_dspark", 3.99)]}
    runs = plot.keep_only(plot.load([a, b]), only)
    assert len(runs[0]["points"]) == 4  # not named: every point
    assert [(p["config"], p["acceptance_length"]) for p in runs[1]["points"]] == [
        ("pp2_dspark", 3.99)
    ]
    md = plot.markdown(runs, ["adaptive.json", "baseline.json"])
    assert "only its points of pp2_dspark@3.99 are used here" in md
    assert "pp2_nospec" not in md.split("## Served results")[1]
    with pytest.raises(SystemExit, match="not among the results"):
        plot.keep_only(plot.load([a]), only)
    with pytest.raises(SystemExit, match="no point of"):
        plot.keep_only(plot.load([b]), plot.parse_only(["baseline.json=pp1_dspark"]))
    with pytest.raises(SystemExit, match="FILE=CONFIG"):
        plot.parse_only(["baseline.json"])


# --------------------------------------------------------------------------- the GPU group's record
def _probe_lines(pid: int, per_step: list[int]) -> str:
    total, out = 0, []
    for i, n in enumerate(per_step, 1):
        total += n
        out.append(f"ADAPTIVE_PROBE pid={pid} verify_steps={i} verified_drafts={total}")
    return "\n".join(out) + "\n"


def test_gpu_record_reads_the_figures_from_the_pytest_log_and_the_launchers_logs(tmp_path):
    logs = tmp_path / "pp_adaptive"
    logs.mkdir()
    steps = [7, 7, 6, 7]
    (logs / "pp1_adaptive.log").write_text("noise\n" + _probe_lines(11, steps))
    summary = (
        "(Worker pid=12) INFO [adaptive.py:191] DSpark PP adaptive verification (stage {}): 4 "
        "verify steps, 27 of 28 scheduled drafts verified; counts lag {}, {} host waits for "
        "counts\n"
    )
    (logs / "pp2_adaptive_node0.log").write_text(
        _probe_lines(12, steps) + summary.format(0, 1, 3) + summary.format(0, 1, 0)
    )
    (logs / "pp2_adaptive_node1.log").write_text(
        "(Worker pid=13) INFO [handshake.py:240] PP handshake: 2 ranks agree (protocol 2, vLLM "
        "0.34.0, method dspark, k=7, fixed graph batch None, adaptive verification True)\n"
        + _probe_lines(13, steps)
    )
    msg = (
        "vllm-dspark-pp: PP stage 1 built a batch of 8 tokens (layout 0x1) in step 2 but the "
        "previous stage sent one of 7 tokens (layout 0x2): the stages disagree on the "
        "(adaptive verification) batch shape"
    )
    (logs / "pp2_corrupt_node1.log").write_text(_probe_lines(14, [7]) + f"RuntimeError: {msg}\n")
    (logs / "ref.log").write_text("no probe here\n")
    pytest_log = tmp_path / "pp_adaptive.log"
    pytest_log.write_text(
        "tests/gpu/x.py::test_pp2_verifies_what_pp1_verifies verify steps 4, drafts verified 27 "
        "of 28; {'num_drafts': 3, 'num_draft_tokens': 21, 'num_accepted_tokens': 9, "
        "'accepted_per_pos': [3, 2, 1, 1, 1, 1, 0]}\nPASSED\n"
        "tests/gpu/x.py::test_control control: request failed: HTTPError after 1.2 s\nPASSED\n"
        "PASSED tests/gpu/x.py::test_pp2_adaptive_is_lossless\n"
        "FAILED tests/gpu/x.py::test_control - boom\n"
        "==== 1 failed, 1 passed in 230.60s (0:03:50) ====\n"
    )
    test_file = tmp_path / "test_x.py"
    test_file.write_text("NUM_PROMPTS = 7\nMAX_TOKENS = 64\nCONTROL_FAIL_S = 60.0\n")
    rec = adaptive.gpu_record(pytest_log, logs, test_file)
    assert rec["summary"] == {"result": "1 failed, 1 passed", "seconds": 230.6}
    assert rec["tests"] == {"test_pp2_adaptive_is_lossless": "PASSED", "test_control": "FAILED"}
    assert rec["test_constants"] == {"NUM_PROMPTS": 7, "MAX_TOKENS": 64, "CONTROL_FAIL_S": 60.0}
    assert rec["k"] == 7
    assert rec["nodes"]["pp2_adaptive_node1"]["handshake"]["adaptive verification"] == "True"
    assert rec["nodes"]["pp1_adaptive"]["probes"] == {
        "11": {"verify_steps": 4, "verified_drafts": 27, "trimmed": [[3, 6]]}
    }
    assert rec["nodes"]["ref"]["probes"] == {}
    assert rec["nodes"]["pp2_corrupt_node1"]["disagree"] == msg
    assert rec["parity"]["scheduled_drafts"] == 28
    assert rec["parity"]["metrics"]["accepted_per_pos"] == [3, 2, 1, 1, 1, 1, 0]
    assert rec["control"] == {"outcome": "request failed: HTTPError", "seconds": 1.2}
    # the last summary line of a stage counts; a stage that logged none has no entry
    assert rec["nodes"]["pp2_adaptive_node0"]["waits"] == {"0": {"lag": "1", "host_waits": 0}}
    assert rec["nodes"]["pp2_adaptive_node1"]["waits"] == {}
    assert rec["meta"] == {}
    md = "\n".join(adaptive.gpu_record_markdown(rec))
    assert "each stage's last summary line: stage 0: counts lag 1, 0 host waits" in md
    assert "* PP=2 adaptive stage 1: 4 verify steps, 27 drafts verified of 28 scheduled" in md
    assert "steps trimmed: step 3: 6 of 7" in md
    assert "after 1.2 s (limit 60.0 s); pp2_corrupt_node1: 1 verify step(s)" in md
    assert adaptive.main(["gpu-record", str(pytest_log), str(logs), "--test-file",
                          str(test_file), "--json", str(tmp_path / "r.json"),
                          "--commit", "abc1234", "--gpu", "H100"]) == 0  # fmt: skip
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["k"] == 7 and written["meta"] == {"commit": "abc1234", "gpu": "H100"}


def test_the_lag_group_sets_lag_0_on_its_own_launchers_only():
    """``adaptive_lag``: the same PP=2 adaptive deployment with the counts decided in the round
    they apply (lag 0) beside the default lag and fixed k, in one interleaved call; the
    variable reaches the lag-0 launchers and no other, even over a driver-wide ``--env``."""
    from benchmarks import serve_pp_one_gpu as d

    assert d.GROUPS["adaptive_lag"] == (
        "pp2_dspark",
        "pp2_dspark_adaptive_lag0",
        "pp2_dspark_adaptive",
    )
    knob = "VLLM_DSPARK_PP_ADAPTIVE_LAG"
    extra = {knob: "1"}
    envs = {
        n: d.server_env(d.CONFIGS[n], hook_root="h", cpu=True, extra=extra)
        for n in d.GROUPS["adaptive_lag"]
    }
    assert envs["pp2_dspark_adaptive_lag0"][knob] == "0"
    assert envs["pp2_dspark_adaptive"][knob] == "1" and envs["pp2_dspark"][knob] == "1"
    assert d.server_env(d.CONFIGS["pp2_dspark_adaptive"], hook_root="h", cpu=True).get(knob) is None


def test_the_adaptive_pp_page_is_generated_from_its_records(tmp_path):
    """docs/results/adaptive_pp_gpu.md is benchmarks/adaptive_pp_page.py's output from every
    adaptive_pp_gpu*.json; a record without its provenance is refused, a failed test is named."""
    import copy

    from benchmarks import adaptive_pp_page as page

    records = page.load()
    assert len(records) >= 2 and page.PAGE.read_text() == page.markdown(records), (
        "run: python -m benchmarks.adaptive_pp_page"
    )
    name, rec = next((n, r) for n, r in records if n == "adaptive_pp_gpu_2026-12-06_lag1.json")
    text = page.markdown([(name, rec)])
    assert "* **failed**: `test_pp2_verifies_what_pp1_verifies`" in text
    assert "stage 0: counts lag 1, 5 host waits" in text
    assert "* commit `91ad093`; GPU: NVIDIA H200; counts lag: 1" in text
    planted = copy.deepcopy(rec)
    planted["tests"]["test_pp2_verifies_what_pp1_verifies"] = "PASSED"
    assert "**failed**" not in page.markdown([(name, planted)])
    del planted["meta"]["commit"]
    bad = tmp_path / "adaptive_pp_gpu_x.json"
    bad.write_text(json.dumps(planted))
    with pytest.raises(page.RecordError, match="no commit"):
        page.load([bad])
    assert page.main(["--check"]) == 0


def test_the_counters_line_says_equality_was_asserted_only_at_lag_0():
    """The test asserts PP=2's counters equal PP=1's only at lag 0; the 2026-12-07 record (lag 2)
    once read "PP=2 == PP=1 asserted key by key"."""
    import copy

    from benchmarks import adaptive_pp_page as page

    rec = next(r for n, r in page.load() if n == "adaptive_pp_gpu_2026-12-07_lag2.json")
    text = "\n".join(adaptive.gpu_record_markdown(rec))
    assert "compared with PP=1 only at lag 0, this run's lag is 2" in text
    assert "asserted key by key" not in text
    lag0 = copy.deepcopy(rec)
    lag0["meta"]["lag"] = "0"
    assert "PP=2 == PP=1 asserted key by key" in "\n".join(adaptive.gpu_record_markdown(lag0))


def test_the_confidence_reading_applies_vllms_budget_rule():
    """benchmarks/tiny_pair_confidences.py (a hand-run reading): vLLM's get_num_tokens rule for
    one request, against values worked out by hand, and the summary's shares."""
    import numpy as np

    from benchmarks import tiny_pair_confidences as tc

    def geometric(q):
        return np.cumprod(np.full(7, q))

    # (1 + sum of the kept survival probabilities) / (2 + slope x (1 + kept)), maximised
    assert tc.budget(np.ones(7), 3) == 7
    assert tc.budget(geometric(0.97), 3) == 5 and tc.budget(geometric(0.93), 10) == 1
    assert tc.budget(geometric(0.93), 30) == 0
    conf = np.vstack([np.ones(7), np.full(7, 0.93)])
    lines = tc.summary(conf, [3.0, 30.0])
    assert lines[0].startswith("2 drafting steps, k = 7")
    assert (
        lines[2] == "slope 3: mean drafts kept 5.00 of 7, steps trimmed 50%, steps cut to zero 0%"
    )
    assert lines[3].endswith("steps trimmed 50%, steps cut to zero 50%")


# --------------------------------------------------------------------------- which graph ran
def _graph_manager(varlen: bool):
    """vLLM 0.34.0's own CudaGraphManager on the CPU (nothing captured): full and piecewise
    graphs, decode at 8 tokens per request (k = 7) for up to 32 requests, as the goal (g) runs
    (``--max-num-seqs 32``). Only the PP group and the graph pool, which need a device, are
    stood in for."""
    from unittest import mock

    from vllm.config import VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu import cudagraph_utils as cu

    cfg = VllmConfig()
    cc = cfg.compilation_config
    cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    cc.max_cudagraph_capture_size = 512
    cc.max_decode_cudagraph_capture_requests = 32
    cc.decode_cudagraph_capture_request_sizes = [1, 2, 4, 8, 16, 32]
    cc.prefill_cudagraph_capture_token_sizes = [8, 16, 32, 64, 128, 256, 512]
    cfg.scheduler_config.max_num_seqs = 32
    pp = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    with (
        mock.patch.object(cu, "get_pp_group", lambda: pp),
        mock.patch.object(cu.current_platform, "get_global_graph_pool", lambda: None, create=True),
    ):
        m = cu.CudaGraphManager(
            cfg,
            torch.device("cpu"),
            CUDAGraphMode.FULL_AND_PIECEWISE,
            {8: 32},
            varlen_decode=varlen,
        )
    m._graphs_captured = True  # dispatch as after capture
    return m


@pytest.mark.parametrize("reqs", [32, 16])  # PP=1 at C = 32; a PP=2 micro-batch of C = 32
def test_graph_kinds_name_what_vllms_dispatcher_picks_for_fixed_k_and_adaptive(reqs):
    fixed, adaptive = _graph_manager(False), _graph_manager(True)
    batch = dict(num_reqs=reqs, num_tokens=8 * reqs, uniform_token_count=8, num_active_loras=0)
    got = fixed.dispatch(**batch, max_query_len=8)
    assert hooks.graph_kind(got) == "full uniform q=8" and got.num_reqs == reqs
    got = adaptive.dispatch(**batch, max_query_len=8)  # nothing trimmed: the same batch
    assert hooks.graph_kind(got) == "full varlen q<=8" and got.num_tokens == 8 * reqs
    # the varlen graph of N tokens holds min(N, max_num_seqs) request slots: a PP=2 micro-batch
    # of 16 requests replays a graph of 32 (cudagraph_utils.py:313-330)
    assert got.num_reqs == 32
    trimmed = adaptive.dispatch(
        num_reqs=reqs, num_tokens=8 * reqs - 3, uniform_token_count=None, num_active_loras=0,
        max_query_len=8,
    )  # fmt: skip
    assert hooks.graph_kind(trimmed) == "full varlen q<=8"
    assert hooks.graph_kind(fixed.dispatch(**{**batch, "uniform_token_count": None})) == "piecewise"


def test_the_first_dispatch_of_a_step_names_its_graph_and_the_summary_counts_kinds(monkeypatch):
    monkeypatch.setattr(hooks, "_cuda", lambda: None)  # host clocks on any machine
    monkeypatch.setattr(hooks, "_STATE", {**hooks._STATE, "steps": [], "cur": None, "xpend": []})
    manager = _graph_manager(True)
    batch = types.SimpleNamespace(num_reqs=4, num_tokens=32, num_draft_tokens=28,
                                  num_tokens_after_padding=32)  # fmt: skip

    class Runner:
        cudagraph_manager = manager
        execute_model_state = types.SimpleNamespace(input_batch=batch)

        def execute_model(self, tokens):
            self.cudagraph_manager.dispatch(4, tokens, None, 0, max_query_len=8)
            self.cudagraph_manager.dispatch(4, 4, None, 0)  # a later, smaller dispatch

        def sample_tokens(self):
            return None

    runner = Runner()
    assert "cudagraph_dispatch" in hooks._install_timers(runner)
    for tokens in (32, 30, 3000):  # 3000: above every graph, eager
        runner.execute_model(tokens)
        runner.sample_tokens()
    steps = hooks._resolve()
    assert [s["graph"] for s in steps] == ["full varlen q<=8"] * 2 + ["eager"]
    assert [s["graph_tokens"] for s in steps] == [32, 32, 3000]
    graphs = hooks.summarize_steps(steps)["graphs"]
    assert list(graphs) == ["full varlen q<=8", "eager"]
    assert (
        graphs["full varlen q<=8"]["steps"] == 2 and graphs["full varlen q<=8"]["graph_reqs"] == 32
    )
    assert (
        hooks.summarize_steps([{"num_reqs": 1, "target_ms": 1.0, "step_ms": 1.0}])["graphs"] is None
    )
