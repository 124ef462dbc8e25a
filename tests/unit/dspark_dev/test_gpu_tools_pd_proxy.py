"""dspark_dev/pd_proxy.py's request flow against fake prefill/decode/bootstrap servers on
loopback."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dspark_dev import pd_proxy

pytestmark = pytest.mark.timeout(60)


def serve(handler) -> tuple[ThreadingHTTPServer, str]:
    """``handler`` served on a free loopback port by a daemon thread: the server and its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class Fake:
    """A loopback HTTP server that records POST bodies and answers with ``reply(path, body)``."""

    def __init__(self, reply):
        self.bodies: list[tuple[str, dict]] = []
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer(*reply(self.path, None))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append((self.path, body))
                self._answer(*reply(self.path, body))

        self.server, self.url = serve(H)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def post(url, body, timeout=20):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture
def fakes():
    made = []

    def make(reply):
        f = Fake(reply)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def test_prefill_then_decode_with_the_mooncake_keys(fakes):
    boot = fakes(
        lambda p, b: (200, {"0": {"engine_id": "eng-P", "worker_addr": {"0": {"0": "tcp://x:1"}}}})
    )
    pre = fakes(
        lambda p, b: (
            200,
            {"choices": [{"text": "x", "token_ids": [9]}], "kv_transfer_params": None},
        )
    )
    dec = fakes(lambda p, b: (200, {"choices": [{"text": "abc", "token_ids": [1, 2, 3]}]}))
    with pd_proxy.PDProxy(pre.url, dec.url, boot.url) as proxy:
        client = {
            "model": "m",
            "prompt": [5, 6, 7],
            "max_tokens": 3,
            "min_tokens": 2,
            "temperature": 0,
        }
        status, out = post(proxy.url + "/v1/completions", client)
        stats = dict(proxy.stats)
    assert status == 200 and out["choices"][0]["token_ids"] == [1, 2, 3]
    ((pp, pb),) = pre.bodies
    ((dp, db),) = dec.bodies
    assert pp == dp == "/v1/completions"
    # prefiller: one token, no streaming, KV kept for a remote decoder
    assert pb["max_tokens"] == 1 and pb["stream"] is False and "min_tokens" not in pb
    assert pb["kv_transfer_params"]["do_remote_decode"] is True
    assert pb["kv_transfer_params"]["do_remote_prefill"] is False
    tid = pb["kv_transfer_params"]["transfer_id"]
    # decoder: the client's request unchanged except the pull instructions
    assert db["max_tokens"] == 3 and db["min_tokens"] == 2 and db["prompt"] == [5, 6, 7]
    kv = db["kv_transfer_params"]
    assert kv == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": tid,
        "remote_engine_id": "eng-P",  # from the bootstrap's /query
        "remote_bootstrap_addr": boot.url,
    }
    assert stats == {
        "requests": 1, "prefill_ok": 1, "decode_ok": 1, "streamed": 0, "errors": [],
        "hops_recorded": 1, "hops_dropped": 0,
    }  # fmt: skip


def test_each_request_gets_its_own_transfer_id_and_prefill_params_are_kept(fakes):
    pre = fakes(
        lambda p, b: (
            200,
            {"choices": [{}], "kv_transfer_params": {"extra_key": 42, "remote_engine_id": None}},
        )
    )
    dec = fakes(lambda p, b: (200, {"choices": [{"token_ids": [1]}]}))
    with pd_proxy.PDProxy(pre.url, dec.url, "http://127.0.0.1:1", engine_id="given") as proxy:
        for _ in range(3):
            assert post(proxy.url + "/v1/completions", {"prompt": [1], "max_tokens": 2})[0] == 200
    tids = {b["kv_transfer_params"]["transfer_id"] for _, b in pre.bodies}
    assert len(tids) == 3
    assert [b["kv_transfer_params"]["transfer_id"] for _, b in dec.bodies] == [
        b["kv_transfer_params"]["transfer_id"] for _, b in pre.bodies
    ]
    kv = dec.bodies[0][1]["kv_transfer_params"]
    assert kv["extra_key"] == 42 and kv["remote_engine_id"] == "given"


def test_prefill_error_is_returned_and_decoder_never_called(fakes):
    pre = fakes(lambda p, b: (500, {"error": "boom"}))
    dec = fakes(lambda p, b: (200, {}))
    with pd_proxy.PDProxy(pre.url, dec.url, "http://127.0.0.1:1", engine_id="e") as proxy:
        status, out = post(proxy.url + "/v1/completions", {"prompt": [1]})
        errors = list(proxy.stats["errors"])
    assert status == 500 and out == {"error": "boom"}
    assert dec.bodies == [] and len(errors) == 1


