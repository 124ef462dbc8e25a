"""Start-up agreement across pipeline-parallel ranks, over the PP group's CPU (gloo) group.

Every PP rank must run the same exchange code, or the ranks post different collectives and the
first mismatched step hangs. Right after the PP groups exist (when the model runner builds its
``PPHandler``), every rank sends the facts that shape the exchange to the last PP rank:

    protocol (vllm_dspark_pp.version.PROTOCOL_VERSION), plugin version, vLLM version,
    pp_size, method, num_speculative_tokens (k), fixed_graph_batch

The last rank compares each rank's facts with its own and sends every rank the same verdict; on
any difference every rank raises :class:`HandshakeError` with one message naming the rank and the
field. Nothing here can block forever:

* all messages are point-to-point with a tag of their own (vLLM's untagged CPU-group traffic can
  never be taken for a handshake) and a fixed size, and every wait polls with a deadline;
* a rank without the plugin sends nothing: the last rank stops waiting after the timeout and
  fails, naming the silent rank, and tells the ranks that did answer, so they fail too;
* if the last rank itself runs without the plugin, the others stop waiting for its verdict after
  the timeout and fail, naming it.

A rank without the plugin cannot be made to fail by us; it is stopped when the engine sees the
other ranks' workers fail (the executor tears every worker down).

Timeout: ``VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S`` (default 120 seconds).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from vllm_dspark_pp.version import PROTOCOL_VERSION, __version__

HANDSHAKE_TAG = 0x5D5  # a gloo tag of our own
_MAGIC = b"DSPKPP01"
_SIZE = 4096  # bytes per message, fixed
DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S"
FIELDS = (
    "protocol",
    "plugin_version",
    "vllm_version",
    "pp_size",
    "method",
    "num_speculative_tokens",
    "fixed_graph_batch",
)


class HandshakeError(RuntimeError):
    """The PP ranks disagree on something that shapes the token exchange, or one is silent."""


@dataclass(frozen=True)
class HandshakeFacts:
    protocol: int
    plugin_version: str
    vllm_version: str
    pp_size: int
    method: str | None
    num_speculative_tokens: int
    fixed_graph_batch: int | None


def facts_from_config(vllm_config: Any) -> HandshakeFacts:
    import vllm

    from vllm_dspark_pp.graph_batch import fixed_graph_batch

    spec = vllm_config.speculative_config
    return HandshakeFacts(
        protocol=PROTOCOL_VERSION,
        plugin_version=__version__,
        vllm_version=vllm.__version__,
        pp_size=vllm_config.parallel_config.pipeline_parallel_size,
        method=None if spec is None else spec.method,
        num_speculative_tokens=0 if spec is None else int(spec.num_speculative_tokens or 0),
        fixed_graph_batch=fixed_graph_batch(vllm_config),
    )


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    return float(raw) if raw else DEFAULT_TIMEOUT_S


def verdict_grace_s(timeout: float) -> float:
    return max(5.0, 0.5 * timeout)


def _encode(obj: dict) -> torch.Tensor:
    body = json.dumps(obj, sort_keys=True).encode()
    if len(body) > _SIZE - len(_MAGIC) - 4:
        raise HandshakeError("handshake message too long")
    raw = _MAGIC + len(body).to_bytes(4, "little") + body
    buf = torch.zeros(_SIZE, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def _decode(buf: torch.Tensor) -> dict | None:
    raw = bytes(buf.numpy().tobytes())
    if not raw.startswith(_MAGIC):
        return None
    n = int.from_bytes(raw[len(_MAGIC) : len(_MAGIC) + 4], "little")
    try:
        return json.loads(raw[len(_MAGIC) + 4 : len(_MAGIC) + 4 + n].decode())
    except (ValueError, UnicodeDecodeError):
        return None


def _wait_all(works: dict[int, Any], deadline: float) -> set[int]:
    """Poll until every work completes or the deadline passes; return the ranks still pending."""
    pending = set(works)
    while pending:
        for r in list(pending):
            if works[r].is_completed():
                works[r].wait()
                pending.discard(r)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    return pending


def compare(ref: dict, ref_rank: int, others: dict[int, dict]) -> list[str]:
    """One line per (rank, field) that differs from the last rank's facts."""
    problems = []
    for r in sorted(others):
        facts = others[r]
        for f in FIELDS:
            if facts.get(f) != ref.get(f):
                problems.append(
                    f"PP rank {r} has {f}={facts.get(f)!r} but PP rank {ref_rank} (last) has "
                    f"{f}={ref.get(f)!r}"
                )
    return problems


