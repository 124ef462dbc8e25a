"""Helpers of the reliability tier (issue 28, docs/results/reliability.md): streaming clients that
can hang up, the lost-stage measurement, and the statistics of the sampling-exactness test.

* :func:`stream_completion`: a ``/v1/completions`` stream read event by event over a raw
  ``http.client`` connection, optionally closed by the client after ``close_after`` events (what
  a user pressing Ctrl-C does: the socket goes away, vLLM must abort the request);
* :func:`worker_pid`: the pid of a vLLM worker from its log prefix (``(Worker_PP1 pid=N)``);
* :func:`kill_stage_mid_generation`: a PP stage SIGKILLed under streaming load, node 0's end
  measured (CPU e2e and GPU tests), :func:`lost_stage_summary` its one-screen summary;
* :func:`target_next_token_probs`: the target's exact next-token distribution (float64 softmax
  of the checkpoint run by ``transformers``, independent of vLLM) for each context;
* :func:`randomized_pit` + :func:`uniformity_chi_square`: the sampled tokens mapped through the
  target's distributions, and Pearson's test of their uniformity; :func:`chi_square_sf` its
  p-value (regularized upper incomplete gamma from ``torch.special``: no scipy in the
  environment); :func:`pit_bin_probs_under`: the exact bin probabilities under an alternative,
  for the power statement; :func:`noncentral_chi_square_sf`, :func:`pit_noncentrality_per_sample`,
  :func:`pit_power` and :func:`samples_for_power`: how many samples a power needs;
* :func:`seeded_sampling_wave`, :func:`tokens_after_accepted_drafts`, :func:`pit_of_wave`: the
  seeded sampled waves of tests/e2e/test_sampling.py and what is tested of them.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import signal
import threading
import time
from functools import cache

import torch

from dspark_dev.serve_demo import live_group_members
from support import tiny_pair


# ------------------------------------------------------------------ clients
def stream_completion(
    port: int,
    body: dict,
    *,
    close_after: int | None = None,
    timeout_s: float = 120.0,
    on_event=None,
) -> dict:
    """POST a streaming completion; return the events' token ids and how the stream ended.

    ``close_after``: close the socket after that many data events (the client disconnects).
    ``on_event(n)``: called after the ``n``-th data event (a caller waiting for a stream to be
    under way).
    Returns ``{"status", "events", "token_ids", "text", "finish_reason", "done", "error"}``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    out = {"events": 0, "token_ids": [], "text": "", "finish_reason": None, "done": False}
    out["error"] = None
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({**body, "stream": True}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        out["status"] = resp.status
        if resp.status != 200:
            out["error"] = resp.read().decode(errors="replace")
            return out
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                out["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                out["error"] = event["error"]
                continue
            out["events"] += 1
            if on_event is not None:
                on_event(out["events"])
            for c in event.get("choices", []):
                out["token_ids"] += list(c.get("token_ids") or [])
                out["text"] += c.get("text") or ""
                out["finish_reason"] = c.get("finish_reason") or out["finish_reason"]
            if close_after is not None and out["events"] >= close_after:
                break
        return out
    finally:
        conn.close()


def post(port: int, path: str, body: dict, timeout_s: float = 300.0) -> tuple[int, dict]:
    """POST JSON; return (status, decoded body) for any status (vLLM's errors are JSON)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode(errors="replace")
        try:
            return resp.status, json.loads(raw)
        except json.JSONDecodeError:
            return resp.status, {"raw": raw}
    finally:
        conn.close()


def get_text(port: int, path: str, timeout_s: float = 10.0) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode(errors="replace")
    finally:
        conn.close()


def gauge(metrics_text: str, name: str) -> float | None:
    """Sum of an unlabeled-or-labeled gauge/counter ``name`` in a Prometheus exposition."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def worker_pid(log_text: str, process_name: str) -> int | None:
    """The pid vLLM prints in each log line of a worker (``(Worker_PP1 pid=123)``)."""
    m = re.search(rf"\({re.escape(process_name)} pid=(\d+)\)", log_text)
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------ a lost PP stage
def kill_stage_mid_generation(
    servers: list,
    ready_s: float,
    exit_limit_s: float,
    victim: str = "Worker_PP1",
    victim_node: int = -1,
) -> dict:
    """Start ``servers`` (node 0 first), stream 8 greedy requests of 400 tokens, SIGKILL the
    ``victim`` worker of ``servers[victim_node]`` (pid from vLLM's log prefix), measure how node
    0 ends (seconds, status, what the clients saw, processes left, logs) and when every other
    launcher ended (``nodes_exit_s``, None if one still ran ``exit_limit_s`` after the kill);
    every group is stopped at the end (tests/e2e/test_process_faults.py,
    tests/gpu/test_pp_lost_stage_gpu.py)."""
    head, victim_host = servers[0], servers[victim_node]
    result: dict = {"clients": []}
    try:
        for s in servers:
            s.start()
        head.wait_ready(ready_s)
        prompts = tiny_pair.heldout_prompts(8)
        results: list[dict] = [{} for _ in prompts]

        def client(i: int) -> None:
            body = {
                "model": tiny_pair.TARGET,
                "prompt": prompts[i],
                "max_tokens": 400,
                "ignore_eos": True,
                "temperature": 0,
                "return_token_ids": True,
            }
            try:
                results[i] = stream_completion(head.port, body, timeout_s=exit_limit_s + 60)
            except Exception as exc:  # noqa: BLE001 - what the client saw is the measurement
                results[i] = {"exception": f"{type(exc).__name__}: {exc}"}

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(3.0)  # generation under way (400 tokens take far longer)
        pid = worker_pid(victim_host.log_tail(10**7), victim)
        assert pid is not None, f"no ({victim} pid=N) in the log\n" + victim_host.log_tail()
        result["victim_pid"] = pid
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        rc = head.wait_exit(exit_limit_s)
        result["exit_s"] = round(time.monotonic() - t0, 1)
        result["rc"] = rc
        for t in threads:
            t.join(timeout=30)
        result["clients"] = results
        # Processes of the head's group still running once the head is gone (orphans).
        time.sleep(2.0)
        result["head_group_left"] = live_group_members(head.proc.pid) if rc is not None else None
        result["other_nodes_running"] = [s.name for s in servers[1:] if s.exited() is None]
        ends = [s.wait_exit(max(0.0, t0 + exit_limit_s - time.monotonic())) for s in servers[1:]]
        result["nodes_exit_s"] = (
            round(time.monotonic() - t0, 1) if all(e is not None for e in ends) else None
        )
        result["head_log"] = head.log_tail(10**7)
        result["victim_log"] = victim_host.log_tail(10**7)
        result["other_logs"] = [s.log_tail(10**7) for s in servers[1:]]
        return result
    finally:
        for s in servers:
            s.stop(grace_s=5.0)
        for s in servers:
            if s.proc is not None:
                assert not live_group_members(s.proc.pid), f"{s.name} left processes behind"


def lost_stage_summary(r: dict) -> str:
    clients = [
        {k: (c.get(k) if k != "token_ids" else len(c.get("token_ids", []))) for k in c}
        for c in r["clients"]
    ]
    errors = [
        ln
        for ln in r["head_log"].splitlines()
        if "ERROR" in ln or "Error" in ln or "DSpark PP:" in ln
    ]
    return (
        f"exit after {r.get('exit_s')} s rc={r.get('rc')} "
        f"head group left={r.get('head_group_left')}"
        f" other nodes running={r.get('other_nodes_running')}\nclients: {clients}\n"
        + "\n".join(errors[-15:])
    )


# ------------------------------------------------------------------ target distribution
@cache
def _target_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_pair.TARGET, dtype=torch.float32).eval()


def target_next_token_probs(contexts: list[list[int]]) -> list[torch.Tensor]:
    """For each context (token ids), the target's next-token distribution (float64, sums to 1),
    from the checkpoint run by ``transformers`` in float32: vLLM is not involved."""
    model = _target_model()
    out = []
    with torch.no_grad():
        for ctx in contexts:
            logits = model(torch.tensor([list(ctx)])).logits[0, -1]
            out.append(torch.softmax(logits.double(), dim=-1))
    return out


def tempered(p: torch.Tensor, temperature: float) -> torch.Tensor:
    """``p`` sampled at ``temperature`` (p ** (1 / T), renormalized)."""
    q = p.clamp_min(1e-300) ** (1.0 / temperature)
    return q / q.sum()


# ------------------------------------------------------------------ statistics
def chi_square_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df)."""
    s = torch.tensor(stat / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), s))


def critical_value(df: int, alpha: float) -> float:
    """The chi-square(df) quantile 1 - alpha (bisection on :func:`chi_square_sf`)."""
    lo, hi = 0.0, float(df) + 20.0 * (df**0.5) + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if chi_square_sf(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def noncentral_chi_square_sf(stat: float, df: int, noncentrality: float) -> float:
    """P(X >= stat) for X ~ noncentral chi-square(df, noncentrality): a Poisson(lambda / 2)
    mixture of central chi-squares with df + 2j degrees of freedom (terms until the Poisson
    tail is below 1e-12). The power of Pearson's test when the alternative's expected statistic
    exceeds df by ``noncentrality``."""
    half = noncentrality / 2.0
    if half <= 0:
        return chi_square_sf(stat, df)
    total, j, weight_sum = 0.0, 0, 0.0
    while weight_sum < 1.0 - 1e-12 and j < 10_000:
        w = math.exp(-half + j * math.log(half) - math.lgamma(j + 1))
        total += w * chi_square_sf(stat, df + 2 * j)
        weight_sum += w
        j += 1
    return total


def pit_noncentrality_per_sample(probs: torch.Tensor, temperature: float, bins: int) -> float:
    """The noncentrality one sample adds to the PIT chi-square (``bins`` bins) when the tokens are
    drawn at ``temperature`` from the contexts' distributions ``probs`` ``[K, vocab]`` but the
    test maps them through ``probs``: ``bins * sum_b (pi_b - 1/bins) ** 2`` with ``pi`` the
    exact bin probabilities under the alternative (:func:`pit_bin_probs_under`); times ``n`` it is
    the statistic's expected excess over its degrees of freedom."""
    q = torch.stack([tempered(row, temperature) for row in probs])
    pi = pit_bin_probs_under(probs, q, bins)
    return float(((pi - 1.0 / bins) ** 2 * bins).sum())


