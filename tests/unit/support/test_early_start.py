"""support/early_start.py: a registered server starts once, during the call of the first trigger
test, only when a test that uses it is still to run and the session is ready for it; the fixture
takes it; one never taken is stopped at the session's end."""

from __future__ import annotations

import pytest
from support import early_start


class FakeServer:
    def __init__(self, log: list) -> None:
        self.log = log

    def start(self) -> FakeServer:
        self.log.append("start")
        return self

    def stop(self, grace_s: float | None = None) -> bool:
        self.log.append("stop")
        return True


class Item:
    def __init__(self, nodeid: str, session, skipped: bool = False) -> None:
        self.nodeid, self.session, self.skipped = nodeid, session, skipped

    def get_closest_marker(self, name: str):
        return object() if (name == "skip" and self.skipped) else None


class Session:
    def __init__(self, *ids: str, skipped: tuple[str, ...] = ()) -> None:
        self.items = [Item(i, self, i in skipped) for i in ids]


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(early_start, "_REGISTERED", {})
    monkeypatch.setattr(early_start, "_STARTED", {})
    monkeypatch.setattr(early_start, "_TRIGGERED", set())
    log: list = []
    ready = {"ok": True}
    early_start.register(
        "srv",
        lambda: FakeServer(log),
        start_with=("a.py::t1", "b.py::t2"),
        used_by="c.py::",
        ready=lambda: ready["ok"],
    )
    return log, ready


def _call_all(session) -> None:
    for item in session.items:
        early_start.pytest_runtest_call(item)


def test_starts_once_at_the_first_trigger_and_is_taken(registry):
    log, _ = registry
    session = Session("a.py::t0", "a.py::t1", "b.py::t2", "c.py::t3")
    early_start.pytest_runtest_call(session.items[0])
    assert log == []  # not a trigger
    _call_all(session)
    assert log == ["start"]  # the second trigger does not start it again
    server = early_start.take("srv")
    assert isinstance(server, FakeServer)
    assert early_start.take("srv") is None
    early_start.pytest_sessionfinish(session, 0)
    assert log == ["start"]  # taken: the fixture stops it, not the session


def test_no_start_without_a_later_user_or_when_not_ready(registry):
    log, ready = registry
    _call_all(Session("a.py::t1", "b.py::t2"))  # c.py not selected
    _call_all(Session("c.py::t3", "a.py::t1"))  # its user ran before the trigger
    _call_all(Session("a.py::t1", "c.py::t3", skipped=("c.py::t3",)))  # its user is skipped
    ready["ok"] = False
    _call_all(Session("a.py::t1", "c.py::t3"))
    assert log == []
    assert early_start.take("srv") is None


def test_a_server_never_taken_is_stopped_at_the_end(registry):
    log, _ = registry
    session = Session("a.py::t1", "c.py::t3")
    _call_all(session)
    early_start.pytest_sessionfinish(session, 0)
    assert log == ["start", "stop"]
    assert early_start.take("srv") is None
