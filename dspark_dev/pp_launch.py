"""PP deployments built from vLLM's own multi-node launchers, one PP stage per launcher.

``vllm serve TARGET -pp N --nnodes N --node-rank R --master-addr 127.0.0.1 --master-port P``
for R = 0 .. N-1 (every node but 0 ``--headless``): each launcher runs one stage, node 0 also
the API server and the engine core. The CPU end-to-end tier (tests/e2e/test_multi_node.py), the
one-GPU PP tier (tests/gpu/test_pp_one_gpu.py) and the served PP benchmark
(benchmarks/serve_pp_one_gpu.py) start their deployments here, so the launcher composition exists
once (in dspark_dev, because a benchmark shares it).

GPU layouts (knob :data:`LAYOUT_ENV`):

* ``shared`` (default): every stage on GPU 0. NCCL refuses two ranks on one device ("Duplicate
  GPU detected") unless each process reports its own host: each launcher gets its own
  ``NCCL_HOSTID``, and NCCL then joins them with its socket transport over loopback
  (``NCCL_SOCKET_IFNAME=lo``). Correct, not fast: both stages share one GPU's compute and the
  wire is a socket (about 2.6 GB/s measured on the H200), so only ratios mean anything there.
* ``per-stage``: stage R on GPU R (a machine with at least N GPUs), NCCL picks its transport.

Memory: several engines share one GPU, so every stage gets a fixed KV budget
(``--kv-cache-memory-bytes``, which also skips vLLM's memory profile: that profile measures the
device's free memory and would count the other engines' allocations) and a small
``--gpu-memory-utilization`` for vLLM's start-up check (free memory >= that share).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dspark_dev.serve_demo import Server, free_port, live_group_members, serve_argv

LAYOUT_ENV = "DSPARK_GPU_PP_LAYOUT"
SHARED = "shared"
PER_STAGE = "per-stage"
LAYOUTS = (SHARED, PER_STAGE)


def layout(value: str | None = None) -> str:
    """The GPU layout: ``value``, else :data:`LAYOUT_ENV`, else ``shared``."""
    chosen = (value or os.environ.get(LAYOUT_ENV) or SHARED).strip().lower()
    if chosen not in LAYOUTS:
        raise ValueError(f"{LAYOUT_ENV}={chosen!r}: use one of {', '.join(LAYOUTS)}")
    return chosen


def stage_env(rank: int, *, device: str, gpu_layout: str = SHARED, tag: str = "dspark") -> dict:
    """The environment of the launcher that runs PP stage ``rank``.

    ``device`` "cpu": nothing (the CPU platform needs no device settings). "gpu": the layout's
    device and NCCL settings (module docstring).
    """
    if device == "cpu":
        return {}
    if device != "gpu":
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
    if layout(gpu_layout) == PER_STAGE:
        return {"CUDA_VISIBLE_DEVICES": str(rank)}
    return {
        "CUDA_VISIBLE_DEVICES": "0",
        "NCCL_HOSTID": f"{tag}-stage{rank}",
        "NCCL_SOCKET_IFNAME": "lo",
    }


def launcher_argv(
    target: str,
    *,
    pp: int,
    rank: int,
    master_port: int,
    api_port: int | None,
    spec: dict | None,
    base_args: list[str] | None = None,
    extra: list[str] = (),
) -> list[str]:
    """The ``vllm serve`` command of launcher ``rank`` of a ``pp``-stage deployment."""
    if not 0 <= rank < pp:
        raise ValueError(f"rank {rank} outside 0..{pp - 1}")
    nodes = [
        "--nnodes", str(pp), "--node-rank", str(rank),
        "--master-addr", "127.0.0.1", "--master-port", str(master_port),
    ]  # fmt: skip
    return serve_argv(
        target,
        pp=pp,
        spec=spec,
        port=api_port if rank == 0 else None,
        base=base_args,
        extra=[*nodes, *extra],
    )


NCCL_COMM = re.compile(r"nRanks (\d+) nNodes (\d+)")
EXCHANGE = re.compile(r"DSpark PP exchange: .*? over (\S+)")


def transport_evidence(texts: list[str]) -> dict:
    """What a deployment's launcher logs say about the stage-to-stage transport: NCCL's
    communicators (ranks, nodes; needs ``NCCL_DEBUG=INFO``), whether NCCL used its socket
    transport, the plugin's exchange backend, and whether the PP handshake ran."""
    text = "\n".join(texts)
    return {
        "nccl_comms": sorted({(int(a), int(b)) for a, b in NCCL_COMM.findall(text)}),
        "nccl_socket": "NET/Socket" in text,
        "exchange_backends": sorted(set(EXCHANGE.findall(text))),
        "handshake": bool(re.search(r"PP handshake: \d+ ranks agree", text)),
    }


