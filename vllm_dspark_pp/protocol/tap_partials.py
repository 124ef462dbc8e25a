"""Aux-tap partial sums: one row per PP stage boundary instead of one per tap.

A DSpark drafter reads the target's aux taps (the hidden states after some target layers) only
through the first op of ``combine_hidden_states``: a bias-free linear ``W`` of their
concatenation (``families.DraftFamily.context_linear``), so

    W @ concat(t_1 .. t_n) = sum_s W_s @ concat(taps made on stage s)

with ``W_s`` the column blocks of the taps stage ``s`` makes. Under PP vLLM relays every tap of
an earlier stage to the last one, each in its own ``IntermediateTensors`` row
(``aux_hidden_states_<slot>``). Here instead every stage that has taps before it, or of its own,
sends one row, :data:`PARTIAL_KEY`: what it received plus ``W_s @`` its own taps. The last stage
hands the drafter ``[partial] + its own taps``; the drafter's linear is swapped for
:class:`PartialSumLinear`, ``partial + W_last @ own``, and whatever follows it (the norm) is
unchanged. The target's own tensors (``hidden_states``, ``residual``) are untouched, so target
output stays the same bit for bit; the drafter's input changes only by summation order (and, in
bf16, by one rounding of the partial per boundary).

Which columns a stage owns: tap slots are the sorted aux layer ids (vLLM's
``EagleModelMixin``); stage ``r`` (layers ``[start, end)``) makes the slots of aux ids in
``(start, end]`` (``[0, end]`` on the first stage: id 0 is the embedding output), i.e. slots
``bisect_right(aux, start) .. bisect_right(aux, end)`` (:func:`stage_slots`).

Every rank decides the mode from the same facts (the config, the knob, the draft checkpoint's
header), so all stages agree without a message; the start-up handshake compares the knob. A
stage before the last reads its column block of ``W`` from the draft checkpoint
(:func:`load_column_block`); so does the last stage for its own block, after checking that
the loaded drafter holds the checkpoint's ``W`` (not checked under ``--load-format dummy``,
whose weights are random by design: there the checkpoint's ``W`` stands in for the dummy one).
Modes (``VLLM_DSPARK_PP_TAP_PARTIALS``): ``auto`` where some boundary would carry two or more
tap rows, ``1`` wherever a tap is relayed, ``0`` never (the default until the mode has run on a
GPU: CUDA graphs, bf16 and TP > 1 inside a stage are untested), ``side`` as ``1`` but off the
critical path (below).

The side channel (``side``). With ``auto``/``1`` the partial still rides in the
``IntermediateTensors`` the next stage's forward waits for (vLLM's worker waits on every received
key before it copies them into its static buffers), though only the last stage's drafter reads
it. With ``side`` the dict carries the target's own tensors only; every stage ``s`` that makes
taps sends ``W_s @ its taps`` (``n`` rows: the step's real token count, which every stage
computes alike from the same scheduler output) straight to the last PP rank on a process group
of its own (:class:`TapSideChannel`: a sibling of the PP group, on a side stream on CUDA, gloo on
CPU). The last stage posts one receive per sender when its ``prepare_inputs`` has built the
step's batch (before its forward) and waits for them right before the drafter reads the taps
(``propose``), where it sums them in stage order (the order the relay adds them in) and hands
the drafter ``[partial] + its own taps``. Sends happen exactly when vLLM's worker sends the
dict (a non-dummy ``execute_model`` returning ``IntermediateTensors``), receives exactly when
the last stage runs a non-dummy forward: both are decided by the same scheduler output on every
stage, so the per-pair FIFO order matches with any number of micro-batches in flight. Each
pending receive is tagged with its step's batch; a drafter that finds the head of the queue
belongs to another step (a forward whose drafter never ran) drains it, and a drafter with no
receive posted for its step raises instead of waiting. Dummy, profile and warm-up-by-dummy runs
send and receive nothing (the drafter reads a zero partial there). Falls back to ``1`` (logged,
decided alike on every rank) where the last stage makes no tap of its own (its forward would
return no aux list) or prefill context parallelism is on (the last stage's batch is rebuilt).
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: The ``IntermediateTensors`` key of the running partial sum.
PARTIAL_KEY = "dspark_tap_partial"
#: vLLM's key prefix of a relayed tap (``EagleModelMixin.AUX_HIDDEN_STATE_KEY``).
TAP_KEY = "aux_hidden_states_"
#: Where a rank's plan hangs on the target's inner decoder (read by the patches).
PLAN_ATTR = "_dspark_tap_plan"
#: ... and where its checkpoint tensor is (``(folder, LinearInCheckpoint)``).
SOURCE_ATTR = "_dspark_tap_source"
#: ... and its side channel (``VLLM_DSPARK_PP_TAP_PARTIALS=side``), read by the drafter patch.
SIDE_ATTR = "_dspark_tap_side"
#: The side channel's process group description.
SIDE_GROUP_DESC = "dspark_tap_side"
_FLOAT_DTYPES = ("F32", "F16", "BF16")


class TapPartialsError(RuntimeError):
    """The partial-sum mode was chosen on every rank but this rank cannot honour it."""


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.dspark_pp.tap_partials")


def stage_slots(aux_layers: Sequence[int], start: int, end: int, first: bool) -> tuple[int, int]:
    """``(base, count)``: the first tap slot stage ``[start, end)`` makes and how many."""
    aux = sorted(set(aux_layers))
    base = 0 if first else bisect.bisect_right(aux, start)
    return base, bisect.bisect_right(aux, end) - base


def upstream_counts(aux_layers: Sequence[int], stage_starts: Sequence[int]) -> list[int]:
    """Taps made before each boundary: entry ``r`` is what boundary ``r -> r+1`` relays raw
    (one row each); ``stage_starts`` are the first layers of stages 0..pp-1."""
    aux = sorted(set(aux_layers))
    return [bisect.bisect_right(aux, s) for s in stage_starts[1:]]


def choose_mode(knob: str, upstream: Sequence[int]) -> tuple[bool, str]:
    """Whether to relay partial sums (``side``: as ``1``, on the side channel), and why (for the
    start-up line)."""
    if knob == "0":
        return False, "VLLM_DSPARK_PP_TAP_PARTIALS=0"
    if not any(upstream):
        return False, "every aux tap is made on the last stage: nothing is relayed"
    if knob == "auto" and max(upstream) < 2:
        return False, (
            "no stage boundary relays more than one tap, so a partial sum saves no bytes "
            "(VLLM_DSPARK_PP_TAP_PARTIALS=1 forces it)"
        )
    return True, f"VLLM_DSPARK_PP_TAP_PARTIALS={knob}"


def boundary_rows(upstream: Sequence[int], partials: bool) -> list[int]:
    """Aux rows each boundary carries besides the target's own tensors."""
    return [min(n, 1) if partials else n for n in upstream]