def test_a_stuck_decoder_becomes_a_504_not_a_hang(fakes):
    pre = fakes(lambda p, b: (200, {"choices": [{}]}))

    def slow(p, b):
        time.sleep(5)
        return 200, {}

    dec = fakes(slow)
    with pd_proxy.PDProxy(
        pre.url, dec.url, "http://127.0.0.1:1", engine_id="e", timeout_s=1.0
    ) as proxy:
        t0 = time.monotonic()
        status, _ = post(proxy.url + "/v1/completions", {"prompt": [1]})
        took = time.monotonic() - t0
    assert status == 504 and took < 4


def test_unknown_routes_are_refused(fakes):
    pre = fakes(lambda p, b: (200, {}))
    with pd_proxy.PDProxy(pre.url, pre.url, "http://127.0.0.1:1", engine_id="e") as proxy:
        assert post(proxy.url + "/v1/other", {})[0] == 404
        with urllib.request.urlopen(proxy.url + "/health", timeout=5) as r:
            assert r.status == 200
    assert pre.bodies == []


class StreamingDecoder:
    """A decoder that answers with two server-sent events and sends the second only after the
    test says it saw the first through the proxy (``seen_first``): a proxy that buffered the
    answer would never pass the first on in time."""

    def __init__(self):
        self.seen_first = threading.Event()
        self.bodies: list[dict] = []
        dec = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                dec.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.write(b'data: {"choices": [{"text": "a"}]}\n\n')
                self.wfile.flush()
                dec.seen_first.wait(3.0)
                self.wfile.write(b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n')
                self.wfile.flush()

        self.server, self.url = serve(H)


def test_a_streaming_request_is_prefilled_then_relayed_as_it_arrives(fakes):
    pre = fakes(lambda p, b: (200, {"choices": [{}], "kv_transfer_params": {}}))
    dec = StreamingDecoder()
    body = {"prompt": [1, 2], "max_tokens": 4, "stream": True, "stream_options": {"x": 1}}
    try:
        with pd_proxy.PDProxy(pre.url, dec.url, "http://127.0.0.1:1", engine_id="e") as proxy:
            req = urllib.request.Request(
                proxy.url + "/v1/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(req, timeout=10) as r:
                t0 = time.monotonic()
                first = r.read1(65536)
                waited = time.monotonic() - t0
                dec.seen_first.set()
                rest = r.read()
            stats = dict(proxy.stats)
    finally:
        dec.seen_first.set()
        dec.server.shutdown()
        dec.server.server_close()
    assert first.startswith(b'data: {"choices": [{"text": "a"}]}') and waited < 2.5, (
        f"the first event came after {waited:.1f} s: the proxy held the stream back"
    )
    assert rest.endswith(b"data: [DONE]\n\n")
    ((_, pb),) = pre.bodies
    assert pb["stream"] is False and "stream_options" not in pb and pb["max_tokens"] == 1
    (db,) = dec.bodies
    assert (
        db["stream"] is True
        and db["max_tokens"] == 4
        and db["kv_transfer_params"]["do_remote_prefill"]
    )
    assert stats["streamed"] == stats["decode_ok"] == 1 and not stats["errors"], stats


def test_metrics_models_and_tokenize_are_the_decoders(fakes):
    pre = fakes(lambda p, b: (200, {"who": "prefill"}))
    dec = fakes(lambda p, b: (200, {"who": "decode", "path": p}))
    with pd_proxy.PDProxy(pre.url, dec.url, "http://127.0.0.1:1", engine_id="e") as proxy:
        for path in ("/metrics", "/v1/models"):
            with urllib.request.urlopen(proxy.url + path, timeout=5) as r:
                assert json.loads(r.read()) == {"who": "decode", "path": path}
        status, out = post(proxy.url + "/tokenize", {"prompt": "x"})
    assert status == 200 and out == {"who": "decode", "path": "/tokenize"}
    assert pre.bodies == [] and dec.bodies == [("/tokenize", {"prompt": "x"})]


def test_bootstrap_listing_two_engines_is_an_error(fakes):
    boot = fakes(lambda p, b: (200, {"0": {"engine_id": "a"}, "1": {"engine_id": "b"}}))
    with pytest.raises(RuntimeError, match="exactly one"):
        pd_proxy.query_engine_id(boot.url)


class SlowStream:
    """A decoder that streams two events, the first ``first_s`` after the request and the
    second ``gap_s`` after the first."""

    def __init__(self, first_s: float, gap_s: float):
        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                time.sleep(first_s)
                self.wfile.write(b'data: {"choices": [{"text": "a"}]}\n\n')
                self.wfile.flush()
                time.sleep(gap_s)
                self.wfile.write(b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n')
                self.wfile.flush()

        self.server, self.url = serve(H)


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_each_hop_of_a_request_is_timed_at_the_proxy(fakes):
    """Prefill 0.3 s, the decoder's first event 0.2 s after the decode is sent, the last 0.4 s
    after that: each shows up in its own hop. Sleeps bound a hop from below when both its ends
    are measured from one send (a slow machine only lengthens them); the gap between the two
    events is not such a bound (the proxy may read the first event late, CI once saw 199.3 ms
    for a 200 ms gap), so it gets half the sleep as slack and stays only a check that the
    first token is marked at the first event, not at the last."""

    def slow_prefill(p, b):
        time.sleep(0.3)
        return 200, {"choices": [{}]}

    pre = fakes(slow_prefill)
    dec = SlowStream(first_s=0.2, gap_s=0.4)
    plain = fakes(lambda p, b: (time.sleep(0.1), (200, {"choices": [{"text": "c"}]}))[1])
    failing = fakes(lambda p, b: (500, {"error": "boom"}))
    try:
        with pd_proxy.PDProxy(pre.url, dec.url, "http://127.0.0.1:1", engine_id="e") as proxy:
            req = urllib.request.Request(
                proxy.url + "/v1/completions",
                data=json.dumps({"prompt": [1], "max_tokens": 2, "stream": True}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.read().endswith(b"data: [DONE]\n\n")
            proxy.decode_url = plain.url  # a non-streamed answer
            assert post(proxy.url + "/v1/completions", {"prompt": [1]})[0] == 200
            proxy.prefill_url = failing.url  # a prefill that fails
            assert post(proxy.url + "/v1/completions", {"prompt": [1]})[0] == 500
            every = get_json(proxy.url + "/hops")["hops"]
            later = get_json(proxy.url + "/hops?start=1")["hops"]
            bad_start = urllib.request.urlopen(proxy.url + "/hops?start=x", timeout=5)
    except urllib.error.HTTPError as e:
        bad_start = e
    finally:
        dec.server.shutdown()
        dec.server.server_close()
    assert bad_start.code == 400
    assert len(every) == 3 and later == every[1:]
    streamed, whole, failed = every
    assert set(streamed) == {"t0", "stream", "ok", *pd_proxy.HOP_KEYS}
    assert streamed["stream"] and streamed["ok"] and whole["ok"] and not whole["stream"]
    for h in (streamed, whole):
        times = [h[k] for k in pd_proxy.HOP_KEYS]
        assert times == sorted(times) and times[0] >= 0.0, h
        assert h["prefill_answered"] - h["prefill_sent"] >= 300.0, h
    assert streamed["first_token"] - streamed["decode_sent"] >= 200.0, streamed
    assert streamed["last_token"] - streamed["decode_sent"] >= 600.0, streamed
    assert streamed["last_token"] - streamed["first_token"] >= 200.0, streamed
    assert whole["first_token"] == whole["last_token"] >= whole["decode_sent"] + 100.0, whole
    assert streamed["t0"] <= whole["t0"] <= failed["t0"]
    # the failed request: its prefill was sent and never answered, nothing else happened
    assert not failed["ok"] and failed["prefill_sent"] is not None
    assert [failed[k] for k in pd_proxy.HOP_KEYS[1:]] == [None] * 4


def test_concurrent_requests_reach_the_prefiller_together(fakes):
    """Issue 29's first hypothesis, answered for the proxy: six clients at once must have six
    prefills in flight at once (the fake prefiller answers none until all six arrived; a proxy
    that serialized requests would break the barrier)."""
    n = 6
    barrier = threading.Barrier(n, timeout=5.0)

    def together(p, b):
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            return 500, {"error": "the prefills did not overlap"}
        return 200, {"choices": [{}]}

    pre = fakes(together)
    dec = fakes(lambda p, b: (200, {"choices": [{"text": "x"}]}))
    with pd_proxy.PDProxy(pre.url, dec.url, "http://127.0.0.1:1", engine_id="e") as proxy:
        answers: list[int] = []
        clients = [
            threading.Thread(
                target=lambda: answers.append(post(proxy.url + "/v1/completions", {"p": 1})[0])
            )
            for _ in range(n)
        ]
        for t in clients:
            t.start()
        for t in clients:
            t.join(20)
        hops = proxy.hops()
    assert answers == [200] * n, answers
    sent = max(h["t0"] + h["prefill_sent"] / 1e3 for h in hops)
    answered = min(h["t0"] + h["prefill_answered"] / 1e3 for h in hops)
    assert sent <= answered, "a prefill was answered before the last one was sent"
