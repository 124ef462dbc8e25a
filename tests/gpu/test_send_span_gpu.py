"""One GPU, two NCCL ranks (each its own process and ``NCCL_HOSTID``, sockets over loopback): the
benchmark hook's send span (``pp_send_ms``, benchmarks/dspark_bench_hooks.py ``_sends_done``)
with torch's real NCCL works.

Rank 1 posts its receive ``HOLD_S`` late. Rank 0 marks its stream, posts ``isend`` as vLLM's
``isend_tensor_dict`` does, asks the hook for the sends' completion mark, then records one more
event on its main stream (the next forward's first kernel, in a served stage). What must hold:

* the host returns at once (the hook makes no host wait);
* the main stream runs on: its next event completes while the send still waits for the receiver
  (the hook waits on a timing stream of its own);
* the span covers the receiver's lateness (from the mark before the send to the send's end).

Control, in the same pair of processes: the same send with the work waited on the current
stream, as a hook without its own timing stream would. The main stream's next event then
completes only after the send, and the second check above fails for it; the test asserts that
it does, so the check is shown to tell the two apart.

Run on the GPU machine:  DSPARK_GPU_ARTIFACTS=$OUT python -m pytest -m gpu -s
tests/gpu/test_send_span_gpu.py (the record ``send_span.json`` goes to ``$DSPARK_GPU_ARTIFACTS``,
else a temporary folder; the 2026-12-07 run at 892d101 predates the record and only printed).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from gpu_common import GpuRecord, require_cuda  # tests/gpu is on sys.path (see conftest)

pytestmark = pytest.mark.gpu

RECORD = GpuRecord("send_span.json")
HOLD_S = 1.0  # how late the receiver posts
NUMEL = 8 << 20  # bf16 elements per send: 16 MiB


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _completed_at(ev, limit_s: float = 30.0) -> float:
    """Host time at which ``ev`` is first seen complete (polled, never synchronized)."""
    t_end = time.perf_counter() + limit_s
    while not ev.query():
        if time.perf_counter() > t_end:
            raise TimeoutError("a CUDA event did not complete in 30 s")
        time.sleep(0.0005)
    return time.perf_counter()


def _rank(rank: int, port: int, out) -> None:
    os.environ.update(
        NCCL_HOSTID=f"dspark-send-span-{rank}", NCCL_SOCKET_IFNAME="lo",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    import torch
    import torch.distributed as dist

    from benchmarks import dspark_bench_hooks as hooks

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda:0"))
    x = torch.ones(NUMEL, device="cuda", dtype=torch.bfloat16)
    try:
        if rank == 0:  # the connection exists before anything is timed
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
        torch.cuda.synchronize()
        for mode in ("timing_stream", "control_current_stream"):
            dist.barrier()
            torch.cuda.synchronize()
            if rank == 1:
                time.sleep(HOLD_S)
                dist.recv(x, 0)
                torch.cuda.synchronize()
                continue
            a = hooks._mark()
            t0 = time.perf_counter()
            work = dist.isend(x, 1)
            if mode == "timing_stream":
                done = hooks._sends_done([None, work], {"x": x})
            else:
                work.wait()
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                done = ("cuda", ev)
            host_ms = (time.perf_counter() - t0) * 1e3
            nxt = torch.cuda.Event()
            nxt.record()  # the main stream's next work
            t_next, t_done = _completed_at(nxt), _completed_at(done[1])
            out.put({
                "mode": mode, "host_ms": host_ms, "span_ms": hooks._elapsed_ms(a, done),
                "next_before_done_ms": (t_done - t_next) * 1e3,
            })  # fmt: skip
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_send_span_waits_on_its_own_stream_with_real_nccl():
    require_cuda()
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(2):
            r = out.get(timeout=90)
            got[r["mode"]] = r
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    print("send span:", got)
    good, ctl = got["timing_stream"], got["control_current_stream"]
    hold_ms = HOLD_S * 1e3
    checks = {
        "no host wait": good["host_ms"] < 0.25 * hold_ms,
        "the main stream ran on": good["next_before_done_ms"] > 0.5 * hold_ms,
        "the span holds the receiver's lateness": good["span_ms"] > 0.8 * hold_ms,
        # the control: waited on the current stream, the next work waits for the send
        "control held the main stream back": ctl["next_before_done_ms"] < 0.1 * hold_ms,
        "both ranks exited 0": all(p.exitcode == 0 for p in procs),
    }
    for name, ok in checks.items():
        RECORD.verdict(name, ok, str(ctl if name.startswith("control") else good))
    RECORD.write(
        Path(__file__).resolve().parents[2], "tests/gpu/test_send_span_gpu.py",
        {"hold_s": HOLD_S, "bytes_per_send": 2 * NUMEL, **got},
        out=None, fallback=None, sources=("benchmarks/dspark_bench_hooks.py",),
    )  # fmt: skip
    assert all(checks.values()), {k: v for k, v in checks.items() if not v}
