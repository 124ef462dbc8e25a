"""The PP peer watch (vllm_dspark_pp/protocol/liveness.py): a lost peer is named at once, a
slow-but-alive peer is not declared lost before the timeout, the knob turns it off, stopping
never blocks, and the executor patch's stopping message names a worker that lost its peer.

The process test runs real ranks (tests/support/liveness_peer.py) on loopback, their records
exchanged through files; the bounds they assert are far from the values they separate
(a socket close is seen in well under the 30 s silence limit)."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_dspark_pp.protocol import liveness

ROOT = Path(__file__).resolve().parents[3]


# ------------------------------------------------------------------ ranks as processes
class Rank:
    def __init__(self, store_dir: str, rank: int, world: int, timeout: str, *extra: str):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "support.liveness_peer", "--store-dir", store_dir,
             "--rank", str(rank), "--world", str(world), "--timeout", timeout, *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, start_new_session=True,
        )  # fmt: skip
        self.events: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def next_event(self, timeout: float) -> dict | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def _start(store_dir, args: list[tuple[str, ...]]) -> list[Rank]:
    """One process per entry of ``args`` (``--timeout T`` and extras), all ready."""
    world = len(args)
    ranks = [Rank(str(store_dir), r, world, *a) for r, a in enumerate(args)]
    for r in ranks:
        ev = r.next_event(120)
        assert ev == {"event": "ready", "watching": True}, (ev, "".join(r.stderr)[-3000:])
    return ranks


def test_busy_peer_kept_stopped_peer_lost_after_its_timeout_dead_peer_named_at_once(tmp_path):
    """Rank 0 (30 s limit, the runtime's own exit), rank 1 (2 s limit), rank 2 (busy, then
    stopped). Rank 1 keeps the busy rank 2, declares the stopped rank 2 lost after its 2 s and
    not before, and exits; rank 0 names the dead rank 1 at once (long before its 30 s limit)
    with vLLM's logger and exits 70."""
    limit = 2.0
    ranks = _start(
        tmp_path, [("30", "--real-exit"), (str(limit),), ("30", "--busy", str(1.5 * limit))]
    )
    try:
        # Rank 2's main thread computes for 1.5x rank 1's limit: its heartbeats still go out.
        assert ranks[2].next_event(60) == {"event": "busy_done"}
        assert ranks[1].next_event(0.1) is None, "a busy peer was declared lost"
        os.killpg(ranks[2].proc.pid, signal.SIGSTOP)  # alive, socket open, silent
        assert ranks[1].next_event(0.5 * limit) is None, "declared lost before the timeout"
        lost = ranks[1].next_event(10 * limit)
        assert lost is not None and lost["event"] == "lost" and lost["rank"] == 2, lost
        assert "no heartbeat for 2 s" in lost["message"], lost
        t_lost = time.monotonic()
        assert ranks[1].proc.wait(timeout=10) == liveness.LOST_PEER_EXIT_STATUS
        # Rank 1's process is gone: rank 0 sees its socket close, with 30 s of silence allowed.
        assert ranks[0].proc.wait(timeout=60) == liveness.LOST_PEER_EXIT_STATUS
        seen_s = time.monotonic() - t_lost
        err = "".join(ranks[0].stderr)
        assert "DSpark PP: lost PP rank 1 (127.0.0.1:" in err, err[-3000:]
        assert "node 1, pid " in err and "the process ended" in err
        assert "This worker (PP rank 0) exits with status 70" in err
        assert seen_s < 20, f"rank 0 named the dead rank 1 only after {seen_s:.1f} s"
    finally:
        if ranks[2].proc.poll() is None:
            os.killpg(ranks[2].proc.pid, signal.SIGCONT)
        for r in ranks:
            r.kill()


# ------------------------------------------------------------------ in-process
def _pair(timeout: float, lost: list):
    a, b = socket.socketpair()
    peer_b = liveness.Peer(1, "127.0.0.1", 1, 1, 11)
    peer_a = liveness.Peer(0, "127.0.0.1", 2, 0, 10)
    wa = liveness.PeerWatch(0, {1: (a, peer_b)}, timeout, lambda *x: lost.append(x))
    wb = liveness.PeerWatch(1, {0: (b, peer_a)}, timeout, lambda *x: lost.append(x))
    return wa.start(), wb.start()


def _until(cond, limit_s: float) -> bool:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_stop_never_blocks_even_with_a_silent_peer():
    lost: list = []
    a, b = socket.socketpair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # never read: its buffer fills
    wa = liveness.PeerWatch(
        0, {1: (a, liveness.Peer(1, "h", 1, 1, 1))}, 30.0, lambda *x: lost.append(x)
    )
    wa.drain_s = 0.3
    wa.start()
    t0 = time.monotonic()
    wa.stop()
    # bounded by the drain (0.3 s), far below the 30 s peer timeout a blocking stop would take;
    # the slack is for a loaded CI machine
    assert time.monotonic() - t0 < 5.0
    assert _until(lambda: not wa.is_alive(), 5.0), "the watch thread did not end after stop()"
    assert not lost
    b.close()


def test_goodbye_then_close_is_orderly_and_close_without_goodbye_is_a_loss():
    lost: list = []
    wa, wb = _pair(30.0, lost)
    wb.stop()  # goodbye, then its thread closes the socket
    assert _until(lambda: not wa.is_alive() and not wb.is_alive(), 5.0)
    assert not lost
    lost2: list = []
    a, b = socket.socketpair()
    wa = liveness.PeerWatch(
        0, {1: (a, liveness.Peer(1, "h", 1, 1, 1))}, 30.0, lambda *x: lost2.append(x)
    ).start()
    b.close()  # the peer process died: no goodbye
    assert _until(lambda: bool(lost2), 5.0)
    me, peer, reason = lost2[0]
    assert (me, peer.rank, peer.name) == ("PP rank 0", 1, "PP rank 1")
    assert "the process ended" in reason


