"""Start-up agreement across pipeline-parallel ranks.

Every PP rank must run the same exchange code, or the ranks post different collectives and the
first mismatched step hangs. Right after the PP groups exist (when the model runner builds its
``PPHandler``), every rank publishes the facts that shape the exchange:

    protocol (vllm_dspark_pp.version.PROTOCOL_VERSION), plugin version, vLLM version,
    pp_size, method, num_speculative_tokens (k), fixed_graph_batch

The last PP rank compares each rank's facts with its own and publishes one verdict; on any
difference every rank raises :class:`HandshakeError` with the same message naming the rank and
the field. Nothing here can block forever:

* the messages go through the key-value store every process of the job already shares (the
  store ``torch.distributed`` was initialised with), read only after a non-blocking ``check``
  says they are there; every wait polls with a deadline. (Gloo point-to-point was tried first:
  its works only complete inside a ``wait``, and a timed-out ``wait`` closes the connections of
  the whole group, so the verdict could no longer reach the ranks that did answer.)
* a rank without the plugin publishes nothing: the last rank stops waiting after the timeout
  and publishes a verdict naming the silent rank, so every rank that runs the plugin fails;
* if the last rank itself runs without the plugin, the others stop waiting for its verdict
  (timeout plus a grace period) and fail, naming it.

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

from vllm_dspark_pp.version import PROTOCOL_VERSION, __version__

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
    "adaptive_verification",
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
    adaptive_verification: bool = False  # ships admitted counts (protocol/adaptive.py)


def facts_from_config(vllm_config: Any) -> HandshakeFacts:
    import vllm

    from vllm_dspark_pp.protocol.adaptive_config import ships_admitted_counts
    from vllm_dspark_pp.protocol.graph_batch import fixed_graph_batch

    spec = vllm_config.speculative_config
    return HandshakeFacts(
        protocol=PROTOCOL_VERSION,
        plugin_version=__version__,
        vllm_version=vllm.__version__,
        pp_size=vllm_config.parallel_config.pipeline_parallel_size,
        method=None if spec is None else spec.method,
        num_speculative_tokens=0 if spec is None else int(spec.num_speculative_tokens or 0),
        fixed_graph_batch=fixed_graph_batch(vllm_config),
        adaptive_verification=ships_admitted_counts(vllm_config),
    )


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    return float(raw) if raw else DEFAULT_TIMEOUT_S


def verdict_grace_s(timeout: float) -> float:
    return max(5.0, 0.5 * timeout)


def _encode(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True)


def _decode(raw: bytes) -> dict | None:
    try:
        obj = json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


class _StoreLost(Exception):
    """The rendezvous store failed while this rank waited (its host process went away)."""


def _poll(store: Any, keys: list[str], deadline: float) -> set[str]:
    """Wait until every key exists or the deadline passes; return the keys still missing.
    Only non-blocking ``check`` calls are made."""
    missing = set(keys)
    while missing:
        for key in list(missing):
            try:
                present = store.check([key])
            except Exception as exc:  # the store's host is gone: nobody can answer any more
                raise _StoreLost(f"{type(exc).__name__}: {exc}") from exc
            if present:
                missing.discard(key)
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return missing


_epochs: dict[tuple, int] = {}


def _prefix(ranks: list[int], epoch: int | None) -> str:
    # One namespace per PP group (there are TP x DP of them) and per handshake of that group in
    # this process (every rank handshakes the same number of times, so the counters agree).
    key = tuple(ranks)
    if epoch is None:
        epoch = _epochs[key] = _epochs.get(key, 0) + 1
    return f"vllm_dspark_pp/handshake/v{PROTOCOL_VERSION}/{'-'.join(map(str, ranks))}/{epoch}"


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
    store: Any,
    timeout: float | None = None,
    epoch: int | None = None,
) -> None:
    """Run the handshake for one PP group; raises :class:`HandshakeError` on every rank if the
    ranks disagree or one is silent. ``ranks`` are the group's global ranks (last = last stage);
    ``store`` is a ``torch.distributed`` store all of them share."""
    mine = asdict(facts) if isinstance(facts, HandshakeFacts) else dict(facts)
    world = len(ranks)
    if world <= 1:
        return
    timeout = timeout_s() if timeout is None else timeout
    deadline = time.monotonic() + timeout
    prefix = _prefix(ranks, epoch)
    last = world - 1
    verdict_key = f"{prefix}/verdict"
    if rank_in_group != last:
        store.set(f"{prefix}/rank{rank_in_group}", _encode(mine))
        # Wait longer than the last rank does, so its verdict about a silent third rank arrives
        # before this rank gives up on it.
        try:
            missing, lost = _poll(store, [verdict_key], deadline + verdict_grace_s(timeout)), ""
        except _StoreLost as exc:
            missing, lost = {verdict_key}, f" (the rendezvous store failed while waiting: {exc})"
        if missing:
            raise HandshakeError(
                f"vllm-dspark-pp start-up handshake: PP rank {last} (last) sent no verdict within "
                f"{timeout + verdict_grace_s(timeout):.0f} s{lost}. It probably runs without "
                f"vllm-dspark-pp (not installed, or left out of VLLM_PLUGINS) or with an "
                f"incompatible release; install the same vllm-dspark-pp on every node. "
                f"({TIMEOUT_ENV} sets the wait.)"
            )
        verdict = _decode(store.get(verdict_key)) or {"ok": False, "message": "unreadable verdict"}
        if not verdict.get("ok"):
            raise HandshakeError(verdict.get("message", "handshake failed"))
        return

    keys = {r: f"{prefix}/rank{r}" for r in range(last)}
    try:
        missing = _poll(store, list(keys.values()), deadline)
    except _StoreLost as exc:
        raise HandshakeError(
            f"vllm-dspark-pp start-up handshake: the rendezvous store failed while PP rank "
            f"{last} (last) waited for the other ranks: {exc}"
        ) from exc
    silent = sorted(r for r, k in keys.items() if k in missing)
    received: dict[int, dict] = {}
    unreadable = []
    for r, key in keys.items():
        if r in silent:
            continue
        msg = _decode(store.get(key))
        if msg is None:
            unreadable.append(r)
        else:
            received[r] = msg
    problems = [
        f"PP rank {r} sent no handshake within {timeout:.0f} s: it probably runs without "
        f"vllm-dspark-pp (not installed, or left out of VLLM_PLUGINS)"
        for r in silent
    ]
    problems += [f"PP rank {r} sent an unreadable handshake" for r in unreadable]
    problems += compare(mine, last, received)
    if problems:
        message = "vllm-dspark-pp start-up handshake failed: " + "; ".join(problems) + "."
        message += _fix_hint(problems)
        store.set(verdict_key, _encode({"ok": False, "message": message}))
        raise HandshakeError(message)
    store.set(verdict_key, _encode({"ok": True}))
    _logger().info(
        "PP handshake: %d ranks agree (protocol %s, vLLM %s, method %s, k=%s, fixed graph batch "
        "%s, adaptive verification %s)",
        world,
        mine.get("protocol"),
        mine.get("vllm_version"),
        mine.get("method"),
        mine.get("num_speculative_tokens"),
        mine.get("fixed_graph_batch"),
        mine.get("adaptive_verification"),
    )


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.dspark_pp.handshake")


def default_store() -> Any:
    """The store ``torch.distributed`` was initialised with (shared by every process)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


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
        store=default_store(),
        timeout=timeout,
    )
