"""PP stages relay one partial sum of the drafter's first linear instead of its aux taps.

WHAT: ``PPHandler.configure_aux_hidden_state_relay`` (every PP rank, right after vLLM set the
target's aux layers) also runs :func:`vllm_dspark_pp.protocol.tap_partials.configure_stage`: on
every rank the same decision (``VLLM_DSPARK_PP_TAP_PARTIALS``, the draft family's first linear,
the draft checkpoint's header), one start-up line with the aux bytes per token row of each stage
boundary before and after, and where the mode is on, this rank's share: a stage after the first
receives ``dspark_tap_partial`` in place of ``aux_hidden_states_<i>`` (its
``make_empty_intermediate_tensors``), a stage with taps of its own loads its column block of the
linear from the draft checkpoint. ``PPHandler.relay_aux_hidden_states`` (every non-last rank,
after the forward) then sends ``hidden_states``, ``residual`` and one ``dspark_tap_partial`` row
(what it received plus its block times its own taps) instead of its taps and the upstream taps.
With ``VLLM_DSPARK_PP_TAP_PARTIALS=side`` ``configure_stage`` first makes the side channel's
process group on every rank (a sibling of the PP group) and links every sender to the last
stage there before any step (``TapSideChannel.connect``: NCCL makes a pair's communicator at
its first contact and blocks both ends, which inside a step waited on itself; H200,
2026-12-06; on CUDA the links are made on a helper thread and start-up fails naming the peer
after the PP handshake's timeout), a stage after the first receives only
the target's own tensors, and the relay drops the taps from what it returns, keeping a stage's
own taps for the side channel's send (``v1_worker_gpu_model_runner__tap_partials``); each rank
logs the keys it receives on the critical path and what goes on the side channel, with bytes per
token row. With the mode off both methods are vLLM's. Either way the first relay of each process
logs the keys it sends and their bytes per token row.

WHY: vLLM 0.34.0 relays every aux tap of an earlier stage to the last one as its own row
(``pp_utils.py:108-131``, ``eagle3_utils.py:56-99``): a boundary after ``m`` taps carries ``m``
rows of the target's hidden size besides the target's two, though the drafter reads the taps
only through one bias-free linear (docs/performance-bound.md, "Aux taps as partial sums").

UPSTREAM: none yet (a relay hook in vLLM's EagleModelMixin for drafters whose first op is
linear).

RETIRE WHEN: vLLM relays a partial sum of the drafter's context projection itself.

TESTED BY: tests/unit/protocol/test_tap_partials.py, tests/unit/protocol/test_tap_side.py,
tests/e2e/test_tap_partials_e2e.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.worker.gpu.pp_utils"


def _patch(module) -> None:
    def make_configure(orig):
        def configure_aux_hidden_state_relay(self, model):
            orig(self, model)
            from vllm.config import get_current_vllm_config

            from vllm_dspark_pp.protocol import tap_partials

            self._dspark_tap_plan = None
            self._dspark_tap_side = None
            tap_partials.configure_stage(self, model, get_current_vllm_config())

        return configure_aux_hidden_state_relay

    def make_relay(orig):
        def relay_aux_hidden_states(self, intermediate_tensors, output_intermediate_tensors):
            from vllm_dspark_pp.protocol import tap_partials

            if getattr(self, "_dspark_tap_plan", None) is None:
                out = orig(self, intermediate_tensors, output_intermediate_tensors)
            else:
                out = tap_partials.relay(self, intermediate_tensors, output_intermediate_tensors)
            if not getattr(self, "_dspark_sent_keys_logged", False):
                self._dspark_sent_keys_logged = True
                tap_partials.log_sent_keys(out)
            return out

        return relay_aux_hidden_states

    # on vLLM's class, where the two methods are defined (module.PPHandler may already be the
    # protocol's subclass, which inherits them unchanged)
    owner = next(k for k in module.PPHandler.__mro__ if "relay_aux_hidden_states" in vars(k))
    wrap(owner, "configure_aux_hidden_state_relay", make_configure)
    wrap(owner, "relay_aux_hidden_states", make_relay)


def apply() -> None:
    when_imported(TARGET, _patch)
