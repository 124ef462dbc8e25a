"""Bracket each sample_tokens with the exchange schedule, and run the PP start-up handshake.

WHAT: ``GPUModelRunner.__init__`` runs :func:`vllm_dspark_pp.protocol.handshake.run_pp_handshake`
right after vLLM built the ``PPHandler`` (so the parallel groups exist), when PP > 1, then starts
the peer watch (:func:`vllm_dspark_pp.protocol.liveness.start_pp_watch`). Both cover every rank
of vLLM's world group (all TP x PP ranks, every DP rank), not only this rank's PP group.
``GPUModelRunner.sample_tokens`` tells the ``DSparkPPHandler`` (patches/v1_worker_gpu_pp_utils.py)
the step's scheduled draft count before
the step (``begin_step``) and checks after it (``end_step``) that the rank posted exactly the
step's schedule. Both are no-ops without PP.

WHY: the last rank's ``PPHandler.broadcast`` does not receive the step's draft count in vLLM
0.34.0, but the schedule needs it to know whether a draft broadcast follows; and a step that
planned a draft broadcast and never posted it would leave every other PP rank waiting. The
handshake makes a rank with another plugin release, vLLM release or speculative setting (or no
plugin at all) fail at start-up instead of hanging at the first step, wherever in the TP x PP
grid that rank is. The peer watch makes a rank (a stage, or one TP rank of it) lost on another
launcher end the engine at once, naming the rank.

UPSTREAM: none (plugin protocol).

RETIRE WHEN: the PP exchange and handshake are upstream.

TESTED BY: tests/unit/protocol/test_protocol_pp_handler.py,
tests/unit/protocol/test_protocol_handshake.py, tests/unit/protocol/test_liveness.py,
tests/unit/protocol/test_world_handshake_watch.py (TP=2 x PP=2 through vLLM's real groups)
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.worker.gpu.model_runner"


def _patch(module) -> None:
    cls = module.GPUModelRunner

    def make_init(orig):
        def __init__(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            if getattr(self, "pp_handler", None) is not None:
                from vllm_dspark_pp.protocol.handshake import run_pp_handshake
                from vllm_dspark_pp.protocol.liveness import start_pp_watch

                run_pp_handshake(self.vllm_config)
                start_pp_watch(self.vllm_config)

        return __init__

    def make_sample_tokens(orig):
        def sample_tokens(self, *args, **kwargs):
            handler = getattr(self, "pp_handler", None)
            state = getattr(self, "execute_model_state", None)
            if handler is None or state is None:  # no PP, or no step to sample
                return orig(self, *args, **kwargs)
            handler.begin_step(state.num_spec_tokens_to_schedule)
            out = orig(self, *args, **kwargs)
            handler.end_step()
            return out

        return sample_tokens

    wrap(cls, "__init__", make_init)
    wrap(cls, "sample_tokens", make_sample_tokens)


def apply() -> None:
    when_imported(TARGET, _patch)
