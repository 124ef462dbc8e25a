"""Probes that narrow down the Kimi-K3 PP=2 race (docs/k3-pp-race.md), loaded by the k3_probe
``sitecustomize`` into every process of a diagnosis deployment (tests/gpu/test_dsv4_k3_pp.py,
``K3_DIAG``). Each is off unless its variable is set; each changes one thing:

* ``DSPARK_TEST_K3_SYNC=<points>``: a device-wide ``torch.cuda.synchronize()`` at the named points
  (comma-separated, :data:`POINTS`): ``step`` after every ``GPUModelRunner.execute_model`` and
  ``sample_tokens`` (the CPU never starts a step before the GPU finished the previous one),
  ``prep`` on entering the model's forward (all input and metadata preparation done), ``embed``
  after the embedding, ``layers`` after every decoder layer and at the forward's exit, ``recv``
  after every call of the runner's PP handler (``receive``, ``get_prev_sampled_outputs``,
  ``broadcast``, ``broadcast_drafts``). The first sync that raises prints
  ``K3_SYNC_PROBE ... first seen at '<label>' ... last clean sync '<label>'``: the failing
  kernel was launched between the two. ``DSPARK_TEST_K3_SYNC_RANKS=0`` (comma-separated PP ranks;
  default all) limits the syncs to those ranks.
* ``DSPARK_TEST_K3_NO_SIDE_STREAMS=1``: after the Kimi-K3 model is built, every side stream its
  modules hold (MoE down-projection, MLA output gate, KDA projection overlap, vLLM's shared-expert
  stream) is set to ``None``, so each of those pairs runs in order on the current stream.
* ``DSPARK_TEST_K3_UVA_DEPTH=<n>``: vLLM's UVA staging pools (``buffer_utils.UvaBufferPool``,
  reused round robin) get at least ``n`` slots instead of ``max_concurrent_batches``.
* ``DSPARK_TEST_K3_DRAFTS_PROBE=1``: the token ids crossing the PP exchange are read back on
  both sides (a device sync each): on the last rank the drafts handed to ``broadcast_drafts``
  (``K3_DRAFTS_PROBE side=send``), on the other ranks the sampled tokens and drafts that
  ``get_prev_sampled_outputs`` hands to the post-update (``side=recv``). A value outside
  ``[-1, 2**20)`` is reported as ``BAD``: which side first holds non-token data says whether the
  drafts were wrong before the broadcast or became wrong on the receiving rank.
* ``DSPARK_TEST_K3_WIRE_PROBE=1``: the token ids crossing the PP exchange copied to the host in
  stream order, with no device or stream sync on the last rank (the ``drafts`` probe's sync before
  ``broadcast_drafts`` would hide a race on that rank): ``side=send-main`` what the last rank's
  current stream holds when it hands the drafts (and sampled tokens) over, ``side=send-bcast`` what
  its broadcast stream holds right after posting them, ``side=recv-bcast`` what the receiving
  rank's broadcast stream holds right after the receive, ``side=recv-main`` what its main stream
  hands to the post-update (that side waits for its copy: PP rank 0's syncs were shown harmless by
  ``locate``). Each line also says whether the current stream is the handler's ``main_stream``.
  The copies keep their source tensors alive until done, as ``record_stream`` would.
* ``DSPARK_TEST_K3_NO_PDL=1``: the CUDA platform reports no Programmatic Dependent Launch, so the
  Triton kernels that ask ``current_platform.is_arch_support_pdl()`` (KDA's short convolution,
  recurrent kernels and metadata staging, the Mamba state gathers) launch in plain stream order.
  A kernel launched with PDL may start before its predecessor finished and must wait
  (``gdc_wait``) before reading its inputs; ``CUDA_LAUNCH_BLOCKING=1`` removes that overlap too.

Every probe prints what it installed (``K3_SYNC_PROBE installed ...``) so a log shows it acted.
Eager engines only: the sync points are Python wrappers a compiled graph does not call.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping

SYNC_ENV = "DSPARK_TEST_K3_SYNC"
RANKS_ENV = "DSPARK_TEST_K3_SYNC_RANKS"
NO_STREAMS_ENV = "DSPARK_TEST_K3_NO_SIDE_STREAMS"
UVA_DEPTH_ENV = "DSPARK_TEST_K3_UVA_DEPTH"
NO_PDL_ENV = "DSPARK_TEST_K3_NO_PDL"
DRAFTS_ENV = "DSPARK_TEST_K3_DRAFTS_PROBE"
WIRE_ENV = "DSPARK_TEST_K3_WIRE_PROBE"
#: a token id outside [-1, this) is not a token id (the tiny targets' vocabularies are < 1024)
TOKEN_ID_BOUND = 1 << 20
POINTS = ("step", "prep", "embed", "layers", "recv")
#: module attributes holding a side stream in vLLM 0.34.0's Kimi-K3 path (docs/k3-pp-race.md)
STREAM_ATTRS = ("_down_proj_stream", "aux_stream", "_projection_aux_stream", "_stream")
RUNNER = "vllm.v1.worker.gpu.model_runner"
MODEL = "vllm.models.kimi_k3.nvidia.model"
BUFFERS = "vllm.v1.worker.gpu.buffer_utils"
CUDA_PLATFORM = "vllm.platforms.cuda"
PP_HANDLER_METHODS = ("receive", "get_prev_sampled_outputs", "broadcast", "broadcast_drafts")


def emit(line: str) -> None:
    print(f"K3_SYNC_PROBE pid={os.getpid()} {line}", file=sys.stderr, flush=True)


def parse_points(value: str) -> frozenset[str]:
    points = frozenset(p.strip() for p in value.split(",") if p.strip())
    unknown = sorted(points - set(POINTS))
    if unknown:
        raise ValueError(f"{SYNC_ENV}: unknown points {unknown}; known: {', '.join(POINTS)}")
    return points


def parse_ranks(value: str) -> frozenset[int] | None:
    value = value.strip()
    if not value or value == "all":
        return None
    return frozenset(int(r) for r in value.split(",") if r.strip())


def _pp_rank() -> int:
    from vllm.distributed.parallel_state import get_pp_group

    return get_pp_group().rank_in_group


def _cuda_sync() -> None:
    import torch

    torch.cuda.synchronize()


class SyncPoints:
    """Synchronises at each hit (on the selected ranks) and names the first one that fails."""

    def __init__(
        self,
        points: frozenset[str],
        ranks: frozenset[int] | None,
        *,
        sync: Callable[[], None] = _cuda_sync,
        rank_of: Callable[[], int] = _pp_rank,
        out: Callable[[str], None] = emit,
    ) -> None:
        self.points, self.ranks = points, ranks
        self._sync, self._rank_of, self._out = sync, rank_of, out
        self.count = 0
        self.last_clean = "(none yet)"

    def active(self, point: str) -> bool:
        return point in self.points

    def hit(self, label: str) -> None:
        if self.ranks is not None and self._rank_of() not in self.ranks:
            return
        self.count += 1
        try:
            self._sync()
        except Exception as e:
            self._out(
                f"CUDA error first seen at '{label}' (sync #{self.count}); "
                f"last clean sync '{self.last_clean}': {type(e).__name__}: {e}"
            )
            raise
        self.last_clean = label


def _after(cls: type, name: str, label: Callable[[object], str], sp: SyncPoints) -> None:
    real = cls.__dict__.get(name) or getattr(cls, name)

    @functools.wraps(real, updated=())
    def wrapper(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        sp.hit(label(self))
        return out

    setattr(cls, name, wrapper)


def _before(cls: type, name: str, label: str, sp: SyncPoints) -> None:
    real = cls.__dict__.get(name) or getattr(cls, name)

    @functools.wraps(real, updated=())
    def wrapper(self, *args, **kwargs):
        sp.hit(label)
        return real(self, *args, **kwargs)

    setattr(cls, name, wrapper)


def patch_runner(module, sp: SyncPoints) -> list[str]:
    """``step`` and ``recv`` points on the model runner module (its ``GPUModelRunner`` and the
    ``PPHandler`` class it binds, the plugin's subclass when the plugin is loaded)."""
    done = []
    if sp.active("step"):
        for name in ("execute_model", "sample_tokens"):
            _after(module.GPUModelRunner, name, lambda _s, n=name: f"after {n}", sp)
            done.append(f"GPUModelRunner.{name}")
    if sp.active("recv"):
        handler = module.PPHandler
        for name in PP_HANDLER_METHODS:
            if hasattr(handler, name):
                _after(handler, name, lambda _s, n=name: f"after PPHandler.{n}", sp)
                done.append(f"{handler.__name__}.{name}")
    return done


def patch_model(module, sp: SyncPoints) -> list[str]:
    """``prep``, ``embed`` and ``layers`` points on the Kimi-K3 model module."""
    done = []
    if sp.active("prep"):
        _before(module.KimiLinearForCausalLM, "forward", "forward entry", sp)
        done.append("KimiLinearForCausalLM.forward (entry)")
    if sp.active("embed"):
        _after(module.KimiLinearModel, "embed_input_ids", lambda _s: "after embedding", sp)
        done.append("KimiLinearModel.embed_input_ids")
    if sp.active("layers"):
        _after(
            module.KimiDecoderLayer,
            "forward",
            lambda s: f"after layer {getattr(s, 'layer_idx', '?')}",
            sp,
        )
        _after(module.KimiLinearModel, "forward", lambda _s: "forward exit", sp)
        done += ["KimiDecoderLayer.forward", "KimiLinearModel.forward (exit)"]
    return done


def null_side_streams(model, is_stream: Callable[[object], bool]) -> list[str]:
    """Set every side stream a module of ``model`` holds to ``None``; returns what it changed."""
    changed = []
    for name, mod in model.named_modules():
        for attr in STREAM_ATTRS:
            if is_stream(mod.__dict__.get(attr)):
                setattr(mod, attr, None)
                changed.append(f"{name or '<model>'}.{attr}")
    return changed


def patch_side_streams(module, is_stream: Callable[[object], bool] | None = None) -> None:
    if is_stream is None:
        import torch

        def is_stream(x):
            return isinstance(x, torch.cuda.Stream)

    cls = module.KimiLinearForCausalLM
    real_init = cls.__init__

    @functools.wraps(real_init, updated=())
    def __init__(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        changed = null_side_streams(self, is_stream)
        emit(f"installed no-side-streams: {len(changed)} set to None: {', '.join(changed)}")

    cls.__init__ = __init__


def patch_uva_depth(module, depth: int) -> None:
    real = module.set_default_max_concurrency

    @functools.wraps(real, updated=())
    def set_default_max_concurrency(n: int) -> None:
        emit(f"installed UVA pool depth {max(n, depth)} (vLLM asked {n})")
        real(max(n, depth))

    module.set_default_max_concurrency = set_default_max_concurrency


def patch_no_pdl(module) -> None:
    """``CudaPlatformBase.is_arch_support_pdl`` answers False (it is a cached classmethod in
    vLLM 0.34.0; replacing it before any kernel asks leaves no cached True behind)."""

    def is_arch_support_pdl(cls) -> bool:
        return False

    module.CudaPlatformBase.is_arch_support_pdl = classmethod(is_arch_support_pdl)
    emit("installed no-PDL: CudaPlatformBase.is_arch_support_pdl -> False")


def token_report(side: str, name: str, values) -> tuple[bool, str]:
    """(bad, line) for one tensor of token ids read back to the host."""
    flat = [int(v) for v in values.reshape(-1).tolist()]
    bad = [v for v in flat if not -1 <= v < TOKEN_ID_BOUND]
    lo, hi = (min(flat), max(flat)) if flat else (0, 0)
    head = "BAD " if bad else ""
    line = f"{head}side={side} {name} n={len(flat)} min={lo} max={hi}"
    if bad:
        line += f" first bad {bad[:8]} of {flat[:40]}"
    return bool(bad), line


def patch_exchange_reads(module, out: Callable[[str], None] = emit, sync=_cuda_sync) -> list[str]:
    """Wrap the runner module's PP handler: drafts read back before ``broadcast_drafts`` (last
    rank), sampled tokens and drafts after ``get_prev_sampled_outputs`` (other ranks)."""
    handler = module.PPHandler
    calls = {"send": 0, "recv": 0}

    def report(side: str, tensors: dict) -> None:
        calls[side] += 1
        sync()
        for name, t in tensors.items():
            if t is None:
                continue
            bad, line = token_report(side, name, t.detach().to("cpu"))
            if bad or calls[side] <= 12:
                out(f"call={calls[side]} {line}")

    real_send = handler.broadcast_drafts

    @functools.wraps(real_send, updated=())
    def broadcast_drafts(self, draft_tokens, *args, **kwargs):
        report("send", {"drafts": draft_tokens})
        return real_send(self, draft_tokens, *args, **kwargs)

    real_recv = handler.get_prev_sampled_outputs

    @functools.wraps(real_recv, updated=())
    def get_prev_sampled_outputs(self, *args, **kwargs):
        got = real_recv(self, *args, **kwargs)
        if got:
            report("recv", {k: got.get(k) for k in ("sampled_tokens", "draft_tokens")})
        return got

    handler.broadcast_drafts = broadcast_drafts
    handler.get_prev_sampled_outputs = get_prev_sampled_outputs
    return [f"{handler.__name__}.broadcast_drafts", f"{handler.__name__}.get_prev_sampled_outputs"]


def _cuda_copy_to_host(tensor, stream):
    """A pinned host copy of ``tensor`` enqueued on ``stream``, and a zero-argument ``done``
    (non-blocking) plus ``wait`` pair for it."""
    import torch

    host = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return host, event.query, event.synchronize


def _current_stream(device):
    import torch

    return torch.cuda.current_stream(device)


class WireSnapshots:
    """Host copies of exchanged token ids, reported once each copy finished (see ``WIRE_ENV``)."""

    def __init__(
        self,
        out: Callable[[str], None] = emit,
        copy: Callable = _cuda_copy_to_host,
        keep: int = 12,
    ) -> None:
        self._out, self._copy, self._keep = out, copy, keep
        self.pending: list[tuple] = []
        self.calls: dict[str, int] = {}

    def snap(self, side: str, name: str, tensor, stream, tag: str = "") -> None:
        if tensor is None:
            return
        key = f"{side} {name}"
        call = self.calls[key] = self.calls.get(key, 0) + 1
        host, done, wait = self._copy(tensor, stream)
        # the source stays referenced until its copy is read (it cannot be reused meanwhile)
        self.pending.append((side, name, call, tag, tensor, host, done, wait))

    def poll(self, wait: bool = False) -> None:
        keep = []
        for entry in self.pending:
            side, name, call, tag, _src, host, done, waiter = entry
            if wait:
                waiter()
            elif not done():
                keep.append(entry)
                continue
            bad, line = token_report(side, name, host)
            if bad or call <= self._keep:
                self._out(f"call={call} {line} {tag}".rstrip())
        self.pending = keep


def patch_exchange_wire(
    module,
    snaps: WireSnapshots | None = None,
    current_stream: Callable = _current_stream,
) -> list[str]:
    """Wrap the runner module's PP handler with :class:`WireSnapshots` (see ``WIRE_ENV``)."""
    snaps = snaps or WireSnapshots()
    handler = module.PPHandler

    def stream_tag(self) -> tuple[object, str]:
        cur = current_stream(self.device)
        return cur, "stream=main" if cur == self.main_stream else "stream=OTHER"

    def sender(real, name: str, after: bool):
        """The last rank's call: what its current stream holds going in (and, for the drafts,
        what its broadcast stream holds once they are posted)."""

        @functools.wraps(real, updated=())
        def wrapper(self, tokens, *args, **kwargs):
            snaps.poll()
            cur, tag = stream_tag(self)
            snaps.snap("send-main", name, tokens, cur, tag)
            out = real(self, tokens, *args, **kwargs)
            if after:
                snaps.snap("send-bcast", name, tokens, self.broadcast_stream, tag)
            return out

        return wrapper

    broadcast = sender(handler.broadcast, "sampled", after=False)
    broadcast_drafts = sender(handler.broadcast_drafts, "drafts", after=True)

    real_recv = handler.receive

    @functools.wraps(real_recv, updated=())
    def receive(self, *args, **kwargs):
        before = self.queue[-1] if self.queue else None
        out = real_recv(self, *args, **kwargs)
        slot = self.queue[-1] if self.queue else None
        if slot is not None and slot is not before:
            _cur, tag = stream_tag(self)
            snaps.snap("recv-bcast", "sampled", slot.sampled_tokens, self.broadcast_stream, tag)
            snaps.snap("recv-bcast", "drafts", slot.draft_tokens, self.broadcast_stream, tag)
        return out

    real_prev = handler.get_prev_sampled_outputs

    @functools.wraps(real_prev, updated=())
    def get_prev_sampled_outputs(self, *args, **kwargs):
        got = real_prev(self, *args, **kwargs)
        if got:
            cur, tag = stream_tag(self)
            snaps.snap("recv-main", "sampled", got.get("sampled_tokens"), cur, tag)
            snaps.snap("recv-main", "drafts", got.get("draft_tokens"), cur, tag)
        snaps.poll(wait=True)
        return got

    handler.broadcast = broadcast
    handler.broadcast_drafts = broadcast_drafts
    handler.receive = receive
    handler.get_prev_sampled_outputs = get_prev_sampled_outputs
    import atexit

    def flush() -> None:
        try:
            snaps.poll(wait=True)
        except Exception as e:  # a failed CUDA context: the copies cannot finish
            emit(f"wire copies not read at exit: {type(e).__name__}: {e}")

    atexit.register(flush)
    return [f"{handler.__name__}.{n}" for n in PP_HANDLER_METHODS]


def install(
    env: Mapping[str, str] = os.environ,
    when_imported: Callable | None = None,
) -> list[str]:
    """Register the probes ``env`` asks for; returns their names (nothing when none is set)."""
    points = parse_points(env.get(SYNC_ENV, ""))
    depth = env.get(UVA_DEPTH_ENV, "").strip()
    no_pdl = env.get(NO_PDL_ENV) == "1"
    drafts = env.get(DRAFTS_ENV) == "1"
    wire = env.get(WIRE_ENV) == "1"
    if not (points or depth or no_pdl or drafts or wire or env.get(NO_STREAMS_ENV) == "1"):
        return []
    if when_imported is None:
        from vllm_dspark_pp.patches import when_imported
    assert when_imported is not None
    installed: list[str] = []
    if points:
        sp = SyncPoints(points, parse_ranks(env.get(RANKS_ENV, "")))
        where = f"points={','.join(sorted(points))} ranks={env.get(RANKS_ENV) or 'all'}"

        def on_runner(module):
            if sp.active("step") or sp.active("recv"):
                emit(f"installed sync {where}: {', '.join(patch_runner(module, sp))}")

        def on_model(module):
            if points & {"prep", "embed", "layers"}:
                emit(f"installed sync {where}: {', '.join(patch_model(module, sp))}")

        when_imported(RUNNER, on_runner)
        when_imported(MODEL, on_model)
        installed.append(f"sync:{','.join(sorted(points))}")
    if env.get(NO_STREAMS_ENV) == "1":
        when_imported(MODEL, patch_side_streams)
        installed.append("no-side-streams")
    if depth:
        when_imported(BUFFERS, lambda m: patch_uva_depth(m, int(depth)))
        installed.append(f"uva-depth:{int(depth)}")
    if no_pdl:
        when_imported(CUDA_PLATFORM, patch_no_pdl)
        installed.append("no-pdl")
    if drafts:

        def on_runner_drafts(module):
            emit(f"installed exchange reads: {', '.join(patch_exchange_reads(module))}")

        when_imported(RUNNER, on_runner_drafts)
        installed.append("exchange-reads")
    if wire:

        def on_runner_wire(module):
            emit(f"installed exchange wire copies: {', '.join(patch_exchange_wire(module))}")

        when_imported(RUNNER, on_runner_wire)
        installed.append("exchange-wire")
    return installed
