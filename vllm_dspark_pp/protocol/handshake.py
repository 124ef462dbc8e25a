"""Start-up agreement across every rank of the world (TP x PP, and DP).

Every PP rank must run the same exchange code, or the ranks post different collectives and the
first mismatched step hangs; the TP ranks of one stage must agree with each other too (they run
the same drafter and sample the same drafts). Right after the PP groups exist (when the model
runner builds its ``PPHandler``), every rank of vLLM's world group (all TP x PCP x PP ranks, on
every DP rank) publishes the facts that shape the exchange:

    protocol (vllm_dspark_pp.version.PROTOCOL_VERSION), plugin version, vLLM version,
    pp_size, tp_size, method, num_speculative_tokens (k), fixed_graph_batch,
    adaptive_verification, admitted_lag, tap_partials (how aux taps cross the stages:
    tap_partials.py)

with its coordinates as vLLM's groups report them. The last rank of the world (the last PP
stage's last TP rank: the referee, chosen by :func:`referee`) compares each rank's facts with its
own and publishes one verdict; on any difference every rank raises :class:`HandshakeError` with
the same message naming the rank (PP rank, TP rank, global rank: :mod:`.world`) and the field.
It logs the one ``PP handshake: N ranks agree (...) over TP=.. x PP=..`` line of the deployment.

No collective is posted, so no rank can wait on a collective another rank never posts. Nothing
here can block forever:

* the messages go through the key-value store every process of the job already shares (the
  store ``torch.distributed`` was initialised with), read only after a non-blocking ``check``
  says they are there; every wait polls with a deadline. (Gloo point-to-point was tried first:
  its works only complete inside a ``wait``, and a timed-out ``wait`` closes the connections of
  the whole group, so the verdict could no longer reach the ranks that did answer.)
* a rank without the plugin publishes nothing: the referee stops waiting after the timeout
  and publishes a verdict naming the silent rank, so every rank that runs the plugin fails;
* if the referee itself runs without the plugin, the others stop waiting for its verdict
  (timeout plus a grace period) and fail, naming it.

A rank without the plugin cannot be made to fail by us; it is stopped when the engine sees the
other ranks' workers fail (the executor tears every worker down).

Timeout: ``VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S`` (default 120 seconds).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from vllm_dspark_pp import envs
from vllm_dspark_pp.protocol.world import WorldShape, layout_mismatch
from vllm_dspark_pp.version import PROTOCOL_VERSION, __version__

DEFAULT_TIMEOUT_S = envs.HANDSHAKE_TIMEOUT_DEFAULT_S
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
    "admitted_lag",
    "tp_size",
    "tap_partials",
)


class HandshakeError(RuntimeError):
    """The ranks disagree on something that shapes the token exchange, or one is silent."""


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
    tp_size: int = 1
    # which shipped count a verify step applies (VLLM_DSPARK_PP_ADAPTIVE_LAG; 0 when no counts
    # ship): ranks that differ would build different verify batches
    admitted_lag: int = 0
    tap_partials: str = "0"  # VLLM_DSPARK_PP_TAP_PARTIALS (protocol/tap_partials.py)


def facts_from_config(vllm_config: Any) -> HandshakeFacts:
    import vllm

    from vllm_dspark_pp.protocol.adaptive_config import resolve_adaptive_lag, ships_admitted_counts
    from vllm_dspark_pp.protocol.graph_batch import fixed_graph_batch

    spec = vllm_config.speculative_config
    ships = ships_admitted_counts(vllm_config)
    return HandshakeFacts(
        protocol=PROTOCOL_VERSION,
        plugin_version=__version__,
        vllm_version=vllm.__version__,
        pp_size=vllm_config.parallel_config.pipeline_parallel_size,
        method=None if spec is None else spec.method,
        num_speculative_tokens=0 if spec is None else int(spec.num_speculative_tokens or 0),
        fixed_graph_batch=fixed_graph_batch(vllm_config),
        adaptive_verification=ships,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        admitted_lag=resolve_adaptive_lag(vllm_config) if ships else 0,
        tap_partials=envs.VLLM_DSPARK_PP_TAP_PARTIALS,
    )


def timeout_s() -> float:
    return envs.VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S


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
    # One namespace per group of ranks (the world) and per handshake of that group in this
    # process (every rank handshakes the same number of times, so the counters agree).
    key = tuple(ranks)
    if epoch is None:
        epoch = _epochs[key] = _epochs.get(key, 0) + 1
    return f"vllm_dspark_pp/handshake/v{PROTOCOL_VERSION}/{'-'.join(map(str, ranks))}/{epoch}"


def referee(ranks: list[int]) -> int:
    """The index (in ``ranks``) of the rank that judges: the last one. Every rank calls this
    same function on the same list, so all of them agree on who judges and who answers."""
    return len(ranks) - 1


def compare(ref: dict, ref_rank: int, others: dict[int, dict], shape: WorldShape) -> list[str]:
    """One line per (rank, field) that differs from the referee's facts (ranks are indices in
    the handshake's group, named through ``shape``)."""
    problems = []
    for r in sorted(others):
        facts = others[r]
        for f in FIELDS:
            if facts.get(f) != ref.get(f):
                problems.append(
                    f"{shape.label(r)} has {f}={facts.get(f)!r} but {shape.label(ref_rank)} (last) "
                    f"has {f}={ref.get(f)!r}"
                )
    return problems