@dataclass(frozen=True)
class TapPlan:
    """One rank's share of the partial-sum mode."""

    num_taps: int
    tap_width: int  # columns of W per tap (the target's hidden size)
    partial_width: int  # rows of W (the drafter's hidden size): the partial's width
    base: int  # first tap slot this stage makes (= taps made on earlier stages)
    count: int  # taps this stage makes
    is_first: bool
    is_last: bool
    upstream: tuple[int, ...]  # taps made before each boundary (raw rows per boundary)
    side: bool = False  # partials go straight to the last stage on the side channel
    senders: tuple[int, ...] = ()  # side: the PP stages (rank in group) that make taps, not last

    @property
    def receives(self) -> bool:
        """Receives a partial in the ``IntermediateTensors`` (never with the side channel)."""
        return not self.side and not self.is_first and self.base > 0

    @property
    def sends(self) -> bool:
        """Sends a partial in the ``IntermediateTensors`` (never with the side channel)."""
        return not self.side and not self.is_last and self.base + self.count > 0

    @property
    def side_sends(self) -> bool:
        """Sends its own ``W_s @ taps`` to the last stage on the side channel."""
        return self.side and not self.is_last and self.count > 0

    def columns(self) -> tuple[int, int]:
        """This stage's column range of ``W``."""
        return self.base * self.tap_width, (self.base + self.count) * self.tap_width


def column_block(weight: torch.Tensor, base: int, count: int, width: int) -> torch.Tensor:
    """The columns of ``weight`` (``[out, n * width]``) that multiply taps ``base..base+count``."""
    return weight[:, base * width : (base + count) * width]


def partial_sum(
    own_taps: Sequence[torch.Tensor], block: torch.Tensor | None, incoming: torch.Tensor | None
) -> torch.Tensor:
    """``incoming + block @ concat(own_taps)`` (either term may be absent, not both)."""
    out = None
    if own_taps:
        assert block is not None
        x = own_taps[0] if len(own_taps) == 1 else torch.cat(list(own_taps), dim=-1)
        out = F.linear(x.to(block.dtype), block)
    if incoming is None:
        assert out is not None, "a stage with no taps before it and none of its own sends none"
        return out
    return incoming if out is None else incoming.to(out.dtype) + out


class PartialSumLinear(nn.Module):
    """The last stage's stand-in for the drafter's first linear: its input is
    ``concat(partial, own taps)`` and it returns ``partial + W_last @ own``."""

    def __init__(self, block: torch.Tensor, partial_width: int) -> None:
        super().__init__()
        self.partial_width = partial_width
        self.weight = nn.Parameter(block.detach().clone(), requires_grad=False)
        self.params_dtype = block.dtype
        self.input_size = partial_width + block.shape[1]
        self.output_size = block.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = x[..., : self.partial_width].to(self.params_dtype)
        if self.weight.shape[1] == 0:
            return partial
        return partial + F.linear(x[..., self.partial_width :].to(self.params_dtype), self.weight)

    def extra_repr(self) -> str:
        return f"partial_width={self.partial_width}, own_columns={self.weight.shape[1]}"


# ---------------------------------------------------------------- the side channel


@dataclass
class PendingStep:
    """The last stage's receives of one step: one buffer per sender, in stage order."""

    batch: Any  # the step's input batch (what the drafter is called with)
    rows: int
    buffers: list[torch.Tensor] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)


