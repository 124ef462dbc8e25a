"""A PD decoder killed while the producer holds its KV (issue 28, case 3, PD part; group
``pd_decoder_kill``).

The DSpark prefill-only producer (``kv_producer``) and a DSpark decoder (``kv_consumer``) on GPU
0 over MooncakeConnector/TCP, as tests/gpu/test_pd_kill_gpu.py (trained tiny pair, k=7, CUDA
graphs, async scheduling; the pair served by hand through tests/support/pd_pair.py):

1. two PD requests (the reference answers);
2. group A, 4 requests: prefilled, pulled, decoding 300 tokens when the decoder dies;
3. group B, 4 requests: prefilled only, their KV held by the producer for a decoder's pull;
4. SIGKILL of the decoder's whole process group (API server, engine core, worker);
5. a decoder restarted at once (new ports), while the producer's ``/health`` and KV usage
   (``vllm:kv_cache_usage_perc`` on its ``/metrics``) are read every second;
6. the two reference requests through the producer and the restarted decoder.

What frees B's KV on the producer: vLLM 0.34.0's Mooncake sender gives a finished prefill's blocks
``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` seconds (env var, default 480; ``kv_lease_duration`` in
``kv_connector_extra_config`` replaces it by a lease that decoders renew) from the end of its
prefill, then frees them, logs ``Request ... timed out after N seconds without being sent.
Freeing its blocks on the producer side.`` and counts ``vllm:mooncake_num_kv_expired_reqs``. It
does not learn that a decoder died. This group sets that env var on the producers to
``DSPARK_PD_DKILL_HOLD_S`` (default 45) so the free falls inside the group's time.

Asserted: no hang and no orphan (A's clients end, no process of the killed decoder's group is
left, the producer stays up and answers ``/health`` at every poll); the producer frees B's KV
(usage back to 0) no later than ``HOLD_S + DSPARK_PD_DKILL_FREE_MARGIN_S`` (default 30) after B's
prefills, by that timeout (4 ``timed out ... without being sent`` lines); the restarted decoder
serves the reference tokens from before the kill with the KV pulled (external prefix-cache hits >
0). Recorded: what A's clients saw, the KV usage samples, the seconds from the kill and from B's
prefills to the free. Control: the same with stock vLLM 0.34.0 (plugin left out, no
speculation), at the same time; recorded.

    source /tmp/site/env.sh && DSPARK_GPU_GROUPS_BUDGET_S=250 bash tools/gpu/run_groups.sh \\
        $OUT pd_decoder_kill

``pd_decoder_kill.json`` and trimmed server logs come back in ``$OUT/artifacts.tgz``
(``DSPARK_GPU_PD_DKILL_LOGS`` sets that folder by hand); the group log prints ``PD DECODER KILL
RESULT``.

``DSPARK_GPU_DRYRUN_CPU=1`` (developers only) runs the same sequence on vLLM's CPU platform
without a connector: the plumbing only; the free and KV-pull checks fail there by design (nothing
is held, nothing pulled).
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
from gpu_common import CPU_DRYRUN_ENV, DRYRUN_CPU, pd_fault_args, require_cuda
from support import pd_fault, pd_pair, served_load, tiny_pair
from support.reliability import gauge, get_text

from dspark_dev.proc import live_group_members
from dspark_dev.serve import GPU_CHILD_ENV, http_text

pytestmark = pytest.mark.gpu

BOUND_S = float(os.environ.get("DSPARK_PD_DKILL_BOUND_S", "150" if DRYRUN_CPU else "40"))
BUDGET_S = float(os.environ.get("DSPARK_PD_DKILL_BUDGET_S", "1500" if DRYRUN_CPU else "240"))
READY_S = float(os.environ.get("DSPARK_PD_DKILL_READY_S", "600" if DRYRUN_CPU else "130"))
STOCK = os.environ.get("DSPARK_PD_DKILL_STOCK", "0" if DRYRUN_CPU else "1") == "1"
HOLD_S = int(os.environ.get("DSPARK_PD_DKILL_HOLD_S", "45"))
FREE_MARGIN_S = float(os.environ.get("DSPARK_PD_DKILL_FREE_MARGIN_S", "30"))
LONG_TOKENS = 24 if DRYRUN_CPU else 300  # random prompts of 64-96 tokens + 300 <= 512
LOG_DIR = Path(
    os.environ.get("DSPARK_GPU_PD_DKILL_LOGS") or tempfile.mkdtemp(prefix="dspark-pd-dkill-")
)
SETUP = pd_pair.PairSetup(
    common=pd_fault_args(),
    base_env={**GPU_CHILD_ENV, **CPU_DRYRUN_ENV} if DRYRUN_CPU else None,
    dryrun=DRYRUN_CPU,
    bound_s=BOUND_S,
    producer_env={pd_pair.ABORT_ENV: str(HOLD_S)},
)
Pair = functools.partial(pd_pair.Pair, setup=SETUP)
EXPIRED = "vllm:mooncake_num_kv_expired_reqs_total"


def _prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(2804)
    randoms = [[rng.randrange(4, 448) for _ in range(rng.randrange(64, 97))] for _ in range(8)]
    return {"ref": tiny_pair.heldout_prompts(2), "A": randoms[:4], "B": randoms[4:]}


def _producer_state(port: int) -> tuple[bool, float | None, float | None]:
    """(answers /health, KV usage, expired-requests counter) of the producer; (False, None, None)
    when it does not answer."""
    try:
        http_text(f"http://127.0.0.1:{port}/health", timeout=5)
        m = get_text(port, "/metrics", timeout_s=5)
    except Exception:  # noqa: BLE001 - a producer that does not answer is the measurement
        return False, None, None
    return True, gauge(m, "vllm:kv_cache_usage_perc"), gauge(m, EXPIRED) or 0.0


def _scenario(name: str, spec: dict | None, env: dict, deadline: float) -> dict:
    pr = _prompts()
    pair = Pair(name, spec, env)
    rec: dict = {"name": name, "speculation": spec is not None, "hold_s": HOLD_S}
    step = "start"
    try:
        p = pair.new_producer()
        d0 = pair.decoder
        p.start()
        d0.start()
        ready_by = min(deadline, time.monotonic() + READY_S)
        step = "wait for the producer"
        p.wait_ready(ready_by - time.monotonic())
        step = "wait for the decoder"
        d0.wait_ready(ready_by - time.monotonic())
        eid = pair.engine_id(ready_by)
        step = "reference PD requests"
        rec["ref_tokens"] = pair.pd_greedy(p, pr["ref"], eid)
        rec["producer_kv_before"], _ = served_load.wait_idle(p.port, timeout_s=20)
        _, _, expired0 = _producer_state(p.port)
        step = "group A: prefill, then decode streams"
        a_pre = [pair.prefill(p, x, LONG_TOKENS) for x in pr["A"]]
        a_box: list = [None] * 4
        a_started = [threading.Event() for _ in a_pre]
        a_threads = [
            threading.Thread(
                target=pair.stream,
                args=(pair.decode_body(x, LONG_TOKENS, pre, eid), a_box, i, a_started[i]),
                daemon=True,
            )
            for i, (x, pre) in enumerate(zip(pr["A"], a_pre, strict=True))
        ]
        for t in a_threads:
            t.start()
        for ev in a_started:  # every A request has its first token: its KV was pulled
            ev.wait(timeout=BOUND_S)
        rec["a_streaming_before_kill"] = sum(ev.is_set() for ev in a_started)
        step = "group B: prefill only (KV held by the producer)"
        for x in pr["B"]:
            pair.prefill(p, x, LONG_TOKENS)
        t_b = time.monotonic()
        _, rec["producer_kv_at_kill"], _ = _producer_state(p.port)
        rec["a_running_at_kill"] = sum(1 for x in a_box if x is None)
        step = "kill the decoder"
        os.killpg(d0.proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        rec["b_prefilled_s_before_kill"] = round(t_kill - t_b, 1)
        step = "restart the decoder"
        d1 = pair.new_decoder()
        d1.start()
        step = "poll the producer until B's KV is freed"
        samples: list[tuple[float, float | None]] = [(0.0, rec["producer_kv_at_kill"])]
        health_failures = 0
        free_by = min(deadline, t_b + HOLD_S + FREE_MARGIN_S)
        while time.monotonic() < free_by:
            ok, usage, _ = _producer_state(p.port)
            health_failures += not ok
            samples.append((round(time.monotonic() - t_kill, 1), usage))
            if pd_fault.first_zero(samples) is not None:
                break
            time.sleep(1.0)
        freed = pd_fault.first_zero(samples)
        rec["kv_freed_s_after_kill"] = freed
        rec["kv_freed_s_after_b_prefill"] = (
            None if freed is None else round(freed + rec["b_prefilled_s_before_kill"], 1)
        )
        rec["producer_kv_samples"] = samples[:: max(1, len(samples) // 40)]
        rec["producer_health_failures"] = health_failures
        for t in a_threads:
            t.join(timeout=BOUND_S + 30)
        rec["threads_left"] = sum(t.is_alive() for t in a_threads)
        rec["A"] = [pd_fault.outcome(x or {"exception": "no result"}, LONG_TOKENS) for x in a_box]
        rec["tally"] = {"A": pd_fault.tally(rec["A"])}
        rec["decoder0_rc"] = d0.proc.poll()
        rec["decoder0_group_left"] = live_group_members(d0.proc.pid)
        alive, _, expired1 = _producer_state(p.port)
        rec["producer_alive"] = alive and p.proc.poll() is None
        rec["producer_expired_counter_delta"] = (
            None if expired1 is None or expired0 is None else expired1 - expired0
        )
        rec["producer_expired_lines"] = pd_fault.expired_requests(p.log_text())
        step = "restarted decoder: ready, then the reference requests"
        t1 = time.monotonic()
        d1.wait_ready(deadline - time.monotonic())
        rec["restart"] = {"ready_s_after_kill": round(time.monotonic() - t_kill, 1)}
        hits0 = pair.counters(d1)["vllm:external_prefix_cache_hits_total"]
        t2 = time.monotonic()
        tokens = pair.pd_greedy(p, pr["ref"], eid)
        rec["restart"].update({
            "waited_ready_s": round(t2 - t1, 1),
            "tokens_equal_before_kill": tokens == rec["ref_tokens"],
            "seconds": round(time.monotonic() - t2, 1),
            "external_hits": pair.counters(d1)["vllm:external_prefix_cache_hits_total"] - hits0,
        })  # fmt: skip
        rec["producer_kv_after"], rec["producer_running_after"] = served_load.wait_idle(
            p.port, timeout_s=20
        )
    except Exception as e:  # noqa: BLE001 - recorded; the tests read it
        rec["error"] = f"at step {step!r}: {type(e).__name__}: {str(e)[:3000]}"
    finally:
        logs = {s.name: s.log_text() for s in (*pair.producers, *pair.decoders)}
        rec["producer_error_lines"] = [
            served_load.error_lines(logs[s.name])[:20] for s in pair.producers
        ]
        if "error" in rec:
            rec["log_tails"] = {k: v[-2500:] for k, v in logs.items()}
        pair.stop(LOG_DIR)
    return rec


@pytest.fixture(scope="module")
def pd_decoder_kill():
    require_cuda()
    ok, why = tiny_pair.available()
    if not ok:
        pytest.skip(why)
    return pd_pair.run_beside_stock(
        _scenario,
        tiny_pair.spec_config(),
        BUDGET_S,
        STOCK,
        "DSPARK_PD_DKILL_STOCK=0",
        LOG_DIR / "pd_decoder_kill.json",
        "PD DECODER KILL RESULT",
        {"bound_s": BOUND_S, "hold_s": HOLD_S, "free_margin_s": FREE_MARGIN_S},
    )


def _ours(pd_decoder_kill) -> dict:
    return pd_pair.ours_record(pd_decoder_kill)


def test_no_hang_no_orphan_and_the_producer_stays_up(pd_decoder_kill):
    rec = _ours(pd_decoder_kill)
    print(f"group A (decoding at the kill): {json.dumps(rec['A'])}; decoder rc "
          f"{rec['decoder0_rc']}, left {rec['decoder0_group_left']}")  # fmt: skip
    assert rec["a_streaming_before_kill"] == 4 and rec["a_running_at_kill"] >= 1, rec["A"]
    assert rec["threads_left"] == 0, rec["A"]
    assert rec["decoder0_group_left"] == [], rec["decoder0_group_left"]
    assert rec["producer_alive"] and rec["producer_health_failures"] == 0, rec


def test_the_producer_frees_the_dead_decoders_kv_on_its_timeout(pd_decoder_kill):
    rec = _ours(pd_decoder_kill)
    print(
        f"producer KV: {rec['producer_kv_at_kill']} at the kill, freed "
        f"{rec['kv_freed_s_after_kill']} s after it ({rec['kv_freed_s_after_b_prefill']} s "
        f"after B's prefills; timeout {HOLD_S} s); expired lines "
        f"{rec['producer_expired_lines']}, counter +{rec['producer_expired_counter_delta']}"
    )
    assert rec["producer_kv_before"] == 0.0, rec["producer_kv_before"]
    assert (rec["producer_kv_at_kill"] or 0) > 0, "the producer held no KV at the kill"
    assert rec["kv_freed_s_after_b_prefill"] is not None, rec["producer_kv_samples"]
    assert rec["kv_freed_s_after_b_prefill"] <= HOLD_S + FREE_MARGIN_S, rec
    assert [s for _, s in rec["producer_expired_lines"]] == [HOLD_S] * 4, rec


def test_a_restarted_decoder_serves_again_with_kv_pulled(pd_decoder_kill):
    r = _ours(pd_decoder_kill)["restart"]
    print(f"restarted decoder: {json.dumps(r)}")
    assert r["tokens_equal_before_kill"] and r["external_hits"] > 0, r


def test_stock_control_is_recorded(pd_decoder_kill):
    st = pd_decoder_kill["stock"]
    shown = {k: v for k, v in st.items() if k != "log_tails"}
    print(f"STOCK vLLM 0.34.0 PD (no speculation) decoder killed: {json.dumps(shown)[:3000]}")
    assert st, "no stock record"
