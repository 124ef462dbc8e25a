"""The Mooncake protocol of the PD tooling (dspark_dev/pd_launch.py, docs/pd_transport.md):
``DSPARK_PD_MOONCAKE_PROTOCOL`` (default ``tcp``) or the caller's protocol in every engine's
``--kv-transfer-config``, and the variable Mooncake's intra-node transport needs
(``MC_INTRANODE_NVLINK``) in every engine's environment, for the served benchmark's deployments
and the GPU tests' launchers (tests/support/pd_run.py, tests/support/pd_pair.py). Nothing
starts: the launchers are only composed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_dev import pd_launch

KNOB = "DSPARK_PD_MOONCAKE_PROTOCOL"
INTRA = {"MC_INTRANODE_NVLINK": "1"}


def _kv(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def _protocol(argv: list[str]) -> str:
    return _kv(argv)["kv_connector_extra_config"]["mooncake_protocol"]


def _mc(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith("MC_")}


def test_the_knob_default_and_override_reach_the_kv_transfer_config_json(monkeypatch):
    monkeypatch.delenv(KNOB, raising=False)
    cfg = json.loads(json.dumps(pd_launch.mooncake_kv_config("kv_producer", "e1")))
    assert cfg == {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        "engine_id": "e1",
    }
    assert pd_launch.mooncake_env() == {}
    monkeypatch.setenv(KNOB, "nvlink_intra")
    cfg = json.loads(json.dumps(pd_launch.mooncake_kv_config("kv_consumer")))
    assert cfg["kv_connector_extra_config"] == {"mooncake_protocol": "nvlink_intra"}
    assert pd_launch.mooncake_env() == INTRA
    # the caller's protocol wins over the knob, and its env follows it
    cfg = pd_launch.mooncake_kv_config("kv_consumer", protocol="tcp")
    assert cfg["kv_connector_extra_config"] == {"mooncake_protocol": "tcp"}
    assert pd_launch.mooncake_env("tcp") == {} and pd_launch.mooncake_env("rdma") == {}
    # a name Mooncake's wheel would quietly treat as TCP (or MNNVL, not built in) is refused
    monkeypatch.setenv(KNOB, "nvlink")
    with pytest.raises(ValueError, match="'nvlink': one of tcp, rdma, nvlink_intra"):
        pd_launch.mooncake_kv_config("kv_producer")
    with pytest.raises(ValueError, match="DSPARK_PD_MOONCAKE_PROTOCOL"):
        pd_launch.mooncake_env()


def _deployment(tmp_path: Path, **kw) -> pd_launch.PDDeployment:
    return pd_launch.pd_deployment(
        "t", "/m/target", spec={"method": "dspark", "model": "/m/d"}, base_args=[],
        producer_kv_bytes=1 << 30, decoder_kv_bytes=3 << 30, log_dir=tmp_path, env={}, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("producer_pp", [1, 2])
def test_every_engine_of_a_deployment_gets_the_protocol_and_its_env(
    tmp_path, monkeypatch, producer_pp
):
    monkeypatch.delenv(KNOB, raising=False)
    dep = _deployment(tmp_path, protocol="nvlink_intra", producer_pp=producer_pp, cpu=True)
    engines = [*dep.producers, dep.decoder]
    assert len(engines) == producer_pp + 1 and dep.protocol == "nvlink_intra"
    for node in engines:
        assert _protocol(node.argv) == "nvlink_intra", node.name
        assert _mc(node.env) == INTRA, node.name
    assert _mc(dep.proxy.env) == {}  # the proxy moves no KV
    # the knob's default: TCP, and no Mooncake variable anywhere
    dep = _deployment(tmp_path, producer_pp=producer_pp, cpu=True)
    assert dep.protocol == "tcp"
    for node in (*dep.producers, dep.decoder):
        assert _protocol(node.argv) == "tcp" and _mc(node.env) == {}, node.name
    # the knob, where the caller names none
    monkeypatch.setenv(KNOB, "nvlink_intra")
    dep = _deployment(tmp_path, producer_pp=producer_pp, cpu=True)
    assert {_protocol(n.argv) for n in (*dep.producers, dep.decoder)} == {"nvlink_intra"}
    assert all(_mc(n.env) == INTRA for n in (*dep.producers, dep.decoder))


def test_a_nixl_deployment_takes_no_mooncake_protocol(tmp_path):
    with pytest.raises(ValueError, match="Mooncake's; a NIXL deployment takes none"):
        _deployment(tmp_path, connector="nixl", protocol="nvlink_intra")
    dep = _deployment(tmp_path, connector="nixl")
    assert dep.protocol is None
    assert all(_mc(n.env) == {} for n in dep.nodes)


def test_the_transport_mooncake_logged_is_read_back():
    texts = [
        "INFO ... The Mooncake Transfer Engine is using nvlink_intra as its protocol.\n"
        "I1205 transfer_engine_impl.cpp:368] Using Intra-Node NVLink transport "
        "(MC_INTRANODE_NVLINK set)",
        "INFO ... The Mooncake Transfer Engine is using tcp as its protocol.\n"
        "I1205 transfer_engine_impl.cpp:395] Using TCP transport (no HCA detected)",
    ]
    assert pd_launch.mooncake_transport_evidence(texts) == {
        "protocols": ["nvlink_intra", "tcp"],
        "transports": ["nvlink_intra", "tcp"],
    }
    assert pd_launch.mooncake_transport_evidence(["nothing"]) == {
        "protocols": [],
        "transports": [],
    }


class _Stop(Exception):
    pass


def test_the_gpu_tests_launchers_follow_the_knob(monkeypatch):
    """tests/support/pd_run.py (the PD GPU tests' producer and decoder) and pd_pair.py (the
    fault tests' pair): the protocol in both ``--kv-transfer-config`` and its variable in both
    environments; a caller's own env still goes on top."""
    from support import pd_pair, pd_run

    monkeypatch.setenv(KNOB, "nvlink_intra")
    made: list[tuple[str, list[str], dict]] = []

    def record(name, model, args, *, env=None, **_kw):
        made.append((name, list(args), dict(env or {})))
        if len(made) == 2:  # producer and decoder composed: stop before anything starts
            raise _Stop

    monkeypatch.setattr(pd_run.Server, "vllm", staticmethod(record))
    with pytest.raises(_Stop):
        pd_run.run_pd("/m", None, [[1]], timeout_s=1.0, common_args=[])
    (pre, pre_args, pre_env), (dec, dec_args, dec_env) = made
    assert (pre, dec) == ("prefill", "decode")
    assert _protocol(pre_args) == _protocol(dec_args) == "nvlink_intra"
    assert _mc(pre_env) == _mc(dec_env) == INTRA
    made.clear()
    with pytest.raises(_Stop):
        pd_run.run_pd("/m", None, [[1]], timeout_s=1.0, common_args=[],
                      decode_env={"MC_INTRANODE_NVLINK": "own"})  # fmt: skip
    assert _mc(made[1][2]) == {"MC_INTRANODE_NVLINK": "own"}

    monkeypatch.undo()
    monkeypatch.setenv(KNOB, "nvlink_intra")
    setup = pd_pair.PairSetup(common=[], base_env={}, dryrun=False, bound_s=1.0)
    pair = pd_pair.Pair("p", None, {}, setup)
    producer = pair.new_producer()
    for node in (pair.decoder, producer):
        assert _protocol(node.argv) == "nvlink_intra" and _mc(node.env) == INTRA, node.name
    # the CPU dry run has no Mooncake: neither the config nor the variable
    dry = pd_pair.Pair("d", None, {}, pd_pair.PairSetup([], {}, True, 1.0))
    assert "--kv-transfer-config" not in dry.decoder.argv and _mc(dry.decoder.env) == {}