def pit_power(n: int, per_sample: float, bins: int, alpha: float) -> float:
    """The probability that the PIT chi-square at ``n`` samples rejects at ``alpha`` against an
    alternative of noncentrality ``per_sample`` per sample."""
    return noncentral_chi_square_sf(critical_value(bins - 1, alpha), bins - 1, n * per_sample)


def samples_for_power(per_sample: float, bins: int, alpha: float, power: float) -> int:
    """The smallest ``n`` at which :func:`pit_power` reaches ``power`` (bisection on n)."""
    lo, hi = 1, 1
    while pit_power(hi, per_sample, bins, alpha) < power:
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if pit_power(mid, per_sample, bins, alpha) >= power:
            hi = mid
        else:
            lo = mid + 1
    return hi


# ------------------------------------------------------------------ sampled continuations
def continuation_probs(prefix: list[int], samples: list[list[int]]) -> torch.Tensor:
    """Target next-token distributions along each sampled continuation of ``prefix``:
    ``[len(samples), M, vocab]`` where row ``[i, j]`` is p(. | prefix + samples[i][:j]).
    All samples must have the same length ``M`` (one batched forward)."""
    model = _target_model()
    m = len(samples[0])
    assert all(len(s) == m for s in samples), "samples of different lengths"
    ids = torch.tensor([list(prefix) + list(s[:-1]) for s in samples])
    with torch.no_grad():
        logits = model(ids).logits[:, len(prefix) - 1 :, :]
    return torch.softmax(logits.double(), dim=-1)


