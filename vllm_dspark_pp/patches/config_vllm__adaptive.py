"""Lift vLLM's refusal of adaptive verification under PP, only where the plugin covers it.

WHAT: Wraps ``VllmConfig._validate_adaptive_verification`` (vllm/config/vllm.py:3271-3314). vLLM's
own checks all run; its last one, the PP refusal (config/vllm.py:3306-3314, "Adaptive
verification is not currently compatible with pipeline parallelism"), is let through only when
``protocol.adaptive.uncovered_reason`` finds the configuration covered: DSpark drafts, aggregated
serving or a PD decoder (kv_consumer), TP = DP = 1, no context parallelism, no batch-sharded
sampling, and only with the opt-in ``VLLM_DSPARK_PP_ADAPTIVE_PP=1`` (experimental until the
one-GPU PP tier shows it lossless). Any other PP configuration keeps vLLM's refusal, with the
reason the plugin does not cover it appended.

WHY: vLLM refuses because its trimmed batch shape is decided on the last PP rank only (the
earlier ranks would diverge); patches/v1_worker_gpu_model_runner__adaptive.py makes the last
stage decide the per-request admitted counts a step early and ship them to every stage in the
drafts payload (docs/protocol.md, "Adaptive verification under PP").

UPSTREAM: the TODO at vllm/config/vllm.py:3309-3310 (broadcast the cost curves and confidences to
all PP ranks); vLLM RFCs #48202, #48627, #54801.

RETIRE WHEN: vLLM supports adaptive verification with PP itself (that TODO is done and the
refusal at config/vllm.py:3306-3314 is gone); retire together with the model runner patch.

TESTED BY: tests/unit/protocol/test_protocol_adaptive.py
"""

from __future__ import annotations

TARGET = "vllm.config.vllm"

#: The words of vLLM 0.34.0's PP refusal (config/vllm.py:3311-3314).
PP_REFUSAL = "not currently compatible with pipeline parallelism"


def apply() -> None:
    from vllm.config.vllm import VllmConfig

    from vllm_dspark_pp.patches._util import wrap
    from vllm_dspark_pp.protocol.adaptive_config import uncovered_reason

    def make(orig):
        def _validate_adaptive_verification(self):
            try:
                return orig(self)
            except ValueError as exc:
                if PP_REFUSAL not in str(exc):
                    raise
                reason = uncovered_reason(self)
                if reason is None:
                    return None  # the PP check is vLLM's last: every other check has passed
                raise ValueError(
                    f"{exc} (vllm-dspark-pp runs it under PP for DSpark only in covered "
                    f"configurations; not this one: {reason})"
                ) from None

        return _validate_adaptive_verification

    wrap(VllmConfig, "_validate_adaptive_verification", make)
