"""Every environment variable the plugin reads at run time, in one place (vLLM's ``vllm/envs.py``
is the model).

Read a knob as an attribute of this module (``envs.VLLM_DSPARK_PP_PEER_TIMEOUT_S``): each read
evaluates the variable then and returns it typed. The comment above each entry of
:data:`environment_variables` is its documentation; docs/knobs.md is generated from it (in a
checkout: ``python -m dspark_dev.knobs --markdown > docs/knobs.md``). Every runtime knob has the
prefix ``VLLM_DSPARK_PP_``; no other module of the package reads the environment
(tests/unit/repo/test_knobs.py checks both).

A renamed knob keeps its old name for one release (:data:`deprecated_environment_variables`): read
under its old name, it logs a deprecation warning once per process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S: float = 120.0
    VLLM_DSPARK_PP_PEER_TIMEOUT_S: float = 30.0
    VLLM_DSPARK_PP_ADMITTED_TIMEOUT_S: float = 60.0
    VLLM_DSPARK_PP_ADAPTIVE_PP: bool = False
    VLLM_DSPARK_PP_ADAPTIVE_LAG: int | None = None
    VLLM_DSPARK_PP_SKIP_PATCHES: str = ""
    VLLM_DSPARK_PP_STACKS_ON_SIGUSR1: bool = False
    VLLM_DSPARK_PP_DRAFT_DIGEST: int = 0
    VLLM_DSPARK_PP_TAP_PARTIALS: str = "0"
    VLLM_DSPARK_PP_TAP_SIDE_TIMEOUT_S: float = 60.0

PREFIX = "VLLM_DSPARK_PP_"
HANDSHAKE_TIMEOUT_DEFAULT_S = 120.0
PEER_TIMEOUT_DEFAULT_S = 30.0

#: Old name -> new name. The old name is still read (the new one wins where both are set) and
#: logs a deprecation warning; remove an entry one release after the rename.
deprecated_environment_variables: dict[str, str] = {
    # renamed after 0.1.0 (one prefix for runtime knobs); the old name goes in 0.3.0
    "DSPARK_PP_STACKS_ON_SIGUSR1": "VLLM_DSPARK_PP_STACKS_ON_SIGUSR1",
}

_warned: set[str] = set()


def _warn_deprecated(old: str, new: str) -> None:
    if old in _warned:
        return
    _warned.add(old)
    from vllm.logger import init_logger

    init_logger("vllm.dspark_pp.envs").warning(
        "vllm-dspark-pp: the environment variable %s is deprecated and will be removed in the "
        "next release; set %s instead",
        old,
        new,
    )


def _raw(name: str) -> str | None:
    """The variable's value, read under its deprecated name too (with a warning)."""
    for old, new in deprecated_environment_variables.items():
        if new == name and old in os.environ:
            _warn_deprecated(old, new)
            if name not in os.environ:
                return os.environ[old]
    return os.environ.get(name)


def parse_peer_timeout_s(raw: str | None) -> float:
    """``VLLM_DSPARK_PP_PEER_TIMEOUT_S`` from its text: unset or blank is the default; anything
    but a finite number >= 0 raises ``ValueError`` naming the variable."""
    name = "VLLM_DSPARK_PP_PEER_TIMEOUT_S"
    if raw is None or raw.strip() == "":
        return PEER_TIMEOUT_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0.0 or value == float("inf"):
        raise ValueError(
            f"{name}={raw!r} is not a number of seconds >= 0; use e.g. "
            f"{name}={PEER_TIMEOUT_DEFAULT_S:.0f} (the default), or 0 to turn the peer "
            "watch off"
        )
    return value


def _handshake_timeout_s() -> float:
    raw = _raw("VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S")
    return float(raw) if raw else HANDSHAKE_TIMEOUT_DEFAULT_S


def _admitted_timeout_s() -> float:
    raw = _raw("VLLM_DSPARK_PP_ADMITTED_TIMEOUT_S")
    return float("60" if raw is None else raw)


