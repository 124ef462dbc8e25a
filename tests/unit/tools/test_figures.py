"""The figure printers of tools/ (tools/reliability_gpu_figures.py,
tools/dsv4_router_layer_figures.py): the lines the results pages quote, from the recorded JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def _figures_tool(name: str):
    """The module of ``tools/<name>.py`` (tools/ is not a package) and docs/results."""
    root = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location(name, root / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, root / "docs" / "results"


def test_reliability_figures_print_the_decoder_kill_and_the_stock_lost_stage():
    """tools/reliability_gpu_figures.py prints the two groups built after the recorded GPU run
    from their JSON when present (the figures of reliability.md rows 3b stock and 3e)."""
    fig, _ = _figures_tool("reliability_gpu_figures")
    side = {
        "A": [{"kind": "closed", "detail": "ended after 40 of 300 tokens (no [DONE])",
               "seconds": 3.1}] * 4,
        "tally": {"A": {"closed": 4}}, "a_streaming_before_kill": 4, "a_running_at_kill": 4,
        "decoder0_rc": -9, "decoder0_group_left": [], "producer_alive": True,
        "producer_health_failures": 0, "producer_kv_at_kill": 0.0031,
        "b_prefilled_s_before_kill": 0.4, "kv_freed_s_after_kill": 45.2,
        "kv_freed_s_after_b_prefill": 45.6, "producer_expired_lines": [["r1", 45]] * 4,
        "producer_expired_counter_delta": 4.0, "producer_error_lines": [[]],
        "restart": {"ready_s_after_kill": 70.0, "tokens_equal_before_kill": True,
                    "seconds": 0.4, "external_hits": 54.0},
    }  # fmt: skip
    d = {"date": "d", "hold_s": 45, "bound_s": 40.0, "wall_s": 230.0, "ours": side,
         "stock": {"skipped": "DSPARK_PD_DKILL_STOCK=0"}}  # fmt: skip
    lines = fig.pd_decoder_lines(d)
    text = "\n".join(lines)
    assert "producer KV usage 0.31 % at the kill" in text
    assert "back to 0 45.2 s after the kill = 45.6 s after B's prefills" in text
    assert "expired lines 4 ([45] s), expired counter +4.0" in text
    assert "external prefix-cache hits 54" in text
    assert "stock: not run: DSPARK_PD_DKILL_STOCK=0" in text
    lost = {"control": False, "stock": True, "named": False, "exit_s": 62.0, "rc": 0,
            "nodes_exit_s": 64.0, "head_group_left": [], "other_nodes_running": [],
            "timeout_line": "TimeoutError: RPC call to sample_tokens timed out.",
            "clients": [{"error": "x", "token_ids": [1] * 9}] * 8}  # fmt: skip
    (line,) = fig.lost_lines("lost_stage_stock", lost)
    assert "stock=True, node 0 exit 62.0 s" in line and "stage named False" in line


def test_reliability_figures_print_the_sampling_run_and_a_failed_sides_first_line():
    """tools/reliability_gpu_figures.py prints case 4's GPU figures from the recorded
    sampling.json, and a side that failed by its error's first line (the rest is a log tail)."""
    fig, results = _figures_tool("reliability_gpu_figures")
    d = json.loads((results / "reliability_gpu_sampling.json").read_text())
    text = "\n".join(fig.sampling_lines(d))
    g = d["first"]
    assert f"T=1.0: n {g['T=1.0']['n']}, stat {g['T=1.0']['stat']}," in text
    assert f"power at n vs 0.8 {g['power_at_n']['0.8']:.4f}" in text
    pp = d["pp2_vs_pp1"]
    assert f"seeded PP=2 vs PP=1 DSpark: {pp['differing']}/{pp['requests']} differ" in text
    dk = {"date": "d", "hold_s": 45, "bound_s": 40.0, "wall_s": 1.0,
          "ours": {"error": "at step 'x': CaseFailure: not ready\nlog tail line"},
          "stock": {"skipped": "off"}}  # fmt: skip
    lines = fig.pd_decoder_lines(dk)
    assert lines[1] == "  ours: not run: at step 'x': CaseFailure: not ready"
    assert lines[2] == "  stock: not run: off"


def test_dsv4_router_layer_figures_name_each_controls_rows():
    """tools/dsv4_router_layer_figures.py prints the recorded layer report's facts and controls."""
    fig, results = _figures_tool("dsv4_router_layer_figures")
    d = json.loads((results / "dsv4_router_layer_gpu.json").read_text())
    text = "\n".join(fig.layer_lines(d))
    assert f"rows flagged {d['controls']['wrong_mask_rows']}" in text
    assert f"graph sizes {d['facts']['graph_sizes']}" in text
    d["facts"]["eager_rows_not_bitwise_vs_unpadded"] = ["R=3 P=4 stale: rows [1]"]
    assert "eager R=3 P=4 stale: rows [1];" in "\n".join(fig.layer_lines(d))
