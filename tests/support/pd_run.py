"""Prefill/decode disaggregation on loopback: two ``vllm serve`` joined by MooncakeConnector.

Over TCP unless ``DSPARK_PD_MOONCAKE_PROTOCOL`` names another Mooncake protocol (both engines then
get the variables it needs: dspark_dev/pd_launch.py ``mooncake_env``).

:func:`run_pd` starts a prefiller (``kv_producer``) and a decoder (``kv_consumer``), both with the
same speculative config, puts :class:`pd_proxy.PDProxy` in front, sends the prompts (concurrently,
token ids in, token ids out), reads the decoder's spec-decode and KV-connector counters from
``/metrics`` before and after, and always kills both servers. On any failure the servers' logs
are saved as artifacts and the exception names the step that failed.

Works with or without the plugin's prefill-only producer role: the instances are started the
same way either way; what differs is what the prefiller's drafter does (see docs/producer.md).
Shared by tests/gpu/test_pd_mooncake_gpu.py (one GPU, PP=1 both sides), tests/gpu/
test_pd_pp_producer.py and tools/gpu/run_pd_pp2.py (PP=2 producer). An engine of several ranks is
one launcher per rank (``prefill_followers`` / ``decode_followers``: the headless launchers' own
arguments and environment, composed by dspark_dev/pd_launch.py ``engine_launchers``).
"""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from dspark_dev.metrics import counter_delta, parse_prometheus
from dspark_dev.metrics import spec_metrics_from_prometheus as spec_counters
from dspark_dev.pd_launch import PREFILL_MARKERS, kv_counters, mooncake_env, mooncake_kv_config
from dspark_dev.pd_proxy import PDProxy, query_engine_id
from dspark_dev.serve import (
    Server,
    Timings,
    check_alive,
    free_port,
    free_port_block,
    greedy_completion_body,
    http_json,
    http_text,
    wait_ready,
)
from support.gpu import GPUCaseFailure


def _metrics(server: Server) -> dict[str, float]:
    return parse_prometheus(http_text(server.url + "/metrics"))


_kv_counters = kv_counters  # the decoder's KV-connector counters (dspark_dev/pd_launch.py)