class TapSideChannel:
    """One rank's end of the side channel (``VLLM_DSPARK_PP_TAP_PARTIALS=side``).

    A stage that makes taps (not the last) keeps its own taps at the relay
    (:meth:`stage_taps`) and, once vLLM's worker is about to send the step's dict, sends
    ``block @ concat(taps[:rows])`` to the last PP rank (:meth:`send`). The last stage posts
    one receive per sender when it has built the step's batch (:meth:`post`) and waits for them
    only when its drafter reads the taps (:meth:`take`), summing them in stage order. On CUDA
    sends and receives are posted on a side stream (which first waits for the main stream: the
    sender's sum is queued there; the receive buffers come from the allocator on the side
    stream and are recorded for the main one), and the drafter's wait is a dependency of the
    main stream on the receive, not a host wait. On CPU (gloo) the host waits, at most
    ``VLLM_DSPARK_PP_TAP_SIDE_TIMEOUT_S`` seconds.
    """

    def __init__(
        self,
        plan: TapPlan,
        group: Any,
        ranks: Sequence[int],
        device: Any,
        dtype: torch.dtype,
        *,
        block: torch.Tensor | None = None,
        main_stream: Any = None,
        timeout_s: float | None = None,
    ) -> None:
        self.plan = plan
        self.group = group
        self.ranks = tuple(int(r) for r in ranks)  # the PP group's global ranks, by stage
        if len(self.ranks) != len(plan.upstream) + 1:
            raise TapPartialsError(
                f"the side channel's PP group has {len(self.ranks)} ranks but the plan "
                f"{len(plan.upstream) + 1} stages"
            )
        self.dst = self.ranks[-1]
        self.sources = tuple(self.ranks[s] for s in plan.senders)
        self.device = torch.device(device)
        self.dtype = dtype
        self.block = block
        self.timeout_s = timeout_s
        self.on_cuda = self.device.type == "cuda"
        self.main_stream = main_stream
        self.stream = None
        if self.on_cuda:
            if self.main_stream is None:
                self.main_stream = torch.cuda.current_stream(self.device)
            self.stream = torch.cuda.Stream(self.device)
        # steps in flight at most: the PP batch queue holds pp_size; twice that and some is
        # room, a longer queue means sends or drafter calls are lost (drained with a warning)
        self.limit = 2 * len(self.ranks) + 2
        self._own: list[torch.Tensor] | None = None
        self._sends: deque[tuple[Any, torch.Tensor]] = deque()
        self._recvs: deque[PendingStep] = deque()
        self.stats = {
            "sent_steps": 0,
            "sent_bytes": 0,
            "recv_steps": 0,
            "recv_bytes": 0,
            "host_wait_s": 0.0,
            "stale_steps": 0,
        }
        self._logged: set[str] = set()
        self.connected = False  # connect() made every sender-last link (start-up)

    # -- both ends
    def connect(self) -> None:
        """Start-up (every rank of the PP group at the same point of ``load_model``): one small
        message from every sender to the last stage, received in stage order, so that each
        sender-last pair's link exists before the first step.

        Why: the side group is a ``torch.distributed`` NCCL group, which makes a pair's
        communicator at the pair's first send or receive and blocks both hosts until both have
        joined. In a step a sender sends its partial before vLLM's worker sends the step's dict,
        and the last stage posts its receives only after the dict of the stage before it came
        (its worker waits for the dict's metadata first): a first contact inside a step waits
        for a receive that waits for it (seen on an H200, 2026-12-06: PP=3 never became ready,
        stage 0 inside the pair's ``ncclCommInitRankConfig``). Here every sender's partner is
        already waiting for it, or comes to it after the senders before it, so nothing waits on
        itself; a peer that died meanwhile ends the run through the peer watch (which runs from
        the handshake on), and the transfer itself is waited for at most the side channel's
        timeout.

        On CUDA the pair's communicator is made inside ``isend``/``irecv``, which block the
        host with no timeout; so the links are made on a helper thread and this one waits for
        it at most as long as the PP handshake waits (every stage comes to both with its own
        load-time skew), then fails naming the peers (a peer that is alive but never comes would
        otherwise hold start-up forever)."""
        if self.connected:
            return
        if not self.on_cuda or not (self.plan.side_sends or self.plan.is_last):
            # gloo: the group's pairs exist already, the waits are bounded; a stage without
            # taps of its own has no link to make
            self._connect()
            return
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        box: dict[str, BaseException] = {}

        def run() -> None:
            try:
                torch.cuda.set_device(index)  # per thread: the launcher's device
                self._connect()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = e

        helper = threading.Thread(target=run, name="dspark-tap-side-connect", daemon=True)
        helper.start()
        timeout = self._connect_timeout()
        helper.join(timeout)
        if helper.is_alive():
            peers = (
                f"PP rank {self.dst}"
                if self.plan.side_sends
                else "PP ranks " + ", ".join(str(s) for s in self.sources)
            )
            raise TapPartialsError(
                f"PP stage {_rank()}: the DSpark tap side channel's start-up link with {peers} "
                f"did not come within {timeout:g} s (the pair's NCCL communicator is made at its "
                "first message and both ends must join; a peer that stopped or never loaded its "
                "model leaves it waiting). Check the other launchers' logs; raise "
                "VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S for a slow start, or set "
                "VLLM_DSPARK_PP_TAP_PARTIALS=1 on every node to send the partials in the "
                "intermediate tensors instead"
            )
        if "error" in box:
            raise box["error"]

    def _connect(self) -> None:
        """:meth:`connect`'s messages, on the calling thread."""
        if self.plan.side_sends:
            probe = torch.ones(1, dtype=torch.int32, device=self.device)
            work = torch.distributed.isend(probe, dst=self.dst, group=self.group)
            self._wait(work, f"PP rank {self.dst} to take its first side-channel message", True)
            link = f"to PP rank {self.dst}"
        elif self.plan.is_last:
            for src in self.sources:  # stage order: the senders' first contacts come in turn
                buf = torch.zeros(1, dtype=torch.int32, device=self.device)
                work = torch.distributed.irecv(buf, src=src, group=self.group)
                self._wait(work, f"the side channel's first message of PP rank {src}", True)
                if int(buf.item()) != 1:
                    raise TapPartialsError(
                        f"PP stage {_rank()}: the side channel's first message of PP rank {src} "
                        f"read {int(buf.item())}, not 1"
                    )
            link = "from PP ranks " + ", ".join(str(s) for s in self.sources)
        else:
            link = ""  # a stage without taps of its own: nothing on the side channel
        self.connected = True
        if link:
            _logger().info("DSpark tap partials: side channel connected (%s)", link)

    def _check_connected(self) -> None:
        if self.on_cuda and not self.connected:
            raise TapPartialsError(
                f"PP stage {_rank()}: the DSpark tap side channel was used before connect() (a "
                "first contact inside a step can wait on itself); this is a bug in "
                "vllm-dspark-pp: set VLLM_DSPARK_PP_TAP_PARTIALS=1 on every node"
            )

    @contextmanager
    def _side_stream(self) -> Iterator[None]:
        """The context every post runs in: the side stream, after the main one, on CUDA."""
        if not self.on_cuda:
            yield
            return
        assert self.stream is not None and self.main_stream is not None
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(self.main_stream)
            yield

    def _timeout(self) -> float:
        if self.timeout_s is not None:
            return float(self.timeout_s)
        from vllm_dspark_pp import envs

        return envs.VLLM_DSPARK_PP_TAP_SIDE_TIMEOUT_S

    def _connect_timeout(self) -> float:
        """:meth:`connect`'s bound: the PP handshake's (a start-up meeting of every stage too),
        at least the side channel's."""
        if self.timeout_s is not None:
            return float(self.timeout_s)
        from vllm_dspark_pp import envs

        return max(envs.VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S, envs.VLLM_DSPARK_PP_TAP_SIDE_TIMEOUT_S)

    def _wait(self, work: Any, what: str, host: bool = False) -> None:
        """Wait for a transfer: on CUDA the current stream waits for it and, with ``host``
        (start-up), the host too; on CPU (gloo) the host. A host waits at most the side
        channel's timeout."""
        if self.on_cuda:
            work.wait()  # the current stream waits for the transfer
            if not host:
                return
        timeout = self._timeout()
        t0 = time.perf_counter()
        try:
            if self.on_cuda:
                done = torch.cuda.Event()
                done.record()
                while not done.query():
                    if time.perf_counter() - t0 > timeout:
                        raise RuntimeError("not done")
                    time.sleep(0.001)
            else:
                work.wait(timeout=timedelta(seconds=timeout))
        except RuntimeError as e:
            raise TapPartialsError(
                f"PP stage {_rank()} waited {timeout:g} s for {what} on the DSpark tap side "
                f"channel ({type(e).__name__}: {e}). Its partner never posted the matching "
                "send or receive (a bug: please report it with every rank's log) or the link is "
                "that slow (raise VLLM_DSPARK_PP_TAP_SIDE_TIMEOUT_S); set "
                "VLLM_DSPARK_PP_TAP_PARTIALS=1 on every node to send the partials in the "
                "intermediate tensors instead"
            ) from e
        finally:
            self.stats["host_wait_s"] += time.perf_counter() - t0

    def _once(self, key: str, msg: str, *args: Any, warn: bool = False) -> None:
        if key in self._logged:
            return
        self._logged.add(key)
        log = _logger()
        (log.warning if warn else log.info)(msg, *args)

    # -- a stage that makes taps (not the last)
    def stage_taps(self, own: Sequence[torch.Tensor]) -> None:
        """The relay's own taps of this step (sent by :meth:`send`, dropped by a dummy run)."""
        self._own = list(own)

    def drop_taps(self) -> None:
        self._own = None

    def send(self, rows: int) -> torch.Tensor:
        """Send ``block @ concat(own taps[:rows])`` to the last stage; returns what was sent."""
        own, self._own = self._own, None
        if own is None:
            raise TapPartialsError(
                f"PP stage {_rank()} must send its tap partial on the side channel but its relay "
                "kept no taps this step; set VLLM_DSPARK_PP_TAP_PARTIALS=1 on every node"
            )
        self._check_connected()
        rows = int(rows)
        contribution = partial_sum([t[:rows] for t in own], self.block, None).contiguous()
        with self._side_stream():
            work = torch.distributed.isend(contribution, dst=self.dst, group=self.group)
            if self.stream is not None:
                contribution.record_stream(self.stream)
        self._sends.append((work, contribution))
        nbytes = contribution.numel() * contribution.element_size()
        self.stats["sent_steps"] += 1
        self.stats["sent_bytes"] += nbytes
        self._once(
            "send",
            "DSpark PP stage %s sends on the side channel per token row: %s %s (to PP rank %s, "
            "first step %d rows, %d B)",
            _rank(),
            PARTIAL_KEY,
            _row_bytes(contribution),
            self.dst,
            rows,
            nbytes,
        )
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()
        while len(self._sends) > self.limit:
            self._wait(self._sends.popleft()[0], "an old side-channel send to complete")
        return contribution

    # -- the last stage
    def post(self, batch: Any) -> PendingStep:
        """Post this step's receives (one per sender, ``batch.num_tokens`` rows each)."""
        self._check_connected()
        rows = int(batch.num_tokens)
        step = PendingStep(batch, rows)
        with self._side_stream():
            for src in self.sources:
                buf = torch.empty(
                    (rows, self.plan.partial_width), dtype=self.dtype, device=self.device
                )
                step.works.append(torch.distributed.irecv(buf, src=src, group=self.group))
                if self.on_cuda:
                    buf.record_stream(self.main_stream)
                step.buffers.append(buf)
        self._recvs.append(step)
        self.stats["recv_steps"] += 1
        self.stats["recv_bytes"] += sum(b.numel() * b.element_size() for b in step.buffers)
        while len(self._recvs) > self.limit:
            self._drain(self._recvs.popleft(), "the side-channel queue is full")
        return step

    def _drain(self, step: PendingStep, why: str) -> None:
        for w in step.works:
            self._wait(w, "a stale side-channel receive")
        self.stats["stale_steps"] += 1
        self._once(
            "stale",
            "DSpark tap partials: dropped the side-channel partials of a step whose drafter "
            "never read them (%s; logged once)",
            why,
            warn=True,
        )

    def take(self, batch: Any) -> torch.Tensor:
        """The partial sum of ``batch``'s step (``[rows, partial_width]``): waits for its
        receives (and drains older steps whose drafter never ran)."""
        while self._recvs:
            step = self._recvs.popleft()
            if step.batch is not batch:
                self._drain(step, "a later step's drafter came first")
                continue
            for src, w in zip(self.sources, step.works, strict=True):
                self._wait(w, f"the partial of PP rank {src}")
            partial = step.buffers[0]
            for buf in step.buffers[1:]:
                partial = partial + buf  # stage order: what the relay of "1" adds up
            return partial
        raise TapPartialsError(
            f"PP stage {_rank()}: the drafter reads the taps of a step for which no partial "
            "was received on the side channel (its forward did not post one); set "
            "VLLM_DSPARK_PP_TAP_PARTIALS=1 on every node"
        )

    def dummy_partial(self, rows: int) -> torch.Tensor:
        """A dummy or profile run's partial: zeros (nothing is sent for those runs)."""
        return torch.zeros(
            (int(rows), self.plan.partial_width), dtype=self.dtype, device=self.device
        )


