"""The last PP stage's DSpark drafter reads ``[partial | own taps]``.

WHAT: after ``DSparkSpeculator.load_model``, on the last PP stage of a target whose decoder
carries a tap-partial plan (:mod:`vllm_dspark_pp.protocol.tap_partials`), the drafter's first
linear on the taps (the family's ``context_linear``: Qwen3 ``fc``, DeepSeek-V4/V4.1
``main_proj``, Kimi-K3 ``context_proj``) is replaced by ``PartialSumLinear``: ``partial +
W_last @ own taps``, ``W_last`` the columns that multiply this stage's taps, read from the draft
checkpoint as the other stages read theirs; the FULL-graph staging buffer of the concatenated
taps (``_aux_staging``) is re-made at the new width. Anything but a bias-free unquantized linear
of the expected shape, holding the checkpoint's values, stops start-up naming the knob (the
earlier stages already send partial sums); under ``--load-format dummy`` the values are not
compared (random by design) and the checkpoint's ``W`` stands in for the dummy one. With the
side channel (``VLLM_DSPARK_PP_TAP_PARTIALS=side``) ``propose`` also puts the step's partial in
front of the aux taps it is called with: received on the side channel and waited for right there
(``tap_partials.drafter_taps``), zeros in a dummy or profile run. Without a plan nothing changes.

WHY: with partial sums the upstream taps arrive as one summed row (the other
``__tap_partials`` patches); the drafter must add its own stage's share instead of projecting
the full concatenation, and everything after the linear (its norm) stays vLLM's. On the side
channel the partial is not in the target's output at all: ``propose`` is the last point before
the drafter reads the taps (``_store_hidden_states``), so the last stage's forward and sampling
never wait for it.

UPSTREAM: none yet (with the relay hook of ``v1_worker_gpu_pp_utils__tap_partials``).

RETIRE WHEN: vLLM relays a partial sum of the drafter's context projection itself.

TESTED BY: tests/unit/protocol/test_tap_partials.py, tests/unit/protocol/test_tap_side.py,
tests/e2e/test_tap_partials_e2e.py
"""

from __future__ import annotations

import inspect

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import original, wrap

TARGET = "vllm.v1.worker.gpu.spec_decode.dspark.speculator"


def _patch(module) -> None:
    def make(orig):
        def load_model(self, target_model):
            orig(self, target_model)
            from vllm_dspark_pp.protocol import tap_partials

            tap_partials.install_on_drafter(self, target_model)

        return load_model

    wrap(module.DSparkSpeculator, "load_model", make)

    # where propose's arguments sit, by vLLM's own signature (other wraps take *args, **kwargs;
    # the call is passed on exactly as it came, only the aux list replaced)
    names = list(inspect.signature(original(module.DSparkSpeculator, "propose")).parameters)[1:]

    def argument(name, args, kwargs, default=None):
        i = names.index(name)
        return args[i] if i < len(args) else kwargs.get(name, default)

    def make_propose(orig):
        def propose(self, *args, **kwargs):
            from vllm_dspark_pp.protocol import tap_partials

            if tap_partials.side_of(self) is None or getattr(self, "_dspark_tap_in_propose", False):
                return orig(self, *args, **kwargs)
            aux = tap_partials.drafter_taps(
                self,
                argument("input_batch", args, kwargs),
                argument("aux_hidden_states", args, kwargs),
                bool(argument("dummy_run", args, kwargs, False)),
            )
            i = names.index("aux_hidden_states")
            if i < len(args):
                args = (*args[:i], aux, *args[i + 1 :])
            else:
                kwargs = {**kwargs, "aux_hidden_states": aux}
            self._dspark_tap_in_propose = True  # another wrap calling propose again adds nothing
            try:
                return orig(self, *args, **kwargs)
            finally:
                self._dspark_tap_in_propose = False

        return propose

    wrap(module.DSparkSpeculator, "propose", make_propose)


def apply() -> None:
    when_imported(TARGET, _patch)
