"""Serve DSpark on a PP target with ``vllm serve`` and ask it one question (the quick start).

Used by ``python -m dspark_dev demo`` (what ``tools/quickstart.sh`` runs) and by the CPU end-to-end
tests (tests/e2e/test_quickstart.py, tests/e2e/test_multi_node.py), which start the same
``vllm serve`` command lines (:func:`serve_argv`) as :class:`dspark_dev.serve.Server` launchers
(its own process group, a readiness wait with a deadline and a progress line, the whole group
stopped: nothing it starts outlives it).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

from dspark_dev.metrics import spec_metrics_from_prometheus
from dspark_dev.proc import live_group_members
from dspark_dev.serve import Server, free_port, http_json

__all__ = [
    "free_port",
    "live_group_members",
    "serve_argv",
    "spec_metrics_from_prometheus",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PAIR = REPO_ROOT / "models" / "tiny-pair"

# float32 (CPU parity), eager (no torch.compile warm-up on CPU), small KV cache.
CPU_SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512"]


def say(msg: str) -> None:
    print(f"[demo] {time.strftime('%H:%M:%S')} {msg}", flush=True)


def pair_spec_config(pair: Path) -> dict:
    draft = pair / "dspark-draft"
    block = json.loads((draft / "config.json").read_text())["block_size"]
    return {"method": "dspark", "model": str(draft), "num_speculative_tokens": int(block)}


def serve_argv(
    target: str,
    *,
    pp: int = 2,
    spec: dict | None = None,
    port: int | None = None,
    extra: list[str] | None = None,
    base: list[str] | None = None,
    tp: int = 1,
) -> list[str]:
    """The ``vllm serve`` command line (``port`` None: headless, no API server); ``base``
    replaces the CPU settings :data:`CPU_SERVE_ARGS` (a GPU deployment passes its own);
    ``-tp`` only when ``tp`` > 1."""
    exe = Path(sys.executable).with_name("vllm")  # the venv's console script
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    argv = [*launcher, "serve", target, "-pp", str(pp)]
    if tp > 1:
        argv += ["-tp", str(tp)]
    argv += CPU_SERVE_ARGS if base is None else list(base)
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    if port is None:
        argv += ["--headless"]
    else:
        argv += ["--host", "127.0.0.1", "--port", str(port)]
    return argv + list(extra or [])


def post_json(url: str, body: dict, timeout_s: float) -> dict:
    return http_json(url, body, timeout=timeout_s)


def complete(url: str, model: str, prompt, max_tokens: int, timeout_s: float = 300.0) -> list[dict]:
    """Greedy ``/v1/completions``; ``prompt`` is text, token ids, or a list of either.
    Returns one dict per prompt: text, token_ids, prompt_token_ids, finish_reason."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    out = post_json(url + "/v1/completions", body, timeout_s)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    return [
        {
            "text": c["text"],
            "token_ids": list(c.get("token_ids") or []),
            "prompt_token_ids": list(c.get("prompt_token_ids") or []),
            "finish_reason": c.get("finish_reason"),
        }
        for c in choices
    ]


def spec_metrics(url: str, settle_s: float = 5.0) -> dict:
    """Read ``/metrics`` until two reads agree (the last step's stats land just after the
    response), at most ``settle_s`` seconds."""
    deadline = time.monotonic() + settle_s
    prev = None
    while True:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            cur = spec_metrics_from_prometheus(r.read().decode())
        if cur == prev or time.monotonic() >= deadline:
            return cur
        prev = cur
        time.sleep(0.3)


def acceptance_summary(m: dict) -> dict:
    drafts = m["num_drafts"]
    return {
        "mean_acceptance_length": 1 + m["num_accepted_tokens"] / drafts if drafts else None,
        "per_position_rates": [a / drafts for a in m["accepted_per_pos"]] if drafts else [],
    }


