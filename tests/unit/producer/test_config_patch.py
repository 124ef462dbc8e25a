"""The prefill-only role from real vLLM configs (engine and workers alike); start-up guards."""

from __future__ import annotations

import copy
import pickle

import cloudpickle
import pytest
from vllm.config import KVTransferConfig

from vllm_dspark_pp.producer import roles


def producer_kv(connector="ExampleConnector", **extra):
    return KVTransferConfig(kv_connector=connector, kv_role="kv_producer", **extra)


def test_real_config_decides_the_role(make_vllm_config):
    cfg = make_vllm_config(producer_kv())
    spec = cfg.speculative_config
    assert spec.method == "dspark"
    assert spec.draft_model_config.architectures == ["Qwen3DSparkModel"]
    assert roles.prefill_only_role(cfg) is True


@pytest.mark.parametrize("role,expected", [("kv_consumer", False), ("kv_both", False)])
def test_other_roles_keep_full_drafter(make_vllm_config, role, expected):
    cfg = make_vllm_config(KVTransferConfig(kv_connector="ExampleConnector", kv_role=role))
    assert roles.prefill_only_role(cfg) is expected


def test_no_kv_transfer(make_vllm_config):
    assert roles.prefill_only_role(make_vllm_config(None)) is False


@pytest.mark.parametrize(
    "dumps,loads",
    [
        (pickle.dumps, pickle.loads),
        (cloudpickle.dumps, cloudpickle.loads),
        (lambda o: o, copy.deepcopy),
    ],
)
def test_workers_decide_the_same_role_from_the_pickled_vllm_config(make_vllm_config, dumps, loads):
    """The engine core sends the whole VllmConfig to every worker: the role a worker computes
    from its copy equals the engine's, with nothing attached to the SpeculativeConfig."""
    from vllm.config.speculative import SpeculativeConfig

    for kv, expected in ((producer_kv(), True), (None, False)):
        cfg = make_vllm_config(kv)
        back = loads(dumps(cfg))
        assert back.speculative_config is not cfg.speculative_config
        assert roles.prefill_only_role(back) is expected
    # The plugin adds nothing to vLLM's SpeculativeConfig (no methods, no pickle state).
    for name in ("is_dspark_prefill_only", "use_dspark_last_stage_drafter"):
        assert not hasattr(SpeculativeConfig, name), name


def test_instance_dict_holds_only_fields(make_vllm_config):
    """vllm.config.utils.replace rebuilds a config from __dict__ and raises on any key that is
    not a dataclass field: nothing of the plugin's may be there (fresh or unpickled)."""
    from vllm.config.speculative import SpeculativeConfig
    from vllm.config.utils import get_field

    cfg = make_vllm_config(producer_kv())
    for spec in (cfg.speculative_config, pickle.loads(pickle.dumps(cfg.speculative_config))):
        for key in spec.__dict__:
            get_field(SpeculativeConfig, key)  # raises ValueError for a non-field


def test_nixl_refused_at_start_under_pp2(make_vllm_config):
    with pytest.raises(NotImplementedError, match="Use MooncakeConnector"):
        make_vllm_config(producer_kv("NixlConnector"), pp=2)


def test_nixl_inside_multiconnector_refused_at_start(make_vllm_config):
    kv = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": "ExampleConnector", "kv_role": "kv_producer"},
                {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer"},
            ]
        },
    )
    with pytest.raises(NotImplementedError, match="NixlPushConnector"):
        make_vllm_config(kv, pp=2)


def test_mooncake_accepted_under_pp2(make_vllm_config):
    cfg = make_vllm_config(producer_kv("MooncakeConnector"), pp=2)
    assert roles.prefill_only_role(cfg) and cfg.parallel_config.pipeline_parallel_size == 2


def test_nixl_pp1_producer_accepted(make_vllm_config):
    cfg = make_vllm_config(producer_kv("NixlConnector"), pp=1)
    assert roles.prefill_only_role(cfg)