def run_pd(
    model: str,
    speculative_config: dict | None,
    prompts: list[list[int]],
    *,
    timeout_s: float,
    common_args: list[str],
    prefill_args: list[str] = (),
    decode_args: list[str] = (),
    prefill_speculative_config: dict | None = None,
    prefill_env: dict | None = None,
    prefill_followers: list[tuple[list[str], dict]] = (),
    decode_env: dict | None = None,
    decode_followers: list[tuple[list[str], dict]] = (),
    max_tokens: int = 48,
    ignore_eos: bool = True,
    request_timeout_s: float = 90.0,
) -> dict:
    deadline = time.monotonic() + timeout_s
    t = Timings()
    t.mark("start")
    step = "choose ports"
    bport = free_port()
    engine_id = f"dspark-pd-prefill-{uuid.uuid4().hex[:8]}"
    spec = ["--speculative-config", json.dumps(speculative_config)] if speculative_config else []
    # a control run gives the prefiller its own (e.g. corrupted) draft; the decoder keeps ``spec``
    pre_spec = (
        ["--speculative-config", json.dumps(prefill_speculative_config)]
        if prefill_speculative_config
        else spec
    )

    def producer(name: str, args: list[str], env: dict) -> Server:
        """One launcher of the producer: node 0 (``pre``: API server, Mooncake bootstrap) or, for
        a PP producer of several launchers, a headless node with its own (args, env)
        (dspark_dev/pp_launch.py composes them)."""
        kv = json.dumps(mooncake_kv_config("kv_producer", engine_id))
        return Server.vllm(
            name,
            model,
            [*common_args, *pre_spec, "--kv-transfer-config", kv, *args],
            env={
                "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bport),
                "VLLM_PORT": str(free_port_block()),
                **mooncake_env(),
                **env,
            },
        )

    pre = producer("prefill", list(prefill_args), dict(prefill_env or {}))
    followers = [
        producer(f"prefill-node{i + 1}", args, env)
        for i, (args, env) in enumerate(prefill_followers)
    ]

    def decoder(name: str, args: list[str], env: dict) -> Server:
        """One launcher of the decoder: node 0 (``dec``: API server) or, for a decoder of
        several ranks (TP > 1 on one GPU: one launcher per rank), a headless node."""
        kv = json.dumps(mooncake_kv_config("kv_consumer"))
        return Server.vllm(
            name,
            model,
            [*common_args, *spec, "--kv-transfer-config", kv, *args],
            # its own (unused) bootstrap port, so nothing on the decode side can collide with the
            # prefiller's
            env={
                "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port()),
                "VLLM_PORT": str(free_port_block()),
                **mooncake_env(),
                **env,
            },
        )

    dec = decoder("decode", list(decode_args), dict(decode_env or {}))
    dec_followers = [
        decoder(f"decode-node{i + 1}", args, env) for i, (args, env) in enumerate(decode_followers)
    ]
    launchers = (pre, *followers, dec, *dec_followers)

    def producer_logs() -> str:
        return "\n".join(x.log_text() for x in (pre, *followers))

    headless = [*followers, *dec_followers]

    ok = False
    try:
        step = "start servers"
        pre.start()
        for f in followers:
            f.start()
        dec.start()
        for f in dec_followers:
            f.start()
        step = "wait for the prefiller's /health"
        wait_ready(pre, deadline - time.monotonic(), watch=headless)
        t.mark("prefill ready")
        step = "wait for the decoder's /health"
        wait_ready(dec, deadline - time.monotonic(), watch=headless)
        check_alive(headless, "the deployment")
        t.mark("decode ready")
        bootstrap = f"http://127.0.0.1:{bport}"
        step = f"ask the prefiller's Mooncake bootstrap {bootstrap}/query for its engine id"
        seen_id = None
        while seen_id is None:
            try:
                seen_id = query_engine_id(bootstrap)
            except Exception:  # noqa: BLE001 - not registered yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        step = "read metrics before"
        dec_before = _metrics(dec)
        pre_before = _metrics(pre)
        step = "send requests through the proxy"
        with PDProxy(pre.url, dec.url, bootstrap, seen_id, timeout_s=request_timeout_s) as proxy:

            def one(ids: list[int]) -> list[int]:
                body = greedy_completion_body(model, ids, max_tokens, ignore_eos)
                out = http_json(
                    proxy.url + "/v1/completions", body, timeout=2 * request_timeout_s + 10
                )
                toks = out["choices"][0].get("token_ids")
                if toks is None:
                    raise GPUCaseFailure(f"decoder answer has no token_ids: {str(out)[:400]}")
                return list(toks)

            with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as ex:
                tokens = list(ex.map(one, prompts))
            stats = dict(proxy.stats)
        t.mark("requests done")
        step = "read metrics after"
        time.sleep(1.5)  # counters are published with the next stats interval
        dec_after = _metrics(dec)
        pre_after = _metrics(pre)
        ok = True
        return {
            "tokens": tokens,
            "decoder_spec": counter_delta(spec_counters(dec_before), spec_counters(dec_after)),
            "prefill_spec": counter_delta(spec_counters(pre_before), spec_counters(pre_after)),
            "decoder_kv": {
                k: v - _kv_counters(dec_before).get(k, 0.0)
                for k, v in _kv_counters(dec_after).items()
            },
            "prefill_kv": {
                k: v - _kv_counters(pre_before).get(k, 0.0)
                for k, v in _kv_counters(pre_after).items()
            },
            "engine_id": seen_id,
            "configured_engine_id": engine_id,
            "proxy": stats,
            "timings": t.describe(),
            # What the prefiller's log says it built (patch log lines of vllm_dspark_pp).
            "prefill_log_markers": {m: m in producer_logs() for m in PREFILL_MARKERS},
            "producer_logs": {x.name: x.log_text() for x in (pre, *followers)},
            "decoder_logs": {x.name: x.log_text() for x in (dec, *dec_followers)},
        }
    except Exception as e:
        raise GPUCaseFailure(
            f"PD run failed at step {step!r} ({t.describe()}): {type(e).__name__}: {e}\n"
            f"--- prefiller log tail ---\n{pre.log_text()[-3000:]}\n"
            + "".join(f"--- {f.name} log tail ---\n{f.log_text()[-2000:]}\n" for f in followers)
            + f"--- decoder log tail ---\n{dec.log_text()[-3000:]}"
            + "".join(f"\n--- {f.name} log tail ---\n{f.log_text()[-2000:]}" for f in dec_followers)
        ) from e
    finally:
        for x in launchers:
            x.stop()
        if not ok:
            for x in launchers:
                x.save_log("pd")