def randomized_pit(probs: torch.Tensor, tokens: torch.Tensor, seed: int) -> torch.Tensor:
    """Randomized probability integral transform of each token under its own distribution
    (tokens ranked by decreasing probability): ``u = P(rank < rank(t)) + V * p(t)`` with
    ``V ~ U(0, 1)``. For draws from ``probs`` the ``u`` are independent U(0, 1), also along a
    sequence where each distribution depends on the earlier draws (Rosenblatt); a sampler that
    favours probable tokens (a lower temperature) pushes them towards 0. ``probs``:
    ``[..., vocab]``, ``tokens``: ``[...]``."""
    order = torch.argsort(probs, dim=-1, descending=True)
    sorted_p = torch.gather(probs, -1, order)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass ranked before each sorted token
    rank = torch.argsort(order, dim=-1)  # rank of every token id
    r = torch.gather(rank, -1, tokens.unsqueeze(-1)).squeeze(-1)
    lo = torch.gather(before, -1, r.unsqueeze(-1)).squeeze(-1)
    pt = torch.gather(probs, -1, tokens.unsqueeze(-1)).squeeze(-1)
    gen = torch.Generator().manual_seed(seed)
    v = torch.rand(pt.shape, generator=gen, dtype=torch.float64)
    return (lo + v * pt).clamp(0.0, 1.0 - 1e-12)


