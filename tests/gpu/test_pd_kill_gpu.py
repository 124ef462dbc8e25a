"""A PD prefiller killed mid-transfer (issue 28, case 3, PD part; group ``pd_kill``).

The DSpark prefill-only producer (``kv_producer``) and a DSpark decoder (``kv_consumer``) on GPU
0 over MooncakeConnector/TCP, as tests/gpu/test_pd_mooncake_gpu.py (trained tiny pair, k=7, CUDA
graphs, async scheduling). Requests go by hand (the keys of dspark_dev/pd_proxy.py: prefill on
the producer with one token, then a streamed decode on the decoder naming the producer's engine
and bootstrap), so the kill finds them in known states:

1. two PD requests before the kill (the reference answers; the decoder now knows the producer);
2. group A, 4 requests: prefilled, pulled, decoding 300 tokens when the producer dies;
3. group B, 4 requests: prefilled, their KV still on the producer (not pulled) when it dies:
   their decode is sent right after the kill (the transfer the kill interrupts);
4. SIGKILL of the producer's whole process group (API server, engine core, worker: a host
   lost);
5. meanwhile a plain request to the decoder (no producer needed);
6. a producer restarted on the same bootstrap port (a new engine id, as a restart gives) and the
   two reference requests through it again.

Asserted: no hang (every request of A and B ends, or is cut by its client after
``DSPARK_PD_KILL_BOUND_S`` of silence, and the decoder stays up and answers ``/health``); group
A completes (its KV was already pulled); the plain request answers within the bound with the
tokens it gave before the kill; the restarted producer serves again (the same tokens, KV pulled
over Mooncake). Recorded: what group B saw (vLLM's error, or silence until the client gave
up), the decoder's connector lines, KV usage and running requests afterwards. Control: the same
with stock vLLM 0.34.0 (plugin left out, no speculation), at the same time; recorded.

    source /tmp/site/env.sh && DSPARK_GPU_GROUPS_BUDGET_S=250 bash tools/gpu/run_groups.sh \\
        $OUT pd_kill

``pd_kill.json`` and trimmed server logs come back in ``$OUT/artifacts.tgz``
(``DSPARK_GPU_PD_KILL_LOGS`` sets that folder by hand); the group log prints ``PD KILL RESULT``.

``DSPARK_GPU_DRYRUN_CPU=1`` (developers only) runs the same sequence on vLLM's CPU platform
without a connector (no Mooncake here: every decode computes its prompt itself and no engine id
is queried), short outputs, no stock control: the plumbing only; the restart's KV-pull check
fails there by design.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
from gpu_common import (
    CPU_DRYRUN_ENV,
    DRYRUN_CPU,
    pd_fault_args,
    require_cuda,
)
from support import pd_fault, pd_pair, served_load, tiny_pair

from dspark_dev.serve import GPU_CHILD_ENV, http_text

pytestmark = pytest.mark.gpu

BOUND_S = float(os.environ.get("DSPARK_PD_KILL_BOUND_S", "150" if DRYRUN_CPU else "40"))
BUDGET_S = float(os.environ.get("DSPARK_PD_KILL_BUDGET_S", "1500" if DRYRUN_CPU else "240"))
READY_S = float(os.environ.get("DSPARK_PD_KILL_READY_S", "600" if DRYRUN_CPU else "150"))
STOCK = os.environ.get("DSPARK_PD_KILL_STOCK", "0" if DRYRUN_CPU else "1") == "1"
# group A and B: random prompts of 64-96 tokens + 300 <= 512
LONG_TOKENS = 24 if DRYRUN_CPU else 300
LOG_DIR = Path(
    os.environ.get("DSPARK_GPU_PD_KILL_LOGS") or tempfile.mkdtemp(prefix="dspark-pd-kill-")
)
COMMON = pd_fault_args()
BASE_ENV = {**GPU_CHILD_ENV, **CPU_DRYRUN_ENV} if DRYRUN_CPU else None


SETUP = pd_pair.PairSetup(common=COMMON, base_env=BASE_ENV, dryrun=DRYRUN_CPU, bound_s=BOUND_S)
# Optional (issue 28 item 3): the decoder's wait for a dead producer's answer to a pull is vLLM's
# VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + 60 s (480 + 60 = 540 s by default). Setting this knob sets
# that env var on the decoders (not the producers) and lets group B's clients wait until that
# wait has ended plus 20 s, so the record shows what vLLM does when it ends. Unset: the run
# recorded on 2026-12-04 (vLLM's default, B cut by its clients after BOUND_S).
DECODER_ABORT_S = os.environ.get("DSPARK_PD_KILL_DECODER_ABORT_S")
if DECODER_ABORT_S is not None:
    SETUP.decoder_env[pd_pair.ABORT_ENV] = str(int(DECODER_ABORT_S))
B_BOUND_S = BOUND_S if DECODER_ABORT_S is None else max(BOUND_S, int(DECODER_ABORT_S) + 80.0)
Pair = functools.partial(pd_pair.Pair, setup=SETUP)


def _prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(2803)
    randoms = [[rng.randrange(4, 448) for _ in range(rng.randrange(64, 97))] for _ in range(8)]
    return {
        "ref": tiny_pair.heldout_prompts(2),
        "plain": tiny_pair.heldout_prompts(3)[2:],
        "A": randoms[:4],
        "B": randoms[4:],
    }


def _restart(pair: Pair, prompts, ref_tokens, old_id: str, deadline: float) -> dict:
    """A new producer on the same bootstrap port serves the reference requests again; its own
    failure is recorded here, so it hides none of the kill's results."""
    left = deadline - time.monotonic()
    if left < 40:
        return {"skipped": f"budget spent ({left:.0f} s left)"}
    t0 = time.monotonic()
    try:
        p1 = pair.new_producer()
        p1.start()
        p1.wait_ready(deadline - time.monotonic())
        ready_s = round(time.monotonic() - t0, 1)
        eid1 = pair.engine_id(deadline)
        hits0 = pair.counters()["vllm:external_prefix_cache_hits_total"]
        t1 = time.monotonic()
        tokens = pair.pd_greedy(p1, prompts, eid1)
        return {
            "ready_s": ready_s,
            "engine_id_changed": eid1 != old_id,
            "tokens_equal_before_kill": tokens == ref_tokens,
            "seconds": round(time.monotonic() - t1, 1),
            "external_hits": pair.counters()["vllm:external_prefix_cache_hits_total"] - hits0,
        }
    except Exception as e:  # noqa: BLE001 - recorded; the restart test reads it
        return {"error": f"{type(e).__name__}: {str(e)[:3000]}",
                "seconds_since_restart": round(time.monotonic() - t0, 1)}  # fmt: skip


