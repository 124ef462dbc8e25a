"""DeepSeek-V4 PD over MooncakeConnector, walked on CPU past start-up (issue 16): the pre-flight
for tests/gpu/test_dsv4_k3_engine.py::test_pd_over_mooncake[dsv4].

Both sides are the real tiny DeepSeek-V4 GPU target (``make_tiny_dsv4_pair(gpu=True)``) built on
CPU with a DSpark speculative config: the prefiller (kv_producer) with our context-KV-only
drafter, the decoder (kv_consumer) with vLLM's full DSpark drafter. Each plan comes from vLLM's
planner (block-outermost layout resolved from the layers' backends, as the engine core does),
``cache_config.block_size`` is rewritten as EngineCore rewrites it (4), each KV cache is
allocated by vLLM's ``allocate_kv_cache`` (kernel blocks from ``prepare_kernel_block_sizes``),
and each ``MooncakeConnectorWorker`` / ``MooncakeConnectorScheduler`` is vLLM's (patched) class
built by its own ``__init__``. Block ids come from vLLM's ``KVCacheManager`` called as the
scheduler calls it (prefill with the config's lookahead on the prefiller; an async remote load
without lookahead on the decoder), and the request goes through both schedulers'
``get_num_new_matched_tokens`` / ``update_state_after_alloc`` / ``build_connector_meta`` and the
prefiller's ``request_finished``; the pull through the decoder's ``_build_pull_metadata`` and the
prefiller's ``record_send_reqs`` / ``send_kv_to_decode`` (regions, block pairing, transfer
descriptors, response).

Stood in for: the Mooncake ``TransferEngine`` object (not installed here; a write is a byte copy
between the two CPU buffers), the CUDA device index the worker records, the prefiller's ZMQ
side-channel listener (network only; ``register_kv_caches`` waits for it after the layout is
computed) and the ZMQ socket ``send_kv_to_decode`` answers on. A ``bootstrap_server_address`` in
the producer's extra config keeps its bootstrap server off.

Not covered (GPU only): the transfer engine itself (TCP, registration of CUDA memory), the
bootstrap / side-channel handshake, the decoder's receive loop and its timing in the engine, and
the kernels reading the pulled pages.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from dspark_dev import tiny_mla_targets as t
from dspark_dev.tiny_dsv4_cpu import (
    build_dsv4_target,
    construct_on_cpu,
    engine_config,
    plan_as_engine_core,
)
from vllm_dspark_pp.connectors import mooncake_blocks as mb

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"
PROMPT_LEN = 100
KV_BYTES = 1 << 24  # ~350 blocks of the tiny plan's 47808-byte rows


class FakeTransferEngine:
    """Stands in for ``mooncake.engine.TransferEngine``: registrations are recorded, a write is
    a byte copy (both "engines" live in this process)."""

    def __init__(self):
        self.registered: list[tuple[int, int]] = []
        self.writes: list[tuple[str, list[int], list[int], list[int]]] = []

    def initialize(self, hostname, metadata, protocol, device_name):
        self.hostname = hostname
        self.port = 17000 + len(_ENGINES)
        return 0

    def get_rpc_port(self):
        return self.port

    def batch_register_memory(self, ptrs, lens):
        self.registered.extend(zip(ptrs, lens, strict=True))
        return 0

    def batch_unregister_memory(self, ptrs):
        return 0

    def batch_transfer_sync_write(self, session, src, dst, lengths):
        self.writes.append((session, list(src), list(dst), list(lengths)))
        peer = next(e for e in _ENGINES if f"{e.hostname}:{e.get_rpc_port()}" == session)
        for s, d, n in zip(src, dst, lengths, strict=True):
            # as the real engine, only between registered memory (and never out of bounds here)
            assert self._inside(s, n) and peer._inside(d, n), (s, d, n)
            ctypes.memmove(d, s, n)
        return 0

    def _inside(self, ptr, n):
        return any(b <= ptr and ptr + n <= b + size for b, size in self.registered)


_ENGINES: list[FakeTransferEngine] = []


def _new_engine():
    e = FakeTransferEngine()
    _ENGINES.append(e)
    return e


@pytest.fixture(scope="module")
def mc(plugin):
    import importlib

    return importlib.import_module(MODULE)


def _side(tmp_path, pair, role, drafter_cls, monkeypatch):
    """(config, KV-cache config, {layer: spec}) for one side, after the engine core's
    block-size rewrite, with the target's and the drafter's layers in the forward context."""
    from vllm.config import set_current_vllm_config

    extra = {"bootstrap_server_address": "127.0.0.1:1"} if role == "kv_producer" else {}
    cfg = engine_config(
        pair,
        kv_cache_dtype="fp8_ds_mla",
        speculative_config=pair.speculative_config(4),
        kv_transfer_config={
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            "kv_connector_extra_config": extra,
        },
    )
    specs = build_dsv4_target(cfg, monkeypatch)
    target_ctx = dict(cfg.compilation_config.static_forward_context)
    construct_on_cpu(cfg, drafter_cls, monkeypatch)
    ctx = cfg.compilation_config.static_forward_context
    with set_current_vllm_config(cfg):
        draft_specs = {
            n: s
            for n, layer in ctx.items()
            if hasattr(layer, "get_kv_cache_spec") and (s := layer.get_kv_cache_spec(cfg))
        }
    ctx.update(target_ctx)
    specs = {**specs, **draft_specs}
    assert cfg.model_config.use_mla  # MooncakeConnector then leaves the layout to the backends
    layout, kv_cfg, _, cfg.cache_config.block_size = plan_as_engine_core(cfg, specs, KV_BYTES)
    assert layout.is_block_outermost
    return cfg, kv_cfg, draft_specs


def _kernel_block_sizes(cfg, kv_cfg):
    """vLLM's ``prepare_kernel_block_sizes`` with each group's layers' backends."""
    from types import SimpleNamespace

    from vllm.v1.worker.utils import prepare_kernel_block_sizes

    ctx = cfg.compilation_config.static_forward_context
    attn_groups = [
        [
            SimpleNamespace(backend=ctx[n].get_attn_backend(), kv_cache_spec=g.kv_cache_spec)
            for n in g.layer_names[:1]
        ]
        for g in kv_cfg.kv_cache_groups
    ]
    return prepare_kernel_block_sizes(kv_cfg, attn_groups)


