"""Warm-up that cannot deadlock a pipeline: no PP broadcasts, post-update variants pre-warmed.

WHAT: ``warmup_kernels`` and ``run_kv_cache_sizing_warmup`` run with the PP exchange disabled on
every rank (``PPHandler.exchange_disabled``: no sampled-token, count or draft broadcast is posted
and no receive; the ring slots stay empty), then ``warmup_kernels`` compiles, on non-last ranks,
the deferred post-update kernel in both variants serving reaches (plain and draft-adopting), on
buffers laid out exactly like the received ones and with every row masked so no state changes
(``vllm_dspark_pp.protocol.handler.prewarm_deferred_post_update``). The last rank runs the warm-up
steps exactly as before; non-last ranks skip the receives only the last rank can feed.

WHY: warm-up steps discard their outputs, yet vLLM 0.34.0 posts the side-stream broadcasts for
them; and with the broadcasts off, the non-last ranks' first deferred post-update (a first-time
Triton compile, whose module load waits behind an in-flight NCCL receive kernel) would happen in
serving. Both hung pipelines (vLLM PR #53577, PR #56956).

UPSTREAM: vllm-project/vllm PR #53577 (closed), PR #56956 (open).

RETIRE WHEN: vLLM's warm-up disables the PP broadcast and pre-warms the deferred post-update.

TESTED BY: tests/unit/protocol/test_protocol_warmup.py, tests/gpu/test_protocol_gpu.py
"""

from __future__ import annotations

from contextlib import nullcontext

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.v1.worker.gpu.warmup"


def _quiet_exchange(model_runner):
    handler = getattr(model_runner, "pp_handler", None)
    if handler is None:  # no PP
        return nullcontext()
    return handler.exchange_disabled()


def _patch(module) -> None:
    from vllm_dspark_pp.protocol.handler import prewarm_deferred_post_update

    def make_warmup_kernels(orig):
        def warmup_kernels(model_runner, *args, **kwargs):
            with _quiet_exchange(model_runner):
                orig(model_runner, *args, **kwargs)
            handler = getattr(model_runner, "pp_handler", None)
            if handler is not None:
                n = prewarm_deferred_post_update(model_runner)
                from vllm.logger import init_logger

                init_logger("vllm.dspark_pp.warmup").info(
                    "PP warm-up ran with the token exchange off; pre-warmed %d deferred "
                    "post-update variant(s) on this %s rank",
                    n,
                    "last" if handler.is_last_rank else "non-last",
                )

        return warmup_kernels

    def make_sizing(orig):
        def run_kv_cache_sizing_warmup(model_runner, *args, **kwargs):
            with _quiet_exchange(model_runner):
                return orig(model_runner, *args, **kwargs)

        return run_kv_cache_sizing_warmup

    wrap(module, "warmup_kernels", make_warmup_kernels)
    wrap(module, "run_kv_cache_sizing_warmup", make_sizing)


def apply() -> None:
    when_imported(TARGET, _patch)
