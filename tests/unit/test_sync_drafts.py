"""Unit tests of the sync-scheduling draft rule (vllm_dspark_pp.sync_drafts + its patch)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from vllm_dspark_pp import sync_drafts


class _Drafts:
    def __init__(self, req_ids, draft_token_ids):
        self.req_ids = req_ids
        self.draft_token_ids = draft_token_ids


def _sched_out(**num_scheduled):
    return SimpleNamespace(num_scheduled_tokens=dict(num_scheduled))


class _Core:
    def __init__(self, *, queue=True, spec=True, async_sched=False, drafts=None):
        self.batch_queue = deque(maxlen=2) if queue else None
        self.check_for_draft_tokens = spec
        self.async_scheduling = async_sched
        self.taken = 0
        self.applied: list[dict] = []
        self._drafts = drafts
        core = self

        class _Exec:
            def take_draft_token_ids(self):
                core.taken += 1
                return core._drafts

        class _Sched:
            def update_draft_token_ids(self, d):
                core.applied.append(dict(zip(d.req_ids, d.draft_token_ids, strict=True)))

        self.model_executor = _Exec()
        self.scheduler = _Sched()


def test_only_pp_batch_queue_with_sync_scheduling_and_drafts_defers():
    assert sync_drafts.defers_draft_application(_Core())
    assert not sync_drafts.defers_draft_application(_Core(queue=False))  # PP=1
    assert not sync_drafts.defers_draft_application(_Core(async_sched=True))
    assert not sync_drafts.defers_draft_application(_Core(spec=False))


def test_in_flight_requests_are_left_out_and_others_applied():
    core = _Core(drafts=_Drafts(["a", "b", "c"], [[-1] * 4, [-1] * 4, [-1] * 4]))
    core.batch_queue.appendleft((None, _sched_out(b=5, z=0), None))
    assert sync_drafts.in_flight_request_ids(core.batch_queue) == {"b"}
    assert sync_drafts.apply_settled_drafts(core) == 2
    assert core.applied == [{"a": [-1] * 4, "c": [-1] * 4}]


def test_nothing_applied_when_all_in_flight_or_no_drafts():
    core = _Core(drafts=_Drafts(["a"], [[1, 2]]))
    core.batch_queue.appendleft((None, _sched_out(a=1), None))
    assert sync_drafts.apply_settled_drafts(core) == 0
    assert core.applied == []
    core = _Core(drafts=None)
    assert sync_drafts.apply_settled_drafts(core) == 0 and core.taken == 1


def test_patched_post_step_skips_fetching_only_in_the_deferred_mode():
    from vllm.v1.engine.core import EngineCore

    from vllm_dspark_pp.patches import v1_engine_core

    v1_engine_core.apply()
    v1_engine_core.apply()  # idempotent

    deferred = _Core(drafts=_Drafts(["a"], [[-1]]))
    EngineCore.post_step(deferred, True)
    assert deferred.taken == 0 and deferred.applied == []

    pp1 = _Core(queue=False, drafts=_Drafts(["a"], [[-1]]))
    EngineCore.post_step(pp1, True)  # vLLM's own behaviour: fetch and apply right away
    assert pp1.taken == 1 and pp1.applied == [{"a": [-1]}]