def _allocate(cfg, kv_cfg):
    from vllm.v1.worker.utils import allocate_kv_cache

    return allocate_kv_cache(
        kv_cfg,
        torch.device("cpu"),
        cfg.cache_config.get_resolved_kv_cache_layout(),
        _kernel_block_sizes(cfg, kv_cfg),
    )


def _worker(mc, cfg, kv_cfg, monkeypatch, engine_id):
    from vllm.config import set_current_vllm_config

    monkeypatch.setattr(mc, "TransferEngine", _new_engine)
    # the worker records its CUDA device for the sender threads; CPU has none
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(mc.current_platform, "set_device", lambda *a: None, raising=False)
    with set_current_vllm_config(cfg):
        w = mc.MooncakeConnectorWorker(cfg, engine_id, kv_cfg)
    return w


def _register(w, caches):
    """vLLM's register_kv_caches; on the prefiller the side-channel listener (ZMQ, network only)
    is replaced by one that reports ready."""
    if not w.is_kv_consumer:

        async def listener(ready_event):
            ready_event.set()

        w._mooncake_sender_listener = listener
    w.register_kv_caches(caches)


@pytest.fixture(scope="module")
def pd(mc, tmp_path_factory, plugin, dist_env):
    from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM

    from vllm_dspark_pp.producer import deepseek_v4

    pair = t.make_tiny_dsv4_pair(tmp_path_factory.mktemp("mc-dsv4-pd"), gpu=True)
    ctx_cls = deepseek_v4.DSparkDeepseekV4ContextKVForCausalLM
    out = {}
    with pytest.MonkeyPatch.context() as m:
        for name, role, cls in (
            ("p", "kv_producer", ctx_cls),
            ("d", "kv_consumer", DSparkDeepseekV4ForCausalLM),
        ):
            cfg, kv_cfg, draft_specs = _side(tmp_path_factory, pair, role, cls, m)
            caches = _allocate(cfg, kv_cfg)
            w = _worker(mc, cfg, kv_cfg, m, f"engine-{name}")
            _register(w, caches)
            s = mc.MooncakeConnectorScheduler(cfg, f"engine-{name}", kv_cfg)
            out[name] = dict(cfg=cfg, kv=kv_cfg, caches=caches, w=w, s=s, draft=draft_specs)
        yield out
        for side in out.values():
            side["w"].shutdown()


