"""One PP rank of the peer-watch tests (tests/unit/protocol/test_liveness.py), as a process.

``python -m support.liveness_peer --store-dir D --rank R --world W --timeout T [--busy S]
[--real-exit]`` sets up the watch of ``vllm_dspark_pp.protocol.liveness`` on loopback, its
records exchanged through :class:`DirStore` (the store interface the watch uses, over files in
``D``: no torch import, so a rank starts in a fraction of a second), and prints JSON lines on
stdout: ``{"event": "ready"}`` once
watching, ``{"event": "lost", "rank": R, "message": ...}`` when it declares a peer lost (then it
exits with status 70), ``{"event": "busy_done"}`` after ``--busy S`` seconds of pure-Python work
in the main thread (holding the GIL as much as Python lets it); then it waits until its stdin
closes. ``--real-exit`` reacts with the runtime's own
:func:`~vllm_dspark_pp.protocol.liveness.exit_on_loss` (vLLM's logger, on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


class DirStore:
    """``set`` / ``get`` / ``check`` of a ``torch.distributed`` store, one file per key."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key.encode().hex()

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else value
        tmp = self._path(key).with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(self._path(key))  # atomic: a reader sees all of it or nothing

    def get(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def check(self, keys: list[str]) -> bool:
        return all(self._path(k).exists() for k in keys)


def _emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store-dir", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--busy", type=float, default=0.0)
    ap.add_argument("--real-exit", action="store_true")
    args = ap.parse_args(argv)

    from vllm_dspark_pp.protocol import liveness

    store = DirStore(args.store_dir)

    def report(me: int, peer: liveness.Peer, reason: str) -> None:
        _emit(event="lost", rank=peer.rank, message=liveness.lost_message(me, peer, reason))
        os._exit(liveness.LOST_PEER_EXIT_STATUS)

    watch = liveness.start_watch(
        rank_in_group=args.rank,
        ranks=list(range(args.world)),
        store=store,
        host="127.0.0.1",
        node=args.rank,
        timeout=args.timeout,
        setup_timeout=60.0,
        on_lost=liveness.exit_on_loss if args.real_exit else report,
    )
    _emit(event="ready", watching=watch is not None)
    if args.busy:
        end, n = time.monotonic() + args.busy, 0
        while time.monotonic() < end:
            n += sum(i * i for i in range(2000))
        _emit(event="busy_done")
    sys.stdin.read()  # until the test closes it (or kills this process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
