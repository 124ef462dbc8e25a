"""Refuse, at start, DSpark configs that cannot work (unsupported producers included).

WHAT: Wraps ``VllmConfig.__post_init__``: after vLLM's checks, for a DSpark prefill-only
producer (``producer.roles.prefill_only_role``: kv_role='kv_producer'), refuses at start
(NotImplementedError)
(a) a draft family without a context-KV-only build and (b) PP>1 over NIXL connectors
(NixlConnector, NixlPullConnector, NixlPushConnector, also inside MultiConnector), naming
MooncakeConnector as the supported path. For every DSpark config it also runs
``vllm_dspark_pp.start_checks.check_dspark`` (the start checks the draft's family registers in
``producer/families.py``, a DSpark drafter, k at most its block size, aux taps within the
target's depth).

WHY: Fail at start, not at step 10,000: both cases would otherwise start and then break or
silently transfer incomplete draft context KV.
It also refuses PP>1 while ``VLLM_DSPARK_PP_SKIP_PATCHES`` (a diagnosis knob) skips any patch:
without the protocol patches a pipeline can hang (the patches in ``patches.PP_SKIPPABLE`` may be
skipped: without the liveness ones a lost stage is only seen late, without the stream one a
request may fail as in stock vLLM).

UPSTREAM: vLLM PR #56957 (DSpark prefill-only producers under PP).

RETIRE WHEN: upstream vLLM builds the context-only drafter itself and validates the connector.

TESTED BY: tests/unit/producer/test_config_patch.py, tests/unit/producer/test_roles.py,
tests/unit/test_bad_configs.py, tests/unit/patches/test_skip_patches.py
"""

from __future__ import annotations

TARGET = "vllm.config.vllm"


def apply() -> None:
    from vllm.config.vllm import VllmConfig

    from vllm_dspark_pp import start_checks
    from vllm_dspark_pp.patches import PP_SKIPPABLE, SKIP_ENV, skipped_patches
    from vllm_dspark_pp.patches._util import wrap
    from vllm_dspark_pp.producer import roles
    from vllm_dspark_pp.producer.families import check_draft_supported

    def make(orig):
        def __post_init__(self, *args, **kwargs):
            result = orig(self, *args, **kwargs)
            skipped = [p for p in skipped_patches() if p not in PP_SKIPPABLE]
            if skipped and self.parallel_config.pipeline_parallel_size > 1:
                raise ValueError(
                    f"vllm-dspark-pp: {SKIP_ENV} skips {', '.join(skipped)}; pipeline "
                    f"parallelism needs every patch (unset {SKIP_ENV})"
                )
            if self.speculative_config is not None:
                start_checks.check_dspark(self)
            if roles.prefill_only_role(self):
                spec = self.speculative_config
                if getattr(spec, "draft_model_config", None) is not None:
                    check_draft_supported(spec)
                roles.check_prefill_only_connectors(
                    spec, self.kv_transfer_config, self.parallel_config
                )
            return result

        return __post_init__

    wrap(VllmConfig, "__post_init__", make)
