"""The check of the producer's context-KV-only drafter's memory at the Qwen3-8B shape (issue 29
item 4), shared by the GPU test (tests/gpu/test_producer_memory_gpu.py, on the reading it takes)
and its CPU test (tests/unit/support/test_producer_memory_check.py, on the recorded readings: run 13
before the fix must fail it, run 17 after it must pass)."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: every record of the recorded Qwen3-8B results, oldest first (runs 9, 13, 14, then 17)
RECORDS = REPO / "docs" / "results" / "perf_qwen3-8b.jsonl"
#: allocator vs plan: the speculator's own small buffers and allocator rounding (run 13: 11.8 kB)
TOLERANCE = 0.002
MIB = 2**20


def producer_loads(path: Path = RECORDS) -> list[dict]:
    """The producer engine's ``draft_load`` readings in a records file, in order."""
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if rec.get("type") == "memory" and rec.get("engine") == "producer/on":
            if rec.get("draft_load"):
                out.append(rec["draft_load"])
    return out


def pre_fix_reading() -> int:
    """The allocator delta recorded before issue 29 item 4 (run 13: the first producer reading)."""
    return producer_loads()[0]["allocated_delta_bytes"]


def check_producer_draft_load(load: dict) -> str:
    """Assert that a ``draft_load`` reading is the context-KV-only drafter holding each weight
    once: its class, and its allocator delta within ``TOLERANCE`` of ``vllm-dspark-pp plan``'s
    rule for the context-only role (240.0 MiB here; the drafter before the fix held the fused
    K/V copy too, 1.333x it). Returns the line to print."""
    from benchmarks import real_shapes
    from vllm_dspark_pp.producer.memory import draft_load_bytes

    assert load.get("draft_class") == "Qwen3DSparkContextKVForCausalLM", load
    draft = real_shapes.draft_config(real_shapes.SHAPES["qwen3-8b"])
    rule = draft_load_bytes(draft, 2, own_embed=False, own_head=False)
    got, before = load["allocated_delta_bytes"], pre_fix_reading()
    line = (
        f"PRODUCER DRAFTER MEMORY qwen3-8b: allocator {got:,} B ({got / MIB:.1f} MiB), plan "
        f"{rule['context_only']:,} B ({rule['context_only'] / MIB:.1f} MiB), before the fix "
        f"(run 13) {before:,} B ({before / MIB:.1f} MiB): less by {(before - got) / MIB:.1f} MiB "
        f"(fused K/V copy {rule['fused_kv_copy'] / MIB:.1f} MiB); peak during load "
        f"{load.get('peak_delta_bytes', 0) / MIB:.1f} MiB"
    )
    assert abs(got / rule["context_only"] - 1) < TOLERANCE, line
    return line