def side_of(obj: Any) -> TapSideChannel | None:
    """The side channel of a model runner (through its PP handler) or a speculator."""
    side = getattr(obj, "_dspark_tap_side", None)
    if side is None:
        side = getattr(getattr(obj, "pp_handler", None), "_dspark_tap_side", None)
    return side if isinstance(side, TapSideChannel) else None


def after_forward(runner: Any, out: Any, dummy_run: bool) -> None:
    """A non-last stage after ``execute_model``: send this step's partial exactly when vLLM's
    worker sends the dict (a non-dummy step that returned ``IntermediateTensors``); a dummy run
    (profile, capture, DP padding) drops what the relay kept."""
    side = side_of(runner)
    if side is None or side.plan.is_last:
        return
    from vllm.sequence import IntermediateTensors

    if dummy_run or not isinstance(out, IntermediateTensors):
        side.drop_taps()
        return
    if side.plan.side_sends:
        side.send(int(runner.execute_model_state.input_batch.num_tokens))


def after_prepare_inputs(runner: Any, input_batch: Any) -> None:
    """The last stage, once a (non-dummy) step's batch is built, before its forward: post the
    step's side-channel receives."""
    side = side_of(runner)
    if side is not None and side.plan.is_last:
        side.post(input_batch)


def drafter_taps(speculator: Any, input_batch: Any, aux_hidden_states: Any, dummy_run: bool) -> Any:
    """The aux list the last stage's drafter reads: ``[partial] + own taps`` with the side
    channel (the partial waited for here, right before the drafter reads it), else unchanged."""
    side = side_of(speculator)
    if side is None:
        return aux_hidden_states
    own = list(aux_hidden_states or [])
    if dummy_run:
        rows = own[0].shape[0] if own else int(input_batch.num_tokens_after_padding)
        return [side.dummy_partial(rows), *own]
    return [side.take(input_batch), *own]


