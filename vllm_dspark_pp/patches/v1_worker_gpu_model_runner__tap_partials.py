"""The DSpark tap side channel's two step hooks: the senders' send and the last stage's receive.

WHAT: only with ``VLLM_DSPARK_PP_TAP_PARTIALS=side`` (a side channel set up by the
``v1_worker_gpu_pp_utils__tap_partials`` patch; otherwise both wraps call vLLM's method and do
nothing else): ``GPUModelRunner.execute_model`` on a PP stage before the last that makes aux taps
sends, after vLLM's method returned, ``W_s @ its taps`` for the step's real tokens to the last PP
rank on the side channel (:func:`vllm_dspark_pp.protocol.tap_partials.after_forward`), exactly
when the method returned ``IntermediateTensors`` outside a dummy run, i.e. exactly when vLLM's
worker sends the step's dict to the next stage (a dummy, profile or capture run drops what the
relay kept); ``GPUModelRunner.prepare_inputs`` on the last stage posts the step's side-channel
receives, one per sender, as soon as the step's batch is built, before the forward
(:func:`~vllm_dspark_pp.protocol.tap_partials.after_prepare_inputs`; ``prepare_inputs`` runs
only for non-dummy forwards). The drafter patch waits for them.

WHY: vLLM 0.34.0's worker sends a non-last stage's ``IntermediateTensors`` after
``execute_model`` (gpu_worker.py:1493-1499) and waits for every received key before the next
stage's forward copies them (model_runner.py:2094-2103 through ``AsyncIntermediateTensors``,
gpu_worker.py:184-213), so a partial sum in that dict holds up the next stage though only the
last stage's drafter reads it. These two hooks are where a step is known to be real on both
ends (the same scheduler output on every stage), so sends and receives pair up one for one.

UPSTREAM: none yet (a per-key "consumer is the drafter" channel in vLLM's PP relay).

RETIRE WHEN: vLLM relays drafter-only tensors outside the stage-to-stage dict itself.

TESTED BY: tests/unit/protocol/test_tap_side.py, tests/e2e/test_tap_partials_e2e.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.worker.gpu.model_runner"


def _patch(module) -> None:
    cls = module.GPUModelRunner

    def make_execute(orig):
        def execute_model(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            from vllm_dspark_pp.protocol import tap_partials

            if tap_partials.side_of(self) is not None:
                # execute_model(scheduler_output, intermediate_tensors, dummy_run, ...)
                dummy_run = kwargs.get("dummy_run", args[2] if len(args) > 2 else False)
                tap_partials.after_forward(self, out, bool(dummy_run))
            return out

        return execute_model

    def make_prepare(orig):
        def prepare_inputs(self, *args, **kwargs):
            input_batch = orig(self, *args, **kwargs)
            from vllm_dspark_pp.protocol import tap_partials

            tap_partials.after_prepare_inputs(self, input_batch)
            return input_batch

        return prepare_inputs

    wrap(cls, "execute_model", make_execute)
    wrap(cls, "prepare_inputs", make_prepare)


def apply() -> None:
    when_imported(TARGET, _patch)
