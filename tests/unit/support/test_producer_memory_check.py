"""CPU test of the GPU check tests/gpu/test_producer_memory_gpu.py makes (issue 29 item 4), on the
recorded Qwen3-8B readings (docs/results/perf_qwen3-8b.jsonl): run 13, before the fix, held the
fused K/V copy (320.0 MiB) and must fail it; run 17 (2026-12-04, 240.0 MiB) must pass it. Also the
driver's exit status for that GPU test's call, ``--phases producer`` (no rows: run 17 exited 1)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from support.producer_memory import check_producer_draft_load, pre_fix_reading, producer_loads

from benchmarks import perf_real_shapes as perf

REPO = Path(__file__).resolve().parents[3]
RUN17 = REPO / "docs" / "results" / "perf_qwen3-8b_producer_memory.json"


def test_the_pre_fix_reading_fails_the_check_and_the_new_one_passes_it():
    loads = producer_loads()
    assert len(loads) >= 2
    before, after = loads[0], loads[-1]
    assert before["allocated_delta_bytes"] == pre_fix_reading()
    with pytest.raises(AssertionError, match="PRODUCER DRAFTER MEMORY"):
        check_producer_draft_load(before)  # 320.0 MiB: 1.333x plan's 240.0 MiB
    line = check_producer_draft_load(after)
    assert "less by 80.0 MiB" in line, line
    wrong_class = dict(after, draft_class="Qwen3DSparkForCausalLM")
    with pytest.raises(AssertionError):
        check_producer_draft_load(wrong_class)


def test_the_gpu_run_s_result_is_the_one_recorded():
    run17 = json.loads(RUN17.read_text())
    recorded = json.loads((REPO / "docs" / "results" / "perf_qwen3-8b.json").read_text())
    load = run17["memory"]["producer/on"]["draft_load"]
    assert recorded["memory"]["producer/on"]["draft_load"] == load == producer_loads()[-1]
    # a merge keeps the later call's plan (the rule without the copy), as it keeps its memory
    assert recorded["plan"] == run17["plan"]
    assert "context-KV-only 240.01 MiB (no copy" in recorded["plan"]["kv_producer"]["draft bytes"]


def test_a_producer_only_call_exits_0_on_its_memory_record_and_1_without_it():
    run17 = json.loads(RUN17.read_text())
    assert run17["phase_order"] == ["producer"] and not run17["rows"]
    assert perf.exit_status(run17) == 0  # the driver returned 1 here before (rows only)
    no_mem = copy.deepcopy(run17)
    del no_mem["memory"]["producer/on"]["draft_load"]
    assert perf.exit_status(no_mem) == 1
    skipped = dict(no_mem, child_status={})
    assert perf.exit_status(skipped) == 1  # nothing measured at all


def test_exit_status_fails_a_phase_that_ran_and_measured_nothing():
    run17 = json.loads(RUN17.read_text())
    row = {"engine": "nospec", "plugin": "on", "concurrency": 1}
    both = dict(run17, phase_order=["producer", "nospec"], rows=[row])
    both["child_status"] = {"producer/on": "ok", "nospec/on": "ok"}
    assert perf.exit_status(both) == 0
    # nospec skipped whole by the budget: not a failure
    assert perf.exit_status(dict(both, rows=[], child_status={"producer/on": "ok"})) == 0
    # nospec ran (killed) and left no row: a failure, though producer measured
    assert perf.exit_status(dict(both, rows=[], child_status={**both["child_status"]})) == 1
