"""Keep a context-KV-only DSpark drafter out of EPLB.

WHAT: Wraps ``EPLBController.maybe_register_speculator``: a speculator whose draft model is
context-KV-only (prefill-only producer) is never registered with the expert load balancer.

WHY: The context-only drafter has no MoE/MLP layers and runs no expert forward; registering it
would make EPLB rebalance experts that do not exist.

UPSTREAM: vLLM PR #56957 (DSpark prefill-only producers under PP).

RETIRE WHEN: upstream builds the context-only drafter (and skips its EPLB registration).

TESTED BY: tests/unit/producer/test_runner_patches.py
"""

from __future__ import annotations

TARGET = "vllm.v1.worker.gpu.eplb_utils"


def apply() -> None:
    from vllm_dspark_pp.patches import when_imported

    when_imported(TARGET, _patch)


def _patch(module) -> None:
    from vllm_dspark_pp.patches._util import wrap
    from vllm_dspark_pp.producer.drafter import is_context_kv_only

    def make(orig):
        def maybe_register_speculator(self, speculator, *args, **kwargs):
            if speculator is not None and is_context_kv_only(getattr(speculator, "model", None)):
                return False
            return orig(self, speculator, *args, **kwargs)

        return maybe_register_speculator

    wrap(module.EPLBController, "maybe_register_speculator", make)
