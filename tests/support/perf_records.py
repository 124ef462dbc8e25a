"""Synthetic run records of benchmarks/perf_real_shapes.py, for the driver's, plot's and
projection's CPU tests (one record = one ``LLM.generate`` of C prompts)."""

from __future__ import annotations


def run_record(
    engine,
    plugin,
    al,
    c,
    rep,
    tok_s,
    *,
    tpot=5.0,
    ttft=20.0,
    tgt=4.0,
    dft=1.0,
    step=6.0,
    measured=None,
) -> dict:
    """A ``"type": "run"`` record; ``measured`` (the measured acceptance length) defaults to
    ``al``; ``draft_ms`` is set for DSpark engines only."""
    return {
        "type": "run",
        "engine": engine,
        "plugin": plugin,
        "acceptance_length": al,
        "concurrency": c,
        "repeat": rep,
        "output_tok_s": tok_s,
        "tpot_ms_mean": tpot,
        "ttft_ms_mean": ttft,
        "measured_acceptance_length": al if measured is None else measured,
        "target_ms": tgt,
        "draft_ms": dft if engine == "dspark" else None,
        "step_ms": step,
    }