@dataclass
class Deployment:
    """The launchers of one PP deployment; node 0 serves the API."""

    name: str
    nodes: list[Server]
    started_at: float = field(default_factory=time.monotonic)

    @property
    def head(self) -> Server:
        return self.nodes[0]

    @property
    def url(self) -> str:
        return self.head.url

    def start(self) -> Deployment:
        self.started_at = time.monotonic()
        for node in self.nodes:
            node.start()
        return self

    def dead_nodes(self) -> list[str]:
        return [f"{n.name} (exit {n.exited()})" for n in self.nodes if n.exited() is not None]

    def wait_ready(self, timeout_s: float) -> float:
        """Wait for node 0's ``/health``; a headless node that exits first fails the wait at
        once. Returns the seconds since :meth:`start`."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes[1:]:
            if node.exited() is not None:
                raise RuntimeError(f"{self.name}: {node.name} exited with {node.exited()}")
        self.head.wait_ready(max(1.0, deadline - time.monotonic()))
        dead = self.dead_nodes()
        if dead:
            raise RuntimeError(f"{self.name}: ready but {', '.join(dead)}")
        return time.monotonic() - self.started_at

    def logs(self, n: int = 10**7) -> str:
        return "\n".join(f"--- {x.name} ---\n{x.log_tail(n)}" for x in self.nodes)

    def stop(self, grace_s: float = 10.0) -> list[int]:
        """Stop every launcher's process group; returns pids that still run (none expected)."""
        for node in self.nodes:
            node.stop(grace_s=grace_s)
        procs = [node.proc for node in self.nodes if node.proc is not None]
        return [pid for proc in procs for pid in live_group_members(proc.pid)]

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def deployment(
    name: str,
    target: str,
    *,
    pp: int,
    spec: dict | None,
    log_dir: Path,
    device: str = "cpu",
    gpu_layout: str | None = None,
    base_args: list[str] | None = None,
    extra: list[str] = (),
    env: dict | None = None,
    env_per_rank: dict[int, dict] | None = None,
    spec_per_rank: dict[int, dict] | None = None,
    own_cache: bool = True,
) -> Deployment:
    """A ``pp``-stage deployment (not started). ``env`` goes to every launcher,
    ``env_per_rank[r]`` / ``spec_per_rank[r]`` to launcher ``r`` only (fault cases)."""
    if pp < 2:
        raise ValueError("a launcher deployment needs pp >= 2 (PP=1 is a plain vllm serve)")
    chosen = layout(gpu_layout) if device == "gpu" else SHARED
    api_port, master_port = free_port(), free_port()
    cache = Path(tempfile.mkdtemp(prefix=f"dspark-{name}-cache-")) if own_cache else None
    nodes = []
    for rank in range(pp):
        node_env = {**stage_env(rank, device=device, gpu_layout=chosen, tag=name)}
        if cache is not None:  # compile caches of launchers started together must not race
            node_env["VLLM_CACHE_ROOT"] = str(cache / f"node{rank}")
        node_env.update(env or {})
        node_env.update((env_per_rank or {}).get(rank, {}))
        argv = launcher_argv(
            target,
            pp=pp,
            rank=rank,
            master_port=master_port,
            api_port=api_port if rank == 0 else None,
            spec=(spec_per_rank or {}).get(rank, spec),
            base_args=base_args,
            extra=list(extra),
        )
        nodes.append(
            Server(
                argv,
                Path(log_dir) / f"{name}_node{rank}.log",
                env=node_env,
                port=api_port if rank == 0 else None,
                name=f"{name} node {rank}" + ("" if rank == 0 else " (headless)"),
                cpu=device == "cpu",
            )
        )
    return Deployment(name, nodes)


def serve_waves(
    url: str,
    model: str,
    waves: list[list[list[int]]],
    max_tokens: int,
    *,
    ignore_eos: bool = False,
    timeout_s: float = 120.0,
) -> tuple[list[list[int]], list[dict]]:
    """Greedy ``/v1/completions`` of each wave (one request holding the wave's prompts, so they
    run as one batch), one wave after the other. Returns every prompt's token ids and each
    wave's spec-decode counters (``/metrics`` after minus before)."""
    from dspark_dev.metrics import counter_delta
    from dspark_dev.serve import greedy_completion_body, http_json
    from dspark_dev.serve_demo import spec_metrics

    tokens: list[list[int]] = []
    per_wave: list[dict] = []
    for wave in waves:
        before = spec_metrics(url, settle_s=3.0)
        body = greedy_completion_body(model, wave, max_tokens, ignore_eos)
        body["return_token_ids"] = True
        out = http_json(url + "/v1/completions", body, timeout=timeout_s)
        tokens += [list(c["token_ids"]) for c in sorted(out["choices"], key=lambda c: c["index"])]
        per_wave.append(counter_delta(before, spec_metrics(url, settle_s=3.0)))
    return tokens, per_wave