def test_both_sides_plan_the_same_groups_with_the_draft_groups(pd):
    p, d = pd["p"], pd["d"]
    assert (
        sorted(p["draft"])
        == sorted(d["draft"])
        == [
            "model.layers.2.attn.swa_cache",
            "model.layers.3.attn.swa_cache",
        ]
    )
    assert p["draft"] == d["draft"]  # the context-only drafter's specs are vLLM's
    assert [g.layer_names for g in p["kv"].kv_cache_groups] == [
        g.layer_names for g in d["kv"].kv_cache_groups
    ]
    assert [g.kv_cache_spec for g in p["kv"].kv_cache_groups] == [
        g.kv_cache_spec for g in d["kv"].kv_cache_groups
    ]
    # the draft groups are SWA 64: the transfer block stays the compressed MLA block
    assert sorted(set(mb.group_block_sizes(p["kv"]))) == [4, 8, 64, 256]
    assert p["cfg"].cache_config.block_size == 4  # the engine core's rewrite
    for side in (p, d):
        assert mb.transfer_block_size(side["kv"], 4) == 256
        assert (side["w"].block_size, side["w"]._physical_blocks_per_logical_kv_block) == (256, 1)
        assert side["s"].block_size == 256


def test_registration_covers_every_layer_with_its_page(pd):
    """Every layer of every transfer group is in one registered region: its own, or (same
    address, row and page: the block-outermost packing overlays groups) a region shared by the
    groups whose layers it holds. Each region is block-major over the one backing allocation."""
    for side in (pd["p"], pd["d"]):
        w, kv = side["w"], side["kv"]
        specs = w._layer_specs
        buf = next(iter(side["caches"].values())).untyped_storage()
        assert w.seen_base_addresses == [buf.data_ptr()]  # one allocation, registered whole
        assert w._kv_data_lens == [buf.nbytes()]
        regions = list(
            zip(
                w.kv_caches_base_addr,
                w.block_len_per_layer,
                w.kv_block_len_per_layer,
                w.region_shared_groups,
                strict=True,
            )
        )
        for name, spec in specs.items():
            tensor = next(tt for tt in kv.kv_cache_tensors if name in tt.layers)
            # the transfer length is the view's bytes per block (the page without its padding)
            page = side["caches"][name][0]
            assert page.is_contiguous() and page.nbytes <= spec.page_size_bytes, name
            key = (buf.data_ptr() + tensor.offset, tensor.block_stride, page.nbytes)
            gid = kv.transfer_group_index_by_layer[name]
            hits = [r for r in regions if r[:3] == key and gid in r[3]]
            assert len(hits) == 1, (name, key, gid)
            assert spec.page_size_bytes <= tensor.block_stride


def _request(rid, params):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    r = Request(rid, list(range(10, 10 + PROMPT_LEN)), SamplingParams(max_tokens=1), None)
    r.kv_transfer_params = params
    return r


