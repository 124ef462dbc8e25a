"""CPU tests of the adaptive-verification measurement (issue 30, item 4): the served-curve
driver's adaptive configurations and groups (benchmarks/serve_pp_one_gpu.py, --dry-run), the
benchmark hook's confidences and verified-draft totals (benchmarks/dspark_bench_hooks.py, on
stand-in vLLM classes), and the "adaptive verification" table (benchmarks/adaptive_bench.py
through benchmarks/plot_pp_one_gpu.py) from a small recorded sample. Nothing is timed and no
server starts."""

from __future__ import annotations

import json
import types

import pytest
import torch
from support.perf_records import dry_run_launchers, serve_point, serve_run
from support.scripts import load_script

serve = load_script("benchmarks/serve_pp_one_gpu.py")
plot = load_script("benchmarks/plot_pp_one_gpu.py")
hooks = load_script("benchmarks/dspark_bench_hooks.py")
adaptive = load_script("benchmarks/adaptive_bench.py")

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


def _spec_text(argv: list[str]) -> str:
    """The speculative config as printed (the dry run prints it unquoted)."""
    return " ".join(argv).split("--speculative-config ", 1)[1].replace("\\", "")


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
        assert '"enable_adaptive_verification": true}' in _spec_text(node["argv"])
        assert "--enforce-eager" not in node["argv"]  # adaptive verification needs full graphs
    for node in fixed.values():
        assert OPT_IN not in node["env"] and hooks.CONFIDENCES_ENV not in node["env"]
        assert '"method": "dspark"' in _spec_text(node["argv"])
        assert "enable_adaptive_verification" not in _spec_text(node["argv"])
    assert serve.main([*args, "--configs", "pp1_dspark_adaptive",
                       "--env", "DSPARK_BENCH_CONFIDENCES=draft"]) == 0  # fmt: skip
    (node,) = dry_run_launchers(capsys.readouterr().out).values()
    assert node["env"][hooks.CONFIDENCES_ENV] == "draft" and node["env"][OPT_IN] == "1"
    assert "VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S" not in node["env"]  # PP=1: no stages to wait on


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
