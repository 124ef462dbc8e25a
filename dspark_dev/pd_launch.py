"""PD on loopback: a DSpark prefill-only producer, a DSpark decoder, dspark_dev/pd_proxy.py.

The pieces every PD run shares, once: the MooncakeConnector ``--kv-transfer-config`` of each role
(:func:`mooncake_kv_config`; its protocol TCP unless ``DSPARK_PD_MOONCAKE_PROTOCOL`` or the caller
says otherwise) and the Mooncake variables that protocol needs (:func:`mooncake_env`), the log
lines that prove the producer is the plugin's prefill-only role (:data:`PREFILL_MARKERS`), the
decoder's KV-connector counters (:data:`KV_METRICS`, :func:`kv_counters`), how a total KV budget
is split between producer and decoder (:func:`split_kv_bytes`), and :class:`PDDeployment`, the
producer / decoder / proxy processes of a served benchmark (benchmarks/serve_pp_one_gpu.py). The
GPU tests start their servers through tests/support/pd_run.py, which takes its settings from here.

Ports: the producer's Mooncake bootstrap server listens on ``VLLM_MOONCAKE_BOOTSTRAP_PORT``; each
engine gets its own ``VLLM_PORT`` block (vLLM counts its internal ports up from it) so two
engines on one host never collide; the decoder gets its own, unused, bootstrap port.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from dspark_dev.metrics import parse_prometheus
from dspark_dev.proc import live_group_members
from dspark_dev.serve import Server, check_alive, free_port, free_port_block, wait_ready

#: Log lines a DSpark prefill-only producer prints (producer/load.py, patches/*producer*,
#: scheduler).
PREFILL_MARKERS = (
    "Built the context-KV-only DSpark drafter",
    "the scheduler schedules no draft tokens",
)

#: The decoder's counters that show the prompt KV came over the connector.
KV_METRICS = (
    "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:prompt_tokens_total",
    "vllm:mooncake_num_failed_transfers_total",
    "vllm:mooncake_num_failed_recvs_total",
)


#: The ``mooncake_protocol`` values the PD tooling accepts: ``tcp`` (our default), ``rdma``
#: (vLLM's default) and ``nvlink_intra`` (Mooncake's intra-node transport: CUDA IPC copies
#: between the processes of one host, also two on one GPU; :func:`mooncake_env`).
MOONCAKE_PROTOCOLS = ("tcp", "rdma", "nvlink_intra")
#: Mooncake's own environment for a protocol. Mooncake 0.3.14's transfer engine installs its
#: transport from the environment when it starts, not from the protocol string (that one picks
#: the allocator of Mooncake's own managed buffers, which vLLM does not use): without
#: ``MC_INTRANODE_NVLINK`` (any value) an ``nvlink_intra`` engine would still send over TCP
#: (docs/pd_transport.md).
MOONCAKE_PROTOCOL_ENV: dict[str, dict[str, str]] = {"nvlink_intra": {"MC_INTRANODE_NVLINK": "1"}}


def mooncake_protocol(protocol: str | None = None) -> str:
    """``protocol``, else ``DSPARK_PD_MOONCAKE_PROTOCOL`` (default ``tcp``); one of
    :data:`MOONCAKE_PROTOCOLS`."""
    chosen = protocol or os.environ.get("DSPARK_PD_MOONCAKE_PROTOCOL", "tcp")
    if chosen not in MOONCAKE_PROTOCOLS:
        raise ValueError(
            f"Mooncake protocol {chosen!r}: one of {', '.join(MOONCAKE_PROTOCOLS)} "
            "(argument or DSPARK_PD_MOONCAKE_PROTOCOL)"
        )
    return chosen


def mooncake_kv_config(
    role: str, engine_id: str | None = None, protocol: str | None = None
) -> dict:
    """``--kv-transfer-config`` of a MooncakeConnector engine (``kv_producer`` /
    ``kv_consumer``) over :func:`mooncake_protocol` of ``protocol``; the producer's ``engine_id``
    is what the proxy names to the decoder. Its engine also needs :func:`mooncake_env`."""
    cfg = {
        "kv_connector": "MooncakeConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"mooncake_protocol": mooncake_protocol(protocol)},
    }
    if engine_id:
        cfg["engine_id"] = engine_id
    return cfg


def mooncake_env(protocol: str | None = None) -> dict[str, str]:
    """The Mooncake variables every engine (producer and decoder alike: both must install the
    same transport) of :func:`mooncake_protocol` of ``protocol`` needs:
    ``MC_INTRANODE_NVLINK=1`` for ``nvlink_intra``, nothing for the others."""
    return dict(MOONCAKE_PROTOCOL_ENV.get(mooncake_protocol(protocol), {}))


#: The lines that say which transport an engine's Mooncake installed (messages of Mooncake 0.3.14's
#: transfer engine, read from its engine.so: docs/pd_transport.md) -> its name.
MOONCAKE_TRANSPORT_LINES = (
    (re.compile(r"Using Intra-Node NVLink transport"), "nvlink_intra"),
    (re.compile(r"Failed to install Intra-Node NVLink transport"), "nvlink_intra failed"),
    (re.compile(r"Using TCP transport|MC_FORCE_TCP is set, using TCP transport only"), "tcp"),
    (re.compile(r"Using RDMA transport"), "rdma"),
)
#: vLLM's line naming the protocol string it handed to Mooncake (mooncake_connector.py:1411).
MOONCAKE_PROTOCOL_LINE = re.compile(r"The Mooncake Transfer Engine is using (\S+) as its protocol")


def mooncake_transport_evidence(texts: list[str]) -> dict:
    """What a Mooncake PD deployment's logs say: the protocol strings vLLM passed and the
    transports Mooncake installed (empty where its log lines did not reach the logs)."""
    text = "\n".join(texts)
    return {
        "protocols": sorted(set(MOONCAKE_PROTOCOL_LINE.findall(text))),
        "transports": sorted({name for pat, name in MOONCAKE_TRANSPORT_LINES if pat.search(text)}),
    }


def nixl_kv_config(role: str, engine_id: str | None = None, enforce_compat: bool = True) -> dict:
    """``--kv-transfer-config`` of a NixlConnector engine (``kv_producer`` / ``kv_consumer``);
    ``enforce_compat=False`` lets a decoder accept any peer's compatibility hash."""
    cfg: dict = {"kv_connector": "NixlConnector", "kv_role": role}
    if engine_id:
        cfg["engine_id"] = engine_id
    if not enforce_compat:
        cfg["kv_connector_extra_config"] = {"enforce_handshake_compat": False}
    return cfg


