"""The e2e harness turns a hang into a failure and leaves no process behind."""

from __future__ import annotations

import re
import time

import pytest
from support.e2e import E2EFailure, run_generate

from dspark_dev.proc import live_group_members

pytestmark = [pytest.mark.e2e, pytest.mark.quick]  # cheap: kept in the developer loop


def test_hard_limit_kills_the_whole_process_group(tiny_models):
    # 8 s is far too short for vLLM's start-up (engine core + 2 PP workers): the case must be
    # reported as HUNG and every process of its group must be gone afterwards.
    t0 = time.monotonic()
    with pytest.raises(E2EFailure) as info:
        run_generate(
            {"model": tiny_models.target, "pipeline_parallel_size": 2}, [[5, 6, 7]], timeout_s=8
        )
    assert info.value.hung and "HUNG" in str(info.value)
    # before the kill, every process of the case printed where it was (vllm_dspark_pp.stack_dumps)
    # (faulthandler's frame lines read 'File "...", line N in func', a traceback's ', in func')
    # (how many processes existed at 8 s depends on the machine's speed)
    assert re.search(r"asked [1-9]\d* process", str(info.value)), str(info.value)
    # (a process still importing at 8 s, as on a slow or loaded machine, is in '<module>' frames)
    assert re.search(r'\.py", line \d+ in (\w+|<module>)\n', str(info.value)), str(info.value)
    assert time.monotonic() - t0 < 40
    # Killed workers may linger as zombies until PID 1 reaps them (killpg(pgid, 0) still succeeds
    # then); what must hold is that nothing of the group still runs.
    assert live_group_members(info.value.pgid) == []


def test_engine_errors_are_failures_with_the_reason(tiny_models):
    with pytest.raises(E2EFailure) as info:
        run_generate({"model": tiny_models.target, "max_model_len": 10**7}, [[5]], timeout_s=120)
    assert not info.value.hung
    assert "max_model_len" in str(info.value) or "max model len" in str(info.value).lower()