def _scenario(name: str, spec: dict | None, env: dict, deadline: float) -> dict:
    pr = _prompts()
    pair = Pair(name, spec, env)
    rec: dict = {"name": name, "speculation": spec is not None}
    step = "start"
    try:
        p0 = pair.new_producer()
        p0.start()
        pair.decoder.start()
        ready_by = min(deadline, time.monotonic() + READY_S)
        step = "wait for the producer"
        p0.wait_ready(ready_by - time.monotonic())
        step = "wait for the decoder"
        pair.decoder.wait_ready(ready_by - time.monotonic())
        eid = pair.engine_id(ready_by)
        step = "reference PD requests"
        rec["ref_tokens"] = pair.pd_greedy(p0, pr["ref"], eid)
        step = "plain reference"
        rec["plain_ref"], _ = pair.plain(pr["plain"][0])
        before = pair.counters()
        step = "group A: prefill, then decode streams"
        a_pre = [pair.prefill(p0, p, LONG_TOKENS) for p in pr["A"]]
        a_box: list = [None] * 4
        a_started = [threading.Event() for _ in a_pre]
        a_threads = [
            threading.Thread(
                target=pair.stream,
                args=(pair.decode_body(p, LONG_TOKENS, pre, eid), a_box, i, a_started[i]),
                daemon=True,
            )
            for i, (p, pre) in enumerate(zip(pr["A"], a_pre, strict=True))
        ]
        for t in a_threads:
            t.start()
        for ev in a_started:  # every A request has its first token: its KV was pulled
            ev.wait(timeout=BOUND_S)
        rec["a_streaming_before_kill"] = sum(ev.is_set() for ev in a_started)
        step = "group B: prefill only"
        b_pre = [pair.prefill(p0, p, LONG_TOKENS) for p in pr["B"]]
        step = "kill the producer"
        rec["a_running_at_kill"] = sum(1 for x in a_box if x is None)
        os.killpg(p0.proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        step = "group B: decode after the kill"
        b_box: list = [None] * 4
        b_threads = [
            threading.Thread(
                target=pair.stream,
                args=(pair.decode_body(p, LONG_TOKENS, pre, eid), b_box, i, None, B_BOUND_S),
                daemon=True,
            )
            for i, (p, pre) in enumerate(zip(pr["B"], b_pre, strict=True))
        ]
        for t in b_threads:
            t.start()
        time.sleep(2.0)
        step = "plain request during the loss"
        try:
            rec["plain_after"], rec["plain_after_s"] = pair.plain(pr["plain"][0])
        except Exception as e:  # noqa: BLE001 - recorded and asserted
            rec["plain_after_error"] = f"{type(e).__name__}: {e}"
        for t in (*a_threads, *b_threads):
            t.join(timeout=B_BOUND_S + 30)
        rec["threads_left"] = sum(t.is_alive() for t in (*a_threads, *b_threads))
        rec["groups_ended_s"] = round(time.monotonic() - t_kill, 1)
        rec["A"] = [pd_fault.outcome(x or {"exception": "no result"}, LONG_TOKENS) for x in a_box]
        rec["B"] = [pd_fault.outcome(x or {"exception": "no result"}, LONG_TOKENS) for x in b_box]
        rec["tally"] = {"A": pd_fault.tally(rec["A"]), "B": pd_fault.tally(rec["B"])}
        rec["decoder_alive"] = pair.decoder.proc.poll() is None
        try:
            rec["health_after"] = http_text(pair.decoder.url + "/health") is not None
        except Exception as e:  # noqa: BLE001
            rec["health_after"] = f"{type(e).__name__}: {e}"
        usage, running = served_load.wait_idle(pair.decoder.port, timeout_s=20)
        rec["kv_usage_after"], rec["running_after"] = usage, running
        rec["counters_delta"] = {k: v - before.get(k, 0.0) for k, v in pair.counters().items()}
        step = "restart the producer"
        rec["restart"] = _restart(pair, pr["ref"], rec["ref_tokens"], eid, deadline)
    except Exception as e:  # noqa: BLE001 - recorded; the tests read it
        rec["error"] = f"at step {step!r}: {type(e).__name__}: {e}"
    finally:
        dec_log = pair.decoder.log_text()
        rec["decoder_connector_lines"] = pd_fault.connector_lines(dec_log)
        rec["decoder_error_lines"] = served_load.error_lines(dec_log)[:20]  # before the stop
        if "error" in rec:
            rec["log_tails"] = {s.name: s.log_text()[-2500:] for s in (*pair.producers,
                                                                       pair.decoder)}  # fmt: skip
        pair.stop(LOG_DIR)
    return rec


@pytest.fixture(scope="module")
def pd_kill():
    require_cuda()
    ok, why = tiny_pair.available()
    if not ok:
        pytest.skip(why)
    return pd_pair.run_beside_stock(
        _scenario,
        tiny_pair.spec_config(),
        BUDGET_S,
        STOCK,
        "DSPARK_PD_KILL_STOCK=0",
        LOG_DIR / "pd_kill.json",
        "PD KILL RESULT",
        {"bound_s": BOUND_S, "b_bound_s": B_BOUND_S, "decoder_abort_s": DECODER_ABORT_S},
    )


def _ours(pd_kill) -> dict:
    return pd_pair.ours_record(pd_kill)


def test_no_hang_every_request_ends_and_the_decoder_stays_up(pd_kill):
    rec = _ours(pd_kill)
    print(f"group A {rec['tally']['A']}, group B {rec['tally']['B']} (bound {BOUND_S:.0f} s)")
    assert rec["threads_left"] == 0, rec
    assert rec["decoder_alive"] and rec["health_after"] is True, rec


def test_requests_already_decoding_complete(pd_kill):
    rec = _ours(pd_kill)
    print(
        f"group A: {rec['a_streaming_before_kill']} streaming before the B prefills, "
        f"{rec['a_running_at_kill']} still running at the kill: {json.dumps(rec['A'])}"
    )
    assert rec["a_streaming_before_kill"] == 4, rec["A"]
    assert rec["a_running_at_kill"] >= 1, "group A ended before the kill: nothing was in flight"
    assert rec["tally"]["A"] == {pd_fault.COMPLETED: 4}, rec["A"]


def test_what_the_interrupted_transfers_did_is_recorded(pd_kill):
    rec = _ours(pd_kill)
    print(f"group B (KV on the killed producer): {json.dumps(rec['B'])}")
    print("decoder connector lines:\n  " + "\n  ".join(rec["decoder_connector_lines"]))
    print(f"decoder after: KV usage {rec['kv_usage_after']}, running {rec['running_after']}, "
          f"counters {rec['counters_delta']}")  # fmt: skip
    assert len(rec["B"]) == 4 and all(o["kind"] in pd_fault.KINDS for o in rec["B"]), rec["B"]


def test_decoder_keeps_serving_requests_that_need_no_producer(pd_kill):
    rec = _ours(pd_kill)
    assert "plain_after_error" not in rec, rec["plain_after_error"]
    assert rec["plain_after"] == rec["plain_ref"], (rec["plain_after"], rec["plain_ref"])
    assert rec["plain_after_s"] <= BOUND_S, rec["plain_after_s"]


def test_a_restarted_producer_serves_again(pd_kill):
    r = _ours(pd_kill)["restart"]
    print(f"restarted producer: {json.dumps(r)[:2000]}")
    assert "skipped" not in r and "error" not in r, r
    assert r["tokens_equal_before_kill"] and r["external_hits"] > 0, r


def test_stock_control_is_recorded(pd_kill):
    st = pd_kill["stock"]
    shown = {k: v for k, v in st.items() if k != "log_tails"}
    print(f"STOCK vLLM 0.34.0 PD (no speculation) producer killed: {json.dumps(shown)}")
    assert st, "no stock record"
