"""Apply draft tokens only for batches whose output was processed (sync scheduling + PP).

WHAT: ``EngineCore.post_step`` no longer fetches drafts while a PP batch queue is used with
synchronous scheduling; instead ``EngineCore.step_with_batch_queue`` fetches them each time it has
processed a batch's output and applies them only to requests not in a batch still in flight
(feature logic: ``vllm_dspark_pp.sync_drafts``). Async scheduling, PP=1 and runs without
speculative decoding are untouched.

WHY: vLLM 0.34.0 calls ``take_draft_token_ids`` from ``post_step`` (vllm/v1/engine/core.py:749-756)
right after ``step_with_batch_queue`` merely *scheduled* a batch (core.py:813-819 returns early),
and ``Scheduler.update_draft_token_ids`` (vllm/v1/core/sched/scheduler.py:2995-3014) gives the
in-flight request drafts before its sampled token exists; the next ``schedule()`` sends the k
drafts without the bonus position and PP rank 0's ``prepare_inputs`` asserts
``num_scheduled_tokens >= num_logits``. Every speculative method with PP and sync scheduling
(the CPU default, ``--no-async-scheduling`` on GPUs) hits it: DSpark, DFlash, EAGLE, MTP, ...

UPSTREAM: none filed yet; the fix belongs in vLLM's ``EngineCore.step_with_batch_queue`` (apply
drafts after ``update_from_output``, skipping requests still in ``batch_queue``).

RETIRE WHEN: vLLM fetches drafts after processing a batch's output in ``step_with_batch_queue``
(check ``post_step`` in vllm/v1/engine/core.py of the new release).

TESTED BY: tests/unit/test_sync_drafts.py, tests/e2e/test_pp_parity.py (sync-mode cases).
"""

from __future__ import annotations

TARGET = "vllm.v1.engine.core"


def apply() -> None:
    from vllm_dspark_pp.patches import when_imported

    when_imported(TARGET, _patch)


def _patch(module) -> None:
    from vllm_dspark_pp import sync_drafts
    from vllm_dspark_pp.patches._util import wrap

    def make_post_step(orig):
        def post_step(self, model_executed: bool) -> None:
            if sync_drafts.defers_draft_application(self):
                return  # drafts are applied in step_with_batch_queue once settled
            orig(self, model_executed)

        return post_step

    def make_step_with_batch_queue(orig):
        def step_with_batch_queue(self):
            outputs, model_executed = orig(self)
            if outputs is not None and sync_drafts.defers_draft_application(self):
                # A batch's output was just folded into the scheduler (vLLM returns outputs
                # only then): its requests' drafts are settled now, unless they are in flight
                # again in a later batch.
                sync_drafts.apply_settled_drafts(self)
            return outputs, model_executed

        return step_with_batch_queue

    wrap(module.EngineCore, "post_step", make_post_step)
    wrap(module.EngineCore, "step_with_batch_queue", make_step_with_batch_queue)