def _kv_manager(side):
    """vLLM's scheduler-side KV-cache manager for this side's plan, built as the scheduler
    builds it (vllm/v1/core/sched/scheduler.py)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_kv_cache_block_sizes,
    )

    cfg = side["cfg"]
    sched_cfg = generate_scheduler_kv_cache_config([side["kv"]])
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(sched_cfg, cfg)
    return KVCacheManager(
        kv_cache_config=sched_cfg,
        max_model_len=cfg.model_config.max_model_len,
        enable_caching=cfg.cache_config.enable_prefix_caching,
        scheduler_block_size=scheduler_block,
        hash_block_size=hash_block,
    )


def _prefill_on_p(p, preq):
    """The prefiller's scheduler for a fresh prompt: the prefill step's allocation (with the
    config's lookahead, as for any new request), the step's computed tokens, then what
    ``_connector_finished`` hands to ``request_finished``."""
    kvm = _kv_manager(p)
    new = kvm.allocate_slots(
        preq,
        preq.num_prompt_tokens,
        num_lookahead_tokens=p["cfg"].num_lookahead_tokens,
    )
    assert new is not None
    p["s"].update_state_after_alloc(preq, kvm.get_blocks(preq.request_id), 0)
    preq.num_computed_tokens = preq.num_prompt_tokens
    kvm.remove_skipped_blocks(
        request_id=preq.request_id,
        processed_computed_tokens=preq.num_computed_tokens,
        num_prompt_tokens=preq.num_prompt_tokens,
    )
    return kvm, kvm.get_block_ids_for_computed_tokens(
        request_id=preq.request_id, num_computed_tokens=preq.num_computed_tokens
    )


def _alloc_on_d(d, dreq, n_ext):
    """The decoder's scheduler for an async remote load: no forward pass, so no lookahead
    (scheduler.py: ``effective_lookahead_tokens``), blocks cached later."""
    kvm = _kv_manager(d)
    new = kvm.allocate_slots(
        dreq,
        0,
        num_lookahead_tokens=0,
        num_external_computed_tokens=n_ext,
        delay_cache_blocks=True,
    )
    assert new is not None
    d["s"].update_state_after_alloc(dreq, kvm.get_blocks(dreq.request_id), n_ext)
    return kvm


class _Sock:
    """Stands in for the prefiller's ZMQ ROUTER socket: keeps the responses."""

    def __init__(self):
        self.sent: list[tuple[bytes, bytes]] = []

    async def send_multipart(self, parts):
        self.sent.append(tuple(parts))


def _run(w, coro, loop_name):
    import asyncio

    return asyncio.run_coroutine_threadsafe(coro, getattr(w, loop_name)).result(timeout=60)


def _backing(caches):
    """The one backing allocation under every layer's view, as flat bytes."""
    (storage,) = {
        c.untyped_storage().data_ptr(): c.untyped_storage() for c in caches.values()
    }.values()
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _pages(caches, kv, group_ids):
    """{(layer, block id): bytes of that layer's page} for the given block ids per group."""
    out = {}
    for gi, g in enumerate(kv.kv_cache_groups):
        for name in g.layer_names:
            for b in group_ids[gi]:
                out[(name, b)] = caches[name][b].contiguous().view(torch.uint8).clone()
    return out


def test_pd_request_transfers_every_group_page_for_page(mc, pd):
    """One 100-token request: P prefills and finishes (max_tokens 1), D pulls. Every D page of
    every group in D's pull equals the P page it pairs with (in order, after the sliding-window
    clipping both schedulers apply); every other byte of D's cache is unchanged."""
    from vllm.v1.request import RequestStatus

    p, d = pd["p"], pd["d"]
    tid = "xfer-1"
    # -- prefiller scheduler: the request is scheduled, then finishes (the PD proxy asks for 1)
    preq = _request("p-req", {"do_remote_decode": True, "transfer_id": tid})
    p["s"].on_new_request(preq)
    assert p["s"].get_num_new_matched_tokens(preq, 0) == (0, False)
    _, p_ids = _prefill_on_p(p, preq)
    step1 = p["s"].build_connector_meta(None)  # the prefill step: P's worker expects a send
    assert step1.reqs_to_send == {"p-req": (tid, [])}
    _run(p["w"], p["w"].record_send_reqs(step1), "sender_loop")
    preq.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay_free, _ = p["s"].request_finished(preq, tuple(p_ids))
    assert delay_free
    p_meta = p["s"].build_connector_meta(None)
    (transfer_id, p_send_ids) = p_meta.reqs_to_send["p-req"]
    assert transfer_id == tid
    assert len(p_send_ids) == len(p["kv"].kv_cache_groups)
    _run(p["w"], p["w"].record_send_reqs(p_meta), "sender_loop")

    # -- decoder scheduler: remote prefill of the same prompt
    dreq = _request(
        "d-req",
        {
            "do_remote_prefill": True,
            "remote_engine_id": "engine-p",
            "remote_bootstrap_addr": "127.0.0.1:1",
            "transfer_id": tid,
        },
    )
    d["s"].on_new_request(dreq)
    n_ext, load_async = d["s"].get_num_new_matched_tokens(dreq, 0)
    assert (n_ext, load_async) == (PROMPT_LEN, True)  # no bounded replay in this plan
    _alloc_on_d(d, dreq, n_ext)
    d_meta = d["s"].build_connector_meta(None)
    pull = d_meta.reqs_to_recv["engine-p"]["d-req"]
    # Per group, D asks for the blocks it still needs (sliding-window and compressor-state
    # groups: only the window's); P holds at least those, and vLLM pairs D's with P's last ones
    # (_build_transfer_params). What P holds before them must be out of its window (null blocks),
    # and nothing D needs may pair with a null block.
    pairs = []
    for gi, (pg, dg) in enumerate(zip(p_send_ids, pull.local_block_ids, strict=True)):
        assert 0 < len(dg) <= len(pg), (gi, pg, dg)
        tail = pg[len(pg) - len(dg) :]
        assert all(b == 0 for b in pg[: len(pg) - len(dg)]), (gi, pg, dg)
        assert 0 not in tail and 0 not in dg, (gi, pg, dg)
        pairs.append(list(zip(tail, dg, strict=True)))
    block_sizes = [g.kv_cache_spec.block_size for g in p["kv"].kv_cache_groups]
    for gi, bs in enumerate(block_sizes):  # full-attention groups: every block of the prompt
        if bs == 256:
            assert len(pairs[gi]) == -(-PROMPT_LEN // bs)

    # -- the pull: D's metadata (with its layout) to P's real send path; bytes move by memmove
    gen = torch.Generator().manual_seed(0)
    p_buf, d_buf = _backing(p["caches"]), _backing(d["caches"])
    p_buf.copy_(torch.randint(0, 256, p_buf.shape, dtype=torch.uint8, generator=gen))
    d_buf.zero_()
    d_before = d_buf.clone()
    xfer_meta = d["w"]._build_pull_metadata({"d-req": pull}, include_layout=True)
    xfer_meta = mc.msgspec.msgpack.Decoder(mc.MooncakeXferMetadata).decode(
        mc.msgspec.msgpack.Encoder().encode(xfer_meta)
    )  # as it crosses the side channel
    sock = _Sock()
    engine = p["w"].engine
    n_writes = len(engine.writes)
    _run(p["w"], p["w"].send_kv_to_decode(b"d", sock, xfer_meta), "sender_loop")
    (resp,) = [mc.msgspec.msgpack.Decoder(mc.MooncakeXferResponse).decode(m) for _, m in sock.sent]
    assert resp.status == mc.MooncakeXferResponseStatus.FINISH, resp
    assert resp.err_reqs is None and resp.ok_reqs == ["d-req"], resp
    assert len(engine.writes) == n_writes + 1
    assert "p-req" in p["w"].finished_sending_reqs

    # -- what a correct transfer needs: pairwise page equality per layer, nothing else touched
    src = _pages(p["caches"], p["kv"], p_send_ids)
    dst = _pages(d["caches"], d["kv"], pull.local_block_ids)
    touched = torch.zeros_like(d_buf, dtype=torch.bool)
    for gi, g in enumerate(d["kv"].kv_cache_groups):
        for name in g.layer_names:
            for pb, db in pairs[gi]:
                assert torch.equal(dst[(name, db)], src[(name, pb)]), (name, pb, db)
                view = d["caches"][name][db]
                start = view.data_ptr() - d_buf.data_ptr()
                touched[start : start + view.nbytes] = True
    # Rows are block-outermost: one row per block id, each id owned by one group at a time, so
    # vLLM may copy a pulled block's whole row (its padding too); no other row may change.
    row = d["kv"].kv_cache_tensors[0].block_stride
    pulled_rows = torch.zeros_like(d_buf, dtype=torch.bool)
    for gi in range(len(pairs)):
        for _, db in pairs[gi]:
            pulled_rows[db * row : (db + 1) * row] = True
    changed = d_buf != d_before
    outside = (changed & ~pulled_rows).nonzero().flatten()
    assert outside.numel() == 0, (
        f"{outside.numel()} bytes outside the pulled blocks' rows changed, rows "
        f"{sorted({int(x) // row for x in outside[:1000]})}"
    )
    assert changed[touched].any()
