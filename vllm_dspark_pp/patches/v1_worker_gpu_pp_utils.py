"""PPHandler posts exactly the step's exchange schedule: fixed width, aligned, one draft site.

WHAT: Replaces ``vllm.v1.worker.gpu.pp_utils.PPHandler`` by ``DSparkPPHandler``, a subclass
(:mod:`vllm_dspark_pp.protocol.handler`), right after pp_utils is imported and before the model
runner binds the name. Its ``broadcast`` / ``receive`` / ``broadcast_drafts`` (last rank and
other ranks) follow :func:`vllm_dspark_pp.protocol.schedule.step_schedule`: the sampled-token
payload is always ``[N, k+1]`` under speculative decoding (plain-sampler ``[N, 1]`` rows padded),
the counts buffer is ``[2, round_up(N, 4)]`` int32 so both row views are 16-byte aligned, drafts
are broadcast at one site at most once per step, and every post is checked against the schedule
before it is posted. It adds ``exchange_disabled`` (used by the warm-up patch) and ``begin_step``
/ ``end_step`` (used by the model runner patch). The microbatch ring, freed-request generation
counters and aux hidden-state relay of 0.34.0 are inherited unchanged.

WHY: vLLM 0.34.0 sizes the sampled payload by whether the batch carried drafts and stacks the
counts as ``[2, N]``: a width-1 payload or a misaligned ``num_rejected`` row compiles a second
Triton variant of the deferred post-update while an NCCL receive spins on the side stream, which
hangs the pipeline (vLLM issues #53402, #57755; PR #53577).

UPSTREAM: vllm-project/vllm PR #53577 (closed; fixed-width aligned PP payloads) or a successor.

RETIRE WHEN: vLLM's PPHandler pads the sampled payload to the speculative width and aligns the
counts rows itself.

TESTED BY: tests/unit/protocol/test_protocol_schedule_randomized.py,
tests/unit/protocol/test_protocol_pp_handler.py,
tests/unit/protocol/test_protocol_gloo.py, tests/gpu/test_protocol_gpu.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported

TARGET = "vllm.v1.worker.gpu.pp_utils"


def _patch(module) -> None:
    from vllm_dspark_pp.protocol.handler import dspark_pp_handler_class

    module.PPHandler = dspark_pp_handler_class(module.PPHandler)


def apply() -> None:
    when_imported(TARGET, _patch)
