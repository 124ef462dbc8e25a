"""PPHandler posts exactly the step's exchange schedule: fixed width, aligned, one draft site.

WHAT: ``PPHandler.broadcast`` / ``.receive`` / ``.broadcast_drafts`` (last rank and other ranks)
follow :func:`vllm_dspark_pp.exchange.step_schedule`: the sampled-token payload is always
``[N, k+1]`` under speculative decoding (plain-sampler ``[N, 1]`` rows padded), the counts buffer
is ``[2, round_up(N, 4)]`` int32 so both row views are 16-byte aligned, drafts are broadcast at
one site at most once per step, and every post is checked against the schedule before it is
posted. Adds ``set_exchange_enabled`` / ``exchange_disabled`` (used by the warm-up patch) and
``begin_step`` / ``end_step`` (used by the model runner patch). The microbatch ring,
freed-request generation counters and aux hidden-state relay of 0.34.0 are untouched.

WHY: vLLM 0.34.0 sizes the sampled payload by whether the batch carried drafts and stacks the
counts as ``[2, N]``: a width-1 payload or a misaligned ``num_rejected`` row compiles a second
Triton variant of the deferred post-update while an NCCL receive spins on the side stream, which
hangs the pipeline (vLLM issues #53402, #57755; PR #53577).

UPSTREAM: vllm-project/vllm PR #53577 (closed; fixed-width aligned PP payloads) or a successor.

RETIRE WHEN: vLLM's PPHandler pads the sampled payload to the speculative width and aligns the
counts rows itself.

TESTED BY: tests/unit/protocol/test_protocol_schedule_randomized.py, tests/unit/protocol/test_protocol_pp_handler.py,
tests/unit/protocol/test_protocol_gloo.py, tests/gpu/test_protocol_gpu.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches._on_import import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.worker.gpu.pp_utils"


def _patch(module) -> None:
    from vllm_dspark_pp import pp_exchange as px

    cls = module.PPHandler

    def make_init(orig):
        def __init__(self, max_num_reqs, num_speculative_steps, device):
            orig(self, max_num_reqs, num_speculative_steps, device)
            px.init_handler_state(self, num_speculative_steps)

        return __init__

    # Replaces pp_utils.py:104-106 (_sample_len): one width for every step.
    wrap(cls, "_sample_len", lambda orig: lambda self, input_batch=None: px.sample_width(self))
    wrap(cls, "__init__", make_init)
    # Replace pp_utils.py:233-266 (broadcast), :176-231 (receive), :165-174 (broadcast_drafts).
    wrap(cls, "broadcast", lambda orig: px.broadcast)
    wrap(cls, "receive", lambda orig: px.receive)
    wrap(cls, "broadcast_drafts", lambda orig: px.broadcast_drafts)
    for name, fn in (
        ("set_exchange_enabled", px.set_exchange_enabled),
        ("exchange_disabled", px.exchange_disabled),
        ("begin_step", px.begin_step),
        ("end_step", px.end_step),
    ):
        if not hasattr(cls, name):
            setattr(cls, name, fn)


def apply() -> None:
    when_imported(TARGET, _patch)