def ucx_env() -> dict[str, str]:
    """UCX for NIXL on one host: ``DSPARK_NIXL_UCX_TLS`` (default ``cuda_ipc,cuda_copy,tcp``:
    same-GPU peers copy device to device over CUDA IPC, control over TCP) and
    ``DSPARK_NIXL_UCX_NET_DEVICES`` (default ``lo``; empty: left unset)."""
    env = {"UCX_TLS": os.environ.get("DSPARK_NIXL_UCX_TLS", "cuda_ipc,cuda_copy,tcp")}
    dev = os.environ.get("DSPARK_NIXL_UCX_NET_DEVICES", "lo")
    if dev:
        env["UCX_NET_DEVICES"] = dev
    return env


def nixl_env() -> dict[str, str]:
    """A NIXL engine's own side-channel port and ``VLLM_PORT`` block, and :func:`ucx_env`."""
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        "VLLM_PORT": str(free_port_block()),
        **ucx_env(),
    }


#: The proxy's bootstrap address for NIXL, which needs none (the prefiller's answer names its
#: side channel).
NIXL_NO_BOOTSTRAP = "nixl:no-bootstrap"
CONNECTORS = ("mooncake", "nixl")


def kv_counters(m: dict[str, float]) -> dict[str, float]:
    """The :data:`KV_METRICS` (0 when absent) and the prompt tokens by source of a parsed
    ``/metrics``."""
    out = {k: m.get(k, 0.0) for k in KV_METRICS}
    out.update({k: v for k, v in m.items() if k.startswith("vllm:prompt_tokens_by_source_total{")})
    return out


