"""End to end on one GPU: DSpark greedy output equals plain greedy output, CUDA graphs on and off.

Waves of 3, 5 and 7 requests (48 tokens each, ``ignore_eos``) run against decode graphs captured
for 4 and 8 requests, so every decode step of the graph run replays a padded graph. All runs
are bf16; the parity rule is dspark_dev/parity.py (identical tokens except at a proven near-tie,
acceptance within 2 points). The engines were started by conftest.gpu_jobs.
"""

from __future__ import annotations

import pytest
from gpu_common import WAVE_SIZES

from dspark_dev.parity import acceptance_close, acceptance_rate, compare_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(480)]


def _print_run(r) -> None:
    print(f"{r.name}: startup {r.startup_s:.0f} s, wall {r.wall_s:.0f} s, config {r.config}")
    for i, n in enumerate(WAVE_SIZES):
        m = r.metrics(i)
        if m["num_draft_tokens"]:
            print(f"  wave {i} ({n} requests): {m} -> acceptance {acceptance_rate(m):.2f}%")


def test_plugin_is_applied_inside_the_vllm_worker(gpu_jobs):
    base = gpu_jobs.result("baseline")
    probe = base.probe
    print(f"worker probe: {probe}")
    assert probe, "collective_rpc returned nothing"
    for info in probe:
        assert info["loaded"], f"vllm_dspark_pp is not imported in worker pid {info['pid']}"
        assert "dspark_pp=vllm_dspark_pp:register" in info["entry_points"], info["entry_points"]
        assert info["applied"] == info["registered"], (
            f"worker pid {info['pid']} applied {info['applied']} of {info['registered']}"
        )


def _check_parity(gpu_jobs, name: str):
    base = gpu_jobs.result("baseline")
    run = gpu_jobs.result(name)
    _print_run(base)
    _print_run(run)
    rep = compare_tokens(base.tokens, run.tokens, base.logprobs)
    print(f"{name} vs baseline: {rep.describe()}")
    assert rep.ok, f"{name}: greedy output differs from the non-speculative run:\n{rep.describe()}"
    m = run.metrics()
    assert m["num_draft_tokens"] > 0, (
        f"{name}: no draft tokens at all ({m}): speculation did not run"
    )
    return base, run


def test_dspark_with_cuda_graphs_matches_plain_greedy(gpu_jobs):
    _, run = _check_parity(gpu_jobs, "spec_graphs")
    cfg = run.config
    assert not cfg["enforce_eager"] and cfg["cudagraph_mode"] != "NONE", (
        f"graphs were not on: {cfg}"
    )
    sizes = cfg.get("decode_cudagraph_capture_request_sizes")
    assert sizes == [4, 8], f"decode graphs for 4 and 8 requests expected, config says {sizes}"


def test_dspark_eager_matches_plain_greedy(gpu_jobs):
    _, run = _check_parity(gpu_jobs, "spec_eager")
    assert run.config["enforce_eager"], run.config


def test_graph_and_eager_acceptance_agree(gpu_jobs):
    g = gpu_jobs.result("spec_graphs")
    e = gpu_jobs.result("spec_eager")
    rows = []
    for i, n in enumerate(WAVE_SIZES):
        ok, desc = acceptance_close(g.metrics(i), e.metrics(i))
        rows.append((n, ok, desc))
        print(f"wave of {n}: graphs vs eager {desc}: {'ok' if ok else 'DIFFERENT'}")
    ok, desc = acceptance_close(g.metrics(), e.metrics())
    print(f"all waves: {desc}")
    assert ok, desc
    assert all(r[1] for r in rows), [r for r in rows if not r[1]]


def test_fixed_dspark_graph_batch_matches_plain_greedy(gpu_jobs):
    _, run = _check_parity(gpu_jobs, "spec_graphs_fixed8")
    extra = run.config.get("additional_config") or {}
    print(f"additional_config: {extra}")
    assert "vllm_dspark_pp" in extra, f"fixed graph batch was not recorded: {extra}"
    e = gpu_jobs.result("spec_eager")
    ok, desc = acceptance_close(run.metrics(), e.metrics())
    print(f"fixed8 vs eager: {desc}")
    assert ok, desc
