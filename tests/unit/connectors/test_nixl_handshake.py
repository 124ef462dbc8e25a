"""NIXL with DSpark (issue 18), on CPU: start-up rules through real configs, the compatibility
hash of each role, and the layer comparison of the patched handshake on a worker stand-in.

nixl itself is not installed here, so no connector is constructed; vLLM's NIXL worker module
imports without it, and its ``_pair_regions`` / ``_nixl_handshake`` run on a stand-in worker
object that carries only the attributes they read.
"""

from __future__ import annotations

import types

import pytest
from vllm.config import KVTransferConfig

from vllm_dspark_pp.connectors import nixl_layers
from vllm_dspark_pp.producer import roles

TARGET_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
DRAFT_NAMES = ["model.layers.6.self_attn.attn"]


# ----------------------------------------------------------------------------- pure functions
def test_sort_is_model_order():
    names = ["model.layers.10.a", "model.layers.9.a", "model.layers.1.a"]
    assert sorted(names, key=nixl_layers.layer_sort_key) == [
        "model.layers.1.a",
        "model.layers.9.a",
        "model.layers.10.a",
    ]


def test_first_difference():
    assert nixl_layers.first_difference(TARGET_NAMES, list(reversed(TARGET_NAMES))) is None
    assert nixl_layers.first_difference(TARGET_NAMES + DRAFT_NAMES, TARGET_NAMES) == (
        6,
        DRAFT_NAMES[0],
        None,
    )
    other = [*TARGET_NAMES[:3], "model.layers.3.self_attn.other", *TARGET_NAMES[4:]]
    assert nixl_layers.first_difference(TARGET_NAMES, other) == (
        3,
        TARGET_NAMES[3],
        "model.layers.3.self_attn.other",
    )


def test_draft_layer_detection():
    assert nixl_layers.is_draft_layer("model.layers.6.self_attn.attn", 6)
    assert not nixl_layers.is_draft_layer("model.layers.5.self_attn.attn", 6)
    assert nixl_layers.is_draft_layer("draft_model.model.layers.0.self_attn.attn", 6)
    assert not nixl_layers.is_draft_layer("model.embed_tokens", 6)


def test_decoder_only_dspark_names_the_missing_draft_layer_and_the_fix():
    msg = nixl_layers.layer_mismatch_problem(
        TARGET_NAMES + DRAFT_NAMES,
        TARGET_NAMES,
        remote_may_hold_more=False,
        num_target_layers=6,
        remote_engine_id="prefill-1",
    )
    assert msg is not None
    assert "engine prefill-1" in msg
    assert "6 target + 1 draft layers" in msg and "6 target + 0 draft layers" in msg
    assert "First difference at position 6" in msg
    assert "here model.layers.6.self_attn.attn, peer (end of list)" in msg
    assert "#48221" in msg and "same --speculative-config" in msg and "kv_producer" in msg


def test_different_drafts_name_the_first_difference():
    two_layer_draft = ["model.layers.6.self_attn.attn", "model.layers.7.self_attn.attn"]
    msg = nixl_layers.layer_mismatch_problem(
        TARGET_NAMES + DRAFT_NAMES,
        TARGET_NAMES + two_layer_draft,
        remote_may_hold_more=False,
        num_target_layers=6,
    )
    assert "here (end of list), peer model.layers.7.self_attn.attn" in msg
    assert "same DSpark draft model" in msg


def test_prefiller_with_draft_but_decoder_without():
    msg = nixl_layers.layer_mismatch_problem(
        TARGET_NAMES, TARGET_NAMES + DRAFT_NAMES, remote_may_hold_more=False, num_target_layers=6
    )
    assert "This instance registers no draft KV layers but the peer does" in msg


