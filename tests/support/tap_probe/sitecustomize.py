"""Test probe for tests/gpu/test_pp_one_gpu.py's control job ``pp3_taps_wrong``, loaded by every
process of a deployment that has this directory first on PYTHONPATH (Python imports
``sitecustomize`` at start-up); then the next ``sitecustomize`` on the path runs too.

``DSPARK_TEST_TAP_WRONG_BLOCK=1``: every PP stage before the last reads its column block of the
drafter's first linear as zeros (``tap_partials.load_column_block``), so the partial sums it
relays drop the taps of the early stages: the target's tensors are untouched (greedy output must
not change) but the drafter reads another context, so its acceptance must fall away from PP=1's.
The last stage's own block is read as it is.
"""

from __future__ import annotations

import os
import runpy


def _install() -> None:
    if os.environ.get("DSPARK_TEST_TAP_WRONG_BLOCK") != "1":
        return
    from vllm_dspark_pp.patches import when_imported

    def patch(module) -> None:
        real = module.load_column_block

        def load_column_block(folder, hit, plan, dtype, device):
            block = real(folder, hit, plan, dtype, device)
            return block if plan.is_last else block.zero_()

        module.load_column_block = load_column_block

    when_imported("vllm_dspark_pp.protocol.tap_partials", patch)


_CHAIN = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sitecustomize_chain.py"
)
runpy.run_path(_CHAIN)["install_then_chain"](__file__, _install)
