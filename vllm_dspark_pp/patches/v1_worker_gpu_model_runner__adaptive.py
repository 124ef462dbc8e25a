"""Adaptive verification under PP: every stage builds the verify step from the shipped counts.

WHAT: In ``vllm.v1.worker.gpu.model_runner`` (only when ``protocol.adaptive.ships_admitted_counts``:
PP > 1, DSpark, adaptive verification on, a covered configuration):
(1) wraps the module's ``maybe_create_adaptive_verification_manager`` (called at
model_runner.py:738-751) so that every PP stage creates the manager, not only the last one (whose
speculator alone carries the flag, model_runner.py:311-315 and 739-741), and makes it a
``ShippedCounts`` manager (protocol/adaptive.py): the last stage decides each request's admitted
draft count after ``record_confidences`` (model_runner.py:2391-2394) and ships it in the drafts
payload; every stage's ``get_num_tokens`` (called at model_runner.py:1421-1424) takes its budget
from those counts. With the manager on every stage, the CUDA graph mode
(model_runner.py:787-791) and the varlen decode graphs (model_runner.py:809) are the same on
every stage.
(2) wraps ``GPUModelRunner.profile_adaptive_verification`` (model_runner.py:1224-1234) on
non-last stages, which vLLM cannot time (``_dummy_run`` returns there, model_runner.py:978-980,
before its timing marks at 991-1032): the stage times the same dummy runs with vLLM's collector
and publishes its verify curve; the last stage sums every stage's curve (the pipeline's cost).
(3) wraps ``execute_model`` / ``prepare_inputs`` so that a non-last stage adds its batch layout
(token count and a checksum of the per-request offsets, a plain tuple in the metadata message) to
the activations it returns for sending (model_runner.py:2206-2211), and a non-first stage checks,
before its forward copies them (model_runner.py:2094-2103), that layout and the received rows
(elements over its own buffer's row size: the receive buffers are flat until ``wait_for_comm``)
against its own batch: stages that disagree on a batch shape fail at once with a message,
instead of truncating activations or waiting.

WHY: vLLM 0.34.0 refuses adaptive verification with PP (config/vllm.py:3306-3314, "earlier ranks
would diverge on the trimmed batch shape"); config_vllm__adaptive.py lifts that refusal only
for the configurations this patch covers.

UPSTREAM: the TODO at vllm/config/vllm.py:3309-3310 (broadcast the cost curves and confidences to
all PP ranks); vLLM RFCs #48202, #48627, #54801 (adaptive / per-request draft length).

RETIRE WHEN: vLLM decides the trimmed layout identically on every PP rank (the TODO above is done
and the refusal at config/vllm.py:3306-3314 is gone).

TESTED BY: tests/unit/protocol/test_protocol_adaptive.py,
tests/unit/protocol/test_protocol_schedule_randomized.py, tests/unit/protocol/test_protocol_gloo.py,
tests/gpu/test_pp_adaptive_one_gpu.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.worker.gpu.model_runner"


def _patch(module) -> None:
    from vllm_dspark_pp.protocol import adaptive

    def make_create(orig):
        def maybe_create_adaptive_verification_manager(**kwargs):
            vllm_config = kwargs["vllm_config"]
            if not adaptive.ships_admitted_counts(vllm_config):
                return orig(**kwargs)
            from vllm.distributed.parallel_state import get_pp_group

            pp = get_pp_group()
            if pp.is_last_rank and not kwargs["enable_adaptive_verification"]:
                raise RuntimeError(
                    "vllm-dspark-pp: the last PP stage's speculator turned adaptive "
                    "verification off while the config asks for it; the stages would build "
                    "different batches"
                )
            manager = orig(**{**kwargs, "enable_adaptive_verification": True})
            manager.__class__ = adaptive.shipped_counts_class(type(manager))
            manager.is_last_stage = pp.is_last_rank
            manager.pipeline_ranks = tuple(pp.ranks)
            manager.stage = pp.rank_in_group
            return manager

        return maybe_create_adaptive_verification_manager

    wrap(module, "maybe_create_adaptive_verification_manager", make_create)
    cls = module.GPUModelRunner

    def shipped(runner):
        manager = getattr(runner, "adaptive_verification", None)
        return manager if isinstance(manager, adaptive.ShippedCounts) else None

    def make_profile(orig):
        def profile_adaptive_verification(self):
            manager = shipped(self)
            if manager is None or manager.is_last_stage:
                return orig(self)
            adaptive.profile_stage_curve(self, manager)

        return profile_adaptive_verification

    def make_execute(orig):
        def execute_model(self, scheduler_output, intermediate_tensors=None, *args, **kwargs):
            manager = shipped(self)
            if manager is not None:
                manager.pp_handler = self.pp_handler
                self._dspark_pp_received = intermediate_tensors
            out = orig(self, scheduler_output, intermediate_tensors, *args, **kwargs)
            if manager is not None and not manager.is_last_stage:
                adaptive.tag_sent_activations(self, out)
            return out

        return execute_model

    def make_prepare(orig):
        def prepare_inputs(self, *args, **kwargs):
            input_batch = orig(self, *args, **kwargs)
            received = getattr(self, "_dspark_pp_received", None)
            if shipped(self) is not None and received is not None:
                self._dspark_pp_received = None
                adaptive.check_received_activations(self, received, input_batch)
            return input_batch

        return prepare_inputs

    wrap(cls, "profile_adaptive_verification", make_profile)
    wrap(cls, "execute_model", make_execute)
    wrap(cls, "prepare_inputs", make_prepare)


def apply() -> None:
    when_imported(TARGET, _patch)