def _threads_named(name: str) -> int:
    return sum(t.name == name for t in threading.enumerate())


def test_knob_zero_opens_no_socket_and_starts_no_thread(monkeypatch):
    assert liveness.timeout_s("0") == 0.0
    assert liveness.timeout_s("") == liveness.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(liveness.TIMEOUT_ENV, "0")
    assert liveness.timeout_s() == 0.0
    store = torch.distributed.HashStore()
    opened = []
    monkeypatch.setattr(liveness, "_listen", lambda host: opened.append(host))
    before = _threads_named("DSparkPPPeerWatch")
    out = [None, None]

    def run(r):
        out[r] = liveness.start_watch(
            rank_in_group=r, ranks=[5, 6], store=store, host="127.0.0.1", node=r,
            setup_timeout=10.0, epoch=1,
        )  # fmt: skip

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert out == [None, None] and not opened
    assert _threads_named("DSparkPPPeerWatch") == before


def test_a_rank_with_the_watch_off_is_skipped_by_the_others():
    store = torch.distributed.HashStore()
    out: dict = {}

    def run(r, timeout):
        out[r] = liveness.start_watch(
            rank_in_group=r, ranks=[0, 1], store=store, host="127.0.0.1", node=r,
            timeout=timeout, setup_timeout=10.0, on_lost=lambda *x: None, epoch=1,
        )  # fmt: skip

    threads = [threading.Thread(target=run, args=a) for a in ((0, 0.0), (1, 5.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert out == {0: None, 1: None}


@pytest.mark.parametrize("raw", ["-1", "abc", "inf", "nan"])
def test_bad_knob_fails_naming_it(raw):
    with pytest.raises(liveness.PeerWatchError, match=liveness.TIMEOUT_ENV):
        liveness.timeout_s(raw)


def test_setup_fails_with_the_fix_when_a_peer_never_publishes():
    store = torch.distributed.HashStore()
    with pytest.raises(liveness.PeerWatchError, match="published no address.*VLLM_HOST_IP"):
        liveness.start_watch(
            rank_in_group=0, ranks=[0, 1], store=store, host="127.0.0.1", node=0,
            timeout=5.0, setup_timeout=0.3,
        )  # fmt: skip


def test_sliced_wait_gives_up_on_shutdown_and_keeps_its_timeout():
    shut = threading.Event()
    polls: list[int] = []

    def poll(ms: int) -> bool:
        polls.append(ms)
        time.sleep(ms / 1000)
        return False

    threading.Timer(0.2, shut.set).start()
    with pytest.raises(liveness.QueueShutDown, match="shut down"):
        liveness.sliced_wait(poll, shut.is_set, None, slice_s=0.1)
    assert max(polls) == 100
    with pytest.raises(TimeoutError):
        liveness.sliced_wait(poll, lambda: False, 0.25, slice_s=0.1)
    assert liveness.sliced_wait(lambda ms: True, lambda: False, None) is None


def _exit_with(code: int | None) -> None:
    if code is None:
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(code or 0)


def test_stopping_message_names_the_worker_that_lost_its_peer():
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_exit_with, args=(c,), name=f"VllmWorker-{i}")
             for i, c in enumerate((70, 0, None))]  # fmt: skip
    for p in procs:
        p.start()
        p.join(10)
    msg = liveness.log_executor_stopping(
        [SimpleNamespace(proc=p, rank=i) for i, p in enumerate(procs)]
    )
    assert "VllmWorker-0 (rank 0) ended with status 70: it lost a peer rank" in msg
    assert "VllmWorker-1 (rank 1) ended with status 0" in msg
    assert "VllmWorker-2 (rank 2) was killed by signal 9" in msg


def test_executor_patch_wires_the_watch_and_the_message(monkeypatch):
    from vllm_dspark_pp.patches import apply_all

    apply_all()
    from vllm.v1.executor import multiproc_executor as mpe

    calls = []
    monkeypatch.setattr(liveness, "stop_all", lambda: calls.append("stop_all"))
    monkeypatch.setattr(liveness, "log_executor_stopping", lambda w: calls.append(("log", w)))
    # WorkerProc.shutdown ends with vLLM's destroy_model_parallel / destroy_distributed_environment:
    # in this process they would tear down the session's one-process world (support.vllm_configs
    # dist_env) under every later test that builds vLLM layers.
    monkeypatch.setattr(mpe, "destroy_model_parallel", lambda: calls.append("destroy_mp"))
    monkeypatch.setattr(mpe, "destroy_distributed_environment", lambda: calls.append("destroy_env"))
    worker = SimpleNamespace(
        rpc_broadcast_mq=None, worker_response_mq=None, worker=SimpleNamespace(shutdown=list)
    )
    mpe.WorkerProc.shutdown(worker)
    assert calls == ["stop_all", "destroy_mp", "destroy_env"]
    del calls[1:]
    ex = mpe.MultiprocExecutor.__new__(mpe.MultiprocExecutor)
    ex.is_failed, ex.workers = True, []
    ex.shutdown()
    assert calls[1] == ("log", [])
    ex.shutdown()  # already shutting down: logged once
    assert len(calls) == 2