# ---------------------------------------------------------------- the draft checkpoint


def _checkpoint_dir(spec: Any, download_dir: str | None) -> str:
    path = spec.draft_model_config.model
    if os.path.isdir(path):
        return path
    from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

    return download_weights_from_hf(
        path,
        download_dir,
        allow_patterns=["*.safetensors", "*.safetensors.index.json"],
        revision=getattr(spec.draft_model_config, "revision", None),
    )


def _safetensors_header(path: str) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


@dataclass(frozen=True)
class LinearInCheckpoint:
    file: str
    key: str
    shape: tuple[int, int]
    dtype: str


def find_linear(folder: str, name: str, in_features: int) -> LinearInCheckpoint | str:
    """The one ``<...>.<name>.weight`` tensor of ``folder``'s safetensors with ``in_features``
    columns, or why there is none usable (a string)."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    index = os.path.join(folder, "model.safetensors.index.json")
    suffix = f"{name}.weight"
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(
            {v for k, v in weight_map.items() if k == suffix or k.endswith("." + suffix)}
        )
    found: list[LinearInCheckpoint] = []
    scales: list[str] = []
    for fname in files:
        header = _safetensors_header(os.path.join(folder, fname))
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            stem = key[: -len("weight")]
            if key == suffix or key.endswith("." + suffix):
                shape = tuple(meta["shape"])
                if len(shape) == 2 and shape[1] == in_features:
                    found.append(LinearInCheckpoint(fname, key, shape, meta["dtype"]))
            elif (stem.endswith(f"{name}.") or stem == f"{name}.") and "scale" in key:
                scales.append(key)
    if not found:
        return f"no {suffix} with {in_features} columns in the draft checkpoint {folder}"
    if len(found) > 1:
        return f"several {suffix} tensors in the draft checkpoint: {[t.key for t in found]}"
    hit = found[0]
    if hit.dtype not in _FLOAT_DTYPES or scales:
        return f"{hit.key} is quantized ({hit.dtype}{', ' + scales[0] if scales else ''})"
    return hit


def load_column_block(
    folder: str, hit: LinearInCheckpoint, plan: TapPlan, dtype: torch.dtype, device: Any
) -> torch.Tensor:
    """This stage's column block of the checkpoint's linear, as ``dtype`` on ``device``."""
    from safetensors import safe_open

    lo, hi = plan.columns()
    with safe_open(os.path.join(folder, hit.file), framework="pt", device="cpu") as f:
        # copied while the file is open: a slice may still point into its mapping
        block = f.get_slice(hit.key)[:, lo:hi].to(dtype=dtype).contiguous().clone()
    return block.to(device=device)


# ---------------------------------------------------------------- wiring (called by patches)


def _inner_decoder(model: Any) -> Any:
    from vllm.v1.worker.gpu.spec_decode.eagle import eagle3_utils

    return eagle3_utils._inner_decoder(model)


def plan_for(vllm_config: Any, inner: Any) -> tuple[TapPlan | None, str, Any]:
    """This rank's plan (None: raw taps), the reason, and the checkpoint hit (or None).

    Decided from what every rank has alike, so every rank decides the same."""
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.distributed.utils import get_pp_indices

    from vllm_dspark_pp import envs
    from vllm_dspark_pp.producer import families

    spec = vllm_config.speculative_config
    pp = get_pp_group()
    aux = tuple(sorted(set(getattr(inner, "aux_hidden_state_layers", ()) or ())))
    if spec is None or pp.world_size < 2 or not aux:
        return None, "no aux taps relayed over PP", None
    knob = envs.VLLM_DSPARK_PP_TAP_PARTIALS
    if knob == "0":
        return None, "VLLM_DSPARK_PP_TAP_PARTIALS=0", None
    num_layers = int(inner.config.num_hidden_layers)  # what the decoder's make_layers split
    starts = [get_pp_indices(num_layers, r, pp.world_size)[0] for r in range(pp.world_size)]
    start, end = get_pp_indices(num_layers, pp.rank_in_group, pp.world_size)
    if (start, end) != (inner.start_layer, inner.end_layer):
        raise TapPartialsError(
            f"stage {pp.rank_in_group} holds target layers [{inner.start_layer}, "
            f"{inner.end_layer}) but vLLM's split of its num_hidden_layers={num_layers} says "
            f"[{start}, {end}); set VLLM_DSPARK_PP_TAP_PARTIALS=0 on every node"
        )
    upstream = upstream_counts(aux, starts)
    on, why = choose_mode(knob, upstream)
    if not on:
        return None, why, None
    side = False
    senders: tuple[int, ...] = ()
    if knob == "side":
        side, senders, why = side_layout(aux, starts, num_layers, vllm_config.parallel_config)
    family = families.family_for(families.draft_architectures(spec))
    linear = family.context_linear if family is not None else None
    if linear is None:
        name = family.name if family is not None else "this drafter"
        return None, f"{name}: its first op on the taps is not known to be a pure linear", None
    tap_width = int(inner.config.hidden_size)
    folder = _checkpoint_dir(spec, vllm_config.load_config.download_dir)
    hit = find_linear(folder, linear, len(aux) * tap_width)
    if isinstance(hit, str):
        return None, hit, None
    assert family is not None
    base, count = stage_slots(aux, start, end, pp.is_first_rank)
    plan = TapPlan(
        num_taps=len(aux),
        tap_width=tap_width,
        partial_width=hit.shape[0],
        base=base,
        count=count,
        is_first=pp.is_first_rank,
        is_last=pp.is_last_rank,
        upstream=tuple(upstream),
        side=side,
        senders=senders,
    )
    return plan, f"{why}; {family.name} {linear} = {hit.key}", (folder, hit)


def side_layout(
    aux: Sequence[int], starts: Sequence[int], num_layers: int, parallel_config: Any = None
) -> tuple[bool, tuple[int, ...], str]:
    """``(side, senders, why)`` for ``VLLM_DSPARK_PP_TAP_PARTIALS=side``: whether the partials
    can travel on the side channel (else they ride in the ``IntermediateTensors`` as with ``1``),
    which stages send one, and the reason for the start-up line. Pure in what every rank has."""
    bounds = [*starts, num_layers]
    counts = [stage_slots(aux, bounds[r], bounds[r + 1], r == 0)[1] for r in range(len(starts))]
    senders = tuple(r for r in range(len(starts) - 1) if counts[r])
    pcp = int(getattr(parallel_config, "prefill_context_parallel_size", 1) or 1)
    fallback = "partial sums ride in the intermediate tensors as with 1"
    if counts[-1] == 0:
        why = (
            "VLLM_DSPARK_PP_TAP_PARTIALS=side, but the last stage makes no aux tap of its own "
            f"(its forward would hand the drafter no aux list to join): {fallback}"
        )
        return False, (), why
    if pcp > 1:
        why = (
            f"VLLM_DSPARK_PP_TAP_PARTIALS=side, but prefill context parallelism is on (size "
            f"{pcp}: the last stage rebuilds its batch for the drafter): {fallback}"
        )
        return False, (), why
    return True, senders, "VLLM_DSPARK_PP_TAP_PARTIALS=side"


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def describe_boundaries(plan_upstream: Sequence[int], partials: bool, row_bytes: dict) -> str:
    """``'0->1: ... | 1->2: ...'``: the aux keys and bytes per token row of every boundary."""
    parts = []
    for r, n in enumerate(plan_upstream):
        if partials and n:
            keys = f"{PARTIAL_KEY} {row_bytes['partial']} B"
        else:
            keys = f"{n} x {TAP_KEY}* {n * row_bytes['tap']} B" if n else "no aux keys"
        parts.append(f"{r}->{r + 1}: {keys}")
    return " | ".join(parts)


def configure_stage(handler: Any, model: Any, vllm_config: Any) -> TapPlan | None:
    """Called on every PP rank after vLLM set the aux layers: decide, log, and install this
    rank's share (the receive buffers, the column block, the plan on the decoder, the side
    channel)."""
    # A collective of every world rank (each runs this at the same point of load_model): made
    # whenever the knob says side, before anything below may decide differently or raise, so no
    # rank can be left waiting in it.
    group = _side_group(handler) if _side_knob() else None
    inner = _inner_decoder(model)
    if inner is None:
        return None
    plan, why, where = plan_for(vllm_config, inner)
    dtype = vllm_config.model_config.dtype
    if plan is None:
        if getattr(inner, "aux_hidden_state_layers", ()):
            try:  # the start-up line only: nothing about it may stop a raw-tap start
                row = {"tap": int(inner.config.hidden_size) * dtype_bytes(dtype)}
                upstream = _upstream_of(vllm_config, inner)
                rows = describe_boundaries(upstream, False, row) if upstream else "none"
            except Exception as e:  # noqa: BLE001
                rows = f"unknown ({type(e).__name__}: {e})"
            _logger().info("DSpark tap partials off (%s): aux rows per boundary %s", why, rows)
        return None
    row = {"tap": int(inner.config.hidden_size) * dtype_bytes(dtype)}
    row["partial"] = plan.partial_width * dtype_bytes(dtype)
    object.__setattr__(inner, PLAN_ATTR, plan)
    object.__setattr__(inner, SOURCE_ATTR, where)
    if plan.receives:
        _reserve_partial_slot(model, plan)
    if plan.side and not plan.is_first:
        _drop_tap_slots(model)
    handler._dspark_tap_plan = plan
    handler._dspark_tap_block = None
    if (plan.sends or plan.side_sends) and plan.count:
        folder, hit = where
        handler._dspark_tap_block = load_column_block(
            folder, hit, plan, dtype, _device(handler, model)
        )
    if plan.side:
        assert group is not None  # plan_for chooses side only where the knob says side
        from vllm.distributed.parallel_state import get_pp_group

        side = TapSideChannel(
            plan,
            group,
            get_pp_group().ranks,
            _device(handler, model),
            dtype,
            block=handler._dspark_tap_block,
            main_stream=getattr(handler, "main_stream", None),
        )
        # the start-up lines first, so that a link that never comes shows where start-up stopped
        _log_side(plan, why, row, _critical_keys(model, plan, dtype, _device(handler, model)))
        side.connect()  # before any step: see TapSideChannel.connect
        handler._dspark_tap_side = side
        object.__setattr__(inner, SIDE_ATTR, side)
        return plan
    if plan.is_last:
        _logger().info(
            "DSpark tap partials on (%s): aux bytes per token row per boundary, raw taps -> "
            "partial sums: %s  =>  %s (the target's own tensors on top; each stage logs all it "
            "sends at its first send)",
            why,
            describe_boundaries(plan.upstream, False, row),
            describe_boundaries(plan.upstream, True, row),
        )
    else:
        _logger().info(
            "DSpark tap partials: stage %s makes tap slots %d..%d (%d), sends %s",
            _rank(),
            plan.base,
            plan.base + plan.count - 1,
            plan.count,
            PARTIAL_KEY if plan.sends else "no aux key",
        )
    return plan


def _device(handler: Any, model: Any) -> torch.device:
    """The handler's device (vLLM's PPHandler has one), else the first real parameter's
    (a layer of another stage may be a meta placeholder)."""
    device = getattr(handler, "device", None)
    if device is not None:
        return torch.device(device)
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


def _rank() -> int | str:
    from vllm.distributed.parallel_state import get_pp_group

    try:
        return get_pp_group().rank_in_group
    except AssertionError:  # no PP group (a unit test driving the handler by hand)
        return "?"


def _upstream_of(vllm_config: Any, inner: Any) -> list[int]:
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.distributed.utils import get_pp_indices

    pp = get_pp_group()
    if pp.world_size < 2:
        return []
    n = int(inner.config.num_hidden_layers)
    starts = [get_pp_indices(n, r, pp.world_size)[0] for r in range(pp.world_size)]
    return upstream_counts(inner.aux_hidden_state_layers, starts)


def _side_knob() -> bool:
    from vllm_dspark_pp import envs

    return envs.VLLM_DSPARK_PP_TAP_PARTIALS == "side"


def _side_group(handler: Any) -> Any:
    """The side channel's process group (made once per handler): a sibling of the PP group's
    device group (NCCL on CUDA, gloo on CPU), so side-channel sends and receives never queue
    behind, or in front of, the stage-to-stage tensors on one communicator."""
    group = getattr(handler, "_dspark_tap_side_group", None)
    if group is None:
        from vllm.distributed.parallel_state import get_pp_group

        pp = get_pp_group()
        if pp.world_size < 2:
            return None
        group = pp.make_sibling_device_group(group_desc=SIDE_GROUP_DESC)
        handler._dspark_tap_side_group = group
    return group


def _drop_tap_slots(model: Any) -> None:
    """The receive buffers of a stage after the first, side channel: the target's own tensors
    only (no relayed tap, no partial)."""
    make = model.make_empty_intermediate_tensors

    def make_empty_without_taps(batch_size, dtype, device):
        tensors = make(batch_size, dtype, device)
        for key in [k for k in tensors.tensors if k.startswith(TAP_KEY) or k == PARTIAL_KEY]:
            del tensors.tensors[key]
        return tensors

    model.make_empty_intermediate_tensors = make_empty_without_taps


def _row_bytes(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return f"({type(t).__name__})"
    return f"{t.shape[-1] * t.element_size() if t.dim() else 0} B"


def _critical_keys(model: Any, plan: TapPlan, dtype: torch.dtype, device: Any) -> str:
    """What this stage receives from the previous one (its receive buffers' keys and bytes per
    token row), for the start-up line; '' on the first stage."""
    if plan.is_first:
        return ""
    try:  # a log line: nothing about it may stop a start
        tensors = model.make_empty_intermediate_tensors(1, dtype, device).tensors
        return ", ".join(f"{k} {_row_bytes(t)}" for k, t in sorted(tensors.items()))
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__}: {e})"


def describe_side(plan: TapPlan, row_bytes: int) -> str:
    """``'stage 0 -> 2: dspark_tap_partial 512 B | ...'``: the side channel's rows per sender."""
    last = len(plan.upstream)
    return " | ".join(f"stage {s} -> {last}: {PARTIAL_KEY} {row_bytes} B" for s in plan.senders)


