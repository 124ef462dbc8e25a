#!/usr/bin/env python3
"""Cost of the sliced remote wait (patches/distributed_device_communicators_shm_broadcast.py).

    python -m benchmarks.mq_remote_wait --out docs/results/mq_remote_wait.json

One vLLM ``MessageQueue`` writer with one remote reader (ZMQ over loopback TCP, as the engine
core reading the reply of a worker on another node). Each round the writer enqueues a batch of
messages (a dict of about 200 bytes, the size of a small step reply) and, once they arrived,
the reader dequeues them all, timed, alternately with vLLM 0.34.0's own ``dequeue`` and with the
patched one (same process, same queue). Reported: per-message dequeue time of each, medians over
the rounds, and the difference. This times only the reader's extra work (the shutdown check and
the sliced poll), not the network; it runs on CPU anywhere.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--batch", type=int, default=200)
    args = ap.parse_args()

    from dspark_dev.mq_pair import remote_queue_pair
    from vllm_dspark_pp.patches import _util, apply_all

    apply_all()
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    writer, reader = remote_queue_pair()
    patched = MessageQueue.dequeue
    stock = _util.original(MessageQueue, "dequeue")
    assert patched is not stock, "the patch is not installed"
    msg = {"req_ids": [f"req-{i}" for i in range(8)], "tokens": [[i] * 8 for i in range(8)]}

    per_msg: dict[str, list[float]] = {"stock": [], "patched": []}
    for i in range(args.rounds):
        for name, fn in (("stock", stock), ("patched", patched))[:: 1 if i % 2 else -1]:
            for _ in range(args.batch):
                writer.enqueue(msg)
            reader.remote_socket.poll(timeout=10_000)
            time.sleep(0.01)  # let the whole batch arrive
            t0 = time.perf_counter()
            for _ in range(args.batch):
                out = fn(reader, timeout=10)
            per_msg[name].append((time.perf_counter() - t0) / args.batch * 1e6)
            assert out == msg
    stock_us = statistics.median(per_msg["stock"])
    patched_us = statistics.median(per_msg["patched"])
    result = {
        "what": "remote MessageQueue.dequeue per message, vLLM 0.34.0 vs patched (sliced wait)",
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": platform.processor() or platform.machine(),
        "rounds": args.rounds,
        "batch": args.batch,
        "stock_us_median": round(stock_us, 2),
        "patched_us_median": round(patched_us, 2),
        "extra_us_per_message": round(patched_us - stock_us, 2),
        "stock_us_rounds": [round(x, 2) for x in per_msg["stock"]],
        "patched_us_rounds": [round(x, 2) for x in per_msg["patched"]],
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"stock {stock_us:.2f} us/message, patched {patched_us:.2f} us/message, "
        f"extra {patched_us - stock_us:+.2f} us ({args.out})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
