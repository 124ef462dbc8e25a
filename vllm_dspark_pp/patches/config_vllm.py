"""Attach the KV-transfer config to the speculative config, and refuse unsupported producers.

WHAT: Wraps ``VllmConfig.__post_init__``: after vLLM's checks, records the instance's
KVTransferConfig on its SpeculativeConfig (``roles.attach_kv_transfer_config``), then, for a
DSpark prefill-only producer (kv_role='kv_producer'), refuses at start (NotImplementedError)
(a) a draft family without a context-KV-only build and (b) PP>1 over NIXL connectors
(NixlConnector, NixlPullConnector, NixlPushConnector, also inside MultiConnector), naming
MooncakeConnector as the supported path. For every DSpark config it also runs
``vllm_dspark_pp.start_checks.check_dspark`` (a DSpark drafter, k at most its block size, aux
taps within the target's depth).

WHY: Fail at start, not at step 10,000: both cases would otherwise start and then break or
silently transfer incomplete draft context KV.

UPSTREAM: vLLM PR #56957 (DSpark prefill-only producers under PP).

RETIRE WHEN: upstream vLLM builds the context-only drafter itself and validates the connector.

TESTED BY: tests/unit/producer/test_config_patch.py, tests/unit/producer/test_roles.py,
tests/unit/test_bad_configs.py
"""

from __future__ import annotations

TARGET = "vllm.config.vllm"


def apply() -> None:
    from vllm.config.vllm import VllmConfig

    from vllm_dspark_pp import context_kv, roles, start_checks
    from vllm_dspark_pp.patches._util import wrap

    def make(orig):
        def __post_init__(self, *args, **kwargs):
            result = orig(self, *args, **kwargs)
            spec = self.speculative_config
            if spec is not None:
                start_checks.check_dspark(self)
                roles.attach_kv_transfer_config(spec, self.kv_transfer_config)
                if roles.is_dspark_prefill_only(spec, self.kv_transfer_config):
                    if getattr(spec, "draft_model_config", None) is not None:
                        context_kv.check_draft_supported(spec)
                    roles.check_prefill_only_connectors(
                        spec, self.kv_transfer_config, self.parallel_config
                    )
            return result

        return __post_init__

    wrap(VllmConfig, "__post_init__", make)