def _log_side(plan: TapPlan, why: str, row: dict, critical: str) -> None:
    log = _logger()
    side = describe_side(plan, row["partial"])
    if plan.is_last:
        log.info(
            "DSpark tap partials on, side channel (%s): aux bytes per token row per boundary, "
            "raw taps: %s  =>  critical path: no aux keys at any boundary (the target's own "
            "tensors only); side channel, straight to the last stage: %s (its drafter waits "
            "for them right before it reads the taps)",
            why,
            describe_boundaries(plan.upstream, False, row),
            side,
        )
    parts = []
    if critical:
        parts.append(f"receives on the critical path: {critical}")
    if plan.side_sends:
        parts.append(
            f"sends on the side channel: {PARTIAL_KEY} {row['partial']} B per token row to the "
            "last stage"
        )
    if plan.is_last:
        parts.append(
            f"receives on the side channel: {PARTIAL_KEY} {row['partial']} B per token row from "
            f"stage{'s' if len(plan.senders) > 1 else ''} "
            f"{', '.join(str(s) for s in plan.senders)}"
        )
    log.info(
        "DSpark tap partials (side channel): stage %s makes tap slots %d..%d (%d); %s",
        _rank(),
        plan.base,
        plan.base + plan.count - 1,
        plan.count,
        "; ".join(parts) or "nothing of the taps crosses this stage",
    )


