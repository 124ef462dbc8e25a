"""Reliability as users meet it (issue 28, CPU tier; docs/results/reliability.md).

One ``vllm serve`` of the trained pair at PP=2 with DSpark (k=7), the shared runs' scheduler
settings (chunked prefill, 128-token budget, 16 sequences), float32 on the CPU platform, shared
by every test of this module (module fixture; its whole process group is stopped at the end).

Case 4 (sampling exactness under PP) is tests/e2e/test_sampling.py: it samples through
``vllm.LLM`` (many seeded requests in one engine call) rather than through this server.

* :func:`test_client_faults_are_answered_and_leave_no_trace` (case 2): client disconnects
  mid-stream, ``max_tokens=1``, prompts at and over ``max_model_len``, stop strings, ``n=2``,
  logprobs and prompt logprobs, seeded sampling.
* :func:`test_structured_output_is_valid_or_refused` (case 5).
* :func:`test_after_the_faults_a_clean_batch_equals_pp1_without_speculation` (last): the KV
  cache is empty again and 32 greedy prompts give exactly PP=1 no-spec's tokens (a fresh PP=2
  DSpark server gives those too: tests/e2e/test_multi_node.py, tests/e2e/test_pp_parity.py).

The server starts early, beside the session's launcher test without the plugin (or the quick
start) when those run before this module (support/early_start.py); the fixture waits for it.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from support import early_start, engines, tiny_pair
from support.reliability import (
    continuation_probs,
    gauge,
    get_text,
    post,
    stream_completion,
    target_next_token_probs,
)

from dspark_dev import serve_demo
from dspark_dev.proc import live_group_members
from dspark_dev.serve import Server, free_port
from dspark_dev.serve_demo import serve_argv

pytestmark = pytest.mark.e2e

READY_TIMEOUT_S = 240.0
MAX_MODEL_LEN = 512  # serve_demo.CPU_SERVE_ARGS

# Scheduler: room for many concurrent requests in one batch (the tiny model's steps cost
# little; their number is what takes time on CPU).
SERVE_ARGS = [
    "--enable-chunked-prefill",
    "--max-num-batched-tokens",
    "1024",
    "--max-num-seqs",
    "128",
    "--seed",
    "0",
]
# The stock vLLM column of docs/results/reliability.md: the same server without the plugin and
# without speculation (stock vLLM 0.34.0 cannot run PP + DSpark: README).
STOCK = os.environ.get("DSPARK_RELIABILITY_STOCK") == "1"


def _new_server() -> Server:
    port = free_port()
    argv = serve_argv(
        tiny_pair.TARGET,
        pp=2,
        spec=None if STOCK else tiny_pair.spec_config(),
        port=port,
        extra=SERVE_ARGS,
    )
    log = Path(tempfile.mkdtemp(prefix="dspark-reliability-")) / "serve.log"
    env = {"VLLM_PLUGINS": "no-such-plugin"} if STOCK else engines.plugin_env()
    return Server(argv, log, env=env, port=port, name="PP=2 server")


# The server starts during the call of the first of these tests that the session runs
# (support/early_start.py), once the shared runs' pair_reference has ended: its start-up overlaps
# theirs, which keep a core of the 2-core machine idle at times (launchers importing vLLM one
# after the other, node 0 waiting for a handshake verdict).
early_start.register(
    "reliability server",
    _new_server,
    start_with=(
        "test_multi_node.py::test_node_without_plugin_fails_at_start_naming_the_rank",
        "test_quickstart.py::test_quickstart_serves_pp2_dspark_and_answers_losslessly",
    ),
    used_by="test_reliability.py::",
    ready=lambda: engines.has_run("pair_reference"),
)


@pytest.fixture(scope="module")
def server(pair_reference):
    # pair_reference first: its engine runs before this server starts, never beside it.
    srv = early_start.take("reliability server") or _new_server().start()
    try:
        srv.wait_ready(READY_TIMEOUT_S)
        yield srv
    except Exception as exc:
        pytest.fail(f"{exc}\n{srv.log_tail()}")
    finally:
        srv.stop(grace_s=10.0)
        assert not live_group_members(srv.proc.pid), "the server left processes behind"


def _body(prompt, max_tokens: int, **kw) -> dict:
    return {
        "model": tiny_pair.TARGET,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        **kw,
    }


def _choices(resp: dict) -> list[dict]:
    return sorted(resp["choices"], key=lambda c: c["index"])


def _assert_alive(server) -> None:
    assert server.exited() is None, "the server died\n" + server.log_tail()
    assert get_text(server.port, "/health") == "", "health check failed"


# ------------------------------------------------------------------ case 2
def test_client_faults_are_answered_and_leave_no_trace(server, pair_reference):
    prompts = tiny_pair.heldout_prompts(engines.PAIR_NUM_PROMPTS)
    port = server.port
    rng = random.Random(28)
    # 1. Ten concurrent streams, two closed by the client at a random event.
    streams = list(range(10))
    closers = {i: rng.randint(1, 4) for i in rng.sample(streams, 2)}  # stream: events read
    got: dict[int, dict] = {}

    def run(i: int) -> None:
        body = _body(prompts[i], engines.PAIR_MAX_TOKENS)
        got[i] = stream_completion(port, body, close_after=closers.get(i), timeout_s=240)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i in streams:
        ref = pair_reference.tokens[i]
        if i in closers:
            assert got[i]["token_ids"] == ref[: len(got[i]["token_ids"])], i
        else:
            assert got[i]["done"] and got[i]["token_ids"] == ref, (i, got[i])
    # 2. max_tokens=1.
    status, r = post(port, "/v1/completions", _body(prompts[:4], 1))
    assert status == 200 and [c["token_ids"] for c in _choices(r)] == [
        t[:1] for t in pair_reference.tokens[:4]
    ]
    # 3. A prompt that fills max_model_len with its one token, one a token too long, one far over.
    fill = (prompts[0] * 40)[: MAX_MODEL_LEN - 1]
    status, r = post(port, "/v1/completions", _body(fill, 1))
    assert status == 200 and len(_choices(r)[0]["token_ids"]) == 1, r
    for too_long, max_tokens in (((prompts[0] * 40)[:MAX_MODEL_LEN], 1), (prompts[0] * 40, 8)):
        status, r = post(port, "/v1/completions", _body(too_long, max_tokens))
        # vLLM's answer: a 400 with its message (at exactly max_model_len it clamps max_tokens
        # to 0 and says "max_tokens must be at least 1"; over it, the context length)
        assert status == 400 and r["error"]["type"] == "BadRequestError", (status, r)
        print(f"prompt of {len(too_long)} tokens: {r['error']['message'][:200]}")
    # 4. A stop string from the middle of an answer (inside an accepted block: the pair accepts
    # about 7.5 tokens per step) ends the text right before it.
    text = pair_reference.texts[0]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    status, r = post(port, "/v1/completions", _body(prompts[0], 64, stop=[stop]))
    assert status == 200, r
    c = _choices(r)[0]
    assert c["text"] == text[:cut] and c["finish_reason"] == "stop", (c, stop)
    # 5. n=2: vLLM refuses it for greedy requests (its 400); sampled, both choices arrive.
    status, r = post(port, "/v1/completions", _body(prompts[1], 16, n=2))
    assert status == 400 and r["error"]["type"] == "BadRequestError", (status, r)
    print(f"n=2 greedy: {r['error']['message']}")
    body = _body(prompts[1], 16, n=2, temperature=1.0, seed=7, ignore_eos=True)
    status, r = post(port, "/v1/completions", body)
    assert status == 200 and [len(c["token_ids"]) for c in _choices(r)] == [16, 16], r
    # Logprobs and prompt logprobs are the target's own (transformers on the checkpoint).
    body = _body(prompts[1], 64, logprobs=3, prompt_logprobs=3)
    status, r = post(port, "/v1/completions", body)
    assert status == 200, r
    (c,) = _choices(r)
    ref = pair_reference.tokens[1]
    assert c["token_ids"] == ref
    plp = c.get("prompt_logprobs") or r["choices"][0].get("prompt_logprobs") or []
    want = target_next_token_probs([prompts[1][:k] for k in range(1, len(prompts[1]))])
    assert len(plp) == len(prompts[1])
    for k, entry in enumerate(plp[1:]):
        tok = prompts[1][k + 1]
        assert abs(entry[str(tok)]["logprob"] - float(torch.log(want[k][tok]))) < 1e-3, k
    gen = continuation_probs(prompts[1], [ref])[0]
    got_lp = c["logprobs"]["token_logprobs"]
    want_lp = [float(torch.log(gen[k][t])) for k, t in enumerate(ref)]
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)) < 1e-3
    # 6. Seeded sampling is reproducible, alone and inside a batch of other requests.
    seeded = _body(prompts[2], 32, temperature=1.0, seed=4242)
    _, a = post(port, "/v1/completions", seeded)
    _, b = post(port, "/v1/completions", {**seeded, "prompt": [prompts[2]] + prompts[3:8]})
    assert _choices(a)[0]["token_ids"] == _choices(b)[0]["token_ids"]
    _assert_alive(server)


# ------------------------------------------------------------------ case 5
def test_structured_output_is_valid_or_refused(server):
    prompt = tiny_pair.heldout_prompts(1)[0]
    choice = ["alpha", "beta", "gamma"]
    status, r = post(
        server.port,
        "/v1/completions",
        _body(prompt, 16, structured_outputs={"choice": choice}),
    )
    print("choice:", status, json.dumps(r)[:300])
    assert status in (200, 400), r
    if status == 200:
        assert _choices(r)[0]["text"] in choice, r
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    status, r = post(server.port, "/v1/completions", _body(prompt, 48, response_format=fmt))
    print("json_schema:", status, json.dumps(r)[:300])
    assert status in (200, 400), r
    if status == 200:
        c = _choices(r)[0]
        if c["finish_reason"] == "stop":
            doc = json.loads(c["text"])
            assert isinstance(doc.get("answer"), int), c
        else:  # cut by max_tokens: still a prefix the schema allows
            assert c["text"].lstrip().startswith("{"), c
    _assert_alive(server)


# ------------------------------------------------------------------ afterwards
def test_after_the_faults_a_clean_batch_equals_pp1_without_speculation(server, pair_reference):
    deadline = time.monotonic() + 30
    while True:
        m = get_text(server.port, "/metrics")
        usage, running = gauge(m, "vllm:kv_cache_usage_perc"), gauge(m, "vllm:num_requests_running")
        if (usage, running) == (0.0, 0.0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert (usage, running) == (0.0, 0.0), f"KV usage {usage}, running {running} after the faults"
    out = serve_demo.complete(
        server.url, tiny_pair.TARGET, engines.pair_prompts(), engines.PAIR_MAX_TOKENS
    )
    # (a fresh PP=2 DSpark server gives these tokens too: tests/e2e/test_multi_node.py,
    # test_quickstart.py; this module no longer spends a batch on asking it first)
    assert [c["token_ids"] for c in out] == pair_reference.tokens, (
        "after the faults: differs from PP=1 without speculation"
    )
