"""The one readiness wait of every launcher (``dspark_dev.serve.wait_ready``).

* ready: a server that answers ``/health`` from its own process group returns the seconds waited;
* dead: a launcher that exits first (the server itself, or a watched headless stage) fails the
  wait at once with a :class:`ServerNotReady` naming it, its exit code and the tail of its log;
* late: past its timeout the wait fails naming the server and quoting its log, after a progress
  line on stdout;
* a ``/health`` from another process group does not count. On the H200 (2026-12-05) two
  concurrent groups were handed the same free port: the GSM8K launcher's server answered
  ``/health`` for the DSV4 PP=2 deployment still capturing CUDA graphs, which then sent its
  requests to the wrong server. Here a foreign server answers on the port while "our" process (a
  sleeper in its own session) never listens: the wait must not report ready. The control is the
  server that listens in its own session, which must be ready.
"""

from __future__ import annotations

import sys
import time

import pytest

from dspark_dev.serve import (
    CaseFailure,
    Server,
    ServerNotReady,
    free_port,
    port_served_by,
    wait_ready,
)

SERVER = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)
SLEEPER = "print('loading the weights', flush=True); import time; time.sleep(60)"


def _server(tmp_path, name: str, code: str, *args: str, port: int | None = None) -> Server:
    argv = [sys.executable, "-c", code, *args]
    return Server(argv, tmp_path / f"{name}.log", port=port, name=name, cpu=False, grace_s=2.0)


def _wait_log(srv: Server, text: str) -> None:
    deadline = time.monotonic() + 20
    while text not in srv.log_text():
        assert time.monotonic() < deadline, f"{srv.name} never printed {text!r}"
        time.sleep(0.05)


def test_a_server_answering_health_is_ready(tmp_path):
    port = free_port()
    with _server(tmp_path, "fake vllm serve", SERVER, str(port), port=port) as srv:
        waited = srv.wait_ready(20.0)
        assert 0.0 <= waited < 20.0
        assert port_served_by(port, srv.proc.pid) is True


def test_a_server_that_exits_fails_the_wait_naming_it_with_its_log(tmp_path):
    code = "print('ValueError: no such model', flush=True); raise SystemExit(3)"
    srv = _server(tmp_path, "engine A", code, port=free_port()).start()
    assert srv.wait_exit(20) == 3
    t0 = time.monotonic()
    with pytest.raises(ServerNotReady) as info:
        srv.wait_ready(60.0)
    assert time.monotonic() - t0 < 10.0, "a dead server must fail the wait at once"
    msg = str(info.value)
    assert "engine A exited with code 3" in msg and "ValueError: no such model" in msg, msg
    assert str(srv.log_path) in msg
    # the test tiers see a case failure, the tools (which catch RuntimeError) an error
    assert isinstance(info.value, CaseFailure) and isinstance(info.value, RuntimeError)


def test_a_watched_launcher_that_exits_fails_the_wait_naming_it(tmp_path):
    head = _server(tmp_path, "node 0", SLEEPER, port=free_port())
    stage = _server(tmp_path, "node 1 (headless)", "print('NCCL error', flush=True); exit(2)")
    with head, stage:
        assert stage.wait_exit(20) == 2
        with pytest.raises(ServerNotReady) as info:
            wait_ready(head, 60.0, watch=[stage])
    msg = str(info.value)
    assert "node 1 (headless) exited with code 2 before node 0 was ready" in msg, msg
    assert "NCCL error" in msg


def test_a_deployment_waits_for_its_head_and_watches_its_headless_nodes(tmp_path):
    from dspark_dev import pp_launch

    port = free_port()
    head = _server(tmp_path, "node 0", SERVER, str(port), port=port)
    with pp_launch.Deployment("dep", [head, _server(tmp_path, "node 1", SLEEPER)]) as dep:
        assert dep.wait_ready(20.0) >= 0.0
    lost = _server(tmp_path, "node 1 (headless)", "print('lost', flush=True); exit(4)")
    never = _server(tmp_path, "node 0", SLEEPER, port=free_port())
    with pp_launch.Deployment("dep", [never, lost]) as dep:
        assert lost.wait_exit(20) == 4
        with pytest.raises(ServerNotReady, match=r"node 1 \(headless\) exited with code 4"):
            dep.wait_ready(60.0)


def test_a_server_not_ready_in_time_fails_with_its_name_and_log(tmp_path, capsys):
    with _server(tmp_path, "slow engine", SLEEPER, port=free_port()) as srv:
        _wait_log(srv, "loading the weights")
        t0 = time.monotonic()
        with pytest.raises(ServerNotReady) as info:
            wait_ready(srv, 1.0, progress_every_s=0.3, poll_s=0.1)
        assert time.monotonic() - t0 < 15.0
    msg = str(info.value)
    assert "slow engine not ready after 1 s" in msg and "loading the weights" in msg, msg
    assert "waiting for slow engine" in capsys.readouterr().out


def test_a_headless_or_unstarted_launcher_cannot_be_waited_on(tmp_path):
    with pytest.raises(ValueError, match="never started"):
        _server(tmp_path, "x", SLEEPER, port=free_port()).wait_ready(1.0)
    with _server(tmp_path, "node 1", SLEEPER) as headless:
        with pytest.raises(ValueError, match="headless"):
            headless.wait_ready(1.0)


def test_foreign_health_is_not_ready_and_own_is(tmp_path):
    port = free_port()
    foreign = _server(tmp_path, "foreign", SERVER, str(port), port=port)
    ours = _server(tmp_path, "ours", "import time; time.sleep(60)", port=port)
    with foreign, ours:
        deadline = time.monotonic() + 20
        while port_served_by(port, foreign.proc.pid) is not True:
            assert time.monotonic() < deadline, "test server never listened"
            time.sleep(0.1)
        assert port_served_by(port, ours.proc.pid) is False
        # a foreign server's 200 must not count: the wait runs into its timeout instead
        with pytest.raises(ServerNotReady, match="ours not ready after 3 s"):
            wait_ready(ours, 3.0, poll_s=0.2)
        # control: the same port, answered by the waited-on group itself
        wait_ready(foreign, 10.0, poll_s=0.2)


def test_free_port_draws_distinct_bindable_ports():
    ports = {free_port() for _ in range(20)}
    assert len(ports) >= 18 and all(20000 <= p < 60000 for p in ports)
