"""A small prefill -> decode proxy for two vLLM servers joined by MooncakeConnector (stdlib only).

For each ``POST /v1/completions`` (or ``/v1/chat/completions``) it

1. picks a fresh ``transfer_id`` and sends the request to the **prefiller** (kv_producer) with
   ``max_tokens=1``, no streaming, and ``kv_transfer_params = {"do_remote_decode": true,
   "do_remote_prefill": false, "transfer_id": ...}``; the prefiller computes the prompt's KV and
   keeps its blocks for the decoder to pull;
2. sends the original request to the **decoder** (kv_consumer) with ``kv_transfer_params =
   {"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": ...,
   "remote_engine_id": <prefiller engine id>, "remote_bootstrap_addr": <prefiller bootstrap
   URL>}`` (anything the prefiller returned in ``kv_transfer_params`` is kept underneath);
3. returns the decoder's answer.

These are the keys vLLM 0.34.0's MooncakeConnector reads (mooncake_connector.py:1132-1152,
1204-1250 scheduler side; the decoder queries ``<bootstrap>/query`` for the prefiller's workers,
:2810-2858). The prefiller's engine id is taken from its bootstrap server's ``/query`` unless given.

A streaming request (``"stream": true``, what ``vllm bench serve`` sends) is prefilled the same
way (the prefiller's copy never streams), then the decoder's event stream is relayed to the
client as it arrives, so the client's time to first token includes the prefill, the KV pull and
the decoder's first step. ``GET /metrics`` and ``GET /v1/models``, ``POST /tokenize`` and
``POST /detokenize`` are passed to the decoder (the engine that drafts and samples), so a
benchmark client that reads them sees the decoder's.

``GET /health`` answers 200; ``GET /stats`` gives the proxy's counters; ``GET /hops?start=N``
gives the per-hop times of every completion request from the N-th on (:data:`HOP_KEYS`, ms
after the request reached the proxy, ``None`` where a hop never happened), so a benchmark can
tell where a request's time went: the producer's queue and prefill, the hand-off, the decoder's
KV pull, queue and first step, the stream. Upstream errors come back
with the upstream status and body, and a timeout as 504, so a stuck server becomes a failed
request, never a hung client. The listen backlog is 256, so a burst of concurrent clients is
queued, not dropped into TCP retries.

Run standalone: ``python -m dspark_dev.pd_proxy --prefill http://127.0.0.1:8100 --decode
http://127.0.0.1:8200 --bootstrap http://127.0.0.1:8998 --port 8000``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROUTES = ("/v1/completions", "/v1/chat/completions")
DECODER_GETS = ("/metrics", "/v1/models")
DECODER_POSTS = ("/tokenize", "/detokenize")
#: What a hop record holds besides ``t0`` (the arrival, seconds since the epoch), ``stream`` and
#: ``ok``: ms after the arrival when the proxy sent the prefill, had the prefiller's answer,
#: sent the decode, read the decoder's first bytes of answer (a streamed answer: its first event,
#: the first token; otherwise the whole answer) and its last.
HOP_KEYS = ("prefill_sent", "prefill_answered", "decode_sent", "first_token", "last_token")
#: Records kept at most (one benchmark run is far below; beyond it new ones are counted only).
MAX_HOPS = 200_000


class Hop:
    """The hop times of one request (:data:`HOP_KEYS`), marked as they happen."""

    def __init__(self, stream: bool):
        self.t0 = time.time()
        self._start = time.perf_counter()
        self.stream = stream
        self.ok = False
        self.times: dict[str, float | None] = dict.fromkeys(HOP_KEYS)

    def mark(self, key: str, *, again: bool = False) -> None:
        """Now, as ``key``'s time: the first call counts, or with ``again`` the latest."""
        if again or self.times[key] is None:
            self.times[key] = round((time.perf_counter() - self._start) * 1e3, 3)

    def record(self) -> dict:
        return {"t0": round(self.t0, 6), "stream": self.stream, "ok": self.ok, **self.times}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256


class UpstreamError(Exception):
    def __init__(self, status: int, body: bytes, where: str):
        super().__init__(f"{where}: HTTP {status}: {body[:500]!r}")
        self.status, self.body, self.where = status, body, where


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        raise UpstreamError(e.code, e.read(), url) from e
    except (TimeoutError, urllib.error.URLError, OSError) as e:
        raise UpstreamError(
            504, json.dumps({"error": f"{url}: {type(e).__name__}: {e}"}).encode(), url
        ) from e