def _fix_hint(shape: WorldShape) -> str:
    return (
        f" Every rank ({shape.world_size} ranks: {shape.describe()}, on every node) must run "
        "the same vLLM and vllm-dspark-pp releases (pip install the same versions on every node, "
        "and keep VLLM_PLUGINS the same) and get the same --speculative-config and parallel "
        "sizes."
    )


def run_handshake(
    facts: HandshakeFacts | dict,
    *,
    rank_in_group: int,
    ranks: list[int],
    store: Any,
    timeout: float | None = None,
    epoch: int | None = None,
    shape: WorldShape | None = None,
    coords: dict[str, int] | None = None,
) -> None:
    """Run the handshake over ``ranks`` (global ranks; vLLM's world group, or one PP group when
    ``shape`` is left out); raises :class:`HandshakeError` on every rank if the ranks disagree or
    one is silent. ``store`` is a ``torch.distributed`` store all of them share; ``coords`` are
    this rank's coordinates as vLLM's groups report them (checked against ``shape``)."""
    mine = asdict(facts) if isinstance(facts, HandshakeFacts) else dict(facts)
    world = len(ranks)
    if world <= 1:
        return
    shape = shape or WorldShape.pp_only(world)
    if shape.world_size != world:
        raise ValueError(f"{shape} does not describe a group of {world} ranks")
    timeout = timeout_s() if timeout is None else timeout
    deadline = time.monotonic() + timeout
    prefix = _prefix(ranks, epoch)
    last = referee(ranks)
    verdict_key = f"{prefix}/verdict"
    if rank_in_group != last:
        store.set(f"{prefix}/rank{rank_in_group}", _encode({**mine, "coords": coords}))
        # Wait longer than the referee does, so its verdict about a silent third rank arrives
        # before this rank gives up on it.
        try:
            missing, lost = _poll(store, [verdict_key], deadline + verdict_grace_s(timeout)), ""
        except _StoreLost as exc:
            missing, lost = {verdict_key}, f" (the rendezvous store failed while waiting: {exc})"
        if missing:
            raise HandshakeError(
                f"vllm-dspark-pp start-up handshake: {shape.label(last)} (last) sent no verdict "
                f"within {timeout + verdict_grace_s(timeout):.0f} s{lost}. It probably runs "
                f"without vllm-dspark-pp (not installed, or left out of VLLM_PLUGINS) or with an "
                f"incompatible release; install the same vllm-dspark-pp on every node. "
                f"({TIMEOUT_ENV} sets the wait.)"
            )
        verdict = _decode(store.get(verdict_key)) or {"ok": False, "message": "unreadable verdict"}
        if not verdict.get("ok"):
            raise HandshakeError(verdict.get("message", "handshake failed"))
        return

    keys = {r: f"{prefix}/rank{r}" for r in range(world) if r != last}
    try:
        missing = _poll(store, list(keys.values()), deadline)
    except _StoreLost as exc:
        raise HandshakeError(
            f"vllm-dspark-pp start-up handshake: the rendezvous store failed while "
            f"{shape.label(last)} (last) waited for the other ranks: {exc}"
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
        f"{shape.label(r)} sent no handshake within {timeout:.0f} s: it probably runs without "
        f"vllm-dspark-pp (not installed, or left out of VLLM_PLUGINS)"
        for r in silent
    ]
    problems += [f"{shape.label(r)} sent an unreadable handshake" for r in unreadable]
    problems += compare(mine, last, received, shape)
    for r, msg in sorted([*received.items(), (last, {"coords": coords})]):
        problem = layout_mismatch(shape, r, msg.get("coords"))
        if problem:
            problems.append(problem)
    if problems:
        message = "vllm-dspark-pp start-up handshake failed: " + "; ".join(problems) + "."
        message += _fix_hint(shape)
        if any("admitted_lag=" in p for p in problems):
            message += (
                " Set VLLM_DSPARK_PP_ADAPTIVE_LAG to the same value on every node (unset, it "
                "follows the scheduling: 2 with async scheduling, 1 without; pass the same "
                "--async-scheduling / --no-async-scheduling to every launcher)."
            )
        store.set(verdict_key, _encode({"ok": False, "message": message}))
        raise HandshakeError(message)
    store.set(verdict_key, _encode({"ok": True}))
    _logger().info(
        "PP handshake: %d ranks agree (protocol %s, vLLM %s, method %s, k=%s, fixed graph batch "
        "%s, adaptive verification %s) over %s",
        world,
        mine.get("protocol"),
        mine.get("vllm_version"),
        mine.get("method"),
        mine.get("num_speculative_tokens"),
        mine.get("fixed_graph_batch"),
        mine.get("adaptive_verification"),
        shape.describe(),
    )


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.dspark_pp.handshake")


def default_store() -> Any:
    """The store ``torch.distributed`` was initialised with (shared by every process)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def run_pp_handshake(
    vllm_config: Any, timeout: float | None = None, epoch: int | None = None
) -> None:
    """Handshake over vLLM's world group: every TP x PCP x PP rank of every DP rank (called by
    the model runner patch when PP > 1, after vLLM built its groups)."""
    from vllm_dspark_pp.protocol.world import vllm_world_position

    pos = vllm_world_position()
    if pos.shape.pp <= 1:
        return
    run_handshake(
        facts_from_config(vllm_config),
        rank_in_group=pos.rank_in_group,
        ranks=pos.ranks,
        store=default_store(),
        timeout=timeout,
        epoch=epoch,
        shape=pos.shape,
        coords=pos.reported,
    )
