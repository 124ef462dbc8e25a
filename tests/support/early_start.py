"""Launchers started ahead of the tests that use them (a pytest plugin: tests/conftest.py loads it
with ``pytest_plugins``), so a ``vllm serve`` start-up overlaps an earlier test that leaves a core
of the 2-core machine idle.

A ``vllm serve`` start-up imports vLLM in its processes one after the other (API server, engine
core, then the workers), which keeps about one core busy; so does an earlier launcher test while
it starts, and a launcher test that waits for a handshake timeout keeps none. A test module
registers its server (:func:`register`: a factory that builds the :class:`dspark_dev.serve.Server`
without starting it, the node id ends of the tests during whose call it may start, and a check
that the session is ready for it); when the session reaches the call of the first of those tests,
and a test of the module that uses the server is still to run, the server is started (only
started: its readiness is waited for by the module's fixture, :func:`take`). A session that
selects none of those tests starts the server in the module's fixture as before. A server started
early and never taken (its tests failed to set up, or the session stopped) is stopped at the end
of the session.

Only servers whose result does not depend on timing belong here: the one started early runs
beside the earlier test, and each takes longer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dspark_dev.serve import Server


@dataclass
class _Early:
    factory: Callable[[], Server]
    start_with: tuple[str, ...]
    used_by: str
    ready: Callable[[], bool]


_REGISTERED: dict[str, _Early] = {}
_STARTED: dict[str, Server] = {}  # started early, not taken yet
_TRIGGERED: set[str] = set()  # started early once (a server starts early at most once)


def register(
    name: str,
    factory: Callable[[], Server],
    *,
    start_with: tuple[str, ...],
    used_by: str,
    ready: Callable[[], bool] = lambda: True,
) -> None:
    """Start ``factory()`` during the call of the first test whose node id ends with one of
    ``start_with``, when a test whose node id contains ``used_by`` is still to run and ``ready()``
    holds (say, the shared engine runs it must not run beside are done)."""
    _REGISTERED[name] = _Early(factory, tuple(start_with), used_by, ready)


def take(name: str) -> Server | None:
    """The server ``name`` if it was started early (the caller owns it from now on), else None."""
    return _STARTED.pop(name, None)


def _still_to_run(item, used_by: str) -> bool:
    items = item.session.items
    later = items[items.index(item) + 1 :] if item in items else items
    return any(used_by in i.nodeid and not i.get_closest_marker("skip") for i in later)


def pytest_runtest_call(item):
    for name, early in _REGISTERED.items():
        if name in _TRIGGERED or not any(item.nodeid.endswith(s) for s in early.start_with):
            continue
        if _still_to_run(item, early.used_by) and early.ready():
            _TRIGGERED.add(name)
            _STARTED[name] = early.factory().start()
            print(f"[early start] {name} started beside {item.nodeid}", flush=True)


def pytest_sessionfinish(session, exitstatus):
    while _STARTED:
        _, server = _STARTED.popitem()
        server.stop(grace_s=5.0)
