"""The last PP stage takes the relayed partial sum as its one upstream aux tap.

WHAT: ``EagleModelMixin.collect_remote_aux_hidden_states`` returns ``[dspark_tap_partial]``
(the ``IntermediateTensors`` row the previous stage sent) on the last stage of a target whose
decoder carries a tap-partial plan (:mod:`vllm_dspark_pp.protocol.tap_partials`, set by the
``v1_worker_gpu_pp_utils__tap_partials`` patch), so the target's forward returns
``[partial] + its own taps`` to the drafter. With the side channel
(``VLLM_DSPARK_PP_TAP_PARTIALS=side``) it returns ``[]`` there: nothing of the taps crossed the
stages in the ``IntermediateTensors``, and the drafter patch puts the partial received on the side
channel in front of the stage's own taps. Without a plan it is vLLM's method.

WHY: vLLM 0.34.0 looks up one ``aux_hidden_states_<i>`` row per upstream tap
(interfaces.py ``collect_remote_aux_hidden_states``) and raises when one is missing; with
partial sums the boundary carries one row of the drafter's hidden size instead (every decoder
that relays taps calls this method: Qwen2/3, Llama, DeepSeek-V4, Kimi-K3, and the V4.1 decoder
through the ``models_deepseek_v41_nvidia_model`` patch).

UPSTREAM: none yet (with the relay hook of ``v1_worker_gpu_pp_utils__tap_partials``).

RETIRE WHEN: vLLM relays a partial sum of the drafter's context projection itself.

TESTED BY: tests/unit/protocol/test_tap_partials.py, tests/unit/protocol/test_tap_side.py,
tests/e2e/test_tap_partials_e2e.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.model_executor.models.interfaces"


def _patch(module) -> None:
    from vllm_dspark_pp.protocol.tap_partials import PARTIAL_KEY, PLAN_ATTR

    def make(orig):
        def collect_remote_aux_hidden_states(self, intermediate_tensors):
            plan = getattr(self, PLAN_ATTR, None)
            if plan is not None and plan.is_last and plan.side:
                return []
            if plan is None or not plan.is_last or not plan.receives:
                return orig(self, intermediate_tensors)
            assert intermediate_tensors is not None
            return [intermediate_tensors[PARTIAL_KEY]]

        return collect_remote_aux_hidden_states

    wrap(module.EagleModelMixin, "collect_remote_aux_hidden_states", make)


def apply() -> None:
    when_imported(TARGET, _patch)
