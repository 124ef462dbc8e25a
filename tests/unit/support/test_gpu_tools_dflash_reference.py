"""The reference of tests/support/dflash_prepare_ref.py against vLLM's real kernel, on the CPU.

vLLM's DFlash prepare-inputs Triton kernel runs here through the Triton interpreter (in a fresh
process with the CPU environment), so the GPU test's reference is known to be right before the
GPU machine sees it; and a corrupted output is shown to be caught, padding rows included.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import dflash_prepare_ref as ref
from support.env import CPU_ENV

SUPPORT_DIR = Path(ref.__file__).resolve().parent

pytestmark = pytest.mark.timeout(600)


def test_vllm_kernel_under_the_triton_interpreter_matches_the_reference():
    code = textwrap.dedent(
        """
        from support import dflash_prepare_ref as ref
        bad = []
        for anchor, n in ((True, 3), (False, 5)):
            case = ref.make_case(40 + n, n, sample_from_anchor=anchor)
            bad += [case.describe() + ": " + p for p in ref.check_case(case, "cpu")]
        print("PROBLEMS", len(bad))
        for b in bad[:20]:
            print(b)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={
            **os.environ,
            **CPU_ENV,
            "PYTHONPATH": os.pathsep.join(
                [str(SUPPORT_DIR.parent), os.environ.get("PYTHONPATH", "")]
            ),
        },
        capture_output=True,
        text=True,
        timeout=540,
    )
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert "PROBLEMS 0" in proc.stdout, out


def _want(case):
    return ref.reference(case, 0)


def test_corrupted_padding_rows_are_caught():
    case = ref.make_case(5, 3, sample_from_anchor=True)
    want = _want(case)
    n, Q, N = case.num_reqs, case.num_query_per_req, case.num_speculative_steps
    assert ref.compare(case, {k: v.clone() for k, v in want.items()}, want) == []
    for name, idx, value in (
        ("is_padding", n * Q + 2, False),  # a padding row not flagged
        ("input_ids", n * Q, 5),  # a padding id not zeroed
        ("positions", case.max_num_tokens - 1, 3),  # the very last padding position
        ("sample_idx_mapping", n * N, 0),  # a padding sample scattering into request 0
        ("seq_lens", case.max_num_reqs - 1, 1),
        ("query_slot_mapping", 0, 12345),  # a real row
    ):
        got = {k: v.clone() for k, v in want.items()}
        got[name][idx] = value
        problems = ref.compare(case, got, want)
        assert len(problems) == 1 and problems[0].startswith(name), (name, problems)
        region = "PADDING row" if not (name == "query_slot_mapping") else "real row"
        assert region in problems[0], problems


def test_reference_padding_layout():
    case = ref.make_case(9, 5, sample_from_anchor=False)
    w = _want(case)
    n, Q, N, M = (
        case.num_reqs,
        case.num_query_per_req,
        case.num_speculative_steps,
        case.max_num_reqs,
    )
    assert Q == N + 1  # DFlash layout: bonus + N masks
    assert w["is_padding"][: n * Q].logical_not().all() and w["is_padding"][n * Q :].all()
    assert (w["input_ids"][n * Q :] == 0).all() and (w["positions"][n * Q :] == 0).all()
    assert (w["query_slot_mapping"][n * Q :] == ref.PAD_SLOT_ID).all()
    assert (w["sample_idx_mapping"][n * N : M * N] == -1).all()
    assert (w["query_start_loc"][n:] == n * Q).all() and (w["seq_lens"][n:] == 0).all()
    assert (w["sample_idx_mapping"][: n * N] >= 0).all()
