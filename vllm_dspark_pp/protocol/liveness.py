"""A side watch of every peer rank, so a rank lost on another node ends the engine at once.

vLLM 0.34.0's multiprocessing executor watches only the worker processes of its own node (their
process sentinels). When a PP stage on another launcher dies (node 1 of ``--nnodes 2``, started
``--headless``), node 0 learns nothing until the reply it waits for times out
(``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, 300 s by default), and its message never names the stage
(docs/results/reliability.md, case 3b). The same holds for a TP rank on another launcher (TP=2 x
PP=2 over four ``--nnodes 4`` launchers): its TP partners and the other stages wait on it.

Right after the start-up handshake (:mod:`vllm_dspark_pp.protocol.handshake`), every rank of
vLLM's world group (all TP x PCP x PP ranks, on every DP rank) opens one small TCP connection to
every other rank of the world:

* each rank listens on an ephemeral port of its host (``VLLM_HOST_IP``, as vLLM's own
  connections), publishes ``host, port, token, node, pid`` in the key-value store the handshake
  uses, connects to each lower rank (presenting that rank's token) and accepts one connection
  from each higher rank; then the listening socket is closed. Every wait has a deadline (the
  handshake's timeout); a rank that cannot connect fails at start with a message naming the fix;
* one daemon thread per process then watches all of its peer sockets. The kernel closes a
  socket the moment its process dies, so a killed, crashed or OOM-killed peer is seen at once;
  a peer whose process is alive but silent (stopped, or its host unreachable) for
  ``VLLM_DSPARK_PP_PEER_TIMEOUT_S`` seconds (default 30; heartbeats go every ``timeout / 10``
  seconds, at most every second) is declared lost too;
* on a loss the thread logs ``DSpark PP: lost PP rank R (host:port, node N, pid P): ...``
  (``lost PP rank P, TP rank T, global rank G (...)`` when the world is more than one PP group;
  :mod:`.world`) with what to look at, and ends its own process with status 70. That process
  is a worker of a launcher whose executor watches it: its death ends that launcher's engine
  (node 0: the API server then exits; other nodes: the headless launcher exits). Every rank
  watches every other, so every launcher ends by itself: a lost TP rank of one stage ends the
  other stages' launchers too.

A world of W ranks holds W x (W - 1) / 2 connections (W - 1 sockets per worker).
* an orderly shutdown (vLLM's ``WorkerProc.shutdown``, through
  ``patches/v1_executor_multiproc_executor.py``) first says goodbye to every peer, so the peers
  do not mistake it for a loss, and stops the thread. The thread is a daemon that never joins
  anything: the watch cannot hold a shutdown up.

No collective is added: the set-up uses the store and plain sockets, and afterwards nothing here
waits on another rank. Only vLLM's multiprocessing executor (``mp``, also used by
``--nnodes``/``--headless``) is covered; with Ray or an external launcher the watch is not
started and vLLM's behaviour is unchanged (Ray reports dead actors itself).

``VLLM_DSPARK_PP_PEER_TIMEOUT_S=0`` turns the watch off (no socket, no thread). Nodes that
disagree (one on, one off) run without the watch between them, with a warning.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_dspark_pp import envs
from vllm_dspark_pp.protocol.world import WorldShape
from vllm_dspark_pp.version import PROTOCOL_VERSION

TIMEOUT_ENV = "VLLM_DSPARK_PP_PEER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = envs.PEER_TIMEOUT_DEFAULT_S
#: Exit status of a worker that lost a peer rank (``EX_SOFTWARE``); the executor patch names it.
LOST_PEER_EXIT_STATUS = 70
#: Every lost line starts so (every rank label starts with "PP rank": world.WorldShape.label).
LOST_PREFIX = "DSpark PP: lost PP rank"

_HEARTBEAT = b"h"
#: On a loss the process ends at the latest this long after the loss, logged or not.
EXIT_GUARD_S = 5.0
#: After an orderly stop the thread reads what the peers still send for at most this long.
DRAIN_S = 2.0
_BYE = b"B"


class PeerWatchError(RuntimeError):
    """The watch could not be set up (bad knob, or the ranks could not reach each other)."""


@dataclass(frozen=True)
class Peer:
    rank: int  # index in the watched group (vLLM's world group: the global rank)
    host: str
    port: int
    node: int
    pid: int
    label: str = ""  # e.g. "PP rank 0, TP rank 1, global rank 1" (world.WorldShape.label)
    worker: str = ""  # its process name in vLLM's logs, e.g. "Worker_PP0_TP1"

    @property
    def name(self) -> str:
        return self.label or f"PP rank {self.rank}"

    def where(self) -> str:
        return f"{self.host}:{self.port}, node {self.node}, pid {self.pid}"


def timeout_s(raw: str | None = None) -> float:
    """The knob: seconds of silence before an open peer is declared lost; 0 turns the watch off."""
    try:
        if raw is None:
            return envs.VLLM_DSPARK_PP_PEER_TIMEOUT_S
        return envs.parse_peer_timeout_s(raw)
    except ValueError as exc:
        raise PeerWatchError(str(exc)) from None


def heartbeat_interval_s(timeout: float) -> float:
    return min(1.0, timeout / 10.0)


def lost_message(me: str, peer: Peer, reason: str) -> str:
    """The line a rank (``me``: its label) logs before it exits: names the lost rank and how to
    diagnose it."""
    worker = peer.worker or f"Worker_PP{peer.rank}"
    return (
        f"DSpark PP: lost {peer.name} ({peer.where()}): {reason}. This worker ({me}) exits with "
        f"status {LOST_PEER_EXIT_STATUS} so that the engine stops now instead of waiting "
        f"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS for that rank. To diagnose: read node "
        f"{peer.node}'s launcher log (lines of {worker}, pid {peer.pid}), its kernel log for an "
        f"out-of-memory kill (dmesg), and whether {peer.host} is reachable. "
        f"({TIMEOUT_ENV}=0 turns this watch off.)"
    )


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.dspark_pp.liveness")


def exit_on_loss(me: str, peer: Peer, reason: str) -> None:
    """Default reaction: log the loss, flush, end this process with status 70 (no cleanup: the
    main thread may be blocked in a collective with the lost rank)."""
    import logging

    # Never hang here: if logging blocks (a handler lock held by a thread that is stuck writing
    # to a full pipe), the process still ends.
    guard = threading.Timer(EXIT_GUARD_S, os._exit, (LOST_PEER_EXIT_STATUS,))
    guard.daemon = True
    guard.start()
    _logger().error("%s", lost_message(me, peer, reason))
    for name in ("", "vllm"):
        for handler in logging.getLogger(name).handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(LOST_PEER_EXIT_STATUS)


class PeerWatch:
    """Watches connected peer sockets from one daemon thread (see the module docstring)."""

    def __init__(
        self,
        me: int,
        conns: dict[int, tuple[socket.socket, Peer]],
        timeout: float,
        on_lost: Callable[[str, Peer, str], None] = exit_on_loss,
        label: str | None = None,
    ) -> None:
        self.me = me
        self.label = label or f"PP rank {me}"
        self.timeout = timeout
        self.interval = heartbeat_interval_s(timeout)
        self.on_lost = on_lost
        self._conns = dict(conns)
        self._gone: set[int] = set()  # peers that said goodbye
        self._stopping = threading.Event()
        self._stop_time = 0.0
        self.drain_s = DRAIN_S
        self._lost_rank: int | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        for sock, _ in self._conns.values():
            sock.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="DSparkPPPeerWatch", daemon=True)

    @property
    def peers(self) -> list[Peer]:
        return [peer for _, peer in self._conns.values()]

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Orderly end: a goodbye and a FIN to every peer, then the thread drains what the
        peers still send (so no reset loses the goodbye) for at most ``DRAIN_S`` and closes.
        Never blocks: the sends are non-blocking and nothing is joined."""
        if self._stopping.is_set():
            return
        self._stop_time = time.monotonic()
        self._stopping.set()
        for sock, _ in self._conns.values():
            try:
                sock.send(_BYE, socket.MSG_DONTWAIT)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        try:
            self._wake_w.send(b"x", socket.MSG_DONTWAIT)
        except OSError:
            pass

    def _close_all(self) -> None:
        for sock in [s for s, _ in self._conns.values()] + [self._wake_r, self._wake_w]:
            try:
                sock.close()
            except OSError:
                pass

    def _lost(self, rank: int, reason: str) -> None:
        if self._stopping.is_set():
            return
        self._lost_rank = rank
        self._stopping.set()
        self.on_lost(self.label, self._conns[rank][1], reason)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        for rank, (sock, _) in self._conns.items():
            sel.register(sock, selectors.EVENT_READ, rank)
        open_ = set(self._conns)  # sockets not yet at end of stream
        now = time.monotonic()
        last_seen = dict.fromkeys(open_, now)
        next_beat = now
        try:
            while open_ and self._lost_rank is None:
                stopping = self._stopping.is_set()
                if stopping and time.monotonic() - self._stop_time > self.drain_s:
                    return
                wait = self.drain_s if stopping else max(0.0, next_beat - time.monotonic())
                for key, _ in sel.select(timeout=wait):
                    rank = key.data
                    if rank is None:  # the stop() wake-up
                        self._wake_r.recv(64)
                        continue
                    sock = self._conns[rank][0]
                    error: OSError | None = None
                    try:
                        data = sock.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError as exc:
                        data, error = b"", exc
                    if data:
                        last_seen[rank] = time.monotonic()
                        if _BYE in data:
                            self._gone.add(rank)
                        continue
                    # End of stream (or a reset): orderly if either side said goodbye.
                    sel.unregister(sock)
                    open_.discard(rank)
                    if rank in self._gone or self._stopping.is_set():
                        continue
                    how = "closed" if error is None else f"was reset ({error})"
                    self._lost(
                        rank,
                        f"its connection {how}: the process ended (killed, crashed, or its "
                        "host went down)",
                    )
                    return
                if self._stopping.is_set():
                    continue
                now = time.monotonic()
                watched = sorted(open_ - self._gone)
                if now >= next_beat:
                    next_beat = now + self.interval
                    for rank in watched:
                        try:
                            self._conns[rank][0].send(_HEARTBEAT, socket.MSG_DONTWAIT)
                        except BlockingIOError:
                            pass  # its receive buffer is full: silence is judged below
                        except OSError:
                            pass  # the reset or close is read on the next select
                for rank in watched:
                    if now - last_seen[rank] > self.timeout:
                        self._lost(
                            rank,
                            f"no heartbeat for {self.timeout:g} s ({TIMEOUT_ENV}) although "
                            "its connection is open: the process is stopped or stuck, or its "
                            "host is unreachable",
                        )
                        return
        finally:
            sel.close()
            self._close_all()


