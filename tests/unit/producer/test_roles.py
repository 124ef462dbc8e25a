"""The producer role predicates and the connector guard, over a config matrix."""

from __future__ import annotations

import itertools
import types

import pytest
from vllm.config import KVTransferConfig

from vllm_dspark_pp.producer import roles


def spec(method="dspark", pp=1):
    """A stand-in with the two SpeculativeConfig attributes the predicates read."""
    return types.SimpleNamespace(
        method=method,
        target_parallel_config=types.SimpleNamespace(pipeline_parallel_size=pp),
    )


def kvc(connector, role, children=None):
    if connector is None:
        return None
    extra = {"connectors": children} if children is not None else {}
    return KVTransferConfig(kv_connector=connector, kv_role=role, kv_connector_extra_config=extra)


def child(name, role, extra=None):
    d = {"kv_connector": name, "kv_role": role}
    if extra is not None:
        d["kv_connector_extra_config"] = extra
    return d


METHODS = ["dspark", "dflash", "eagle3", "mtp", None]
PPS = [1, 2, 3]
ROLES = ["kv_producer", "kv_consumer", "kv_both"]
CONNECTORS = [
    "MooncakeConnector",
    "NixlConnector",
    "NixlPullConnector",
    "NixlPushConnector",
    "ExampleConnector",
]


@pytest.mark.parametrize(
    "method,pp,role,connector", list(itertools.product(METHODS, PPS, ROLES, CONNECTORS))
)
def test_predicates_direct_connector(method, pp, role, connector):
    s, kv = spec(method, pp), kvc(connector, role)
    prefill_only = roles.is_dspark_prefill_only(s, kv)
    assert prefill_only == (method == "dspark" and role == "kv_producer")
    problem = roles.prefill_only_connector_problem(s, kv)
    expect_refusal = prefill_only and pp > 1 and connector.startswith("Nixl")
    assert (problem is not None) == expect_refusal
    if expect_refusal:
        with pytest.raises(NotImplementedError, match="MooncakeConnector") as e:
            roles.check_prefill_only_connectors(s, kv)
        assert connector in str(e.value) and f"pipeline_parallel_size={pp}" in str(e.value)
    else:
        roles.check_prefill_only_connectors(s, kv)


def test_no_connector_is_never_prefill_only():
    assert not roles.is_dspark_prefill_only(spec(), None)
    assert not roles.is_dspark_prefill_only(spec(), KVTransferConfig())
    assert roles.prefill_only_connector_problem(spec(pp=2), None) is None
    assert not roles.is_dspark_prefill_only(None, kvc("MooncakeConnector", "kv_producer"))


MULTI = [
    # (children, top-level role, prefill-only?, NIXL names refused under PP>1)
    (
        [child("NixlConnector", "kv_producer"), child("OffloadingConnector", "kv_producer")],
        "kv_producer",
        True,
        ["NixlConnector"],
    ),
    ([child("NixlPushConnector", "kv_producer")], "kv_producer", True, ["NixlPushConnector"]),
    (
        [child("MooncakeConnector", "kv_producer"), child("OffloadingConnector", "kv_producer")],
        "kv_producer",
        True,
        [],
    ),
    # A consuming child makes the instance decode too: full drafter, no refusal.
    (
        [child("NixlConnector", "kv_producer"), child("OffloadingConnector", "kv_both")],
        "kv_producer",
        False,
        [],
    ),
    ([child("NixlPullConnector", "kv_consumer")], "kv_producer", False, []),
    # MultiConnector's own kv_role does not count, its children's do (as in vLLM).
    ([child("NixlPullConnector", "kv_producer")], "kv_both", True, ["NixlPullConnector"]),
    # Nested two levels deep.
    (
        [
            child(
                "MultiConnector",
                "kv_producer",
                {"connectors": [child("NixlConnector", "kv_producer")]},
            ),
            child("MooncakeConnector", "kv_producer"),
        ],
        "kv_producer",
        True,
        ["NixlConnector"],
    ),
]


@pytest.mark.parametrize("children,top_role,prefill_only,nixl", MULTI)
@pytest.mark.parametrize("pp", [1, 2])
def test_multiconnector(children, top_role, prefill_only, nixl, pp):
    kv = kvc("MultiConnector", top_role, children)
    s = spec("dspark", pp)
    assert roles.is_dspark_prefill_only(s, kv) == prefill_only
    problem = roles.prefill_only_connector_problem(s, kv)
    if pp > 1 and prefill_only and nixl:
        assert problem is not None
        for name in nixl:
            assert name in problem
        assert "MooncakeConnector" in problem
    else:
        assert problem is None


def test_configured_connectors_walks_nesting():
    kv = kvc("MultiConnector", "kv_producer", MULTI[-1][0])
    assert roles.configured_connectors(kv) == [
        "MultiConnector",
        "MultiConnector",
        "NixlConnector",
        "MooncakeConnector",
    ]
    assert roles.nixl_connectors_in(kv) == ["NixlConnector"]


def test_guard_message_names_the_fix():
    msg = roles.prefill_only_connector_problem(spec(pp=2), kvc("NixlConnector", "kv_producer"))
    assert msg == (
        "DSpark prefill-only producer (kv_role=kv_producer) with pipeline_parallel_size=2 over "
        "NixlConnector is not supported by vllm-dspark-pp: the NIXL path for the draft's context "
        "KV from a PP>1 producer is not proven correct. Use MooncakeConnector "
        "(kv_connector='MooncakeConnector'), or run the producer with pipeline_parallel_size=1."
    )


def test_explicit_parallel_config_wins():
    s = spec("dspark", pp=1)
    pc = types.SimpleNamespace(pipeline_parallel_size=4)
    assert roles.prefill_only_connector_problem(s, kvc("NixlConnector", "kv_producer"), pc)