def _tap_side_timeout_s() -> float:
    """``VLLM_DSPARK_PP_TAP_SIDE_TIMEOUT_S``: seconds > 0; unset or blank is 60; anything else
    raises ``ValueError`` naming the variable."""
    name = "VLLM_DSPARK_PP_TAP_SIDE_TIMEOUT_S"
    raw = _raw(name)
    if raw is None or raw.strip() == "":
        return 60.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0.0 or value == float("inf"):
        raise ValueError(
            f"{name}={raw!r} is not a number of seconds > 0; use e.g. 60 (the default)"
        )
    return value


def parse_adaptive_lag(raw: str | None) -> int | None:
    """``VLLM_DSPARK_PP_ADAPTIVE_LAG`` from its text: unset or blank is ``None`` (chosen from the
    scheduling: ``protocol.adaptive_config.resolve_adaptive_lag``); 0, 1 or 2; anything else
    raises ``ValueError`` naming the variable."""
    name = "VLLM_DSPARK_PP_ADAPTIVE_LAG"
    if raw is None or raw.strip() == "":
        return None
    if raw.strip() not in ("0", "1", "2"):
        raise ValueError(
            f"{name}={raw!r} is not 0, 1 or 2; leave it unset (2 with async scheduling, 1 "
            "without: counts decided early enough that no host waits for them) or set "
            f"{name}=0 (counts of the draft being verified; every stage's host waits for the "
            "last stage's draft)"
        )
    return int(raw)


environment_variables: dict[str, Callable[[], Any]] = {
    # Seconds the last PP rank waits at start-up for every other rank's handshake record before
    # it fails naming the silent ranks (the others wait that long plus a grace period for its
    # verdict). Also bounds the tap side channel's start-up links on CUDA (at least
    # VLLM_DSPARK_PP_TAP_SIDE_TIMEOUT_S). Empty: the default. (protocol/handshake.py,
    # protocol/tap_partials.py)
    "VLLM_DSPARK_PP_HANDSHAKE_TIMEOUT_S": _handshake_timeout_s,
    # Seconds of silence after which a PP rank's peer watch declares another rank lost and the
    # worker exits (status 70) instead of waiting for vLLM's execute timeout; heartbeats go every
    # timeout / 10 (at most 1 s). 0 turns the watch off; set the same value on every node.
    # Anything but a number >= 0 stops start-up. (protocol/liveness.py)
    "VLLM_DSPARK_PP_PEER_TIMEOUT_S": lambda: parse_peer_timeout_s(
        _raw("VLLM_DSPARK_PP_PEER_TIMEOUT_S")
    ),
    # Seconds a verify step waits on the host for admitted draft counts that were already
    # posted (adaptive verification under PP); a longer wait is a bug and fails the step.
    # (protocol/handler.py)
    "VLLM_DSPARK_PP_ADMITTED_TIMEOUT_S": _admitted_timeout_s,
    # "1": run adaptive verification under PP through the plugin in the covered configurations
    # (experimental until verified on a GPU; set it on every node). Anything else: vLLM's
    # refusal stands. (protocol/adaptive_config.py)
    "VLLM_DSPARK_PP_ADAPTIVE_PP": lambda: _raw("VLLM_DSPARK_PP_ADAPTIVE_PP") == "1",
    # Adaptive verification under PP: which decision of the last stage a verify step applies,
    # counted in the request's draft broadcasts before the one being verified. Unset (default):
    # 2 with async scheduling (vLLM may schedule a request's next round before the last stage
    # has drafted its previous one: seen on an H200, 2026-12-06, lag 1 waited in 5 of 10 verify
    # steps), else 1; either way every stage already holds it on its host, so no host waits for
    # counts. 0: the draft being verified (as before 2026-12-05; every stage's host waits for
    # the last stage's draft). Set the same value on every node (the start-up handshake checks
    # the resolved lag). (protocol/adaptive_config.py, protocol/handler.py)
    "VLLM_DSPARK_PP_ADAPTIVE_LAG": lambda: parse_adaptive_lag(_raw("VLLM_DSPARK_PP_ADAPTIVE_LAG")),
    # Diagnosis only: comma-separated patch names this process does not apply (docs/patches.md);
    # config_vllm cannot be skipped, and PP > 1 is refused unless only the lost-stage controls
    # are skipped. Empty: apply every patch. (patches/__init__.py)
    "VLLM_DSPARK_PP_SKIP_PATCHES": lambda: _raw("VLLM_DSPARK_PP_SKIP_PATCHES") or "",
    # "1": every process that loads the plugin prints the Python stack of each thread to stderr
    # on SIGUSR1 and goes on running (docs/bad-configs.md). Formerly DSPARK_PP_STACKS_ON_SIGUSR1
    # (still read, with a deprecation warning). (stack_dumps.py)
    "VLLM_DSPARK_PP_STACKS_ON_SIGUSR1": lambda: _raw("VLLM_DSPARK_PP_STACKS_ON_SIGUSR1") == "1",
    # Diagnosis only: N > 0 makes every PP rank log a running digest of the draft payloads it
    # posts (last stage) or receives (other stages) after every N-th one ("DSpark drafts digest:
    # <rank>: <count> draft posts, digest 0x..."), so that all TP x PP ranks can be checked to
    # have drafted and received the same drafts; each line syncs the exchange stream once.
    # Empty or 0: off. (protocol/draft_digest.py)
    "VLLM_DSPARK_PP_DRAFT_DIGEST": lambda: _draft_digest_every(_raw("VLLM_DSPARK_PP_DRAFT_DIGEST")),
    # How a PP target relays the drafter's aux taps of earlier stages. "0" (default until it has
    # run on a GPU): raw taps, as vLLM does. "auto": each stage sends one partial sum of the
    # drafter's first linear layer (W_s @ its taps, plus what it received) instead of its taps,
    # where that makes some stage boundary carry fewer rows; "1": wherever taps are relayed.
    # Drafters whose first op is not a known bias-free unquantized linear keep raw taps
    # (logged). "side": as "1", but each stage that makes taps sends its own W_s @ taps straight
    # to the last stage on a process group of its own (a side stream on CUDA), outside the
    # tensors the next stage's forward waits for; only the last stage's drafter waits for them
    # (falls back to "1", logged, where the last stage makes no tap of its own or prefill
    # context parallelism is on). Set the same value on every node (the start-up handshake
    # compares it). (protocol/tap_partials.py)
    "VLLM_DSPARK_PP_TAP_PARTIALS": lambda: parse_tap_partials(_raw("VLLM_DSPARK_PP_TAP_PARTIALS")),
    # Seconds the last PP stage's drafter waits on the host (CPU platform, gloo) for the side
    # channel's partial sums of a step whose senders already ran (VLLM_DSPARK_PP_TAP_PARTIALS=
    # side); a longer wait is a bug and stops the engine naming the knob. On CUDA the wait is a
    # stream dependency (the NCCL watchdog and the peer watch bound it). (protocol/tap_partials.py)
    "VLLM_DSPARK_PP_TAP_SIDE_TIMEOUT_S": lambda: _tap_side_timeout_s(),
}