# ------------------------------------------------------------------ set-up
_epochs: dict[tuple, int] = {}


def _prefix(ranks: list[int], epoch: int | None) -> str:
    # One namespace per watched group (the world) and per set-up of that group in this process
    # (every rank sets up as often as the others, so the counters agree); tests pass ``epoch``.
    key = tuple(ranks)
    if epoch is None:
        epoch = _epochs[key] = _epochs.get(key, 0) + 1
    return f"vllm_dspark_pp/liveness/v{PROTOCOL_VERSION}/{'-'.join(map(str, ranks))}/{epoch}"


def _listen(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(16)
    return listener


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_line(sock: socket.socket, deadline: float) -> bytes:
    """The hello line; bytes after it (the peer's first heartbeats) are dropped."""
    buf = b""
    while b"\n" not in buf and len(buf) < 4096:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(4096 - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\n", 1)[0]


def _setup_error(me: str, what: str, setup_timeout: float) -> PeerWatchError:
    return PeerWatchError(
        f"vllm-dspark-pp peer watch ({me}): {what} within {setup_timeout:.0f} s. "
        "The nodes must reach each other's VLLM_HOST_IP on ephemeral TCP ports (as for "
        "torch.distributed): set VLLM_HOST_IP to the interface the nodes share and open those "
        f"ports, or set {TIMEOUT_ENV}=0 on every node to run without the watch."
    )


def connect_peers(
    *,
    rank_in_group: int,
    ranks: list[int],
    store: Any,
    host: str,
    node: int,
    enabled: bool = True,
    setup_timeout: float = 120.0,
    epoch: int | None = None,
    shape: WorldShape | None = None,
) -> dict[int, tuple[socket.socket, Peer]]:
    """Connect this rank to every other rank of ``ranks`` (vLLM's world group, or one PP group
    when ``shape`` is left out) that runs the watch; returns ``{index: (socket, peer)}``. Every
    rank publishes its record, ``enabled`` or not."""
    from vllm_dspark_pp.protocol.handshake import _poll

    me, world = rank_in_group, len(ranks)
    shape = shape or WorldShape.pp_only(world)
    me_label = shape.label(me)
    prefix = _prefix(ranks, epoch)
    deadline = time.monotonic() + setup_timeout
    token = secrets.token_hex(16)
    listener = _listen(host) if enabled else None
    try:
        mine: dict[str, Any] = {"enabled": enabled, "node": node, "pid": os.getpid()}
        if listener is not None:
            mine.update(host=host, port=listener.getsockname()[1], token=token)
        store.set(f"{prefix}/rank{me}", json.dumps(mine))
        if not enabled:
            return {}
        keys = {r: f"{prefix}/rank{r}" for r in range(world) if r != me}
        missing = _poll(store, list(keys.values()), deadline)
        if missing:
            silent = "; ".join(shape.label(r) for r, k in sorted(keys.items()) if k in missing)
            raise _setup_error(me_label, f"{silent} published no address", setup_timeout)
        records = {r: json.loads(store.get(k)) for r, k in keys.items()}
        off = [shape.label(r) for r, rec in sorted(records.items()) if not rec.get("enabled")]
        if off:
            _logger().warning(
                "DSpark PP: %s run with %s=0: they are not watched (set the same value on every "
                "node)",
                "; ".join(off),
                TIMEOUT_ENV,
            )
        peers = {
            r: Peer(
                r,
                rec["host"],
                int(rec["port"]),
                int(rec["node"]),
                int(rec["pid"]),
                label=shape.label(r),
                worker=shape.worker_name(r),
            )
            for r, rec in records.items()
            if rec.get("enabled")
        }
        conns: dict[int, tuple[socket.socket, Peer]] = {}
        try:
            for r in sorted(p for p in peers if p < me):
                peer = peers[r]
                try:
                    sock = socket.create_connection(
                        (peer.host, peer.port), timeout=max(0.01, deadline - time.monotonic())
                    )
                    conns[r] = (_tune(sock), peer)
                    hello = {"rank": me, "token": records[r]["token"]}
                    sock.sendall(json.dumps(hello).encode() + b"\n")
                except OSError as exc:
                    raise _setup_error(
                        me_label,
                        f"could not connect to {peer.name} ({peer.where()}): {exc}",
                        setup_timeout,
                    ) from exc
            expected = {p for p in peers if p > me}
            assert listener is not None
            while expected:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    late = "; ".join(shape.label(r) for r in sorted(expected))
                    raise _setup_error(me_label, f"{late} did not connect", setup_timeout)
                listener.settimeout(remaining)
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    continue
                try:
                    hello = json.loads(_read_line(sock, deadline) or b"{}")
                except (OSError, ValueError):
                    hello = {}
                who = hello.get("rank") if isinstance(hello, dict) else None
                if who in expected and hello.get("token") == token:
                    sock.settimeout(None)
                    conns[who] = (_tune(sock), peers[who])
                    expected.discard(who)
                else:  # not one of ours: drop it and keep waiting
                    sock.close()
        except BaseException:
            for sock, _ in conns.values():
                sock.close()
            raise
        return conns
    finally:
        if listener is not None:
            listener.close()


_active: list[PeerWatch] = []


def start_watch(
    *,
    rank_in_group: int,
    ranks: list[int],
    store: Any,
    host: str,
    node: int,
    timeout: float | None = None,
    setup_timeout: float = 120.0,
    on_lost: Callable[[str, Peer, str], None] = exit_on_loss,
    epoch: int | None = None,
    shape: WorldShape | None = None,
) -> PeerWatch | None:
    """Set up and start the watch of ``ranks`` (see :func:`connect_peers`); ``None`` when the
    knob is 0 or there is no other rank."""
    timeout = timeout_s() if timeout is None else timeout
    if len(ranks) <= 1:
        return None
    shape = shape or WorldShape.pp_only(len(ranks))
    conns = connect_peers(
        rank_in_group=rank_in_group,
        ranks=ranks,
        store=store,
        host=host,
        node=node,
        enabled=timeout > 0,
        setup_timeout=setup_timeout,
        epoch=epoch,
        shape=shape,
    )
    if timeout <= 0 or not conns:
        return None
    watch = PeerWatch(rank_in_group, conns, timeout, on_lost, shape.label(rank_in_group)).start()
    _active.append(watch)
    return watch


def stop_all() -> None:
    """Orderly shutdown of this process: every watch says goodbye and stops (non-blocking)."""
    while _active:
        _active.pop().stop()


def start_pp_watch(
    vllm_config: Any,
    *,
    on_lost: Callable[[str, Peer, str], None] = exit_on_loss,
    epoch: int | None = None,
) -> PeerWatch | None:
    """The watch of every rank of this worker's world (all TP x PCP x PP ranks, every DP rank;
    called by the model runner patch right after the handshake, when PP > 1). Only under vLLM's
    multiprocessing executor."""
    from vllm_dspark_pp.protocol.handshake import default_store
    from vllm_dspark_pp.protocol.handshake import timeout_s as handshake_timeout_s
    from vllm_dspark_pp.protocol.world import vllm_world_position

    pos = vllm_world_position()
    if pos.shape.pp <= 1:
        return None
    parallel = vllm_config.parallel_config
    backend = parallel.distributed_executor_backend
    if backend != "mp":
        _logger().info(
            "DSpark PP: the peer watch covers vLLM's multiprocessing executor only; with "
            "executor backend %r a lost rank is reported by that backend",
            backend,
        )
        return None
    from vllm.utils.network_utils import get_ip

    watch = start_watch(
        rank_in_group=pos.rank_in_group,
        ranks=pos.ranks,
        store=default_store(),
        host=get_ip(),
        node=int(getattr(parallel, "node_rank", 0) or 0),
        setup_timeout=handshake_timeout_s(),
        on_lost=on_lost,
        epoch=epoch,
        shape=pos.shape,
    )
    if watch is not None:
        _logger().info(
            "DSpark PP: %s watches %d ranks of %s: %s (silence limit %g s, %s; 0 = off)",
            watch.label,
            len(watch.peers),
            pos.shape.describe(),
            "; ".join(f"{p.name} ({p.where()})" for p in watch.peers),
            watch.timeout,
            TIMEOUT_ENV,
        )
    return watch


# ------------------------------------------------------------------ bounded waits
#: How long one slice of a remote reader's wait is (patches/distributed_device_communicators_
#: shm_broadcast.py): between slices the wait checks whether its queue was shut down.
WAIT_SLICE_S = 0.5


class QueueShutDown(RuntimeError):
    """A reader's message queue was shut down while it waited (its executor is stopping)."""


def sliced_wait(
    poll: Callable[[int], bool],
    cancelled: Callable[[], bool],
    timeout: float | None,
    slice_s: float = WAIT_SLICE_S,
) -> None:
    """Wait until ``poll(ms)`` reports data, in slices of ``slice_s``: raises ``TimeoutError``
    once ``timeout`` (``None``: no limit) passes and :class:`QueueShutDown` as soon as
    ``cancelled()`` says the queue was shut down."""
    deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
    while True:
        if cancelled():
            raise QueueShutDown(
                "the message queue was shut down while this process waited for a remote "
                "worker's message: the executor is stopping (the lines above say why: a worker "
                f"died, or '{LOST_PREFIX} ...')"
            )
        wait_s = slice_s if deadline is None else min(slice_s, deadline - time.monotonic())
        if poll(max(0, int(wait_s * 1000))):
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError


# ------------------------------------------------------------------ executor message
def executor_stopping_message(ended: list[tuple[str, int, int | None]]) -> str:
    """``ended``: ``(process name, global rank, exit status)`` of the local workers that ended
    (a negative status is the signal that killed it, as ``multiprocessing`` reports it)."""
    parts = []
    for name, rank, code in ended:
        if code == LOST_PEER_EXIT_STATUS:
            parts.append(
                f"{name} (rank {rank}) ended with status {code}: it lost a peer rank (the "
                f"'{LOST_PREFIX} ...' line above names that rank and its node)"
            )
        elif code is not None and code < 0:
            parts.append(f"{name} (rank {rank}) was killed by signal {-code}")
        else:
            parts.append(f"{name} (rank {rank}) ended with status {code}")
    if not parts:
        parts.append("a worker process ended")
    return (
        "DSpark PP: stopping the engine: " + "; ".join(parts) + ". Requests in flight fail; "
        "restart every node of the deployment."
    )


def log_executor_stopping(workers: list[Any], join_s: float = 0.5) -> str:
    """Log :func:`executor_stopping_message` for the ended ones among vLLM's worker handles
    (each has ``proc`` and ``rank``). A process whose sentinel fired may not be reaped yet, so
    each is joined briefly; all joins share one ``join_s`` budget."""
    deadline = time.monotonic() + join_s
    ended = []
    for w in workers:
        proc = getattr(w, "proc", None)
        if proc is None:
            continue
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is not None:
            ended.append((proc.name, int(getattr(w, "rank", -1)), proc.exitcode))
    msg = executor_stopping_message(ended)
    _logger().error("%s", msg)
    return msg
