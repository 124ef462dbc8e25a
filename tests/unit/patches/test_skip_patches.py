"""VLLM_DSPARK_PP_SKIP_PATCHES (diagnosis knob): named patches are not applied, the others are,
bad names fail at start, and PP>1 is refused while any patch is skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vllm_dspark_pp.patches import SKIP_ENV, registry, skipped_patches


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, **env),
    )


def test_skipped_patch_is_not_applied_and_its_target_is_vllms_own():
    proc = _run_python(
        """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import vllm.v1.core.sched.scheduler as s
        from vllm_dspark_pp.patches import applied_patches, registry
        from vllm_dspark_pp.patches._util import is_patched
        names = [p.name for p in registry()]
        got = applied_patches()
        assert got == [n for n in names if n != "v1_core_sched_scheduler"], got
        assert not is_patched(s.Scheduler, "__init__")
        print("OK", len(got))
        """,
        **{SKIP_ENV: "v1_core_sched_scheduler"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"OK {len(registry()) - 1}" in out
    assert "NOT applying v1_core_sched_scheduler" in out, out[-3000:]


@pytest.mark.parametrize(
    "value,match", [("no_such_patch", "unknown patches"), ("config_vllm", "cannot skip")]
)
def test_bad_skip_lists_raise(monkeypatch, value, match):
    monkeypatch.setenv(SKIP_ENV, value)
    with pytest.raises(ValueError, match=match):
        skipped_patches()


def test_empty_skip_list_skips_nothing(monkeypatch):
    monkeypatch.setenv(SKIP_ENV, " , ")
    assert skipped_patches() == []


def test_pp_is_refused_while_a_patch_is_skipped(tmp_path):
    from vllm_dspark_pp.tiny_models import make_tiny_models

    target = make_tiny_models(tmp_path).target
    proc = _run_python(
        f"""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.engine.arg_utils import EngineArgs
        try:
            EngineArgs(model={str(target)!r}, pipeline_parallel_size=2,
                       skip_tokenizer_init=True).create_engine_config()
        except Exception as e:
            print("REFUSED", type(e).__name__, e)
        else:
            print("ACCEPTED")
        """,
        **{SKIP_ENV: "v1_worker_gpu_warmup"},
        VLLM_TARGET_DEVICE="cpu",
        CUDA_VISIBLE_DEVICES="",
    )
    out = proc.stdout + proc.stderr
    assert "REFUSED" in out and SKIP_ENV in out, out[-3000:]


def test_pp_skippable_patches_exist_and_exclude_the_protocol():
    """The patches PP may run without (the lost-stage controls, the stream-ordering control) are
    real patch names, and none of the PP exchange's own patches is among them."""
    from vllm_dspark_pp.patches import PP_SKIPPABLE

    names = {info.name for info in registry()}
    assert PP_SKIPPABLE <= names
    exchange = {"v1_worker_gpu_pp_utils", "v1_worker_gpu_warmup", "engine_arg_utils__protocol"}
    assert not {n for n in PP_SKIPPABLE if n in exchange or n.endswith(("__protocol", "adaptive"))}
