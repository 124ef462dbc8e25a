"""One producer + decoder over MooncakeConnector, served by hand for the PD fault groups (issue
28, case 3: tests/gpu/test_pd_kill_gpu.py kills the producer, tests/gpu/test_pd_decoder_kill_gpu.py
the decoder).

Requests go with the keys of dspark_dev/pd_proxy.py (prefill on the producer with one token, then
the decode on the decoder naming the producer's engine and bootstrap), so a test decides which
requests are where when it kills a process. Either side can be restarted: a new producer on the
same bootstrap port (a new engine id, as a restart gives), or a new decoder (new ports, the first
decoder's compile cache).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dspark_dev.metrics import parse_prometheus
from dspark_dev.pd_launch import mooncake_env, mooncake_kv_config
from dspark_dev.pd_proxy import decode_request, prefill_request, query_engine_id
from dspark_dev.serve import Server, free_port, free_port_block, http_json, http_text
from support import served_load, tiny_pair
from support.reliability import stream_completion

MOONCAKE_COUNTERS = (
    "vllm:external_prefix_cache_hits_total",
    "vllm:mooncake_num_failed_transfers_total",
    "vllm:mooncake_num_failed_recvs_total",
)
# vLLM 0.34.0's Mooncake knob for both sides' waits (envs.py, default 480 s; mooncake_connector.py):
# the producer frees KV that no decoder pulled this long after the prefill ended, and a decoder
# waits this + 60 s for a producer's answer to its pull before it fails the request.
ABORT_ENV = "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"


@dataclass
class PairSetup:
    """What differs between the GPU run and its CPU dry run (no Mooncake there)."""

    common: list[str]
    base_env: dict | None
    dryrun: bool
    bound_s: float
    producer_env: dict = field(default_factory=dict)
    decoder_env: dict = field(default_factory=dict)


def kv_args(setup: PairSetup, role: str, engine_id: str | None = None) -> list[str]:
    if setup.dryrun:  # no Mooncake on the CPU machine
        return []
    return ["--kv-transfer-config", json.dumps(mooncake_kv_config(role, engine_id))]


def kv_env(setup: PairSetup) -> dict:
    """The Mooncake variables of the protocol :func:`kv_args` names (none in a dry run)."""
    return {} if setup.dryrun else mooncake_env()


class Pair:
    """One producer + decoder over Mooncake (``spec`` None: no speculation)."""

    def __init__(self, name: str, spec: dict | None, env: dict, setup: PairSetup):
        self.name, self.spec, self.env, self.setup = name, spec, env, setup
        self.bport = free_port()
        self.bootstrap = f"http://127.0.0.1:{self.bport}"
        self.producers: list[Server] = []
        self.engine_ids: list[str] = []
        self.decoders: list[Server] = []
        self.new_decoder()

    @property
    def decoder(self) -> Server:
        return self.decoders[-1]

    def _spec_args(self) -> list[str]:
        return ["--speculative-config", json.dumps(self.spec)] if self.spec else []

    def new_decoder(self) -> Server:
        """A decoder (the first, or a restart on new ports reusing the first one's compile
        cache); not started."""
        n = len(self.decoders)
        env = {**kv_env(self.setup), **self.env, **self.setup.decoder_env,
               "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port()),
               "VLLM_PORT": str(free_port_block())}  # fmt: skip
        if self.decoders:
            env["VLLM_CACHE_ROOT"] = self.decoders[0].env["VLLM_CACHE_ROOT"]
        d = Server.vllm(
            f"{self.name}-decoder" + (f"{n}" if n else ""),
            tiny_pair.TARGET,
            [*self.setup.common, *self._spec_args(), *kv_args(self.setup, "kv_consumer")],
            env=env,
            base_env=self.setup.base_env,
        )
        self.decoders.append(d)
        return d

    def new_producer(self) -> Server:
        n = len(self.producers)
        engine_id = f"{self.name}-producer{n}-{uuid.uuid4().hex[:6]}"
        env = {**kv_env(self.setup), **self.env, **self.setup.producer_env,
               "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.bport),
               "VLLM_PORT": str(free_port_block())}  # fmt: skip
        if self.producers:  # the restart reuses the first one's compile cache
            env["VLLM_CACHE_ROOT"] = self.producers[0].env["VLLM_CACHE_ROOT"]
        p = Server.vllm(
            f"{self.name}-producer{n}",
            tiny_pair.TARGET,
            [*self.setup.common, *self._spec_args(),
             *kv_args(self.setup, "kv_producer", engine_id)],
            env=env,
            base_env=self.setup.base_env,
        )  # fmt: skip
        self.engine_ids.append(engine_id)
        self.producers.append(p)
        return p

    def engine_id(self, deadline: float) -> str:
        if self.setup.dryrun:
            return self.engine_ids[-1]
        while True:
            try:
                return query_engine_id(self.bootstrap)
            except Exception:  # noqa: BLE001 - not registered yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def body(self, prompt: list[int], max_tokens: int) -> dict:
        return {"model": tiny_pair.TARGET, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip

    def prefill(self, producer: Server, prompt: list[int], max_tokens: int) -> dict:
        tid = uuid.uuid4().hex
        out = http_json(
            producer.url + "/v1/completions",
            prefill_request(self.body(prompt, max_tokens), tid),
            timeout=60,
        )
        return {"tid": tid, "params": out.get("kv_transfer_params")}

    def decode_body(self, prompt, max_tokens: int, pre: dict, engine_id: str) -> dict:
        return decode_request(
            self.body(prompt, max_tokens), pre["tid"], engine_id, self.bootstrap, pre["params"]
        )

    def stream(
        self,
        body: dict,
        box: list,
        i: int,
        started: threading.Event | None = None,
        bound_s: float | None = None,
    ):
        """Stream ``body`` from the current decoder into ``box[i]``; the client gives up after
        ``bound_s`` (default the setup's) of silence."""
        port = self.decoder.port
        t0 = time.monotonic()
        try:
            r = stream_completion(
                port,
                body,
                timeout_s=self.setup.bound_s if bound_s is None else bound_s,
                on_event=None if started is None else (lambda n: started.set()),
            )
        except Exception as e:  # noqa: BLE001 - what the client saw is the measurement
            r = {"exception": f"{type(e).__name__}: {e}"}
        r["seconds"] = round(time.monotonic() - t0, 1)
        box[i] = r

    def pd_greedy(self, producer: Server, prompts, engine_id: str) -> list[list[int]]:
        def one(p):
            pre = self.prefill(producer, p, tiny_pair_ref_tokens(self.setup))
            out = http_json(
                self.decoder.url + "/v1/completions",
                self.decode_body(p, tiny_pair_ref_tokens(self.setup), pre, engine_id),
                timeout=self.setup.bound_s,
            )
            return list(out["choices"][0]["token_ids"])

        with ThreadPoolExecutor(max_workers=len(prompts)) as ex:
            return list(ex.map(one, prompts))

    def plain(self, prompt) -> tuple[list[int], float]:
        t0 = time.monotonic()
        out = http_json(
            self.decoder.url + "/v1/completions",
            self.body(prompt, tiny_pair_ref_tokens(self.setup)),
            timeout=self.setup.bound_s,
        )
        return list(out["choices"][0]["token_ids"]), round(time.monotonic() - t0, 1)

    def counters(self, server: Server | None = None) -> dict:
        m = parse_prometheus(http_text((server or self.decoder).url + "/metrics"))
        return {k: m.get(k, 0.0) for k in MOONCAKE_COUNTERS}

    def stop(self, log_dir) -> None:
        for s in (*self.producers, *self.decoders):
            s.stop()
            (log_dir / f"{s.name}.log").write_text(trimmed(s.log_text()))


def tiny_pair_ref_tokens(setup: PairSetup) -> int:
    """Tokens of the reference and plain requests (short on the CPU dry run)."""
    return 8 if setup.dryrun else 48


def trimmed(text: str, keep: int = 300) -> str:
    lines = text.splitlines()
    if len(lines) <= 3 * keep:
        return text
    errs = served_load.error_lines(text)[:200]
    return "\n".join([*lines[:keep], "... [trimmed: error lines] ...", *errs,
                      "... [trimmed: last lines] ...", *lines[-keep:]])  # fmt: skip


def run_beside_stock(
    scenario: Callable[[str, dict | None, dict[str, str], float], dict],
    spec: dict,
    budget_s: float,
    stock: bool,
    stock_off_reason: str,
    out: Path,
    title: str,
    facts: dict,
) -> dict:
    """A PD fault group's fixture: the scenario for DSpark with the plugin and, in a second thread
    at the same time, for stock vLLM (the plugin left out, no speculation), both ending by
    ``budget_s`` - 10 s; the summary (``facts`` and both records) written to ``out`` and printed
    without the log tails under ``title``."""
    t0 = time.monotonic()
    deadline = t0 + budget_s - 10
    with ThreadPoolExecutor(max_workers=2) as ex:
        f_stock = (
            ex.submit(scenario, "stock", None, {"VLLM_PLUGINS": "no-such-plugin"}, deadline)
            if stock
            else None
        )
        ours = scenario("dspark", spec, {}, deadline)
        other = f_stock.result() if f_stock else {"skipped": stock_off_reason}
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wall_s": round(time.monotonic() - t0, 1),
        **facts,
        "ours": ours,
        "stock": other,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1, default=str))
    shown = {
        k: ({kk: vv for kk, vv in v.items() if kk != "log_tails"} if isinstance(v, dict) else v)
        for k, v in summary.items()
    }
    print(f"{title} " + json.dumps(shown, indent=1, default=str))
    return summary


def ours_record(summary: dict) -> dict:
    """The plugin's record of a fault group; fails the test with the logs' tails if it broke."""
    rec = summary["ours"]
    assert "error" not in rec, f"{rec['error']}\n{json.dumps(rec.get('log_tails'), indent=1)}"
    return rec
