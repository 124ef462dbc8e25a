#!/usr/bin/env python3
"""Mooncake's transports between two processes on one GPU, measured without vLLM (issue 44 item 6).

    python3 tools/gpu/mooncake_probe.py --out $OUT/mooncake_probe.json [--mib 256] [--chunk-kib 64]

For each transport (``tcp``: Mooncake's choice without RDMA cards, ``MC_FORCE_TCP=1``;
``nvlink_intra``: ``MC_INTRANODE_NVLINK=1``, CUDA IPC copies between processes on one host),
a receiver and a sender process each start a ``mooncake.engine.TransferEngine`` on GPU 0 (P2P
handshake, no metadata server), register a cudaMalloc'd buffer, and the sender writes its buffer
into the receiver's, first as one transfer and then as a batch of ``--chunk-kib`` pieces (the
shape of a KV pull: many block-sized copies). The receiver checks every byte against the pattern
the sender wrote. Printed and written: per transport and shape, GiB/s over ``--repeats`` writes
(each timed), whether the bytes arrived, and the error where a transport failed to start.
Each process ends within ``--timeout-s``; nothing is left running.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TRANSPORTS = {
    "tcp": ("tcp", {"MC_FORCE_TCP": "1"}),
    "nvlink_intra": ("nvlink_intra", {"MC_INTRANODE_NVLINK": "1"}),
}


def pattern_value(repeat: int) -> int:
    """The byte the sender fills its buffer with before write ``repeat`` (never 0: the receiver's
    buffer starts zeroed, so a write that did not land is seen)."""
    return 1 + (repeat * 37) % 255


def summary(times_s: list[float], nbytes: int) -> dict:
    """GiB/s of each timed write, median and spread."""
    rates = [nbytes / t / 2**30 for t in times_s if t > 0]
    if not rates:
        return {"writes": 0}
    return {
        "writes": len(rates),
        "gib_s_median": round(statistics.median(rates), 3),
        "gib_s_min": round(min(rates), 3),
        "gib_s_max": round(max(rates), 3),
    }


def _engine(protocol: str):
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize(..., {protocol!r}) returned {rc}")
    return engine


def _receiver(protocol: str, env: dict, nbytes: int, conn) -> None:
    os.environ.update(env)
    try:
        import torch

        buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
        engine = _engine(protocol)
        if engine.register_memory(buf.data_ptr(), nbytes) != 0:
            raise RuntimeError("register_memory failed on the receiver")
        conn.send(("ready", engine.get_rpc_port(), buf.data_ptr()))
        while True:
            msg = conn.recv()
            if msg[0] == "check":
                torch.cuda.synchronize()
                want = msg[1]
                bad = int((buf != want).sum().item())
                conn.send(("checked", bad))
                buf.zero_()
                torch.cuda.synchronize()
            elif msg[0] == "stop":
                break
    except Exception as exc:  # reported to the parent, which records it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _sender(protocol: str, env: dict, nbytes: int, chunk: int, repeats: int, conn, peer) -> None:
    os.environ.update(env)
    try:
        import torch

        buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        engine = _engine(protocol)
        if engine.register_memory(buf.data_ptr(), nbytes) != 0:
            raise RuntimeError("register_memory failed on the sender")
        port, dst = peer
        target = f"127.0.0.1:{port}"
        out = {}
        for shape in ("whole", "chunks"):
            times, bad_total = [], 0
            for r in range(repeats):
                buf.fill_(pattern_value(r))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if shape == "whole":
                    rc = engine.transfer_sync_write(target, buf.data_ptr(), dst, nbytes)
                else:
                    offs = range(0, nbytes, chunk)
                    rc = engine.batch_transfer_sync_write(
                        target,
                        [buf.data_ptr() + o for o in offs],
                        [dst + o for o in offs],
                        [min(chunk, nbytes - o) for o in offs],
                    )
                dt = time.perf_counter() - t0
                if rc != 0:
                    raise RuntimeError(f"{shape} write {r} returned {rc}")
                conn.send(("check", pattern_value(r)))
                bad_total += conn.recv()
                times.append(dt)
            out[shape] = {**summary(times[1:] or times, nbytes), "bad_bytes": bad_total}
        conn.send(("done", out))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def probe(name: str, nbytes: int, chunk: int, repeats: int, timeout_s: float) -> dict:
    protocol, env = TRANSPORTS[name]
    ctx = mp.get_context("spawn")
    r_parent, r_child = ctx.Pipe()
    s_parent, s_child = ctx.Pipe()
    recv = ctx.Process(target=_receiver, args=(protocol, env, nbytes, r_child), daemon=True)
    recv.start()
    result: dict = {"protocol": protocol, "env": env, "bytes": nbytes, "chunk_bytes": chunk}
    send = None
    deadline = time.monotonic() + timeout_s
    try:
        if not r_parent.poll(timeout_s):
            raise TimeoutError(f"receiver not ready in {timeout_s} s")
        msg = r_parent.recv()
        if msg[0] == "error":
            raise RuntimeError(f"receiver: {msg[1]}")
        peer = (msg[1], msg[2])
        send = ctx.Process(
            target=_sender, args=(protocol, env, nbytes, chunk, repeats, s_child, peer), daemon=True
        )
        send.start()
        while True:  # relay the sender's checks to the receiver until the sender is done
            left = deadline - time.monotonic()
            if left <= 0 or not s_parent.poll(left):
                raise TimeoutError(f"sender did not finish in {timeout_s} s")
            msg = s_parent.recv()
            if msg[0] == "check":
                r_parent.send(msg)
                if not r_parent.poll(max(1.0, deadline - time.monotonic())):
                    raise TimeoutError("receiver did not check in time")
                got = r_parent.recv()
                if got[0] == "error":
                    raise RuntimeError(f"receiver: {got[1]}")
                s_parent.send(got[1])
            elif msg[0] == "error":
                raise RuntimeError(f"sender: {msg[1]}")
            else:
                result.update(msg[1])
                result["ok"] = all(v.get("bad_bytes", 1) == 0 for v in msg[1].values())
                break
    except Exception as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        try:
            r_parent.send(("stop",))
        except OSError:
            pass
        for p in (send, recv):
            if p is not None:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    return result


def meta(argv: list[str]) -> dict:
    """What the record says about its run: commit (``DSPARK_GPU_COMMIT``, else git), date, GPU
    (nvidia-smi), the command line."""

    def _out(cmd: list[str]) -> str:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else ""

    here = Path(__file__).resolve().parents[2]
    commit = os.environ.get("DSPARK_GPU_COMMIT") or _out(
        ["git", "-C", str(here), "rev-parse", "--short", "HEAD"]
    )
    return {
        "test": "tools/gpu/mooncake_probe.py",
        "commit": commit or "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": _out(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]) or "unknown",
        "command": " ".join(["python3 tools/gpu/mooncake_probe.py", *argv]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mib", type=int, default=256, help="bytes per write, MiB")
    ap.add_argument("--chunk-kib", type=int, default=64, help="piece size of the batched write")
    ap.add_argument(
        "--repeats", type=int, default=4, help="writes per shape (the first is warm-up)"
    )
    ap.add_argument("--timeout-s", type=float, default=60.0, help="per transport")
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    nbytes, chunk = args.mib * 2**20, args.chunk_kib * 2**10
    results = {}
    for name in args.transports.split(","):
        t0 = time.monotonic()
        results[name] = probe(name, nbytes, chunk, args.repeats, args.timeout_s)
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"mooncake_probe {name}: {json.dumps(results[name])}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**meta(argv), "transports": results}, indent=1) + "\n")
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
