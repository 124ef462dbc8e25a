"""The KV-transfer config reaches SpeculativeConfig and survives pickling; start-up guards."""

from __future__ import annotations

import copy
import pickle

import cloudpickle
import pytest
from vllm.config import KVTransferConfig

from vllm_dspark_pp import roles


def producer_kv(connector="ExampleConnector", **extra):
    return KVTransferConfig(kv_connector=connector, kv_role="kv_producer", **extra)


def test_real_config_exposes_roles(make_vllm_config):
    cfg = make_vllm_config(producer_kv())
    spec = cfg.speculative_config
    assert spec.method == "dspark"
    assert spec.draft_model_config.architectures == ["Qwen3DSparkModel"]
    assert roles.is_attached(spec)
    assert roles.attached_kv_transfer_config(spec) is cfg.kv_transfer_config
    assert spec.is_dspark_prefill_only() is True
    assert spec.use_dspark_last_stage_drafter() is False


@pytest.mark.parametrize("role,expected", [("kv_consumer", False), ("kv_both", False)])
def test_other_roles_keep_full_drafter(make_vllm_config, role, expected):
    cfg = make_vllm_config(KVTransferConfig(kv_connector="ExampleConnector", kv_role=role))
    assert cfg.speculative_config.is_dspark_prefill_only() is expected


def test_no_kv_transfer(make_vllm_config):
    cfg = make_vllm_config(None)
    assert roles.is_attached(cfg.speculative_config)
    assert cfg.speculative_config.is_dspark_prefill_only() is False


@pytest.mark.parametrize("dumps,loads", [(pickle.dumps, pickle.loads),
                                         (cloudpickle.dumps, cloudpickle.loads),
                                         (lambda o: o, copy.deepcopy)])
def test_survives_pickling_of_the_whole_vllm_config(make_vllm_config, dumps, loads):
    cfg = make_vllm_config(producer_kv())
    back = loads(dumps(cfg))
    spec = back.speculative_config
    assert spec is not cfg.speculative_config
    assert roles.is_attached(spec)
    assert spec.is_dspark_prefill_only() is True
    kv = roles.attached_kv_transfer_config(spec)
    assert kv.kv_role == "kv_producer" and kv.kv_connector == "ExampleConnector"
    # Nothing extra is left in the instance dict, so vLLM's replace() still works.
    assert roles.STATE_KEY not in spec.__dict__


def test_shallow_copy_of_the_speculative_config(make_vllm_config):
    cfg = make_vllm_config(producer_kv())
    dup = copy.copy(cfg.speculative_config)
    assert dup is not cfg.speculative_config and dup.is_dspark_prefill_only() is True


def test_instance_dict_holds_only_fields(make_vllm_config):
    """vllm.config.utils.replace rebuilds a config from __dict__ and raises on any key that is
    not a dataclass field; the attachment must not add one (fresh or unpickled)."""
    from vllm.config.speculative import SpeculativeConfig
    from vllm.config.utils import get_field

    cfg = make_vllm_config(producer_kv())
    for spec in (cfg.speculative_config, pickle.loads(pickle.dumps(cfg.speculative_config))):
        assert spec.is_dspark_prefill_only()
        for key in spec.__dict__:
            get_field(SpeculativeConfig, key)  # raises ValueError for a non-field


def test_unpickled_without_our_setstate(make_vllm_config):
    """A worker that unpickles before the plugin patched the class gets the value in
    __dict__; the first lookup moves it to the side table."""
    from vllm.config.speculative import SpeculativeConfig

    cfg = make_vllm_config(producer_kv())
    state = cfg.speculative_config.__getstate__()
    assert roles.STATE_KEY in state
    fresh = SpeculativeConfig.__new__(SpeculativeConfig)
    fresh.__dict__.update(state)  # what object's default __setstate__ does
    assert fresh.is_dspark_prefill_only() is True
    assert roles.STATE_KEY not in fresh.__dict__


def test_nixl_refused_at_start_under_pp2(make_vllm_config):
    with pytest.raises(NotImplementedError, match="Use MooncakeConnector"):
        make_vllm_config(producer_kv("NixlConnector"), pp=2)


def test_nixl_inside_multiconnector_refused_at_start(make_vllm_config):
    kv = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={"connectors": [
            {"kv_connector": "ExampleConnector", "kv_role": "kv_producer"},
            {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer"},
        ]},
    )
    with pytest.raises(NotImplementedError, match="NixlPushConnector"):
        make_vllm_config(kv, pp=2)


def test_mooncake_accepted_under_pp2(make_vllm_config):
    cfg = make_vllm_config(producer_kv("MooncakeConnector"), pp=2)
    spec = cfg.speculative_config
    assert spec.is_dspark_prefill_only() and spec.use_dspark_last_stage_drafter()


def test_nixl_pp1_producer_accepted(make_vllm_config):
    cfg = make_vllm_config(producer_kv("NixlConnector"), pp=1)
    assert cfg.speculative_config.is_dspark_prefill_only()
