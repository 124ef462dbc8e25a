"""Pin the DSpark drafter's query-pass dispatch to the fixed graph batch, DP sync rebuilt.

WHAT: when ``dspark_pp_fixed_graph_batch`` (B) is configured, ``DSparkSpeculator
.init_cudagraph_manager`` tags the drafter's query graph manager with B, and the
``dispatch_cg_and_sync_dp`` that ``vllm.v1.worker.gpu.spec_decode.dflash.speculator`` calls is
wrapped so that, for a tagged manager only, a step with at most B requests (DP-wide maximum) is
dispatched at ``B * q`` tokens and the reused DP-sync state is rebuilt with that token count
(``vllm_dspark_pp.protocol.graph_batch.pinned_dispatch``). Without the key nothing changes.

WHY: the drafter would otherwise replay a different graph per batch size; and pinning the shape
without rebuilding the DP-sync token count would trip vLLM's "reusing a DP sync taken over a
different batch" assert or run the forward with a wrong token count (vLLM PR #53577:
"DFlashSpeculator.propose rebuilds the reused DP-sync token count").

UPSTREAM: vllm-project/vllm PR #53577 (closed; padded graph batch safety).

RETIRE WHEN: DFlash/DSpark speculators take a fixed graph batch from SpeculativeConfig.

TESTED BY: tests/unit/protocol/test_protocol_graph_batch.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.worker.gpu.spec_decode.dspark.speculator"
DFLASH = "vllm.v1.worker.gpu.spec_decode.dflash.speculator"


# Pinned dispatches in this process; logged at the 1st, 10th, 100th, ... (the one-GPU PP tier reads
# the count from the engine's log to show that the pinned dispatch fired).
_pinned = [0]


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.dspark_pp.graph_batch")


def _patch_dflash(module) -> None:
    from vllm_dspark_pp.protocol.graph_batch import MANAGER_ATTR, pinned_dispatch

    def make(orig):
        def dispatch_cg_and_sync_dp(cudagraph_manager, num_reqs, num_tokens, *args, **kwargs):
            fixed = getattr(cudagraph_manager, MANAGER_ATTR, None)
            if fixed and not kwargs.get("need_eager", False) and not args:
                before = num_tokens
                num_tokens, kwargs["dp_sync_state"] = pinned_dispatch(
                    fixed,
                    num_reqs,
                    num_tokens,
                    kwargs.get("uniform_token_count"),
                    kwargs.get("dp_sync_state"),
                )
                if num_tokens != before:
                    _pinned[0] += 1
                    n = _pinned[0]
                    if n == 10 ** (len(str(n)) - 1):  # 1, 10, 100, ...
                        # plain info: vLLM's info_once prints on the node's first rank only
                        _logger().info(
                            "DSpark drafter dispatch pinned to the fixed graph batch of %d "
                            "requests (%d tokens): %d pinned dispatches so far",
                            fixed,
                            num_tokens,
                            n,
                        )
            return orig(cudagraph_manager, num_reqs, num_tokens, *args, **kwargs)

        return dispatch_cg_and_sync_dp

    wrap(module, "dispatch_cg_and_sync_dp", make)


def _patch_dspark(module) -> None:
    from vllm_dspark_pp.protocol.graph_batch import MANAGER_ATTR, fixed_graph_batch

    def make(orig):
        def init_cudagraph_manager(self, cudagraph_mode):
            orig(self, cudagraph_mode)
            fixed = fixed_graph_batch(self.vllm_config)
            if fixed and self.query_cudagraph_manager is not None:
                setattr(self.query_cudagraph_manager, MANAGER_ATTR, int(fixed))

        return init_cudagraph_manager

    wrap(module.DSparkSpeculator, "init_cudagraph_manager", make)


def apply() -> None:
    when_imported(DFLASH, _patch_dflash)
    when_imported(TARGET, _patch_dspark)