def uniformity_chi_square(u: torch.Tensor, bins: int = 20) -> dict:
    """Pearson's test that ``u`` is U(0, 1), with ``bins`` equiprobable bins."""
    n = int(u.numel())
    observed = torch.bincount((u.flatten() * bins).long().clamp(0, bins - 1), minlength=bins)
    e = n / bins
    stat = float(((observed.double() - e) ** 2 / e).sum())
    return {
        "n": n,
        "stat": stat,
        "df": bins - 1,
        "p_value": chi_square_sf(stat, bins - 1),
        "observed": observed.tolist(),
    }


def pit_bin_probs_under(probs: torch.Tensor, q: torch.Tensor, bins: int = 20) -> torch.Tensor:
    """Expected PIT bin probabilities when tokens come from ``q`` but the transform uses
    ``probs`` (both ``[K, vocab]``), averaged over the K contexts: the alternative of the power
    statement (vectorized over tokens; exact, no sampling)."""
    order = torch.argsort(probs, dim=-1, descending=True)
    sp = torch.gather(probs, -1, order)
    sq = torch.gather(q, -1, order)
    lo = torch.cumsum(sp, dim=-1) - sp
    hi = lo + sp
    edges = torch.linspace(0.0, 1.0, bins + 1, dtype=torch.float64)
    out = torch.zeros(bins, dtype=torch.float64)
    width = sp.clamp_min(1e-300)
    for b in range(bins):
        overlap = (torch.minimum(hi, edges[b + 1]) - torch.maximum(lo, edges[b])).clamp_min(0)
        out[b] = (sq * overlap / width).sum() / probs.shape[0]
    return out


# ------------------------------------------------------------------ seeded sampled waves
# Prompts of the sampled waves: held-out questions cut after this many tokens ("Question: NAME"),
# where the trained target is uncertain (the next token's mode has about 0.63 of the mass; the
# answers themselves are near-certain). The drafter was trained on answers: in question text it
# accepts mostly at draft position 0, so the tokens closing an accepted block are those of steps
# that accepted one or two drafts.
SAMPLING_PREFIX_TOKENS = 3


# The GPU run of case 4 (tests/gpu/test_sampling_gpu.py, group ``sampling``). Its size comes from
# the CPU hand run's power statement (docs/results/reliability.md, "Case 4"): against temperature
# 0.8 the noncentrality was 7.9 at n = 256 first tokens and 3.8 at n = 152 tokens right after an
# accepted draft token, 0.031 and 0.025 per sample; Pearson's test over 5 bins at alpha 1e-3
# reaches power 0.9 at a noncentrality of 27.6, so 898 and 1,108 samples
# (:func:`samples_for_power`), 1,301 and 1,606 for power 0.99. 2,048 requests of 17 tokens (the
# first token and two whole verification blocks at k = 7) give 2,048 first tokens and, at the CPU
# run's rate per verification block, over 2,000 tokens after an accepted draft token.
CPU_RUN_NONCENTRALITY_T08 = {"first": (7.9, 256), "after_accepted": (3.8, 152)}
GPU_SAMPLING_REQUESTS = 2048
GPU_SAMPLING_PER_PROMPT = 32  # 64 held-out prefixes
GPU_SAMPLING_MAX_TOKENS = 17
SAMPLING_ALPHA = 1e-3
SAMPLING_BINS = 5
SAMPLING_POWER = 0.9