def heldout_question(index: int = 0) -> tuple[str, str]:
    """(question, prompt) of the pair's held-out problem ``index`` (never seen in training)."""
    from dspark_dev.training import corpus

    p = corpus.heldout_problems(max(index + 1, corpus.DEFAULT_HELDOUT_SIZE))[index]
    return p.question, corpus.format_prompt(p.question)


# The same deployment with a real model on two GPUs (the draft vLLM's DSpark config names as
# its example; tests/evals/gsm8k/configs/qwen3-8b-dspark-pp2.yaml).
GPU_COMMAND = (
    "vllm serve Qwen/Qwen3-8B -pp 2 --speculative-config "
    '\'{"method": "dspark", "model": "deepseek-ai/dspark_qwen3_8b_block7", '
    '"num_speculative_tokens": 7}\''
)


def run_demo(
    pair: Path = DEFAULT_PAIR,
    *,
    pp: int = 2,
    question_index: int = 0,
    max_tokens: int = 64,
    ready_timeout_s: float = 240.0,
    log_path: Path | None = None,
    port: int | None = None,
) -> dict:
    """Start ``vllm serve`` (PP, DSpark) on the pair, ask one held-out question, stop.

    Returns a dict with the question, answer, token ids, spec-decode counters, acceptance
    summary, timings and whether the server stopped on SIGTERM; raises on failure (the server
    is stopped either way)."""
    pair = Path(pair)
    target = str(pair / "target")
    spec = pair_spec_config(pair)
    port = port or free_port()
    log_path = Path(log_path or (REPO_ROOT / ".demo" / "vllm-serve.log"))
    server = Server(serve_argv(target, pp=pp, spec=spec, port=port), log_path, port=port)
    question, prompt = heldout_question(question_index)
    result: dict = {"question": question, "prompt": prompt, "pp": pp, "spec": spec}
    t0 = time.monotonic()
    say(
        f"starting vllm serve {target} -pp {pp} with DSpark k={spec['num_speculative_tokens']} "
        f"on the CPU platform, float32 (log: {log_path})"
    )
    server.start()
    try:
        server.wait_ready(ready_timeout_s)
        result["ready_s"] = round(time.monotonic() - t0, 1)
        say(f"server ready after {result['ready_s']} s; asking one held-out question")
        t1 = time.monotonic()
        (choice,) = complete(server.url, target, prompt, max_tokens)
        result["answer_s"] = round(time.monotonic() - t1, 2)
        result.update(
            answer=choice["text"],
            token_ids=choice["token_ids"],
            prompt_token_ids=choice["prompt_token_ids"],
            finish_reason=choice["finish_reason"],
        )
        result["metrics"] = spec_metrics(server.url)
        result.update(acceptance_summary(result["metrics"]))
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        say(f"FAILED: {result['error']}\n--- server log tail ({log_path}) ---\n{server.log_tail()}")
        raise
    finally:
        say("stopping the server (SIGTERM to its process group)")
        result["stopped_cleanly"] = server.stop()
        result["leftover_pids"] = live_group_members(server.proc.pid) if server.proc else []
        result["wall_s"] = round(time.monotonic() - t0, 1)
    return result


def format_result(r: dict) -> str:
    rates = " ".join(f"{x:.2f}" for x in r.get("per_position_rates", []))
    mal = r.get("mean_acceptance_length")
    m = r["metrics"]
    return "\n".join(
        [
            f"question:  {r['question']}",
            f"answer:   {r['answer']}",
            f"tokens:    {len(r['token_ids'])} generated (finish: {r['finish_reason']}) "
            f"in {r['answer_s']} s",
            f"DSpark:    mean acceptance length {mal:.2f} "
            f"({m['num_accepted_tokens']} of {m['num_draft_tokens']} drafted tokens accepted "
            f"in {m['num_drafts']} draft steps, k={r['spec']['num_speculative_tokens']})"
            if mal is not None
            else "DSpark:    no draft step ran",
            f"per-position acceptance rate: {rates}",
        ]
    )
