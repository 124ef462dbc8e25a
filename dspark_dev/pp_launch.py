"""PP (and TP x PP) deployments built from vLLM's own multi-node launchers, one rank per launcher.

``vllm serve TARGET -pp N --nnodes N --node-rank R --master-addr 127.0.0.1 --master-port P``
for R = 0 .. N-1 (every node but 0 ``--headless``): each launcher runs one stage, node 0 also
the API server and the engine core.

TP x PP (``tp`` > 1): ``-tp T -pp N --nnodes T*N``. vLLM's launcher puts ``world_size / nnodes``
ranks on each node, so every launcher holds exactly one rank, and since vLLM orders the global
ranks as ``pp_rank * tp + tp_rank`` (``initialize_model_parallel`` in
vllm/distributed/parallel_state.py) and a node's first rank is ``node_rank * ranks_per_node``,
launcher R holds global rank R: PP stage ``R // T``, TP rank ``R % T``. Node 0 (stage 0, TP rank
0) runs the API server. The CPU end-to-end tier (tests/e2e/test_multi_node.py), the
one-GPU PP tier (tests/gpu/test_pp_one_gpu.py) and the served PP benchmark
(benchmarks/serve_pp_one_gpu.py) start their deployments here, so the launcher composition exists
once (in dspark_dev, because a benchmark shares it).

GPU layouts (knob :data:`LAYOUT_ENV`):

* ``shared`` (default): every rank on GPU 0. NCCL refuses two ranks on one device ("Duplicate
  GPU detected") unless each process reports its own host: each launcher gets its own
  ``NCCL_HOSTID`` (``{tag}-rank{R}``), and NCCL then joins them with its socket transport over
  loopback (``NCCL_SOCKET_IFNAME=lo``). Correct, not fast: the ranks share one GPU's compute and
  the wire is a socket (about 2.6 GB/s measured on the H200), so only ratios mean anything there.
* ``per-stage``: launcher R (global rank R) on GPU R (a machine with at least T*N GPUs), NCCL
  picks its transport.

With ``tp`` > 1 on the GPU every launcher also gets ``--disable-custom-all-reduce``
(:func:`device_args`): vLLM's custom all-reduce of a TP group looks up the P2P access of the
group's ranks by indexing this process's visible devices with the TP rank, and a launcher here
sees one device only, so every rank but TP rank 0 died at start on the H100 without the flag.

Memory: several engines share one GPU, so every stage gets a fixed KV budget
(``--kv-cache-memory-bytes``, which also skips vLLM's memory profile: that profile measures the
device's free memory and would count the other engines' allocations) and a small
``--gpu-memory-utilization`` for vLLM's start-up check (free memory >= that share).

Caches: every launcher gets its own ``VLLM_CACHE_ROOT`` (launchers started together must not race
on one compile cache), seeded with this environment's model-info cache
(:func:`seed_model_infos`), so that no launcher re-inspects the model classes in a fresh process.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dspark_dev.proc import live_group_members
from dspark_dev.serve import Server, check_alive, free_port, wait_ready
from dspark_dev.serve_demo import serve_argv

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
    """The environment of launcher ``rank`` (global rank ``rank``; the PP stage when TP=1).

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
        "NCCL_HOSTID": f"{tag}-rank{rank}",
        "NCCL_SOCKET_IFNAME": "lo",
    }


def device_args(*, tp: int, device: str) -> list[str]:
    """``vllm serve`` flags every launcher of a ``tp`` x PP deployment needs on ``device``:
    ``--disable-custom-all-reduce`` on the GPU when TP > 1 (module docstring: one visible device
    per launcher, in either layout), nothing else."""
    return ["--disable-custom-all-reduce"] if device == "gpu" and tp > 1 else []