def test_accepts_exactly_what_vllm_accepts():
    same = nixl_layers.layer_mismatch_problem
    assert (
        same(TARGET_NAMES + DRAFT_NAMES, TARGET_NAMES + DRAFT_NAMES, remote_may_hold_more=False)
        is None
    )
    # a PP stage holds a slice of the peer's layers: extra peer layers are fine there only
    assert same(TARGET_NAMES[:3], TARGET_NAMES, remote_may_hold_more=True) is None
    assert same(TARGET_NAMES[:3], TARGET_NAMES, remote_may_hold_more=False) is not None
    # a local layer missing on the peer is always refused
    assert same(TARGET_NAMES, TARGET_NAMES[:3], remote_may_hold_more=True) is not None


def test_hash_hint():
    hint = nixl_layers.hash_mismatch_hint("dspark", "abc", "abc")
    assert "runs no speculative decoding" in hint and "#48221" in hint
    other = nixl_layers.hash_mismatch_hint("dspark", "abc", "def")
    assert "must use the same --speculative-config" in other
    assert nixl_layers.hash_mismatch_hint(None, "abc", "abc") is None
    assert nixl_layers.remote_hash_in("Local: 12ab, Remote: 34cd. Prefill ...") == "34cd"


# ------------------------------------------------------------- start-up rules (real configs)
def nixl(role):
    return KVTransferConfig(kv_connector="NixlConnector", kv_role=role)


def test_nixl_producer_pp1_accepted_and_prefill_only(make_vllm_config):
    cfg = make_vllm_config(nixl("kv_producer"), pp=1)
    assert roles.prefill_only_role(cfg)
    assert (
        roles.prefill_only_connector_problem(cfg.speculative_config, cfg.kv_transfer_config) is None
    )


def test_nixl_producer_pp2_refused_with_the_existing_message(make_vllm_config):
    with pytest.raises(NotImplementedError) as e:
        make_vllm_config(nixl("kv_producer"), pp=2)
    assert str(e.value).startswith(
        "DSpark prefill-only producer (kv_role=kv_producer) with pipeline_parallel_size=2 over "
        "NixlConnector is not supported by vllm-dspark-pp"
    )


# --------------------------------------------------------------------- the compatibility hash
@pytest.fixture(scope="module")
def base_worker(plugin):
    import importlib

    mod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    from vllm_dspark_pp.patches._util import is_patched

    assert is_patched(mod.NixlBaseConnectorWorker, "_pair_regions")
    assert is_patched(mod.NixlBaseConnectorWorker, "_nixl_handshake")
    assert is_patched(mod, "compute_nixl_compatibility_hash")
    return mod


@pytest.fixture(scope="module")
def configs(make_vllm_config):
    from vllm.engine.arg_utils import EngineArgs

    decoder = make_vllm_config(nixl("kv_consumer"))
    producer = make_vllm_config(nixl("kv_producer"))
    plain = EngineArgs(
        model=decoder.model_config.model,
        kv_transfer_config=nixl("kv_producer"),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        enforce_eager=True,
    ).create_engine_config()
    return types.SimpleNamespace(decoder=decoder, producer=producer, plain=plain)


def test_hashes_of_the_roles(base_worker, configs):
    """Stock vLLM 0.34.0 with DSpark only on the decoder fails the NIXL handshake at the hash
    (not at the layer count of #48221); our prefill-only producer has the decoder's hash."""
    from vllm_dspark_pp.patches import distributed_kv_transfer_kv_connector_v1_nixl_base_worker as p

    h = base_worker.compute_nixl_compatibility_hash  # the patched global the worker calls
    dec, pre, plain = (
        h(c, "TRITON_ATTN") for c in (configs.decoder, configs.producer, configs.plain)
    )
    assert roles.prefill_only_role(configs.producer)
    assert not roles.prefill_only_role(configs.decoder)
    assert dec == pre
    assert dec != plain
    assert p.hash_without_spec(dec) == plain


class _Meta:
    """The NixlAgentMetadata fields ``_pair_regions`` reads."""

    def __init__(self, names, engine_id="prefill-1"):
        self.engine_id = engine_id
        self.kv_caches_base_addr = [1000 * (i + 1) for i in range(len(names))]
        self.block_lens = [4096] * len(names)
        self.block_strides = [4096] * len(names)
        self.region_num_blocks = None
        self.region_group_ids = None
        self.region_names = list(names)
        self.region_mem_types = None
        self.region_members = [[n] for n in names]
        self.layer_group_ids = {}
        self.packed_member_layouts = {}


