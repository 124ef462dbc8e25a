"""A PD prefiller killed mid-transfer (issue 28, case 3, PD part): what each request saw.

tests/gpu/test_pd_kill_gpu.py sends requests to the decoder by hand (prefill on the producer,
then a streamed decode on the decoder, the keys of dspark_dev/pd_proxy.py) so that some are
decoding and some still have their KV on the producer when it is SIGKILLed. This module holds
the parts that are not serving (tests/unit/support/test_served_load.py checks them on CPU):

* :func:`outcome`: one request's ending as a word plus the evidence (completed / error /
  stalled / closed);
* :func:`tally`: how many requests of a group ended which way;
* :func:`connector_lines`: the decoder log's lines about the lost producer (Mooncake receive
  failures, request failures), so the record says which requests vLLM failed and why.
"""

from __future__ import annotations

import re

COMPLETED, ERROR, STALLED, CLOSED = "completed", "error", "stalled", "closed"
KINDS = (COMPLETED, ERROR, STALLED, CLOSED)


def outcome(stream: dict, expected_tokens: int) -> dict:
    """The ending of one streamed request. ``stream``: what
    :func:`support.reliability.stream_completion` returned, or ``{"exception": ...}`` when the
    client gave up (its socket timed out: the server sent nothing for that long), plus
    ``seconds``. ``expected_tokens``: the request's ``max_tokens`` with ``ignore_eos``."""
    seconds = stream.get("seconds")
    if stream.get("exception"):
        kind = STALLED if "timed out" in stream["exception"] else CLOSED
        return {"kind": kind, "detail": stream["exception"][:300], "seconds": seconds}
    if stream.get("status") not in (None, 200):
        detail = f"HTTP {stream['status']}: {str(stream.get('error'))[:300]}"
        return {"kind": ERROR, "detail": detail, "seconds": seconds}
    if stream.get("error"):
        return {"kind": ERROR, "detail": str(stream["error"])[:300], "seconds": seconds,
                "tokens": len(stream.get("token_ids") or [])}  # fmt: skip
    n = len(stream.get("token_ids") or [])
    if stream.get("done") and n == expected_tokens:
        return {"kind": COMPLETED, "tokens": n, "seconds": seconds}
    return {"kind": CLOSED, "detail": f"ended after {n} of {expected_tokens} tokens "
            f"({'[DONE]' if stream.get('done') else 'no [DONE]'})", "seconds": seconds}  # fmt: skip


def tally(outcomes: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in outcomes:
        out[o["kind"]] = out.get(o["kind"], 0) + 1
    return out


_CONNECTOR = re.compile(
    r"(mooncake|kv transfer|kv load|failed to (receive|recv|load)|remote|bootstrap|prefill)",
    re.IGNORECASE,
)
_LEVEL = re.compile(r"\b(ERROR|WARNING)\b")


def connector_lines(log_text: str, limit: int = 30) -> list[str]:
    """ERROR / WARNING lines of a decoder log that speak of the connector or the remote
    prefiller (vLLM's own words about the loss), first ``limit``."""
    out = [
        ln.strip()[:400]
        for ln in log_text.splitlines()
        if _LEVEL.search(ln) and _CONNECTOR.search(ln)
    ]
    return out[:limit]


# What vLLM 0.34.0's Mooncake producer logs when it frees the KV of a request that no decoder
# pulled within VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT (mooncake_connector.py,
# fetch_finished_sending_reqs; without a kv_lease_duration): the producer's request id and the
# timeout in seconds.
_EXPIRED = re.compile(r"Request (\S+) timed out after (\d+) seconds without being sent")


def expired_requests(log_text: str) -> list[tuple[str, int]]:
    """(producer request id, timeout s) of each request whose KV the producer freed because no
    decoder pulled it, in log order."""
    return [(m.group(1), int(m.group(2))) for m in _EXPIRED.finditer(log_text)]


def first_zero(samples: list[tuple[float, float | None]]) -> float | None:
    """The time of the first sample reading 0 after one read above 0 (KV usage polled as
    ``(seconds, usage)``): when held KV was freed; None if it never was (or never held)."""
    held = False
    for t, value in samples:
        if value is None:
            continue
        if value > 0:
            held = True
        elif held:
            return t
    return None
