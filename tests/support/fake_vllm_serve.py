"""A stand-in for ``vllm serve`` (stdlib, no model): what benchmarks/serve_pp_one_gpu.py's ``pd``
group talks to, so its orchestration runs end to end on a CPU machine without MooncakeConnector
(tests/unit/benchmarks/test_perf_pp_one_gpu.py, hand run), and the launchers of its PP and
interleaved runs (tests/unit/benchmarks/test_perf_pp_interleave.py, hand run: a ``--headless``
launcher only waits).
It answers ``/health``, ``/metrics`` (spec-decode
counters as a DSpark engine at AL 4 would count them; the decoder's external prefix-cache hits),
``/collective_rpc`` (the benchmark hook's commands), ``/v1/completions`` (JSON, or a streamed
answer of ``max_tokens`` tokens, four per event), and for a ``kv_producer`` a bootstrap
``/query`` on ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` naming the engine id of its
``--kv-transfer-config``; it prints the prefill-only producer's log markers.

    python tests/support/fake_vllm_serve.py MODEL [vllm serve arguments ...]
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: what a DSpark prefill-only producer logs (dspark_dev/pd_launch.PREFILL_MARKERS)
PRODUCER_LOG = "Built the context-KV-only DSpark drafter; the scheduler schedules no draft tokens"


class Quiet(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def send_body(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def use_instead_of_vllm_serve(monkeypatch, *modules) -> None:
    """Make each module's ``serve_argv`` (``dspark_dev.serve_demo``, ``dspark_dev.pp_launch``)
    start this stand-in with the same ``vllm serve`` arguments (a hand-run end-to-end test's
    set-up)."""
    import dspark_dev.serve_demo as serve_demo

    real = serve_demo.serve_argv

    def stand_in(target, **kw):
        argv = real(target, **kw)
        return [sys.executable, os.path.abspath(__file__), *argv[argv.index("serve") + 1 :]]

    for module in modules:
        monkeypatch.setattr(module, "serve_argv", stand_in)


def serve(port: int, handler) -> None:
    ThreadingHTTPServer.request_queue_size = 256
    srv = ThreadingHTTPServer(("127.0.0.1", port), handler)
    srv.daemon_threads = True
    srv.serve_forever()


def main(argv: list[str]) -> None:
    def opt(flag, default=None):
        return argv[argv.index(flag) + 1] if flag in argv else default

    if "--headless" in argv:  # a PP stage's launcher other than node 0: no API, runs until stopped
        print("stand-in vllm serve: headless", flush=True)
        while True:
            time.sleep(60)
    port = int(opt("--port"))
    kv = json.loads(opt("--kv-transfer-config", "{}"))
    role = kv.get("kv_role", "aggregated")
    spec = "--speculative-config" in argv
    counts = {"drafts": 0, "accepted": 0, "prompt": 0, "hits": 0}
    lock = threading.Lock()
    print(f"stand-in vllm serve: {role} on port {port}", flush=True)
    if role == "kv_producer":
        print(PRODUCER_LOG, flush=True)
        listing = json.dumps({"0": {"engine_id": kv["engine_id"]}}).encode()

        class Bootstrap(Quiet):
            def do_GET(self):
                self.send_body(200, listing)

        port_b = int(os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"])
        threading.Thread(target=serve, args=(port_b, Bootstrap), daemon=True).start()
    time.sleep(2.0)  # a start-up

    class Api(Quiet):
        def do_GET(self):
            if self.path == "/health":
                return self.send_body(200, b"{}")
            if self.path != "/metrics":
                return self.send_body(404, b"{}")
            with lock:
                page = (
                    f"vllm:spec_decode_num_drafts_total {counts['drafts']}\n"
                    f"vllm:spec_decode_num_draft_tokens_total {counts['drafts'] * 7}\n"
                    f"vllm:spec_decode_num_accepted_tokens_total {counts['accepted']}\n"
                    f"vllm:external_prefix_cache_hits_total {counts['hits']}\n"
                    f"vllm:prompt_tokens_total {counts['prompt']}\n"
                )
            return self.send_body(200, page.encode(), "text/plain")

        def do_POST(self):
            n = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(n) or b"{}")
            if self.path == "/collective_rpc":
                return self.send_body(200, json.dumps(rpc(body.get("args") or [])).encode())
            if self.path != "/v1/completions":
                return self.send_body(404, b"{}")
            tokens = int(body.get("max_tokens", 16))
            prompt = body.get("prompt")
            plen = len(prompt.split()) if isinstance(prompt, str) else len(prompt or [])
            with lock:
                counts["prompt"] += plen
                if role == "kv_consumer":  # the prompt's KV came over the connector
                    counts["hits"] += plen
                if spec and role != "kv_producer":  # AL 4: three of seven drafts accepted
                    counts["drafts"] += -(-tokens // 4)
                    counts["accepted"] += 3 * (tokens // 4)
            if not body.get("stream"):
                answer = {"choices": [{"text": "w1", "index": 0}], "kv_transfer_params": {}}
                return self.send_body(200, json.dumps(answer).encode())
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def event(obj) -> None:
                data = f"data: {obj}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            for i in range(0, tokens, 4):
                text = " w5" * min(4, tokens - i)
                event(json.dumps({"choices": [{"text": text, "index": 0}]}))
                time.sleep(0.004)
            usage = {"prompt_tokens": plen, "completion_tokens": tokens}
            event(json.dumps({"choices": [], "usage": usage}))
            event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")

    def rpc(args: list) -> dict:
        if args and args[0] == "set_acceptance_length":
            return {"results": [{"applied": spec, "unconditional_rates": [1.0, 1.0, 1.0]}]}
        if args and args[0] == "collect":
            main_ = {"target_ms": 5.0, "draft_ms": 1.3, "step_ms": 6.7}
            return {"results": [{"summary": {"main_num_reqs": 4, "main": main_}}]}
        return {"results": [{}]}

    serve(port, Api)


if __name__ == "__main__":
    main(sys.argv[2:])  # after the model argument