def _fix_hint(problems: list[str]) -> str:
    return (
        " Every PP rank must run the same vLLM and vllm-dspark-pp releases (pip install the "
        "same versions on every node, and keep VLLM_PLUGINS the same) and get the same "
        "--speculative-config."
    )


def run_handshake(
    facts: HandshakeFacts | dict,
    *,
    rank_in_group: int,
    ranks: list[int],
    cpu_group: Any,
    timeout: float | None = None,
) -> None:
    """Run the handshake for one PP group; raises :class:`HandshakeError` on any rank if the
    ranks disagree or one is silent. ``ranks`` are the group's global ranks, last = last stage."""
    mine = asdict(facts) if isinstance(facts, HandshakeFacts) else dict(facts)
    world = len(ranks)
    if world <= 1:
        return
    timeout = timeout_s() if timeout is None else timeout
    deadline = time.monotonic() + timeout
    last = world - 1
    if rank_in_group != last:
        send = dist.isend(
            _encode({"rank": rank_in_group, **mine}), ranks[last], cpu_group, HANDSHAKE_TAG
        )
        verdict_buf = torch.zeros(_SIZE, dtype=torch.uint8)
        recv = dist.irecv(verdict_buf, ranks[last], cpu_group, HANDSHAKE_TAG + 1)
        # Wait longer than the last rank does, so its verdict about a silent third rank
        # arrives before this rank gives up on it.
        if _wait_all({last: recv}, deadline + verdict_grace_s(timeout)):
            raise HandshakeError(
                f"vllm-dspark-pp start-up handshake: PP rank {last} (last) sent no verdict within "
                f"{timeout + verdict_grace_s(timeout):.0f} s. It probably runs without vllm-dspark-pp (not installed, or left "
                f"out of VLLM_PLUGINS) or with an incompatible release; install the same "
                f"vllm-dspark-pp on every node. ({TIMEOUT_ENV} sets the wait.)"
            )
        _wait_all({last: send}, deadline)
        verdict = _decode(verdict_buf) or {"ok": False, "message": "unreadable verdict"}
        if not verdict.get("ok"):
            raise HandshakeError(verdict.get("message", "handshake failed"))
        return

    bufs = {r: torch.zeros(_SIZE, dtype=torch.uint8) for r in range(last)}
    works = {r: dist.irecv(bufs[r], ranks[r], cpu_group, HANDSHAKE_TAG) for r in range(last)}
    silent = _wait_all(works, deadline)
    received: dict[int, dict] = {}
    unreadable = []
    for r in range(last):
        if r in silent:
            continue
        msg = _decode(bufs[r])
        if msg is None:
            unreadable.append(r)
        else:
            received[r] = msg
    problems = [
        f"PP rank {r} sent no handshake within {timeout:.0f} s: it probably runs without "
        f"vllm-dspark-pp (not installed, or left out of VLLM_PLUGINS)"
        for r in sorted(silent)
    ]
    problems += [f"PP rank {r} sent an unreadable handshake" for r in unreadable]
    problems += compare(mine, last, received)
    if problems:
        message = "vllm-dspark-pp start-up handshake failed: " + "; ".join(problems) + "."
        message += _fix_hint(problems)
        verdict = {"ok": False, "message": message}
    else:
        message = ""
        verdict = {"ok": True}
    sends = {
        r: dist.isend(_encode(verdict), ranks[r], cpu_group, HANDSHAKE_TAG + 1) for r in received
    }
    _wait_all(sends, time.monotonic() + min(timeout, 10.0))
    if problems:
        raise HandshakeError(message)


def run_pp_handshake(vllm_config: Any, timeout: float | None = None) -> None:
    """Handshake over vLLM's PP group (called by the model runner patch when PP > 1)."""
    from vllm.distributed.parallel_state import get_pp_group

    pp = get_pp_group()
    if pp.world_size <= 1:
        return
    run_handshake(
        facts_from_config(vllm_config),
        rank_in_group=pp.rank_in_group,
        ranks=list(pp.ranks),
        cpu_group=pp.cpu_group,
        timeout=timeout,
    )
