"""Take the plugin's fixed DSpark graph batch key out of --speculative-config before vLLM sees it.

WHAT: ``EngineArgs.create_engine_config`` removes ``dspark_pp_fixed_graph_batch`` from the
``speculative_config`` dict, lets vLLM build the config, then validates the value (DSpark only,
at most max_num_seqs) and records it in ``VllmConfig.additional_config["vllm_dspark_pp"]``
(see vllm_dspark_pp/protocol/graph_batch.py and docs/protocol.md).

WHY: vLLM's ``SpeculativeConfig`` forbids unknown fields, so a plugin setting cannot ride in the
JSON users already pass to ``vllm serve --speculative-config``; additional_config reaches every
worker with the config.

UPSTREAM: none yet (a DSpark graph batch setting would belong in SpeculativeConfig).

RETIRE WHEN: SpeculativeConfig has a fixed drafter graph batch field.

TESTED BY: tests/unit/protocol/test_protocol_graph_batch.py
"""

from __future__ import annotations

from vllm_dspark_pp.patches import when_imported
from vllm_dspark_pp.patches._util import wrap

TARGET = "vllm.engine.arg_utils"
_STASH = "_vllm_dspark_pp_fixed_graph_batch"


def _patch(module) -> None:
    from vllm_dspark_pp.protocol import graph_batch

    def make(orig):
        def create_engine_config(self, *args, **kwargs):
            spec = self.speculative_config
            if isinstance(spec, dict):
                _, value = graph_batch.take_from_spec_dict(spec)
                if value is not None:
                    setattr(self, _STASH, value)
            config = orig(self, *args, **kwargs)
            graph_batch.record(config, getattr(self, _STASH, None))
            return config

        return create_engine_config

    wrap(module.EngineArgs, "create_engine_config", make)


def apply() -> None:
    when_imported(TARGET, _patch)
