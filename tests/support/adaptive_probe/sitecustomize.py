"""Test probe for tests/gpu/test_pp_adaptive_one_gpu.py, loaded by every process of a
deployment that has this directory first on PYTHONPATH (Python imports ``sitecustomize`` at
start-up); then the next ``sitecustomize`` on the path runs too (a GPU kit may have one).

* ``DSPARK_TEST_VERIFY_COST_SLOPE=S``: vLLM's adaptive-verification cost tables are pinned to
  draft cost 1 per step and verify cost ``1 + S * tokens`` (profiled timings vary from run to
  run and between PP=1 and PP=2; pinned tables make the admitted counts comparable, and a steep
  slope makes the budget bind). ``DSPARK_TEST_VERIFY_COST_CAP=T``: a verify step of more than ``T``
  tokens costs a thousand times as much (probe_tables.py), so a lone request verifies at most
  ``T - 1`` drafts and the budget binds at every verify step.
* Every call of vLLM's ``AdaptiveVerificationManager.reallocate_drafts`` (each verify step, on
  every PP stage) prints ``ADAPTIVE_PROBE pid=.. verify_steps=.. verified_drafts=..`` (running
  totals of the drafts the step verifies) to stderr.
* ``DSPARK_TEST_CORRUPT_STAGE0=1`` (the control): the first PP stage reads every admitted count
  off by one, so it builds another batch shape than the other stages.
"""

from __future__ import annotations

import os
import runpy
import sys


def _install() -> None:
    from vllm_dspark_pp.patches import when_imported

    slope = os.environ.get("DSPARK_TEST_VERIFY_COST_SLOPE")
    cap = os.environ.get("DSPARK_TEST_VERIFY_COST_CAP")

    def patch_adaptive(module) -> None:
        if slope:
            from probe_tables import pinned_tables as tables  # this directory, on PYTHONPATH

            def pinned_tables(draft_curve, verify_curve, max_num_reqs, max_batch_tokens, *a, **k):
                return tables(float(slope), int(cap) if cap else None, max_num_reqs,
                              max_batch_tokens)  # fmt: skip

            module.build_cost_tables_from_curves = pinned_tables
        cls = module.AdaptiveVerificationManager
        real = cls.reallocate_drafts
        totals = {"steps": 0, "verified": 0}

        def reallocate_drafts(self, req_ids, idx_mapping):
            out = real(self, req_ids, idx_mapping)
            totals["steps"] += 1
            totals["verified"] += int(out[2])
            print(
                f"ADAPTIVE_PROBE pid={os.getpid()} verify_steps={totals['steps']} "
                f"verified_drafts={totals['verified']}",
                file=sys.stderr,
                flush=True,
            )
            return out

        cls.reallocate_drafts = reallocate_drafts

    when_imported("vllm.v1.worker.gpu.spec_decode.adaptive_verification", patch_adaptive)

    if os.environ.get("DSPARK_TEST_CORRUPT_STAGE0") == "1":

        def patch_handler(module) -> None:
            import numpy as np

            real = module.DSparkExchange.admitted_counts_for

            def admitted_counts_for(self, idx_mapping_np):
                counts = real(self, idx_mapping_np)
                if self.is_last_rank or self.broadcast_group is None:
                    return counts
                return np.where(counts > 0, counts - 1, counts + 1).astype(counts.dtype)

            module.DSparkExchange.admitted_counts_for = admitted_counts_for

        when_imported("vllm_dspark_pp.protocol.handler", patch_handler)


_CHAIN = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sitecustomize_chain.py"
)
runpy.run_path(_CHAIN)["install_then_chain"](__file__, _install)
