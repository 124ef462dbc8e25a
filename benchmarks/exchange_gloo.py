#!/usr/bin/env python3
"""The PP token exchange itself, timed on CPU over gloo: stock vLLM 0.34.0 vs this plugin.

    python -m benchmarks.exchange_gloo --out docs/results/exchange_gloo.json [--md FILE]

Two processes (PP=2: rank 1 is the last stage, rank 0 receives), one decode step per iteration
with k drafts per request at N requests, for N in 1..64. What each side posts per step
(broadcasts from the last rank, in this order):

* stock (vllm/v1/worker/gpu/pp_utils.py ``PPHandler.broadcast``/``receive``/
  ``broadcast_drafts``): sampled ``[N, W]`` int64 with ``W = k + 1`` when the batch carries
  drafts and ``1`` otherwise (variable), ``torch.stack((num_sampled, num_rejected))`` ``[2, N]``
  int32 (its second row starts at byte ``4N``: 16-byte aligned only when N % 4 == 0), drafts
  ``[N, k]`` int64;
* ours (vllm_dspark_pp/protocol/schedule.py ``step_schedule``, posted by protocol/handler.py):
sampled
  ``[N, k + 1]`` int64 always, counts ``[2, round_up(N, 4)]`` int32 (both rows aligned), drafts
  ``[N, k]`` int64; the payload shapes come from ``step_schedule`` itself.

Timed: the wall time of the step's broadcasts on each rank (both ranks barrier-aligned first;
the receiver's time is reported, medians over ``--iters``). The receiving rank also checks the
payloads it got (values are step-dependent), so a wrong shape would fail, not time. This is
gloo over loopback TCP on this machine's CPU: it shows the bytes and the per-broadcast cost
of the protocol, not NCCL over NVLink (which the several-GPU run measures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def stock_payloads(n: int, k: int, with_drafts: bool = True) -> list[tuple[str, tuple, str]]:
    w = k + 1 if with_drafts else 1
    out = [("sampled", (n, w), "int64"), ("counts", (2, n), "int32")]
    if with_drafts:
        out.append(("drafts", (n, k), "int64"))
    return out


def ours_payloads(n: int, k: int) -> list[tuple[str, tuple, str]]:
    from types import SimpleNamespace

    import numpy as np

    from vllm_dspark_pp.protocol.schedule import ExchangeSpec, step_schedule

    batch = SimpleNamespace(
        num_reqs=n,
        num_computed_tokens_np=np.full(n, 200),
        num_scheduled_tokens=np.full(n, k + 1),
        prefill_len_np=np.full(n, 128),
        max_seq_len_np=None,
        is_prefilling_np=np.zeros(n, bool),
    )
    sched = step_schedule(ExchangeSpec(k), batch, num_spec_tokens=k)
    return [(p.name, p.shape, p.dtype) for p in sched.payloads]


def payload_bytes(payloads) -> int:
    size = {"int64": 8, "int32": 4}
    total = 0
    for _, shape, dt in payloads:
        n = size[dt]
        for d in shape:
            n *= d
        total += n
    return total


def misaligned_rows(payloads) -> int:
    """Row views (counts rows) a receiver hands to kernels that do not start on 16 bytes."""
    bad = 0
    for name, shape, dt in payloads:
        if name == "counts":
            row_bytes = shape[1] * (4 if dt == "int32" else 8)
            bad += sum(1 for r in range(shape[0]) if (r * row_bytes) % 16)
    return bad


def _worker(rank: int, world: int, init: str, ns: list[int], k: int, iters: int, q) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    dt = {"int64": torch.int64, "int32": torch.int32}
    src = world - 1
    res = []
    for n in ns:
        variants = {"stock": stock_payloads(n, k), "ours": ours_payloads(n, k)}
        times: dict[str, list[float]] = {v: [] for v in variants}
        for it in range(iters + 3):
            # alternate the order every step so drift on a shared machine hits both alike
            order = list(variants) if it % 2 == 0 else list(reversed(list(variants)))
            for variant in order:
                pays = variants[variant]
                bufs = []
                for i, (_, shape, d) in enumerate(pays):
                    if rank == src:
                        t = torch.full(shape, it * 10 + i, dtype=dt[d])
                    else:
                        t = torch.empty(shape, dtype=dt[d])
                    bufs.append(t)
                dist.barrier()
                t0 = time.perf_counter()
                for t in bufs:
                    dist.broadcast(t, src=src)
                el = time.perf_counter() - t0
                if rank != src:
                    for i, t in enumerate(bufs):
                        if not bool((t == it * 10 + i).all()):
                            raise AssertionError(f"{variant} N={n}: payload {i} corrupted")
                if it >= 3:
                    times[variant].append(el)
        if rank != src:
            for variant, pays in variants.items():
                ts = sorted(times[variant])
                res.append(
                    {
                        "variant": variant,
                        "N": n,
                        "k": k,
                        "bytes": payload_bytes(pays),
                        "broadcasts": len(pays),
                        "misaligned_rows": misaligned_rows(pays),
                        "us_median": 1e6 * statistics.median(ts),
                        "us_p90": 1e6 * ts[int(0.9 * (len(ts) - 1))],
                    }
                )
    if rank != src:
        q.put(res)
    dist.barrier()
    dist.destroy_process_group()


def run(ns: list[int], k: int, iters: int) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, path = tempfile.mkstemp(prefix="dspark-gloo-")
    os.close(fd)
    os.unlink(path)
    init = f"file://{path}"
    procs = [ctx.Process(target=_worker, args=(r, 2, init, ns, k, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return res


def markdown(rows: list[dict]) -> str:
    by = {(r["N"], r["variant"]): r for r in rows}
    lines = [
        "| N | stock bytes | ours bytes | stock misaligned rows | ours misaligned rows | "
        "stock us/step | ours us/step |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sorted({r["N"] for r in rows}):
        s, o = by.get((n, "stock")), by.get((n, "ours"))
        if not s or not o:
            continue
        lines.append(
            f"| {n} | {s['bytes']} | {o['bytes']} | {s['misaligned_rows']} | "
            f"{o['misaligned_rows']} | {s['us_median']:.0f} | {o['us_median']:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ns", default="1,2,3,4,8,16,31,32,48,64")
    ap.add_argument("-k", type=int, default=7)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    a = ap.parse_args(argv)
    ns = [int(x) for x in a.ns.split(",")]
    print(f"[exchange_gloo] N={ns} k={a.k} iters={a.iters} (2 processes, gloo)", flush=True)
    rows = run(ns, a.k, a.iters)
    md = markdown(rows)
    result = {
        "k": a.k,
        "iters": a.iters,
        "backend": "gloo (CPU, loopback)",
        "rows": rows,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    if a.md:
        a.md.write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
