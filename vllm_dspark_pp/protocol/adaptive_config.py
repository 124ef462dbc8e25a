"""Which PP configurations run adaptive verification through the plugin (config facts only).

Kept apart from ``protocol/adaptive.py`` so the handshake and the handler can ask without
importing the run-time side (which itself uses the handshake's store helpers).
"""

from __future__ import annotations

from typing import Any

from vllm_dspark_pp import envs

#: Opt-in for the covered configurations until the one-GPU PP tier has shown them lossless on a
#: GPU (tests/gpu/test_pp_adaptive_one_gpu.py; issue 30). Without it vLLM's refusal stands.
OPT_IN_ENV = "VLLM_DSPARK_PP_ADAPTIVE_PP"


def uncovered_reason(vllm_config: Any) -> str | None:
    """Why this PP config's adaptive verification is not covered by the plugin (None: covered).

    Covered: DSpark drafts, aggregated serving or a PD decoder (kv_consumer), TP = DP = 1, no
    context parallelism, no batch-sharded sampling."""
    from vllm_dspark_pp.producer import roles

    spec = vllm_config.speculative_config
    par = vllm_config.parallel_config
    if spec is None or spec.method != "dspark":
        method = None if spec is None else spec.method
        return f"only DSpark drafts ship admitted counts (method is {method!r})"
    if roles.prefill_only_role(vllm_config):
        return "a DSpark prefill-only producer never verifies drafts"
    kv = vllm_config.kv_transfer_config
    if kv is not None and kv.kv_connector is not None:
        if kv.is_kv_producer or not kv.is_kv_consumer:
            return (
                "with a KV connector only the PD decoder (kv_consumer) is covered, "
                f"not {kv.kv_role}"
            )
    if par.tensor_parallel_size != 1 or par.data_parallel_size != 1:
        return "only TP=1 and DP=1 are covered (not verified with several ranks per stage)"
    if par.decode_context_parallel_size != 1 or par.prefill_context_parallel_size != 1:
        return "context parallelism is not covered"
    if par.enable_batch_sharded_sampling:
        return "batch-sharded sampling needs vLLM's host copy of the ranked counts"
    if not envs.VLLM_DSPARK_PP_ADAPTIVE_PP:
        return (
            f"experimental and not yet verified on a GPU; set {OPT_IN_ENV}=1 on every node to "
            "try it (docs/protocol.md, 'Adaptive verification under PP')"
        )
    return None


def ships_admitted_counts(vllm_config: Any) -> bool:
    """Whether this config runs adaptive verification under PP through the plugin."""
    spec = vllm_config.speculative_config
    return (
        vllm_config.parallel_config.pipeline_parallel_size > 1
        and spec is not None
        and bool(getattr(spec, "enable_adaptive_verification", False))
        and uncovered_reason(vllm_config) is None
    )


def resolve_adaptive_lag(vllm_config: Any) -> int:
    """Which shipped count a verify step applies (docs/protocol.md, "Where the hosts wait"):
    ``VLLM_DSPARK_PP_ADAPTIVE_LAG`` where set, else 2 with async scheduling and 1 without (or
    where there is no config).

    Without async scheduling vLLM schedules a request's next round only once its previous
    round's output came back, and the stage's GPU had waited for the drafts (and their counts)
    of the round before that; with async scheduling the next round can be scheduled while the
    previous one is still in flight (vLLM 0.34.0's ``AsyncScheduler.decode_stagger``), so only
    the counts of two rounds back are sure to be on every host."""
    from vllm_dspark_pp import envs

    lag = envs.VLLM_DSPARK_PP_ADAPTIVE_LAG
    if lag is not None:
        return int(lag)
    sched = getattr(vllm_config, "scheduler_config", None)
    return 2 if bool(getattr(sched, "async_scheduling", False)) else 1