def _worker(base_worker, cfg, names, pp_size=1):
    """A NIXL worker stand-in with what ``_pair_regions`` reads (one region per layer)."""
    w = object.__new__(base_worker.NixlBaseConnectorWorker)
    w.vllm_config = cfg
    w.model_config = cfg.model_config
    w.pp_size = pp_size
    w._packed_member_layouts = {}
    w._has_mamba = False
    w.block_len_per_layer = [4096] * len(names)
    w.kv_cache_config = types.SimpleNamespace(transfer_group_index_by_layer={n: 0 for n in names})
    w._set_region_layers([[n] for n in names])
    return w


@pytest.fixture(scope="module")
def layer_names(configs, dist_env):
    """KV layer names as vLLM registers them: the target's, the decoder's full drafter's and the
    producer's context-KV-only drafter's (built on CPU by support.vllm_configs.build_model)."""
    from support.vllm_configs import build_model
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    from vllm_dspark_pp.producer import qwen3

    _, tcfg = build_model(configs.decoder, Qwen3ForCausalLM)
    _, fcfg = build_model(configs.decoder, Qwen3DSparkForCausalLM)
    _, ccfg = build_model(configs.producer, qwen3.Qwen3DSparkContextKVForCausalLM)
    keys = lambda c: sorted(c.compilation_config.static_forward_context)  # noqa: E731
    return types.SimpleNamespace(target=keys(tcfg), full=keys(fcfg), context=keys(ccfg))


def test_real_layer_names(layer_names):
    assert layer_names.target == TARGET_NAMES
    assert layer_names.full == layer_names.context == DRAFT_NAMES


def test_prefill_only_producer_pairs_with_the_dspark_decoder(base_worker, configs, layer_names):
    dec = _worker(base_worker, configs.decoder, layer_names.target + layer_names.full)
    meta = _Meta(layer_names.target + layer_names.context)
    pairs = dec._pair_regions(meta)  # ours first, then vLLM's pairing
    assert pairs.local == list(range(7)) and pairs.remote == list(range(7))
    assert pairs.groups_match


def test_plain_producer_fails_the_handshake_naming_the_draft_layer(
    base_worker, configs, layer_names
):
    dec = _worker(base_worker, configs.decoder, layer_names.target + layer_names.full)
    with pytest.raises(RuntimeError) as e:
        dec._pair_regions(_Meta(layer_names.target))
    msg = str(e.value)
    assert "First difference at position 6" in msg
    assert "here model.layers.6.self_attn.attn, peer (end of list)" in msg
    assert "6 target + 1 draft layers" in msg and "#48221" in msg


def test_stock_pairing_message_is_what_the_patch_replaces(base_worker, configs, layer_names):
    """Without our check vLLM 0.34.0 names the missing layer but not why (kept as evidence)."""
    from vllm_dspark_pp.patches._util import original

    dec = _worker(base_worker, configs.decoder, layer_names.target + layer_names.full)
    stock = original(base_worker.NixlBaseConnectorWorker, "_pair_regions")
    with pytest.raises(RuntimeError, match=r"does not hold the KV layers \['model.layers.6"):
        stock(dec, _Meta(layer_names.target))


