"""CPU dry run of tests/support/pd_nixl.py's plumbing (the NIXL PD GPU test itself needs nixl +
CUDA):
server command lines and environment, the corrupted draft, the proxy's NIXL parameters as vLLM's
NIXL metadata reads them, log parsing of the patch's messages, the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import pd_nixl

from dspark_dev import pd_proxy

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(120)


def test_kv_configs_are_valid_vllm_configs():
    from vllm.config import KVTransferConfig

    for role, eid, strict in (("kv_producer", "p-1", True), ("kv_consumer", None, False)):
        cfg = pd_nixl.nixl_kv_config(role, eid, enforce_compat=strict)
        kv = KVTransferConfig(**cfg)
        assert kv.kv_connector == "NixlConnector" and kv.kv_role == role
        assert kv.get_from_extra_config("enforce_handshake_compat", True) is strict
        if eid:
            assert kv.engine_id == eid


def test_server_command_and_environment(monkeypatch):
    monkeypatch.delenv("DSPARK_NIXL_UCX_TLS", raising=False)
    monkeypatch.delenv("DSPARK_NIXL_UCX_NET_DEVICES", raising=False)
    spec = {"method": "dspark", "model": "/d"}
    s = pd_nixl.nixl_server(
        "dec",
        "/m",
        ["--dtype", "float32"],
        spec,
        pd_nixl.nixl_kv_config("kv_consumer"),
        ["--no-enable-prefix-caching"],
    )
    cmd = s.argv
    assert cmd[cmd.index("--speculative-config") + 1] == json.dumps(spec)
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_role"] == "kv_consumer"
    assert "--no-enable-prefix-caching" in cmd
    assert s.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert int(s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) > 0
    assert s.env["UCX_TLS"] == "cuda_ipc,cuda_copy,tcp" and s.env["UCX_NET_DEVICES"] == "lo"
    plain = pd_nixl.nixl_server("pre", "/m", [], None, pd_nixl.nixl_kv_config("kv_producer"))
    assert "--speculative-config" not in plain.argv
    assert plain.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    monkeypatch.setenv("DSPARK_NIXL_UCX_NET_DEVICES", "")
    monkeypatch.setenv("DSPARK_NIXL_UCX_TLS", "tcp,cuda_copy")
    assert pd_nixl.ucx_env() == {"UCX_TLS": "tcp,cuda_copy"}


def test_corrupted_draft_changes_only_context_weights(tmp_path):
    from safetensors.torch import load_file

    src = ROOT / "models" / "tiny-pair" / "dspark-draft"
    out = Path(pd_nixl.corrupt_draft(str(src), str(tmp_path)))
    assert (out / "config.json").read_text() == (src / "config.json").read_text()
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    changed = sorted(k for k in a if not (a[k] == b[k]).all())
    assert "fc.weight" in changed and "layers.0.self_attn.k_proj.weight" in changed
    assert all(any(c in k for c in pd_nixl.CORRUPT_KEYS) for k in changed)
    assert (a["embed_tokens.weight"] == b["embed_tokens.weight"]).all()


def test_proxy_passes_the_prefillers_nixl_params_as_vllm_reads_them():
    """What NixlConnector's prefiller returns goes to the decoder as vLLM's NIXL metadata reads
    it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    from_prefill = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[3, 4, 5]],
        "remote_engine_id": "dspark-nixl-p",
        "remote_request_id": "cmpl-1",
        "remote_host": "127.0.0.1",
        "remote_port": 5611,
        "tp_size": 1,
    }
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8}
    pre = pd_proxy.prefill_request(body, "t-1")
    assert pre["kv_transfer_params"]["do_remote_decode"] is True and pre["max_tokens"] == 1
    d = pd_proxy.decode_request(body, "t-1", "dspark-nixl-p", "nixl:no-bootstrap", from_prefill)
    params = d["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    meta = NixlConnectorMetadata()
    meta.add_new_req_to_recv("req", ([0, 1, 2],), params)
    remote = meta.reqs_to_recv["req"].remote
    assert (remote.engine_id, remote.host, remote.port) == ("dspark-nixl-p", "127.0.0.1", 5611)
    assert remote.block_ids == [[3, 4, 5]] and remote.request_id == "cmpl-1"


def test_log_parsing_of_the_patch_messages():
    from vllm_dspark_pp.connectors import nixl_layers

    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    msg = nixl_layers.layer_mismatch_problem(
        names, names[:4], remote_may_hold_more=False, num_target_layers=4, remote_engine_id="p"
    )
    paired = nixl_layers.PAIRED_LOG % ("p-1", 4, 2, "")  # the patch's log format
    log = "\n".join(
        [
            "(EngineCore pid=1) INFO 12-03 [x.py:1] noise",
            f"(EngineCore pid=1) INFO 12-03 [nixl.py:1] {paired}",
            f"RuntimeError: {msg}",
            "[1764] [host:1:0] ucp_worker.c:1 UCX  ERROR no transport",
        ]
    )
    lines = pd_nixl.failure_lines(log)
    assert len(lines) == 2 and "First difference at position 4" in lines[0]
    assert "UCX  ERROR" in lines[1]
    assert [m.groups() for m in pd_nixl.PAIRED.finditer(log)] == [("p-1", "4", "2")]


def test_summary_and_cli(tmp_path, capsys):
    spec = {"num_drafts": 10, "num_draft_tokens": 70, "num_accepted_tokens": 63}
    kv = {"vllm:external_prefix_cache_hits_total": 240.0}
    ok = {"tokens": [[1]], "errors": [], "spec": spec, "kv": kv}
    results = {
        "trained": {
            "aggregated": ok,
            "pd": ok,
            "decoder_only": {
                "decoder": {
                    "answer": {"error": "HTTPError 500"},
                    "log_lines": [
                        "RuntimeError: NIXL compatibility hash mismatch. Local: a, Remote: b."
                    ],
                }
            },
        },
        "qwen3": {"error": "GPUCaseFailure: server exited", "step": "wait for /health"},
    }
    table = pd_nixl.summary(results)
    assert "90.0" in table and "hash mismatch" in table and "failed at 'wait for /health'" in table
    pd_nixl.write_artifacts(str(tmp_path), results, {"trained/decoder": "log text"})
    assert "log text" in (tmp_path / "nixl_servers.log").read_text()
    assert pd_nixl.main(["--summary", str(tmp_path / "nixl_result.json")]) == 0
    assert "NIXL PD summary" in capsys.readouterr().out
    assert pd_nixl.main(["--summary", str(tmp_path / "missing.json")]) == 1