def kv_counters_at(url: str, timeout: float = 10.0) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        return kv_counters(parse_prometheus(r.read().decode()))


#: A KV connector's transfer histograms, ``vllm:<connector>_`` + each: one observation per
#: transfer batch (MooncakeConnector: timed on the producer around Mooncake's
#: ``batch_transfer_sync_write``, vLLM's mooncake/stats.py; NixlConnector: on the decoder, which
#: reads, nixl/stats.py).
XFER_HISTOGRAMS = ("xfer_time_seconds", "bytes_transferred", "num_descriptors")


def xfer_counters(m: dict[str, float], connector: str = "mooncake") -> dict[str, float]:
    """The ``_sum`` and ``_count`` of each :data:`XFER_HISTOGRAMS` of ``connector`` in a parsed
    ``/metrics`` (summed over label sets; 0 when absent), keyed without the connector's name."""
    return {
        f"{h}{e}": m.get(f"vllm:{connector}_{h}{e}", 0.0)
        for h in XFER_HISTOGRAMS
        for e in ("_sum", "_count")
    }


def xfer_counters_at(urls: list[str], connector: str, timeout: float = 10.0) -> dict[str, float]:
    """:func:`xfer_counters` summed over the engines at ``urls`` (whichever side records)."""
    out: dict[str, float] = {}
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
            for k, v in xfer_counters(parse_prometheus(r.read().decode()), connector).items():
                out[k] = out.get(k, 0.0) + v
    return out


def split_kv_bytes(total_bytes: int, decoder_share: float, block: int = 1 << 20) -> tuple[int, int]:
    """(producer, decoder) KV-cache bytes of a PD deployment whose two engines together hold
    ``total_bytes`` (what one aggregated engine gets, for a same-memory comparison): the decoder
    ``decoder_share`` of it, rounded down to ``block`` bytes, the producer the rest, so the two
    always add up to ``total_bytes`` exactly."""
    if not 0.0 < decoder_share < 1.0:
        raise ValueError(f"decoder share {decoder_share} must lie strictly between 0 and 1")
    if total_bytes < 2 * block:
        raise ValueError(f"total KV {total_bytes} bytes is below two blocks of {block}")
    dec = max(block, int(total_bytes * decoder_share) // block * block)
    dec = min(dec, total_bytes - block)
    return total_bytes - dec, dec


def producer_env(bootstrap_port: int) -> dict:
    return {
        "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap_port),
        "VLLM_PORT": str(free_port_block()),
    }


def decoder_env() -> dict:
    return {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port()), "VLLM_PORT": str(free_port_block())}


def proxy_argv(
    prefill_url: str,
    decode_url: str,
    bootstrap_url: str,
    engine_id: str,
    port: int,
    timeout_s: float,
) -> list[str]:
    """dspark_dev/pd_proxy.py as its own process (so its threads never share a GIL with the
    benchmark client)."""
    return [
        sys.executable, "-m", "dspark_dev.pd_proxy", "--prefill", prefill_url,
        "--decode", decode_url, "--bootstrap", bootstrap_url, "--engine-id", engine_id,
        "--port", str(port), "--timeout", str(timeout_s),
    ]  # fmt: skip


def wait_engine_id(bootstrap_url: str, deadline: float) -> str:
    """The engine id the producer's bootstrap server lists, polled until ``deadline`` (the
    producer registers while it starts)."""
    from dspark_dev.pd_proxy import query_engine_id

    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            seen = query_engine_id(bootstrap_url)
        except Exception as e:  # noqa: BLE001 - not registered yet
            last = e
            time.sleep(1.0)
            continue
        return seen
    raise TimeoutError(f"bootstrap {bootstrap_url} listed no engine in time (last error: {last})")


def new_engine_id(tag: str = "dspark-pd-prefill") -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