class _FakePrefillSideChannel:
    """A prefiller's NIXL side channel (zmq REP) answering vLLM's metadata query with a given
    NixlHandshakePayload, so vLLM's own ``_nixl_handshake`` runs up to the hash and layer checks."""

    def __init__(self, compat_hash: str, names: list[str], engine_id: str = "prefill-1"):
        import msgspec
        import zmq
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlAgentMetadata,
            NixlHandshakePayload,
        )

        meta = NixlAgentMetadata(
            engine_id=engine_id,
            agent_metadata=b"agent",
            kv_caches_base_addr=_Meta(names).kv_caches_base_addr,
            device_id=0,
            num_blocks=8,
            block_lens=[4096] * len(names),
            block_strides=[4096] * len(names),
            kv_cache_layout="LBHNC",
            block_size=16,
            ssm_sizes=(0, 0),
            attn_backend_name="TRITON_ATTN",
            physical_blocks_per_logical_kv_block=1,
            region_names=list(names),
            region_members=[[n] for n in names],
            layer_group_ids={n: 0 for n in names},
        )
        enc = msgspec.msgpack.Encoder()
        self.reply = enc.encode(NixlHandshakePayload(compat_hash, enc.encode(meta)))
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REP)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        import threading

        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        import time

        import msgspec
        import zmq

        if self.sock.poll(20000, zmq.POLLIN):
            self.sock.recv()
            self.sock.send_multipart([self.reply, msgspec.msgpack.encode(time.perf_counter())])

    def close(self):
        self.thread.join(timeout=25)
        self.sock.close(linger=0)
        self.ctx.term()


def _handshaking_worker(base_worker, cfg, names, compat_hash):
    """The stand-in plus what ``_nixl_handshake`` and ``add_remote_agent`` read before pairing."""
    w = _worker(base_worker, cfg, names)
    w._is_csa_linear = False
    w.use_host_buffer = True  # no CUDA device to select in the handshake thread
    w.transfer_topo = types.SimpleNamespace(handshake_target_ranks=lambda tp, dcp: [0])
    w.compat_hash = compat_hash
    w.enforce_compat_hash = True
    w.pcp_size = w.dcp_size = 1
    w._remote_agents = {}
    w._supports_pp_hma = False
    return w


def _handshake(w, names, remote_hash):
    side = _FakePrefillSideChannel(remote_hash, names)
    try:
        with pytest.raises(RuntimeError) as e:
            w._nixl_handshake("127.0.0.1", side.port, 1, "prefill-1")
    finally:
        side.close()
    return str(e.value)


def test_handshake_with_a_plain_prefiller_names_the_cause(base_worker, configs, layer_names):
    """vLLM's own ``_nixl_handshake`` against a prefiller without speculation: the hash differs
    and our wrapper adds the cause and the fix to vLLM's message."""
    h = base_worker.compute_nixl_compatibility_hash
    local, remote = h(configs.decoder, "TRITON_ATTN"), h(configs.plain, "TRITON_ATTN")
    w = _handshaking_worker(
        base_worker, configs.decoder, layer_names.target + layer_names.full, local
    )
    msg = _handshake(w, layer_names.target, remote)
    assert msg.startswith("NIXL compatibility hash mismatch")  # vLLM's text stays first
    assert "runs no speculative decoding" in msg and "#48221" in msg


def test_handshake_reaches_the_layer_check_when_the_hash_matches(base_worker, configs, layer_names):
    """Same hash (e.g. the check disabled, or equal factors) but no draft layers on the peer:
    the handshake fails in ``add_remote_agent`` with our layer message."""
    h = base_worker.compute_nixl_compatibility_hash
    local = h(configs.decoder, "TRITON_ATTN")
    w = _handshaking_worker(
        base_worker, configs.decoder, layer_names.target + layer_names.full, local
    )
    msg = _handshake(w, layer_names.target, local)
    assert "First difference at position 6" in msg and "peer (end of list)" in msg


def test_plan_note_per_role(configs):
    pre = nixl_layers.nixl_plan_note(
        configs.producer.speculative_config, configs.producer.kv_transfer_config
    )
    dec = nixl_layers.nixl_plan_note(
        configs.decoder.speculative_config, configs.decoder.kv_transfer_config
    )
    assert pre.startswith("NixlConnector with a DSpark prefill-only producer at PP=1: accepted")
    assert "prefiller must use the same --speculative-config" in dec
    assert (
        nixl_layers.nixl_plan_note(
            configs.plain.speculative_config, configs.plain.kv_transfer_config
        )
        is None
    )