def prefill_request(body: dict, transfer_id: str) -> dict:
    """The prefiller's copy of a client request: one output token, KV kept for the decoder."""
    p = dict(body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p.pop("min_tokens", None)
    p["stream"] = False
    p.pop("stream_options", None)
    p["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    return p


def decode_request(
    body: dict, transfer_id: str, engine_id: str, bootstrap_addr: str, from_prefill: dict | None
) -> dict:
    """The decoder's copy: pull the prompt's KV from the prefiller, then generate."""
    params = dict(from_prefill or {})
    params.update(
        do_remote_prefill=True,
        do_remote_decode=False,
        transfer_id=transfer_id,
    )
    for key, value in (("remote_engine_id", engine_id), ("remote_bootstrap_addr", bootstrap_addr)):
        if not params.get(key):  # missing or null in what the prefiller returned
            params[key] = value
    d = dict(body)
    d["kv_transfer_params"] = params
    return d


def query_engine_id(bootstrap_addr: str, timeout: float = 5.0) -> str:
    """The prefiller's engine id as its Mooncake bootstrap server lists it."""
    with urllib.request.urlopen(bootstrap_addr.rstrip("/") + "/query", timeout=timeout) as r:
        data = json.loads(r.read().decode())
    ids = sorted({entry["engine_id"] for entry in data.values()})
    if len(ids) != 1:
        raise RuntimeError(
            f"bootstrap {bootstrap_addr} lists engine ids {ids}, expected exactly one"
        )
    return ids[0]


class PDProxy:
    def __init__(
        self,
        prefill_url: str,
        decode_url: str,
        bootstrap_addr: str,
        engine_id: str | None = None,
        *,
        timeout_s: float = 60.0,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.bootstrap_addr = bootstrap_addr.rstrip("/")
        self._engine_id = engine_id
        self.timeout_s = timeout_s
        self.stats = {
            "requests": 0, "prefill_ok": 0, "decode_ok": 0, "streamed": 0, "errors": [],
            "hops_recorded": 0, "hops_dropped": 0,
        }  # fmt: skip
        self._hops: list[dict] = []
        self._lock = threading.Lock()
        self._server = _Server((host, port), self._handler_class())
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def engine_id(self) -> str:
        if self._engine_id is None:
            self._engine_id = query_engine_id(self.bootstrap_addr)
        return self._engine_id

    def add_hop(self, hop: Hop) -> None:
        """Keep a finished request's hop record (:meth:`hops`)."""
        with self._lock:
            if len(self._hops) < MAX_HOPS:
                self._hops.append(hop.record())
                self.stats["hops_recorded"] += 1
            else:
                self.stats["hops_dropped"] += 1

    def hops(self, start: int = 0) -> list[dict]:
        """The hop records from the ``start``-th on, in the order the requests finished."""
        with self._lock:
            return list(self._hops[max(0, start) :])

    def prefill(self, path: str, body: dict, hop: Hop | None = None) -> dict:
        """Step 1 of a request: the prefiller computes the prompt's KV; returns the decoder's
        copy of the request (raises UpstreamError on an upstream failure)."""
        hop = hop or Hop(stream=bool(body.get("stream")))
        with self._lock:
            self.stats["requests"] += 1
        tid = f"dspark-pd-{uuid.uuid4().hex}"
        hop.mark("prefill_sent")
        p = _post(self.prefill_url + path, prefill_request(body, tid), self.timeout_s)
        hop.mark("prefill_answered")
        with self._lock:
            self.stats["prefill_ok"] += 1
        return decode_request(
            body, tid, self.engine_id, self.bootstrap_addr, p.get("kv_transfer_params")
        )

    def handle(self, path: str, body: dict, hop: Hop | None = None) -> dict:
        """Prefill then decode one request; raises UpstreamError on an upstream failure."""
        hop = hop or Hop(stream=False)
        dbody = self.prefill(path, body, hop)
        hop.mark("decode_sent")
        d = _post(self.decode_url + path, dbody, self.timeout_s)
        hop.mark("first_token")  # a whole answer: its first token came with its last
        hop.times["last_token"] = hop.times["first_token"]
        with self._lock:
            self.stats["decode_ok"] += 1
        return d

    def open_decode_stream(self, path: str, body: dict, hop: Hop | None = None):
        """Prefill, then open the decoder's streaming answer (an open HTTP response whose
        ``read1`` gives the event stream as it comes)."""
        hop = hop or Hop(stream=True)
        req = urllib.request.Request(
            self.decode_url + path,
            data=json.dumps(self.prefill(path, body, hop)).encode(),
            headers={"Content-Type": "application/json"},
        )
        hop.mark("decode_sent")
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            raise UpstreamError(e.code, e.read(), self.decode_url + path) from e
        except (TimeoutError, urllib.error.URLError, OSError) as e:
            raise UpstreamError(
                504, json.dumps({"error": f"{self.decode_url}: {type(e).__name__}: {e}"}).encode(),
                self.decode_url + path,
            ) from e  # fmt: skip

    def forward(self, method: str, path: str, data: bytes | None) -> tuple[int, bytes, str]:
        """``method path`` on the decoder, answer passed back as is."""
        req = urllib.request.Request(
            self.decode_url + path, data=data, method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return r.status, r.read(), r.headers.get("Content-Type", "application/json")
        except urllib.error.HTTPError as e:
            return e.code, e.read(), "application/json"
        except (TimeoutError, urllib.error.URLError, OSError) as e:
            return 504, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode(), "text/plain"

    def _handler_class(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            # each streamed event is a small write: without TCP_NODELAY, Nagle's algorithm and
            # the client's delayed ACK can hold an event back for tens of milliseconds
            disable_nagle_algorithm = True

            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, payload: bytes, ctype: str = "application/json"):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                if self.path == "/health":
                    return self._send(200, b"{}")
                if self.path == "/stats":
                    with proxy._lock:
                        return self._send(200, json.dumps(proxy.stats).encode())
                url = urllib.parse.urlsplit(self.path)
                if url.path == "/hops":
                    query = urllib.parse.parse_qs(url.query)
                    try:
                        start = int(query.get("start", ["0"])[0])
                    except ValueError:
                        return self._send(400, b'{"error": "start: not an integer"}')
                    return self._send(200, json.dumps({"hops": proxy.hops(start)}).encode())
                if self.path in DECODER_GETS:
                    return self._send(*proxy.forward("GET", self.path, None))
                return self._send(404, b'{"error": "not found"}')

            def _relay(self, upstream, hop: Hop) -> bool:
                """The decoder's event stream, chunk by chunk as it arrives (HTTP/1.0: the
                end of the answer is the end of the connection); False if it was cut."""
                with upstream:
                    self.send_response(upstream.status)
                    ctype = upstream.headers.get("Content-Type", "text/event-stream")
                    self.send_header("Content-Type", ctype)
                    self.send_header("Cache-Control", "no-cache")
                    self.end_headers()
                    try:
                        while True:
                            chunk = upstream.read1(65536)
                            if not chunk:
                                break
                            hop.mark("first_token")
                            hop.mark("last_token", again=True)
                            self.wfile.write(chunk)
                            self.wfile.flush()
                    except Exception as e:  # noqa: BLE001 - headers are out: end the answer
                        with proxy._lock:
                            proxy.stats["errors"].append(f"stream cut: {type(e).__name__}: {e}")
                        self.close_connection = True
                        return False
                with proxy._lock:
                    proxy.stats["decode_ok"] += 1
                    proxy.stats["streamed"] += 1
                return True

            def do_POST(self):
                n = int(self.headers.get("Content-Length", "0") or 0)
                raw = self.rfile.read(n) if n else b""
                if self.path in DECODER_POSTS:
                    return self._send(*proxy.forward("POST", self.path, raw))
                if self.path not in ROUTES:
                    return self._send(404, b'{"error": "not found"}')
                try:
                    body = json.loads(raw.decode() or "{}")
                except ValueError as e:
                    return self._send(400, json.dumps({"error": f"bad JSON: {e}"}).encode())
                hop = Hop(stream=bool(body.get("stream")))
                reply = None
                try:
                    reply = self._answer(body, hop)
                finally:  # kept before the answer goes out: a client that then asks sees it
                    proxy.add_hop(hop)
                if reply is not None:
                    self._send(*reply)

            def _answer(self, body: dict, hop: Hop) -> tuple[int, bytes] | None:
                """Prefill and decode; a streamed answer is relayed here (None), any other
                comes back as (status, body) for the caller to send."""
                try:
                    if body.get("stream"):
                        hop.ok = self._relay(proxy.open_decode_stream(self.path, body, hop), hop)
                        return None
                    out = proxy.handle(self.path, body, hop)
                except UpstreamError as e:
                    with proxy._lock:
                        proxy.stats["errors"].append(str(e)[:300])
                    return e.status, e.body or b"{}"
                except Exception as e:  # noqa: BLE001 - the client must get an answer
                    with proxy._lock:
                        proxy.stats["errors"].append(f"{type(e).__name__}: {e}"[:300])
                    return 502, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
                hop.ok = True
                return 200, json.dumps(out).encode()

        return Handler

    def start(self) -> PDProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> PDProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="prefiller base URL (kv_producer)")
    ap.add_argument("--decode", required=True, help="decoder base URL (kv_consumer)")
    ap.add_argument("--bootstrap", required=True, help="prefiller's Mooncake bootstrap URL")
    ap.add_argument("--engine-id", default=None, help="prefiller engine id (default: ask /query)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args(argv)
    proxy = PDProxy(
        a.prefill, a.decode, a.bootstrap, a.engine_id, timeout_s=a.timeout, host=a.host, port=a.port
    )
    print(f"pd_proxy on {proxy.url}: {a.prefill} -> {a.decode}", flush=True)
    try:
        proxy._server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