def _reserve_partial_slot(model: Any, plan: TapPlan) -> None:
    """The receive buffers of a stage after the first: the partial in place of the taps."""
    make = model.make_empty_intermediate_tensors

    def make_empty_with_partial(batch_size, dtype, device):
        tensors = make(batch_size, dtype, device)
        for key in [k for k in tensors.tensors if k.startswith(TAP_KEY)]:
            del tensors.tensors[key]
        tensors[PARTIAL_KEY] = torch.zeros(
            (batch_size, plan.partial_width), dtype=dtype, device=device
        )
        return tensors

    model.make_empty_intermediate_tensors = make_empty_with_partial


def relay(handler: Any, received: Any, out: Any) -> Any:
    """A non-last stage's outgoing ``IntermediateTensors``: its own tap rows replaced by the
    partial sum (what it received plus its block times its own taps)."""
    from vllm.sequence import IntermediateTensors

    plan: TapPlan = handler._dspark_tap_plan
    tensors = dict(out.tensors)
    own_keys = sorted(
        (k for k in tensors if k.startswith(TAP_KEY)), key=lambda k: int(k[len(TAP_KEY) :])
    )
    expected = [f"{TAP_KEY}{plan.base + i}" for i in range(plan.count)]
    if own_keys != expected:
        raise TapPartialsError(f"this stage made tap rows {own_keys}, the plan says {expected}")
    own = [tensors.pop(k) for k in own_keys]
    if plan.side:
        # the side channel sends W_s @ own taps after the step (TapSideChannel.send, called
        # where vLLM's worker sends this dict); nothing of the taps stays in it
        if plan.side_sends:
            handler._dspark_tap_side.stage_taps(own)
        return IntermediateTensors(tensors)
    if plan.sends:
        incoming = received[PARTIAL_KEY] if plan.receives else None
        if incoming is not None:
            incoming = incoming[: out["hidden_states"].shape[0]]
        tensors[PARTIAL_KEY] = partial_sum(own, handler._dspark_tap_block, incoming)
    return IntermediateTensors(tensors)