def _draft_digest_every(raw: str | None) -> int:
    if raw is None or raw.strip() == "":
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"VLLM_DSPARK_PP_DRAFT_DIGEST={raw!r} is not a whole number >= 0; use e.g. 16 "
            "(a digest line every 16 draft posts) or 0 (off)"
        )
    return value


TAP_PARTIALS_VALUES = ("auto", "1", "0", "side")
#: unset or blank: raw taps (the partial sums have run on CPU only; docs/performance-bound.md)
TAP_PARTIALS_DEFAULT = "0"


def parse_tap_partials(raw: str | None) -> str:
    """``VLLM_DSPARK_PP_TAP_PARTIALS`` from its text: unset or blank is
    :data:`TAP_PARTIALS_DEFAULT`; anything but ``auto``, ``1``, ``0`` or ``side`` raises
    ``ValueError`` naming the variable."""
    value = TAP_PARTIALS_DEFAULT if raw is None or raw.strip() == "" else raw.strip().lower()
    if value not in TAP_PARTIALS_VALUES:
        raise ValueError(
            f"VLLM_DSPARK_PP_TAP_PARTIALS={raw!r} is not one of auto, 1, 0, side (auto: relay one "
            "partial sum where that sends fewer bytes; 1: wherever taps are relayed; 0: raw taps; "
            "side: partial sums sent straight to the last stage, off the critical path)"
        )
    return value


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables.keys())


def is_set(name: str) -> bool:
    """Whether the knob (or its deprecated name) is set in the environment."""
    if name not in environment_variables:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return name in os.environ or any(
        new == name and old in os.environ for old, new in deprecated_environment_variables.items()
    )