@dataclass
class PDDeployment:
    """Producer launcher(s), decoder and proxy (``dspark_dev.serve.Server`` objects, not
    started). Same interface as ``pp_launch.Deployment``: ``url`` is what clients target (the
    proxy), ``control_url`` where the spec-decode counters and ``/collective_rpc`` go (the
    decoder, the engine that drafts and samples)."""

    name: str
    producers: list[Server]  # node 0 first (API server, bootstrap), then headless PP launchers
    decoder: Server
    proxy: Server
    bootstrap_url: str
    engine_id: str
    started_at: float = field(default_factory=time.monotonic)
    connector: str = "mooncake"  # or "nixl" (:data:`CONNECTORS`)
    protocol: str | None = None  # Mooncake's (:data:`MOONCAKE_PROTOCOLS`); None over NIXL

    @property
    def nodes(self) -> list:
        return [*self.producers, self.decoder, self.proxy]

    @property
    def url(self) -> str:
        return self.proxy.url

    @property
    def control_url(self) -> str:
        return self.decoder.url

    @property
    def producer_url(self) -> str:
        return self.producers[0].url

    def start(self) -> PDDeployment:
        """The engines; the proxy starts once both answer (:meth:`wait_ready`)."""
        self.started_at = time.monotonic()
        for node in (*self.producers, self.decoder):
            node.start()
        return self

    def dead_nodes(self) -> list[str]:
        return [f"{n.name} (exit {n.exited()})" for n in self.nodes if n.exited() is not None]

    def wait_ready(self, timeout_s: float) -> float:
        """Producer and decoder healthy, the producer's engine registered with its bootstrap
        server, then the proxy started and healthy, each through
        :func:`dspark_dev.serve.wait_ready` with every engine launcher watched (one that exits
        fails the wait at once, named with its log tail). Returns the seconds since
        :meth:`start`."""
        deadline = time.monotonic() + timeout_s
        engines = [*self.producers, self.decoder]
        for node in (self.producers[0], self.decoder):
            others = [n for n in engines if n is not node]
            wait_ready(node, max(1.0, deadline - time.monotonic()), watch=others)
        if self.connector == "mooncake":  # NIXL has no bootstrap server
            seen = wait_engine_id(self.bootstrap_url, deadline)
            if seen != self.engine_id:  # the proxy names the one the bootstrap server lists
                self.proxy.argv = [seen if a == self.engine_id else a for a in self.proxy.argv]
                self.engine_id = seen
        self.proxy.start()
        wait_ready(self.proxy, max(5.0, min(30.0, deadline - time.monotonic())), watch=engines)
        check_alive(engines, f"deployment {self.name}")
        return time.monotonic() - self.started_at

    def stop(self, grace_s: float = 10.0) -> list[int]:
        """The proxy first (no new requests reach the engines), then every engine launcher at
        once (each one's grace period runs alongside the others'). Returns pids still alive."""
        import threading

        self.proxy.stop(grace_s=grace_s)
        threads = [
            threading.Thread(target=n.stop, kwargs={"grace_s": grace_s}, daemon=True)
            for n in (*self.producers, self.decoder)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(grace_s + 30.0)
        return [
            pid for n in self.nodes if n.proc is not None for pid in live_group_members(n.proc.pid)
        ]

    def log_markers(self) -> dict[str, bool]:
        text = "\n".join(n.log_tail(10**8) for n in self.producers)
        return {m: m in text for m in PREFILL_MARKERS}


def pd_deployment(
    name: str,
    target: str,
    *,
    spec: dict,
    base_args: list[str],
    producer_kv_bytes: int,
    decoder_kv_bytes: int,
    log_dir: Path,
    env: dict,
    cpu: bool = False,
    proxy_timeout_s: float = 300.0,
    producer_pp: int = 1,
    gpu_layout: str | None = None,
    connector: str = "mooncake",
    protocol: str | None = None,
) -> PDDeployment:
    """A producer (PP=1, or ``producer_pp`` launchers composed by dspark_dev/pp_launch.py, one
    stage each, ``producer_kv_bytes`` split evenly over them) and a PP=1 decoder, all with the
    DSpark speculative config ``spec`` and ``base_args`` (no ``--kv-cache-memory-bytes`` in it:
    each gets its own share), on the devices ``env`` names, plus the proxy. ``connector``:
    MooncakeConnector over :func:`mooncake_protocol` of ``protocol`` (TCP by default; every
    engine gets :func:`mooncake_env`), or NixlConnector (UCX, :func:`ucx_env`; PP=1 producer
    only, no ``protocol``). Nothing starts here."""
    from dspark_dev import pp_launch
    from dspark_dev.serve_demo import serve_argv

    if any(a == "--kv-cache-memory-bytes" for a in base_args):
        raise ValueError("base_args must not set --kv-cache-memory-bytes (each role gets its own)")
    if connector not in CONNECTORS:
        raise ValueError(f"connector {connector!r}: one of {', '.join(CONNECTORS)}")
    if connector == "nixl" and producer_pp != 1:
        raise ValueError("a NIXL PD deployment takes a PP=1 producer (pd_launch composes none)")
    if connector == "nixl" and protocol is not None:
        raise ValueError(f"protocol {protocol!r} is Mooncake's; a NIXL deployment takes none")
    engine_id = new_engine_id()
    bport = free_port()
    log_dir = Path(log_dir)

    def engine(role: str, kv_cfg: dict, kv_bytes: int, role_env: dict) -> Server:
        port = free_port()
        kv = [] if cpu else ["--kv-cache-memory-bytes", str(kv_bytes)]
        extra = [*kv, "--kv-transfer-config", json.dumps(kv_cfg)]
        argv = serve_argv(target, pp=1, spec=spec, port=port, base=base_args, extra=extra)
        cache = {"VLLM_CACHE_ROOT": str(log_dir / f"cache-{name}-{role}")}
        return Server(argv, log_dir / f"{name}_{role}.log", env={**env, **cache, **role_env},
                      port=port, name=f"{name} {role}", cpu=cpu)  # fmt: skip

    if connector == "nixl":
        producer = engine("producer", nixl_kv_config("kv_producer", engine_id),
                          producer_kv_bytes, nixl_env())  # fmt: skip
        dec = engine("decoder", nixl_kv_config("kv_consumer"), decoder_kv_bytes, nixl_env())
        pport = free_port()
        proxy = Server(
            proxy_argv(producer.url, dec.url, NIXL_NO_BOOTSTRAP, engine_id, pport,
                       proxy_timeout_s),
            log_dir / f"{name}_proxy.log", env=dict(env), port=pport, name=f"{name} proxy",
            cpu=cpu,
        )  # fmt: skip
        return PDDeployment(
            name, [producer], dec, proxy, NIXL_NO_BOOTSTRAP, engine_id, connector="nixl"
        )
    protocol = mooncake_protocol(protocol)
    mc_env = mooncake_env(protocol)
    pre_kv = mooncake_kv_config("kv_producer", engine_id, protocol)
    if producer_pp == 1:
        producers = [
            engine("producer", pre_kv, producer_kv_bytes, {**producer_env(bport), **mc_env})
        ]
        dec_env = {**decoder_env(), **mc_env}
    else:
        # every stage is a kv_producer with the same engine id; the decoder pulls from each
        device = "cpu" if cpu else "gpu"
        chosen = pp_launch.layout(gpu_layout) if device == "gpu" else pp_launch.SHARED
        api_port, master = free_port(), free_port()
        stage_bytes = split_stage_bytes(producer_kv_bytes, producer_pp)
        producers = []
        for rank in range(producer_pp):
            kv = [] if cpu else ["--kv-cache-memory-bytes", str(stage_bytes[rank])]
            argv = pp_launch.launcher_argv(
                target, pp=producer_pp, rank=rank, master_port=master,
                api_port=api_port if rank == 0 else None, spec=spec, base_args=base_args,
                extra=[*kv, "--kv-transfer-config", json.dumps(pre_kv)],
            )  # fmt: skip
            node_env = {
                **pp_launch.stage_env(rank, device=device, gpu_layout=chosen, tag=name),
                **env,
                "VLLM_CACHE_ROOT": str(log_dir / f"cache-{name}-producer{rank}"),
                **producer_env(bport),
                **mc_env,
            }
            if device == "gpu":
                node_env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET")
            producers.append(
                Server(argv, log_dir / f"{name}_producer_node{rank}.log", env=node_env,
                       port=api_port if rank == 0 else None, cpu=cpu,
                       name=f"{name} producer node {rank}" + (" (headless)" if rank else ""))
            )  # fmt: skip
        # the decoder after the producer's stages (its own GPU with the per-stage layout)
        dec_env = {
            **decoder_env(),
            **pp_launch.stage_env(producer_pp, device=device, gpu_layout=chosen, tag=name),
            **mc_env,
        }
    dec_kv = mooncake_kv_config("kv_consumer", protocol=protocol)
    dec = engine("decoder", dec_kv, decoder_kv_bytes, dec_env)
    pport = free_port()
    proxy = Server(
        proxy_argv(producers[0].url, dec.url, f"http://127.0.0.1:{bport}", engine_id, pport,
                   proxy_timeout_s),
        log_dir / f"{name}_proxy.log", env=dict(env), port=pport, name=f"{name} proxy", cpu=cpu,
    )  # fmt: skip
    return PDDeployment(
        name, producers, dec, proxy, f"http://127.0.0.1:{bport}", engine_id, protocol=protocol
    )


def split_stage_bytes(total: int, stages: int, block: int = 1 << 20) -> list[int]:
    """A PP producer's KV bytes per stage: equal whole-``block`` shares, the last stage the
    remainder, so they add up to ``total`` exactly."""
    share = total // stages // block * block
    return [share] * (stages - 1) + [total - share * (stages - 1)]


def engine_launchers(
    *,
    tp: int,
    pp: int,
    device: str,
    gpu_layout: str | None = None,
    tag: str = "pd",
    master_port: int | None = None,
    first_index: int = 0,
) -> list[tuple[list[str], dict]]:
    """``(args, env)`` of each launcher of one PD engine (producer or decoder) of ``tp`` x ``pp``
    ranks, launcher R holding global rank R (one rank each, dspark_dev/pp_launch.py), for
    tests/support/pd_run.py: launcher 0 first (it serves the API), then the headless ones.

    ``args`` go after the engine's own (model, common arguments, speculative and KV-transfer
    configs): ``-tp``/``-pp``, ``--nnodes tp*pp --node-rank R``, the master address, vLLM's
    all-reduce flag of :func:`pp_launch.device_args`, ``--headless`` for R > 0. A TP=1 PP=1
    engine is one plain launcher (no args). ``env`` is :func:`pp_launch.stage_env` of index
    ``first_index + R``: a decoder after a producer of W ranks passes ``first_index=W``, so that
    in the ``per-stage`` layout it takes the next GPUs and in the ``shared`` layout every launcher
    of the deployment has its own ``NCCL_HOSTID``."""
    from dspark_dev import pp_launch

    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
    world = tp * pp
    chosen = pp_launch.layout(gpu_layout) if device == "gpu" else pp_launch.SHARED

    def env(index: int) -> dict:
        return pp_launch.stage_env(first_index + index, device=device, gpu_layout=chosen, tag=tag)

    if world == 1:
        return [([], env(0))]
    if master_port is None:
        master_port = free_port()
    out = []
    for rank in range(world):
        args = [*(["-tp", str(tp)] if tp > 1 else []), "-pp", str(pp),
                "--nnodes", str(world), "--node-rank", str(rank),
                "--master-addr", "127.0.0.1", "--master-port", str(master_port),
                *pp_launch.device_args(tp=tp, device=device)]  # fmt: skip
        if rank:
            args.append("--headless")
        out.append((args, env(rank)))
    return out


def shape_label(producer_tp: int, producer_pp: int, decoder_tp: int, decoder_pp: int = 1) -> str:
    """The PD shapes as the ``PD acceptance:`` line names them: ``producer TP2xPP2 -> decoder
    TP2`` (a PP=1 side without its PP)."""

    def side(tp: int, pp: int) -> str:
        return f"TP{tp}xPP{pp}" if pp > 1 else f"TP{tp}"

    return f"producer {side(producer_tp, producer_pp)} -> decoder {side(decoder_tp, decoder_pp)}"