def log_sent_keys(out: Any) -> None:
    """One line: the keys this stage sends to the next and their bytes per token row."""
    try:  # a log line: nothing about it may stop a step
        keys = ", ".join(
            f"{k} {_row_bytes(t)}" for k, t in sorted(getattr(out, "tensors", {}).items())
        )
    except Exception as e:  # noqa: BLE001
        keys = f"unknown ({type(e).__name__}: {e})"
    _logger().info("DSpark PP stage %s sends per token row: %s", _rank(), keys)


def install_on_drafter(speculator: Any, target_model: Any) -> None:
    """Last stage: swap the drafter's first linear for :class:`PartialSumLinear` (its own
    column block read from the draft checkpoint, as the other stages read theirs, and checked
    against the loaded weight where the platform keeps it); the FULL-graph staging buffer of
    the concatenated taps is re-made at the new width."""
    inner = _inner_decoder(target_model)
    plan: TapPlan | None = getattr(inner, PLAN_ATTR, None) if inner is not None else None
    if plan is None or not plan.is_last:
        return
    from vllm_dspark_pp.producer import families

    spec = speculator.vllm_config.speculative_config
    family = families.family_for(families.draft_architectures(spec))
    name = family.context_linear if family is not None else None
    drafter = getattr(speculator.model, "model", None)
    module = getattr(drafter, name, None) if name else None
    folder, hit = getattr(inner, SOURCE_ATTR)
    load_config = getattr(speculator.vllm_config, "load_config", None)
    dummy = getattr(load_config, "load_format", None) == "dummy"
    why = _not_plain_linear(module, plan, folder, hit, compare=not dummy)
    if why:
        raise TapPartialsError(
            f"the other PP stages relay DSpark tap partial sums, but on the last stage the "
            f"drafter's {name} {why}; set VLLM_DSPARK_PP_TAP_PARTIALS=0 on every node"
        )
    assert module is not None and name is not None
    weight = module.weight
    block = load_column_block(folder, hit, plan, weight.dtype, weight.device)
    setattr(drafter, name, PartialSumLinear(block, plan.partial_width))
    if plan.side:
        side = getattr(inner, SIDE_ATTR, None)
        if side is None:
            raise TapPartialsError(
                "the last stage's plan says the partials come on the side channel but none was "
                "set up; set VLLM_DSPARK_PP_TAP_PARTIALS=1 on every node"
            )
        speculator._dspark_tap_side = side
    staging = getattr(speculator, "_aux_staging", None)
    if staging is not None:
        width = plan.partial_width + block.shape[1]
        speculator._aux_staging = torch.zeros(
            staging.shape[0], width, dtype=staging.dtype, device=staging.device
        )
    _logger().info(
        "DSpark tap partials: the drafter's %s reads [partial | %d own taps] (%d of its %d "
        "columns)%s",
        name,
        plan.count,
        block.shape[1],
        plan.num_taps * plan.tap_width,
        f"; --load-format dummy: the checkpoint's {hit.key} stands in for the dummy {name} "
        "(not compared: dummy weights are no checkpoint's)"
        if dummy
        else "",
    )


def _not_plain_linear(
    module: Any, plan: TapPlan, folder: str, hit: LinearInCheckpoint, compare: bool = True
) -> str:
    """Why ``module`` is not the checkpoint's bias-free unquantized ``[partial_width,
    n * tap_width]`` linear ('' when it is). ``compare=False`` (vLLM's ``--load-format dummy``,
    a benchmark's random weights) skips comparing its values with the checkpoint's: the loaded
    values are random by design, and the other stages' blocks and the last stage's own come
    from the checkpoint alike, so the drafter still reads one consistent ``W``."""
    if module is None:
        return "is missing"
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return f"is a {type(module).__name__} without a weight"
    if getattr(module, "bias", None) is not None:
        return "has a bias"
    method = getattr(module, "quant_method", None)
    if method is not None and type(method).__name__ != "UnquantizedLinearMethod":
        return f"is quantized ({type(method).__name__})"
    want = (plan.partial_width, plan.num_taps * plan.tap_width)
    shape: tuple = (getattr(module, "output_size", None), getattr(module, "input_size", None))
    if None in shape:
        shape = tuple(weight.shape) if weight.dim() == 2 else (None, None)
    if tuple(shape) != want:
        return f"has shape {tuple(shape)}, not {want}"
    if compare and weight.dim() == 2 and weight.numel():  # the CPU platform packs it away
        from safetensors import safe_open

        with safe_open(os.path.join(folder, hit.file), framework="pt", device="cpu") as f:
            ref = f.get_tensor(hit.key)
        if not torch.equal(ref.to(weight.dtype), weight.detach().cpu()):
            return f"holds other weights than the checkpoint's {hit.key}"
    return ""