def rank_place(rank: int, *, tp: int) -> tuple[int, int]:
    """(PP stage, TP rank) of launcher ``rank``: vLLM's global rank is ``pp_rank * tp + tp_rank``
    and launcher R holds global rank R."""
    return divmod(rank, tp)


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
    tp: int = 1,
    device: str = "cpu",
) -> list[str]:
    """The ``vllm serve`` command of launcher ``rank`` of a ``tp`` x ``pp`` deployment (one rank
    per launcher: ``--nnodes tp*pp``)."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
    world = tp * pp
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside 0..{world - 1}")
    nodes = [
        "--nnodes", str(world), "--node-rank", str(rank),
        "--master-addr", "127.0.0.1", "--master-port", str(master_port),
    ]  # fmt: skip
    return serve_argv(
        target,
        pp=pp,
        tp=tp,
        spec=spec,
        port=api_port if rank == 0 else None,
        base=base_args,
        extra=[*nodes, *device_args(tp=tp, device=device), *extra],
    )


def model_info_cache() -> Path:
    """vLLM's model-info cache of this environment: ``VLLM_CACHE_ROOT/modelinfos``, the root
    resolved as vllm/envs.py does (``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm``)."""
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "vllm"
    )
    return Path(os.path.expanduser(root)) / "modelinfos"


def seed_model_infos(cache_root: Path, source: Path | None = None) -> int:
    """Copy vLLM's model-info cache (``source``, default :func:`model_info_cache`) into a
    launcher's own ``VLLM_CACHE_ROOT``; returns the number of files copied (0 when there is none).

    A launcher with an empty cache root inspects the target's and the draft's architecture each in
    a fresh Python process that imports vLLM (``_LazyRegisteredModel.inspect_model_cls``,
    vllm/model_executor/models/registry.py): four launchers on two CPU cores spent about 40 s of
    their start-up there (2026-12-05). Every entry carries the hash of the model's vLLM module and
    vLLM re-inspects on a mismatch, so a copied entry is only used where it is current; the
    compile caches (what ``own_cache`` keeps apart) are not copied.
    """
    src = Path(source) if source is not None else model_info_cache()
    dst = Path(cache_root) / "modelinfos"
    copied = 0
    try:
        files = sorted(src.glob("*.json"))
    except OSError:
        return 0
    for f in files:
        try:
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst / f.name)
            copied += 1
        except OSError:  # written or removed meanwhile: that launcher inspects it itself
            continue
    return copied


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
        "handshake": bool(HANDSHAKE.search(text)),
    }


HANDSHAKE = re.compile(r"PP handshake: (\d+) ranks agree")


RANK_LINE = re.compile(
    r"rank (\d+) in world size (\d+) is assigned as DP rank \d+, PP rank (\d+), PCP rank \d+, "
    r"TP rank (\d+)"
)


def rank_assignments(texts: list[str]) -> list[list[tuple[int, ...]]]:
    """Per launcher log: vLLM's ``rank R in world size W is assigned as ... PP rank P ... TP rank
    T`` lines (one per worker process, from ``initialize_model_parallel``), as ``(R, W, P, T)``.
    A TP x PP deployment whose ranks all joined shows ``[(R, T*N, R // T, R % T)]`` in log R."""
    return [sorted({tuple(int(x) for x in m) for m in RANK_LINE.findall(t)}) for t in texts]


def handshake_sizes(texts: list[str]) -> list[int]:
    """The rank counts of every ``PP handshake: N ranks agree`` line, in log order (one line per
    PP group today, ``N`` = PP; a handshake over the whole TP x PP world may log ``N`` = TP*PP)."""
    return [int(n) for t in texts for n in HANDSHAKE.findall(t)]


@dataclass
class Deployment:
    """The launchers of one PP deployment; node 0 serves the API."""

    name: str
    nodes: list[Server]
    started_at: float = field(default_factory=time.monotonic)
    tp: int = 1
    pp: int = 0  # 0: len(nodes) (a PP-only deployment)

    @property
    def stages(self) -> int:
        return self.pp or len(self.nodes)

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
        """:func:`dspark_dev.serve.wait_ready` on node 0 with the headless nodes watched (one that
        exits fails the wait at once, named with its log tail). Returns the seconds since
        :meth:`start`."""
        wait_ready(self.head, timeout_s, watch=self.nodes[1:])
        check_alive(self.nodes[1:], f"deployment {self.name}")
        return time.monotonic() - self.started_at

    def logs(self, n: int = 10**7) -> str:
        return "\n".join(f"--- {x.name} ---\n{x.log_tail(n)}" for x in self.nodes)

    def stop(self, grace_s: float = 10.0) -> list[int]:
        """Stop every launcher's process group, all at once (a headless launcher took about 4.5 s
        to exit on SIGTERM on the CPU, so one after the other cost 14 s for four); returns pids
        that still run (none expected)."""
        with ThreadPoolExecutor(max_workers=len(self.nodes) or 1) as pool:
            list(pool.map(lambda node: node.stop(grace_s=grace_s), self.nodes))
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
    tp: int = 1,
    cache_dir: Path | None = None,
) -> Deployment:
    """A ``tp`` x ``pp`` deployment (not started): ``tp * pp`` launchers, launcher R holding global
    rank R (PP stage ``R // tp``, TP rank ``R % tp``). ``env`` goes to every launcher,
    ``env_per_rank[r]`` / ``spec_per_rank[r]`` to launcher ``r`` only (fault cases).
    ``cache_dir``: the launchers' caches go to ``cache_dir/node<R>`` (kept, so that a later start
    of the same deployment loads vLLM's compiled graphs) instead of a fresh folder."""
    if tp < 1 or pp < 1 or tp * pp < 2:
        raise ValueError(
            f"a launcher deployment needs pp >= 2 or tp >= 2 (got tp={tp} pp={pp}; "
            "TP=1 PP=1 is a plain vllm serve)"
        )
    chosen = layout(gpu_layout) if device == "gpu" else SHARED
    api_port, master_port = free_port(), free_port()
    if cache_dir is not None:
        cache = Path(cache_dir)
    else:
        cache = Path(tempfile.mkdtemp(prefix=f"dspark-{name}-cache-")) if own_cache else None
    nodes = []
    for rank in range(tp * pp):
        node_env = {**stage_env(rank, device=device, gpu_layout=chosen, tag=name)}
        if cache is not None:  # compile caches of launchers started together must not race
            node_env["VLLM_CACHE_ROOT"] = str(cache / f"node{rank}")
            seed_model_infos(cache / f"node{rank}")
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
            tp=tp,
            device=device,
        )
        stage, tp_rank = rank_place(rank, tp=tp)
        where = f" (PP stage {stage}, TP rank {tp_rank})" if tp > 1 else ""
        nodes.append(
            Server(
                argv,
                Path(log_dir) / f"{name}_node{rank}.log",
                env=node_env,
                port=api_port if rank == 0 else None,
                name=f"{name} node {rank}{where}" + ("" if rank == 0 else " (headless)"),
                cpu=device == "cpu",
            )
        )
    return Deployment(name, nodes, tp=tp, pp=pp)


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
