"""The last PP stage's DSpark drafter reads ``[partial | own taps]``.

WHAT: after ``DSparkSpeculator.load_model``, on the last PP stage of a target whose decoder
carries a tap-partial plan (:mod:`vllm_dspark_pp.protocol.tap_partials`), the drafter's first
linear on the taps (the family's ``context_linear``: Qwen3 ``fc``, DeepSeek-V4/V4.1
``main_proj``, Kimi-K3 ``context_proj``) is replaced by ``PartialSumLinear``: ``partial +
W_last @ own taps``, ``W_last`` the columns of the loaded weight that multiply this stage's
taps; the FULL-graph staging buffer of the concatenated taps (``_aux_staging``) is re-made at
the new width. Anything but a bias-free unquantized linear of the expected shape stops start-up
naming the knob (the earlier stages already send partial sums). Without a plan nothing changes.

WHY: with partial sums the upstream taps arrive as one summed row (the other two
``__tap_partials`` patches); the drafter must add its own stage's share instead of projecting
the full concatenation, and everything after the linear (its norm) stays vLLM's.

UPSTREAM: none yet (with the relay hook of ``v1_worker_gpu_pp_utils__tap_partials``).

RETIRE WHEN: vLLM relays a partial sum of the drafter's context projection itself.

TESTED BY: tests/unit/protocol/test_tap_partials.py, tests/e2e/test_tap_partials_e2e.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.worker.gpu.spec_decode.dspark.speculator"


def _patch(module) -> None:
    def make(orig):
        def load_model(self, target_model):
            orig(self, target_model)
            from vllm_dspark_pp.protocol import tap_partials

            tap_partials.install_on_drafter(self, target_model)

        return load_model

    wrap(module.DSparkSpeculator, "load_model", make)


def apply() -> None:
    when_imported(TARGET, _patch)
