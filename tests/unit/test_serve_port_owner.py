"""``wait_for_health`` trusts a ``/health`` only from its own server's process group.

On the H200 (2026-12-05) two concurrent groups were handed the same free port: the GSM8K launcher's
server answered ``/health`` for the DSV4 PP=2 deployment still capturing CUDA graphs, which then
sent its requests to the wrong server. Here a foreign server answers on the port while "our"
process (a sleeper in its own session) never listens: the wait must not report ready. The control
is a server started in the waited-on process's own session, which must be ready.
"""

from __future__ import annotations

import subprocess
import sys
import time

from dspark_dev.proc import kill_group, start_in_session
from dspark_dev.serve import free_port, port_served_by, wait_for_health

SERVER = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


def _start(argv: list[str]) -> subprocess.Popen:
    return start_in_session(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_listening(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 20
    while port_served_by(port, proc.pid) is not True:
        assert time.monotonic() < deadline, "test server never listened"
        time.sleep(0.1)


def test_foreign_health_is_not_ready_and_own_is():
    port = free_port()
    foreign = _start([sys.executable, "-c", SERVER, str(port)])
    ours = _start([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _wait_listening(port, foreign)
        assert port_served_by(port, ours.pid) is False
        url = f"http://127.0.0.1:{port}"
        # a foreign server's 200 must not count: the wait runs into its deadline instead
        assert wait_for_health(ours, url, time.monotonic() + 3, poll_s=0.2) == "late"
        # control: the same port, answered by the waited-on group itself
        assert wait_for_health(foreign, url, time.monotonic() + 10, poll_s=0.2) == "ready"
    finally:
        kill_group(foreign, grace_s=2)
        kill_group(ours, grace_s=2)


def test_free_port_draws_distinct_bindable_ports():
    ports = {free_port() for _ in range(20)}
    assert len(ports) >= 18 and all(20000 <= p < 60000 for p in ports)