def seeded_sampling_wave(
    requests: int, max_tokens: int, *, temperature: float, seed0: int, per_prompt: int = 1
) -> dict:
    """An extra wave for :func:`support.e2e.run_generate`: ``requests`` seeded sampled requests
    (``ignore_eos``, so every sample has ``max_tokens`` tokens), ``per_prompt`` consecutive
    requests per held-out prefix, request ``i`` seeded ``seed0 + i``."""
    n_prompts = -(-requests // per_prompt)
    prefixes = [p[:SAMPLING_PREFIX_TOKENS] for p in tiny_pair.heldout_prompts(n_prompts)]
    prompts = [prefixes[i // per_prompt] for i in range(requests)]
    base = {"temperature": temperature, "max_tokens": max_tokens, "ignore_eos": True}
    sampling = [{**base, "seed": seed0 + i} for i in range(requests)]
    return {"prompts": prompts, "sampling": sampling}


def tokens_after_accepted_drafts(step_lengths: list[int]) -> list[int]:
    """Indices of the tokens sampled right after an accepted draft token of the same verification
    step: the next draft's rejection test (accepted), the recovered token or the bonus token.
    ``step_lengths``: the request's token count after each step (``dspark_dev.engine_worker``);
    a verification step that adds ``m`` tokens accepted its first ``m - 1``, so tokens 2..m of
    its chunk follow an accepted draft.

    The selection looks only at the previous position's outcome. Selecting the *last* token of
    each accepted block instead would select on the token's own outcome (its draft rejected),
    and such a token comes from the residual distribution ``(p - q)+``, not from ``p``; with
    vLLM's token-level verification (``rejection_sample_method`` "standard", the default) the
    randomness of a position is independent of the earlier positions' acceptance, so the tokens
    selected here are draws from the target's ``p`` at their context."""
    out, prev = [], 0
    for n in step_lengths:
        if prev > 0:
            out.extend(range(prev + 1, n))
        prev = n
    return out


def pit_of_wave(wave: dict, *, seed: int, near_certain: float = 0.99) -> dict:
    """Randomized PIT values (:func:`randomized_pit`, under the target's own distributions at
    each sampled context) of a sampled wave's first tokens and of its tokens that follow an
    accepted draft token (:func:`tokens_after_accepted_drafts`), informative contexts only (top
    token below ``near_certain``: chosen from the context, not from the sampled token, so the
    null distribution stays U(0, 1)). Also the contexts' distributions (for power statements)
    and the wave's step bookkeeping."""
    groups: dict[tuple, list[int]] = {}  # requests by prompt: one batched forward per prompt
    prompts = wave["prompts"]
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    u: dict[str, list] = {"first": [], "after_accepted": []}
    ctx: dict[str, list] = {"first": [], "after_accepted": []}
    for g, (prefix, idx) in enumerate(groups.items()):
        toks = torch.tensor([wave["tokens"][i] for i in idx])
        probs = continuation_probs(list(prefix), toks.tolist())  # [R, M, V]
        pit = randomized_pit(probs, toks, seed=seed + g)
        informative = probs.max(dim=-1).values < near_certain
        for r, i in enumerate(idx):
            for name, cols in (
                ("first", [0]),
                ("after_accepted", tokens_after_accepted_drafts(wave["step_lengths"][i])),
            ):
                keep = [c for c in cols if informative[r, c]]
                u[name].append(pit[r, keep])
                ctx[name].append(probs[r, keep])
    return {
        "u": {k: torch.cat(v) for k, v in u.items()},
        "contexts": {k: torch.cat(v) for k, v in ctx.items()},
        "verification_steps": sum(len(s) - 1 for s in wave["step_lengths"]),
        "accepted_in_output": sum(
            b - a - 1 for s in wave["step_lengths"] for a, b in zip(s, s[1:], strict=False)
        ),
    }
