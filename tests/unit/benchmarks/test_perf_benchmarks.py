"""CPU tests of the one-GPU performance benchmark's pure parts (issue 15): shape folders, result
aggregation, plugin on/off ratios, step-time summaries, markdown/PNG output, the PP projection,
the exchange payload model and the plan's drafter-memory prediction. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.perf_records import run_record

from benchmarks import dspark_bench_hooks as hooks
from benchmarks import exchange_gloo, plot_perf, pp_projection, real_shapes
from benchmarks import perf_real_shapes as perf

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "benchmarks"


def _records():
    recs = []
    for c in (1, 4):
        for rep, scale in enumerate((1.0, 1.2, 0.9)):
            recs.append(run_record("nospec", "on", None, c, rep, 100.0 * c * scale, dft=None))
            recs.append(run_record("dspark", "on", 3.99, c, rep, 300.0 * c * scale))
            recs.append(run_record("dspark", "off", 3.99, c, rep, 303.0 * c * scale))
    recs.append(
        {
            "type": "memory",
            "engine": "dspark/on",
            "draft_load": {
                "allocated_delta_bytes": 3 * 2**30,
                "peak_delta_bytes": 5 * 2**30,
                "param_bytes_own": 2 * 2**30,
                "draft_class": "X",
            },
        }
    )
    recs.append(
        {
            "type": "plan",
            "kv_both": {"draft bytes": "full drafter 1.00 MiB"},
            "kv_producer": {"draft bytes": "context-KV-only 0.10 MiB"},
        }
    )
    recs.append({"type": "skip", "what": "nospec rep 2 C 64", "why": "budget: 3 s left"})
    recs.append({"type": "engine", "engine": "dspark", "plugin": "on", "start_s": 61.0})
    return recs


def _result():
    meta = {
        "shape": "qwen3-8b",
        "shape_config": real_shapes.SHAPES["qwen3-8b"].__dict__,
        "k": 7,
        "repeats": 3,
        "input_len": 128,
        "output_len": 512,
    }
    return perf.build_result(meta, _records())


def test_aggregate_takes_medians_over_repeats_and_ratios_per_concurrency():
    res = _result()
    rows = {(r["engine"], r["plugin"], r["concurrency"]): r for r in res["rows"]}
    assert rows[("dspark", "on", 4)]["output_tok_s"] == pytest.approx(1200.0)  # median of 3
    assert rows[("dspark", "on", 4)]["repeats"] == 3
    ratios = {p["concurrency"]: p["ratio"] for p in res["plugin_ratio"]}
    assert set(ratios) == {1, 4}
    assert ratios[1] == pytest.approx(300.0 / 303.0)
    sp = {s["concurrency"]: s["speedup"] for s in res["speedup"]}
    assert sp[1] == pytest.approx(3.0)
    assert res["skipped"] and res["memory"]["dspark/on"]["draft_load"]["param_bytes_own"]
    table = perf.summary_table(res)
    assert "plugin on/off AL=3.99 C=4: 0.990" in table and "SKIPPED" in table


def test_request_latencies_from_vllm_stats():
    ttft, tpot = perf.request_latencies(
        arrival=0.0, first_ts=10.0, last_ts=15.11, num_gen=512, first_latency=0.25
    )
    assert ttft == 0.25 and tpot == pytest.approx(5.11 / 511)
    assert perf.request_latencies(0.0, 1.0, 1.0, 1, 0.1)[1] is None


def test_step_summary_groups_by_batch_size():
    steps = [
        {"num_reqs": 4, "target_ms": t, "draft_ms": 1.0, "step_ms": t + 2, "num_tokens": 32}
        for t in (3.0, 4.0, 5.0)
    ]
    steps.append(
        {"num_reqs": 3, "target_ms": 9.0, "draft_ms": None, "step_ms": 10.0, "num_tokens": 24}
    )
    s = hooks.summarize_steps(steps)
    assert s["main_num_reqs"] == 4 and s["main"]["target_ms"] == 4.0
    assert s["per_num_reqs"]["3"]["draft_ms"] is None and s["total_steps"] == 4
    assert hooks.summarize_steps([])["main"] is None


def test_plot_writes_tables_and_png(tmp_path):
    res_path = tmp_path / "perf_qwen3-8b.json"
    res_path.write_text(json.dumps(_result()))
    md_path = tmp_path / "tables.md"
    assert plot_perf.main([str(res_path), "--out-dir", str(tmp_path), "--md", str(md_path)]) == 0
    md = md_path.read_text()
    assert "| DSpark k=7, AL 3.99 | 4 | 1200.0 | 3.00x |" in md
    assert "| 3.99 | 1 | 300.0 | 303.0 | 0.990 |" in md
    assert "| full DSpark drafter | 3072.0 MiB | no (first run) | 5120.0 MiB | 2048.0 MiB |" in md
    assert "`vllm-dspark-pp plan` on the GPU machine (kv_both): full drafter 1.00 MiB" in md
    assert "nospec rep 2 C 64" in md  # what was not measured is listed
    png = tmp_path / "perf_qwen3-8b.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_projection_splits_the_step_and_counts_exchange_bytes():
    res = _result()
    p = pp_projection.project(res, link_gbps=100.0, bcast_us=10.0)
    r = next(x for x in p["rows"] if x["concurrency"] == 4)
    assert r["target_ms_per_layer"] == pytest.approx(4.0 / 36)
    assert r["rest_ms"] == pytest.approx(1.0)  # step 6 - target 4 - draft 1
    # stage 0 of a 36-layer PP=2 split holds layers 0-17: taps at layers 1, 9, 17
    assert p["stage0_taps"] == 3
    assert r["activation_bytes"] == 4 * 8 * 4096 * 2 * (2 + 3)
    assert r["bubble_ms"] == pytest.approx(1.0 + 1.0 + r["t_tok_ms"])
    assert r["pp2_one_wave_tok_s"] < r["pp1_tok_s_model"]  # one wave only adds transfer
    assert r["pp2_two_waves_tok_s"] > r["pp2_one_wave_tok_s"]
    md = pp_projection.markdown(p)
    assert "overtakes PP=1" in md and "N=64: stock 8192 B, ours 8192 B" in md


def test_exchange_payload_model_matches_the_schedule():
    assert pp_projection.token_exchange_bytes(1, 7) == {"stock": 128, "ours": 152}
    for n in (1, 3, 4, 31, 64):
        ours = exchange_gloo.ours_payloads(n, 7)
        assert [p[0] for p in ours] == ["sampled", "counts", "drafts"]
        assert exchange_gloo.payload_bytes(ours) == pp_projection.token_exchange_bytes(n, 7)["ours"]
        assert exchange_gloo.misaligned_rows(ours) == 0
        stock = exchange_gloo.stock_payloads(n, 7)
        assert exchange_gloo.misaligned_rows(stock) == (0 if n % 4 == 0 else 1)
    # stock vLLM narrows the sampled payload to one column when the batch carries no drafts
    assert exchange_gloo.stock_payloads(2, 7, with_drafts=False)[0][1] == (2, 1)
    rows = [
        {"N": 4, "variant": v, "bytes": 512, "misaligned_rows": 0, "us_median": 3.0}
        for v in ("stock", "ours")
    ]
    assert "| 4 | 512 | 512 | 0 | 0 | 3 | 3 |" in exchange_gloo.markdown(rows)


def test_shape_folders_carry_the_published_draft_shape(tmp_path):
    paths = real_shapes.write_shape("qwen3-8b", tmp_path)
    t = json.loads(Path(paths.target, "config.json").read_text())
    d = json.loads(Path(paths.draft, "config.json").read_text())
    assert (t["num_hidden_layers"], t["hidden_size"], t["intermediate_size"]) == (36, 4096, 12288)
    assert t["vocab_size"] == 151936 and not t["tie_word_embeddings"]
    assert d["num_hidden_layers"] == 5 and d["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert d["block_size"] == 7 and d["markov_rank"] == 256 and d["confidence_head_with_markov"]
    assert "dspark" in paths.draft  # vLLM picks the method from the draft path
    assert not list(Path(paths.draft).glob("*.safetensors"))  # config only, never weights
    kw = real_shapes.engine_kwargs(paths, spec=True, acceptance_length=6.1)
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"]
    assert kw["speculative_config"]["rejection_sample_method"] == "synthetic"
    assert kw["speculative_config"]["synthetic_acceptance_length"] == 6.1


def test_real_shape_builds_vllm_engine_config(tmp_path):
    """vLLM 0.34.0 builds the Qwen3-8B-shaped pair (CPU platform, no weights)."""
    code = (
        "import json,sys; from benchmarks import real_shapes as r; "
        "p = r.write_shape('qwen3-8b', sys.argv[1]); print(json.dumps(r.check_engine_config(p)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=str(REPO),  # `python -c` finds benchmarks and this checkout from its root
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["draft_architecture"] == "Qwen3DSparkModel" and got["num_speculative_tokens"] == 7
    assert got["aux_taps"] == [2, 10, 18, 26, 34] and got["draft_layers"] == 5
    assert got["synthetic_acceptance_rates"] == pytest.approx([1, 1, 0.99, 0, 0, 0, 0])


def test_plan_draft_bytes_exclude_shared_embedding_and_count_the_full_drafters_kv_copy(tmp_path):
    from vllm_dspark_pp.deployment_plan import _checkpoint_ships
    from vllm_dspark_pp.producer.memory import draft_load_bytes, draft_param_bytes

    hf = real_shapes.draft_config(real_shapes.SHAPES["qwen3-8b"])
    comp = draft_param_bytes(hf, "kv_both", 2)["components"]
    shared = draft_load_bytes(hf, 2, own_embed=False, own_head=False)
    own = draft_load_bytes(hf, 2, own_embed=True, own_head=True)
    assert own["full"] - shared["full"] == comp["embed_tokens"] + comp["lm_head"]
    assert shared["fused_kv_copy"] == 5 * 4096 * 2 * 8 * 128 * 2 + 5 * 128 * 2
    # the full drafter holds vLLM's fused K/V copy; the context-only one shares it (no copy)
    full_params = draft_param_bytes(hf, "kv_both", 2)["full_bytes_excluding_shared"]
    assert shared["full"] == full_params + shared["fused_kv_copy"]
    context = ("fc", "hidden_norm", "layers.kv_proj", "layers.k_norm")
    assert shared["context_only"] == sum(comp[k] for k in context)
    assert shared["context_only"] == own["context_only"]
    assert shared["context_only"] < shared["full"] / 5
    # a config-only folder ships neither; a checkpoint naming them ships both
    paths = real_shapes.write_shape("qwen3-4b", tmp_path)
    assert _checkpoint_ships(paths.draft) == (False, False)
    import torch
    from safetensors.torch import save_file

    save_file(
        {"model.embed_tokens.weight": torch.zeros(2, 2), "lm_head.weight": torch.zeros(2, 2)},
        str(Path(paths.draft) / "model.safetensors"),
    )
    assert _checkpoint_ships(paths.draft) == (True, True)


def test_hook_distribution_registers_the_bench_plugin(tmp_path):
    root = perf.make_hook_dist(tmp_path)
    ep = (root / "dspark_bench_hooks-0.0.dist-info" / "entry_points.txt").read_text()
    assert "[vllm.general_plugins]" in ep and "dspark_bench = dspark_bench_hooks:register" in ep
    code = (
        "from importlib.metadata import entry_points; "
        "print(sorted(e.name for e in entry_points(group='vllm.general_plugins')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{root}:{BENCH}", "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert "dspark_bench" in proc.stdout, proc.stderr


def test_fill_replaces_only_the_generated_block(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text("# T\nkeep\n<!-- BEGIN GENERATED -->\nold\n<!-- END GENERATED -->\ntail\n")
    plot_perf.fill_between(doc, "GENERATED", "new table\n")
    assert doc.read_text() == (
        "# T\nkeep\n<!-- BEGIN GENERATED -->\nnew table\n<!-- END GENERATED -->\ntail\n"
    )
    with pytest.raises(ValueError):
        plot_perf.fill_between(doc, "PROJECTION", "x")
    # the committed docs carry the blocks the scripts fill
    assert "<!-- BEGIN GENERATED -->" in (REPO / "docs/results/performance.md").read_text()
    assert "<!-- BEGIN PROJECTION -->" in (REPO / "docs/performance-bound.md").read_text()


def test_pp1_reference_is_interpolated_never_extrapolated():
    rows = {c: {"pp1_tok_s_model": v} for c, v in ((1, 100.0), (4, 300.0), (16, 700.0))}
    assert pp_projection.pp1_at(rows, 4) == 300.0
    assert pp_projection.pp1_at(rows, 2) == pytest.approx(200.0)  # halfway in log2(C)
    assert pp_projection.pp1_at(rows, 8) == pytest.approx(500.0)
    assert pp_projection.pp1_at(rows, 32) is None
