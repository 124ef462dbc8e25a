"""Benchmark-only vLLM plugin: per-step target/draft times and drafter memory, for
benchmarks/perf_real_shapes.py. Never installed; the driver makes it discoverable in its child
processes only (a throw-away ``*.dist-info`` with a ``vllm.general_plugins`` entry point named
``dspark_bench`` on the child's PYTHONPATH), so vLLM loads it in every process it starts, with
``VLLM_PLUGINS=dspark_bench`` (plugin off) as well as ``dspark_pp,dspark_bench`` (plugin on).

Why hand-written: vLLM 0.34.0 has no per-step split of the decode step into "target forward" and
"draft propose". Its torch profiler (``VLLM_TORCH_PROFILER_DIR``) gives the split but writes
hundreds of MB of traces per run and perturbs the timing; the spec-decode metrics count tokens,
not time. CUDA events cost a few microseconds per record, are queued on the same stream as the
work (no synchronisation while serving), and are resolved only between runs.

What it measures, per engine step, in GPU-stream time between events recorded at:
``t0`` entry of ``execute_model`` (input preparation + target forward are queued after it),
``t1`` entry of ``sample_tokens`` (sampling / rejection sampling), ``t2``/``t3`` around the
speculator's ``propose`` (context-KV precompute + query pass + Markov sampling), ``t4`` exit of
``sample_tokens``. target = t1 - t0, draft = t3 - t2, step = t4 - t0. When the GPU waits for
the CPU between two events the gap is included (reported as is: it is what a step costs).
On the CPU platform (dry runs) host clocks replace events.

Adaptive verification (issue 30). With dummy weights the Qwen3-8B shape's DSpark confidence
head is a ``float32`` linear layer with weights drawn from vLLM's dummy range (+-1e-3), so its
sigmoid is about 0.5 at every position of every request, and vLLM's synthetic rejection sampler
accepts draft position ``i`` when a counter-based random number is below the configured
conditional rate of position ``i``: no draft token, logit or confidence enters that decision.
The confidences are then no estimate of anything the sampler does. ``DSPARK_BENCH_CONFIDENCES``
in a server's environment chooses what adaptive verification ranks and budgets with:

* ``synthetic``: every request's confidences are the synthetic sampler's own conditional
  per-position rates (the tensor ``set_acceptance_length`` rewrites, so they follow every switch),
  written over the draft's confidences right before vLLM's ``record_confidences`` (the last PP
  stage; under PP the plugin's decision reads the same rows). The survival products are then the
  exact expected acceptance of each position, the same for every request: this measures vLLM's
  budget (expected accepted tokens per step cost, the profiled cost curve) with perfectly
  calibrated confidences. It does not model confidences that differ between requests or steps
  (vLLM's per-request ranking only breaks ties, in request order), nor a confidence head's
  errors.
* unset (or ``draft``): the draft's own confidences, as vLLM would use them.

vLLM's synthetic rates for a mean length are its minimum-variance schedule (AL 3.99 at k=7:
unconditional ``1, 1, 0.99, 0, 0, 0, 0``), so the synthetic confidences say "verify exactly the
first three": adaptive verification's best case. ``DSPARK_BENCH_SYNTHETIC_SCHEDULE=geometric``
(the driver's ``--env``, every server alike) makes ``set_acceptance_length`` use a geometric
profile of the same mean instead (one conditional rate ``p`` at every position; AL 3.99 at k=7:
``p`` about 0.79), where every extra verified position still pays off a little and the budget has
a real trade-off to make against the step cost. ``DSPARK_BENCH_PROFILE_POSITIONS=K`` (set by
the driver for its k sweep) spreads the mean over ``K`` positions whatever the server's own ``k``
and keeps the first ``k`` rates: servers drafting 1..7 tokens then accept position ``i`` alike
(the same geometric ``p``), and a shorter ``k`` has a lower mean acceptance length.

Either way each step's draft confidences, as the draft produced them, are summed per position on
the device (no host synchronisation while serving) and ``collect`` reports their mean per
position, minimum and maximum (``confidences``), so a run records what the dummy draft gives.

The timers are installed on the live model runner and speculator *instances* by the first
``dspark_bench_ctl("enable")`` RPC, i.e. after start-up (profiling, compilation and CUDA-graph
capture never see them). The drafter's memory is measured at load: the allocator's
``memory_allocated`` before and after ``DraftModelSpeculator.load_model`` (the speculator's own
load, which calls vLLM's or this plugin's ``load_draft_model``), each after ``gc.collect()``,
and the peak in between; the whole model load (target + draft) is vLLM's own
``model_memory_usage`` (also measured after ``gc.collect()``). The first GPU run (2026-12-03)
read the allocator without ``gc.collect()`` and so counted the drafter's replaced embedding and
LM head copies (docs/results/performance.md).

Which CUDA graph ran each step (issue 44 goal (g)). The runner's graph manager's ``dispatch``
is wrapped on the live instance, and the first descriptor of a step (the batch's own; the
fast-prefill logits dispatch comes later) names the step's graph kind: ``eager``,
``piecewise``, ``full uniform q=Q`` (a decode graph keyed by request count, every request ``Q``
tokens: fixed k), ``full varlen q<=Q`` (adaptive verification's token-keyed decode graphs,
vllm/v1/worker/gpu/cudagraph_utils.py:313-330) or ``full tokens``. ``summarize_steps`` counts
the steps of each kind with their median target time, so a record says whether adaptive's
steps replayed other graphs than fixed k's, and what each kind cost.

Exchange accounting (issue 29 goal (e), same ``enable`` / ``collect`` RPCs). Installed with the
step timers on the live objects; every record belongs to the engine step it happens in (the
stage-to-stage receive, posted by vLLM's worker before the model runner's ``execute_model``, to
the step that follows). Bytes are exact (``numel * element_size`` of what is sent or received).
Per step and rank:

* ``pp_send_bytes:<key>``: what this stage sends to the next (vLLM's ``isend_tensor_dict`` of the
  intermediate tensors, per key: ``hidden_states``, ``residual``, relayed aux taps);
  ``pp_send_host_ms``: host time of that call (posting; the NCCL send itself is asynchronous);
  ``pp_send_ms`` (CUDA only): from an event on the sender's stream right before the call (its
  forward's end: NCCL's stream starts the sends after it) to the sends' completion, waited on a
  timing stream of the hook's own (not under ``TORCH_NCCL_BLOCKING_WAIT``, where that wait
  would hold the host). It holds the transfer and any wait for the receiver's receive; the
  receiver's ``pp_recv_wait_ms`` holds what is left of the transfer when its stream needs the
  data, and any wait for the sender's forward. Whoever comes second waits for nothing, so the
  smaller of the two (medians, one per stage) bounds the transfer time the last stage is
  exposed to, where either alone may also hold the peer's work (at PP=2: the first and last
  workers are the two ends of the one link).
* ``pp_recv_bytes:<key>``, ``pp_recv_rows``: what a non-first stage receives;
  ``pp_recv_host_ms``: host time of ``irecv_tensor_dict`` (it blocks on the metadata object the
  sender posts over the CPU group, so it includes waiting for the sender to reach its send);
  ``pp_recv_ready_ms``: GPU-stream time on the receiving stage's stream from an event recorded
  right after the receives are posted to one recorded right after vLLM's ``wait_for_comm`` (the
  stream can run nothing of this step's forward before the data are there: post to usable);
  ``pp_recv_wait_ms``: from an event recorded right before ``wait_for_comm`` to the one after it:
  how long the forward's stream actually stalled on the activations.
* ``x_bytes:<name>``: the last stage's token broadcasts (``sampled``, ``counts``, ``drafts``, in
  the order both stock vLLM and this plugin post them), sent by the last stage, received by the
  others; ``x_bcast_ms``: GPU time on the broadcast side stream from an event before each
  broadcast to one after it, summed over the step (includes waiting for the peer to join);
  ``x_wait_ms``: how long the main stream stalled on the received tokens (events around
  ``get_prev_sampled_outputs``, which makes the main stream wait for the broadcast's event).
* the DSpark tap side channel (``VLLM_DSPARK_PP_TAP_PARTIALS=side``, protocol/tap_partials.py):
  ``side_send_bytes:dspark_tap_partial`` (what a stage that makes taps sends straight to the
  last stage), ``side_recv_bytes:dspark_tap_partial`` (what the last stage posts receives for,
  all senders), ``side_wait_ms``: how long the last stage's main stream stalled on them, from an
  event right before the drafter's wait to one right after it (it waits only there, after its
  forward and sampling). With the partials in the intermediate tensors instead (``1``/``auto``)
  they are ``pp_*_bytes:dspark_tap_partial`` and their wait is part of ``pp_recv_wait_ms``.

On the CPU platform host clocks replace events (gloo is synchronous: the spans are host time).
The host wait in ``irecv_tensor_dict`` falls before the step's ``t0`` (vLLM's worker posts the
receive before the model runner's step), so it is reported beside the step, not in its share.
The stalls (``pp_recv_wait_ms + x_wait_ms + side_wait_ms``) are an upper bound of what the
exchange costs a stage: with both stages on one GPU they also hold the time the peer spends
computing before it sends. ``pp_recv_rows`` is the received tensors' first dimension once
usable (after vLLM's ``wait_for_comm``: before it, vLLM 0.34.0's receive buffers are flat,
``rows x hidden`` elements, even at TP=1). The first step, and the first whose rows differ
from the batch's padded token count, are logged once (shapes usable and as posted,
``num_tokens``, ``num_tokens_padded``).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any

FIRST_STEPS_KEPT = 6  # steps of each run reported one by one (``collect``)
CONFIDENCES_ENV = "DSPARK_BENCH_CONFIDENCES"
SCHEDULE_ENV = "DSPARK_BENCH_SYNTHETIC_SCHEDULE"
PROFILE_ENV = "DSPARK_BENCH_PROFILE_POSITIONS"
_STATE: dict[str, Any] = {
    "steps": [], "cur": None, "mem": {}, "installed": False, "rates": None, "conf": None,
    "xpend": [], "xctx": None, "recv_post": None, "recv_shapes": None, "shape_logged": set(),
    "send_stream": None,
}  # fmt: skip


def _cuda():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        return None


def _mark():
    torch = _cuda()
    if torch is None:
        return ("host", time.perf_counter())
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ("cuda", ev)


def _elapsed_ms(a, b) -> float | None:
    if a is None or b is None:
        return None
    if a[0] == "host":
        return (b[1] - a[1]) * 1e3
    return float(a[1].elapsed_time(b[1]))


# --------------------------------------------------------------------------- memory at load
def _patch_speculator_base(module) -> None:
    cls = module.DraftModelSpeculator
    if getattr(cls, "_dspark_bench_mem", False):
        return
    orig = cls.load_model

    def load_model(self, target_model):
        torch = _cuda()
        before = peak0 = None
        if torch is not None:
            gc.collect()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = orig(self, target_model)
        rec: dict[str, Any] = {
            "speculator": type(self).__name__,
            "load_s": round(time.perf_counter() - t0, 3),
            "draft_class": type(getattr(self, "model", None)).__name__,
        }
        model = getattr(self, "model", None)
        if model is not None:
            # Parameters the drafter owns: shared target modules (embedding, LM head) are the
            # target's and are not counted.
            target_ptrs = {p.data_ptr() for p in target_model.parameters()}
            own = [p for p in model.parameters() if p.data_ptr() not in target_ptrs]
            rec["param_bytes_all"] = sum(p.numel() * p.element_size() for p in model.parameters())
            rec["param_bytes_own"] = sum(p.numel() * p.element_size() for p in own)
            rec["buffer_bytes"] = sum(b.numel() * b.element_size() for b in model.buffers())
        if torch is not None:
            torch.cuda.synchronize()
            after_no_gc = torch.cuda.memory_allocated()
            peak0 = torch.cuda.max_memory_allocated()
            # vLLM replaces the drafter's own embedding / LM head by the target's; on the first
            # H200 run the replaced copies were still allocated when load_model returned, and
            # vLLM's model_memory_usage (taken after its own gc.collect()) did not hold them. The
            # steady-state figure is the one after gc.collect(); the one before is kept.
            gc.collect()
            torch.cuda.synchronize()
            after = torch.cuda.memory_allocated()
            rec.update(
                allocated_delta_bytes=after - before,
                allocated_delta_bytes_before_gc=after_no_gc - before,
                peak_delta_bytes=peak0 - before,
                gc_collected=True,
            )
        _STATE["mem"]["draft_load"] = rec
        return out

    cls.load_model = load_model
    cls._dspark_bench_mem = True


# --------------------------------------------------------------------------- step timers
def _install_timers(runner) -> list[str]:
    installed = []

    orig_exec = runner.execute_model

    def execute_model(*args, **kwargs):
        cur = _STATE["cur"] = {"t0": _mark()}
        if _STATE["xpend"]:  # the stage-to-stage receive vLLM's worker posted for this step
            cur["x"], _STATE["xpend"] = _STATE["xpend"], []
        if _STATE["recv_shapes"] is not None:
            cur["recv_shapes"], _STATE["recv_shapes"] = _STATE["recv_shapes"], None
        return orig_exec(*args, **kwargs)

    runner.execute_model = execute_model
    installed.append("execute_model")

    orig_sample = runner.sample_tokens

    def sample_tokens(*args, **kwargs):
        cur = _STATE["cur"]
        state = getattr(runner, "execute_model_state", None)
        if cur is not None and state is not None:
            cur["t1"] = _mark()
            batch = getattr(state, "input_batch", None)
            cur["num_reqs"] = int(getattr(batch, "num_reqs", 0) or 0)
            cur["num_tokens"] = int(getattr(batch, "num_tokens", 0) or 0)
            cur["num_draft_tokens"] = int(getattr(batch, "num_draft_tokens", 0) or 0)
            padded = getattr(batch, "num_tokens_after_padding", None)
            cur["num_tokens_padded"] = int(padded) if padded is not None else None
            _maybe_log_shapes(cur)
        out = orig_sample(*args, **kwargs)
        if cur is not None and "t1" in cur:
            cur["t4"] = _mark()
            _STATE["steps"].append(cur)
            _STATE["cur"] = None
        return out

    runner.sample_tokens = sample_tokens
    installed.append("sample_tokens")

    manager = getattr(runner, "cudagraph_manager", None)
    if manager is not None and hasattr(manager, "dispatch"):
        orig_dispatch = manager.dispatch

        def dispatch(*args, **kwargs):
            desc = orig_dispatch(*args, **kwargs)
            cur = _STATE["cur"]
            if cur is not None and "graph" not in cur:
                cur["graph"] = graph_kind(desc)
                cur["graph_tokens"] = int(desc.num_tokens)
                cur["graph_reqs"] = desc.num_reqs
            return desc

        manager.dispatch = dispatch
        installed.append("cudagraph_dispatch")

    spec = getattr(runner, "speculator", None)
    if spec is not None and hasattr(spec, "propose"):
        orig_propose = spec.propose

        def propose(*args, **kwargs):
            cur = _STATE["cur"]
            if cur is not None:
                cur["t2"] = _mark()
            out = orig_propose(*args, **kwargs)
            if cur is not None:
                cur["t3"] = _mark()
            return out

        spec.propose = propose
        installed.append("propose")
    return installed


# --------------------------------------------------------------------------- adaptive verification
def confidence_mode() -> str:
    """What adaptive verification ranks with in this process (``DSPARK_BENCH_CONFIDENCES``)."""
    mode = os.environ.get(CONFIDENCES_ENV, "draft") or "draft"
    if mode not in ("draft", "synthetic"):
        raise ValueError(f"{CONFIDENCES_ENV}={mode!r}: use 'synthetic' or 'draft'")
    return mode


def _patch_rejection_sampler(module) -> None:
    """Remember the synthetic sampler's conditional rates tensor (the last stage's)."""
    cls = module.RejectionSampler
    if getattr(cls, "_dspark_bench_rates", False):
        return
    orig = cls.__init__

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        rates = getattr(self, "synthetic_conditional_rates", None)
        if rates is not None:
            _STATE["rates"] = rates

    cls.__init__ = __init__
    cls._dspark_bench_rates = True


def note_confidences(conf, num_reqs: int) -> None:
    """Add the rows ``[:num_reqs]`` of the draft's confidences to the device-side running
    per-position sum, minimum and maximum (no host synchronisation)."""
    import torch

    rows = conf[:num_reqs].float()
    acc = _STATE["conf"]
    if acc is None:
        k = rows.shape[1]
        acc = _STATE["conf"] = {
            "sum": torch.zeros(k, dtype=torch.float64, device=rows.device),
            "min": torch.full((), float("inf"), device=rows.device),
            "max": torch.full((), float("-inf"), device=rows.device),
            "rows": 0,
            "steps": 0,
        }
    acc["sum"] += rows.sum(0, dtype=torch.float64)
    torch.minimum(acc["min"], rows.min(), out=acc["min"])
    torch.maximum(acc["max"], rows.max(), out=acc["max"])
    acc["rows"] += num_reqs
    acc["steps"] += 1


def confidence_summary() -> dict | None:
    """The recorded confidences since the last call (then reset): steps, rows, mean per
    position, minimum, maximum."""
    acc, _STATE["conf"] = _STATE["conf"], None
    if acc is None or not acc["rows"]:
        return None
    return {
        "steps": acc["steps"],
        "rows": acc["rows"],
        "mean_per_position": [round(float(x) / acc["rows"], 6) for x in acc["sum"].tolist()],
        "min": round(float(acc["min"]), 6),
        "max": round(float(acc["max"]), 6),
    }


def _patch_adaptive(module) -> None:
    """Record the draft's confidences; with ``DSPARK_BENCH_CONFIDENCES=synthetic`` replace them
    by the synthetic sampler's conditional rates before vLLM (and the plugin) read them."""
    cls = module.AdaptiveVerificationManager
    if getattr(cls, "_dspark_bench_conf", False):
        return
    orig = cls.record_confidences
    synthetic = confidence_mode() == "synthetic"

    def record_confidences(self, confidence_probs, input_batch):
        n = int(input_batch.num_reqs)
        if n:
            note_confidences(confidence_probs, n)
            rates = _STATE["rates"]
            if synthetic:
                if rates is None:
                    raise RuntimeError(
                        f"{CONFIDENCES_ENV}=synthetic needs rejection_sample_method 'synthetic' "
                        "(no synthetic rates on the stage that records confidences)"
                    )
                k = confidence_probs.shape[1]
                confidence_probs[:n].copy_(rates[:k].to(confidence_probs.dtype).expand(n, k))
        return orig(self, confidence_probs, input_batch)

    cls.record_confidences = record_confidences
    cls._dspark_bench_conf = True


def _median(xs) -> float | None:
    """The median of the values that are not ``None``, rounded to 4 places (``None`` if none)."""
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def graph_kind(desc) -> str:
    """The kind of graph a vLLM ``BatchExecutionDescriptor`` runs (module docstring)."""
    mode = getattr(desc.cg_mode, "name", str(desc.cg_mode))
    if mode == "NONE":
        return "eager"
    if mode == "PIECEWISE":
        return "piecewise"
    if desc.uniform_token_count is not None:
        return f"full uniform q={desc.uniform_token_count}"
    if desc.max_query_len is not None:
        return f"full varlen q<={desc.max_query_len}"
    return "full tokens"


def graph_totals(steps: list[dict]) -> dict | None:
    """Per graph kind: the steps that ran it, their median target time, padded tokens and
    request slots (``None`` when no step recorded a graph: an older record or no graph manager)."""
    by: dict[str, list[dict]] = {}
    for s in steps:
        if s.get("graph"):
            by.setdefault(s["graph"], []).append(s)
    if not by:
        return None
    return {
        kind: {
            "steps": len(ss),
            "target_ms": _median([s.get("target_ms") for s in ss]),
            "graph_tokens": _median([s.get("graph_tokens") for s in ss]),
            "graph_reqs": _median([s.get("graph_reqs") for s in ss]),
        }
        for kind, ss in sorted(by.items(), key=lambda kv: -len(kv[1]))
    }


def verify_totals(steps: list[dict]) -> dict:
    """Draft tokens the steps verified (``InputBatch.num_draft_tokens``: after adaptive
    verification's trimming, vllm/v1/worker/gpu/model_runner.py:1541-1548 and 1630): the steps
    that verified any, their requests, and the drafts verified per such step and per request."""
    verify = [s for s in steps if s.get("num_draft_tokens")]
    drafts = sum(int(s["num_draft_tokens"]) for s in verify)
    rows = sum(int(s.get("num_reqs") or 0) for s in verify)
    return {
        "verify_steps": len(verify),
        "verify_rows": rows,
        "verified_drafts": drafts,
        "drafts_per_verify_step": round(drafts / len(verify), 4) if verify else None,
        "drafts_per_request": round(drafts / rows, 4) if rows else None,
    }


def summarize_steps(steps: list[dict]) -> dict:
    """Aggregate resolved steps (``target_ms``, ``draft_ms``, ``step_ms``, ``num_reqs``) into
    medians per batch size; the most frequent batch size is reported as ``main``."""
    by_n: dict[int, list[dict]] = {}
    for s in steps:
        by_n.setdefault(int(s["num_reqs"]), []).append(s)

    per_n = {
        n: {
            "steps": len(ss),
            "target_ms": _median([s["target_ms"] for s in ss]),
            "draft_ms": _median([s.get("draft_ms") for s in ss]),
            "step_ms": _median([s["step_ms"] for s in ss]),
            "num_tokens": _median([s.get("num_tokens") for s in ss]),
        }
        for n, ss in sorted(by_n.items())
    }
    main = max(per_n, key=lambda n: (per_n[n]["steps"], n)) if per_n else None
    return {
        "per_num_reqs": {str(n): v for n, v in per_n.items()},
        "main_num_reqs": main,
        "main": per_n.get(main) if main is not None else None,
        "total_steps": len(steps),
        "verify": verify_totals(steps),
        "graphs": graph_totals(steps),
        "exchange": summarize_exchange(steps, main),
    }


def _resolve() -> list[dict]:
    torch = _cuda()
    if torch is not None:
        torch.cuda.synchronize()
    out = []
    for s in _STATE["steps"]:
        out.append(
            {
                "num_reqs": s.get("num_reqs", 0),
                "num_tokens": s.get("num_tokens", 0),
                "num_draft_tokens": s.get("num_draft_tokens", 0),
                "graph": s.get("graph"),
                "graph_tokens": s.get("graph_tokens"),
                "graph_reqs": s.get("graph_reqs"),
                "target_ms": _elapsed_ms(s.get("t0"), s.get("t1")),
                "draft_ms": _elapsed_ms(s.get("t2"), s.get("t3")),
                "step_ms": _elapsed_ms(s.get("t0"), s.get("t4")),
                "x": step_exchange(_resolve_exchange(s.get("x", []))),
            }
        )
    _STATE["steps"] = []
    return out


def acceptance_schedule() -> str:
    """``DSPARK_BENCH_SYNTHETIC_SCHEDULE``: how ``set_acceptance_length`` spreads a mean
    acceptance length over the positions: ``min-variance`` (vLLM's: positions before the mean
    always accepted, one partial, none after) or ``geometric``."""
    mode = os.environ.get(SCHEDULE_ENV, "min-variance") or "min-variance"
    if mode not in ("min-variance", "geometric"):
        raise ValueError(f"{SCHEDULE_ENV}={mode!r}: use 'min-variance' or 'geometric'")
    return mode


def profile_positions(n: int) -> int:
    """``DSPARK_BENCH_PROFILE_POSITIONS``: how many positions the acceptance profile spans (unset:
    the server's own ``n``); never fewer than ``n``."""
    raw = os.environ.get(PROFILE_ENV, "").strip()
    if not raw:
        return n
    positions = int(raw)
    if positions < n:
        raise ValueError(f"{PROFILE_ENV}={raw}: fewer positions than this server drafts ({n})")
    return positions


def geometric_rates(length: float, n: int) -> list[float]:
    """Unconditional per-position rates ``p, p^2, ..., p^n`` (every position accepted with the
    same conditional rate ``p``) whose mean acceptance length ``1 + sum`` is ``length``."""
    if not 1.0 <= length <= n + 1:
        raise ValueError(f"acceptance length {length} outside [1, {n + 1}]")
    lo, hi = 0.0, 1.0
    for _ in range(100):  # the sum grows with p: bisection
        p = (lo + hi) / 2
        if 1.0 + sum(p**j for j in range(1, n + 1)) < length:
            lo = p
        else:
            hi = p
    p = (lo + hi) / 2
    return [p**j for j in range(1, n + 1)]


def _set_acceptance_length(runner, length: float) -> dict:
    """Switch the synthetic rejection sampler to another mean acceptance length in place (the
    same tensor, so anything captured keeps reading it)."""
    from vllm.config import SpeculativeConfig
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import (
        unconditional_to_conditional_rates,
    )

    rs = getattr(runner, "rejection_sampler", None)
    rates_t = getattr(rs, "synthetic_conditional_rates", None)
    if rates_t is None:  # not the sampling PP stage, or not a synthetic engine
        return {"applied": False}
    n = int(rates_t.numel())
    positions = profile_positions(n)
    if acceptance_schedule() == "geometric":
        rates = geometric_rates(float(length), positions)
    else:  # vLLM's own (minimum-variance) schedule
        rates = SpeculativeConfig._resolve_synthetic_acceptance_rates(
            positions, None, float(length)
        )
    rates = list(rates)[:n]  # the profile's first n positions (all of them unless a k sweep)
    cond = unconditional_to_conditional_rates(rates)
    import torch

    rates_t.copy_(torch.tensor(cond, dtype=rates_t.dtype, device=rates_t.device))
    return {
        "applied": True,
        "acceptance_length": length,
        "schedule": acceptance_schedule(),
        "profile_positions": positions,
        "unconditional_rates": rates,
        "conditional_rates": cond,
    }


def dspark_bench_ctl(self, cmd: str, arg: Any = None) -> Any:
    """Worker RPC (``llm.collective_rpc("dspark_bench_ctl", args=(cmd, arg))``)."""
    runner = self.model_runner
    if cmd == "enable":
        if not _STATE["installed"]:
            _STATE["installed"] = _install_timers(runner) + _install_exchange(runner)
        _STATE["steps"] = []
        _STATE["cur"] = None
        _STATE["xpend"] = []
        _STATE["conf"] = None
        return _STATE["installed"]
    if cmd == "collect":
        steps = _resolve()
        # the first steps of a run as they were (the prefill steps decide TTFT; the medians
        # of summarize_steps hide them)
        first = [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items() if k != "x"}
            | ({"x": {k: round(v, 4) for k, v in s["x"].items()}} if s.get("x") else {})
            for s in steps[:FIRST_STEPS_KEPT]
        ]
        summary = summarize_steps(steps)
        # what the draft's confidences were over the same steps, and what was ranked with
        summary["confidences"] = confidence_summary()
        summary["confidence_mode"] = confidence_mode()
        return {"summary": summary, "steps": len(steps), "first_steps": first}
    if cmd == "memory":
        torch = _cuda()
        out = dict(_STATE["mem"])
        out["model_memory_usage_bytes"] = getattr(runner, "model_memory_usage", None)
        if torch is not None:
            out["allocated_now_bytes"] = torch.cuda.memory_allocated()
            out["device"] = torch.cuda.get_device_name()
        return out
    if cmd == "set_acceptance_length":
        return _set_acceptance_length(runner, float(arg))
    raise ValueError(f"unknown dspark_bench_ctl command {cmd!r}")


# --------------------------------------------------------------------------- exchange accounting
X_NAMES = ("sampled", "counts", "drafts")  # the order both stock vLLM and the plugin post them
GOAL_E_SHARE = 0.03  # issue 29 goal (e): the exchange under 3% of a decode step at C >= 8
GOAL_E_MIN_C = 8
#: the spans in which a stage's main stream waits on the exchange (summed into the stall share)
STALLS = ("pp_recv_wait_ms", "x_wait_ms", "side_wait_ms")


def _tensor_bytes(t) -> int:
    return int(t.numel()) * int(t.element_size())


def _xrecord(kind: str, pending: bool = False, **fields) -> None:
    """One exchange record, for the current step, or (``pending``, or outside a step) for the
    next one. The stage-to-stage receive is always ``pending``: vLLM's worker posts it before
    the model runner's ``execute_model``, and the last open step may be an empty one (no
    tokens scheduled: ``execute_model`` without ``sample_tokens``) that is never recorded."""
    cur = _STATE["cur"]
    rec = {"kind": kind, **fields}
    if cur is not None and not pending:
        cur.setdefault("x", []).append(rec)
    else:
        _STATE["xpend"].append(rec)


def step_exchange(records: list[dict]) -> dict:
    """Resolved records of one step -> flat per-step metrics (bytes summed per key, ms summed
    per span). Records carry ``ms`` (already resolved) or ``bytes``."""
    out: dict[str, float] = {}
    for r in records:
        if "metric" in r and r.get("value") is not None:
            out[r["metric"]] = out.get(r["metric"], 0) + r["value"]
    return out


def summarize_exchange(steps: list[dict], main_num_reqs: int | None) -> dict | None:
    """Medians of every exchange metric over the steps of the main batch size, and the
    stall / step share (``(pp_recv_wait_ms + x_wait_ms + side_wait_ms) / step_ms`` per step,
    median)."""
    sel = [s for s in steps if s.get("x") and int(s.get("num_reqs") or 0) == main_num_reqs]
    if not sel:
        return None
    keys = sorted({k for s in sel for k in s["x"]})
    med = {k: round(statistics.median(float(s["x"].get(k, 0.0)) for s in sel), 4) for k in keys}
    shares = [
        sum(s["x"].get(k, 0.0) for k in STALLS) / s["step_ms"] for s in sel if s.get("step_ms")
    ]
    return {
        "steps": len(sel),
        "median": med,
        "stall_share": round(statistics.median(shares), 5) if shares else None,
    }


def _resolve_exchange(recs: list[dict]) -> list[dict]:
    out = []
    for r in recs:
        if r["kind"] == "bytes":
            out.append({"metric": r["metric"], "value": r["value"]})
        elif r["kind"] == "span":
            out.append({"metric": r["metric"], "value": _elapsed_ms(r["a"], r["b"])})
        elif r["kind"] == "host":
            out.append({"metric": r["metric"], "value": r["value"]})
    return out


def _maybe_log_shapes(cur: dict) -> None:
    """Log once the received intermediate tensors' shapes against the batch's token count (the
    first step, and the first step where the rows are not the padded token count)."""
    shapes = cur.get("recv_shapes") or {}
    usable = shapes.get("usable")
    if not usable:
        return
    rows = {int(v[0]) for v in usable.values() if v}
    padded = cur.get("num_tokens_padded")
    odd = bool(rows) and padded is not None and rows != {int(padded)}
    logged = _STATE["shape_logged"]
    if "first" in logged and (not odd or "odd" in logged):
        return
    logged.add("odd" if odd and "first" in logged else "first")
    from vllm.logger import init_logger

    init_logger("vllm.dspark_bench").info(
        "dspark_bench: %s step received intermediate tensors %s (as posted, before vLLM's "
        "wait: %s) for a batch of %s requests, %s tokens (%s after padding)",
        "a" if not odd else "an odd-sized",
        usable,
        shapes.get("posted"),
        cur.get("num_reqs"),
        cur.get("num_tokens"),
        padded,
    )


def _sends_done(handles, tensor_dict) -> tuple | None:
    """A mark that completes when every CUDA tensor send of one ``isend_tensor_dict`` has (its
    NCCL works waited on a timing stream of this module's own, so neither the host nor vLLM's
    streams wait), or None: no GPU, no CUDA tensor sent, or handles not laid out as vLLM 0.34.0's
    ``isend_tensor_dict`` returns them (the metadata object's first, then one per tensor of
    nonzero size, in the dict's order; parallel_state.py:1217-1236)."""
    torch = _cuda()
    if torch is None or os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") not in ("", "0"):
        return None  # blocking wait: ``wait`` would hold the host until the peer received
    sent = [v for v in tensor_dict.values() if hasattr(v, "numel") and v.numel() > 0]
    if not isinstance(handles, list) or len(handles) != 1 + len(sent):
        return None
    works = [h for h, t in zip(handles[1:], sent, strict=True) if getattr(t, "is_cuda", False)]
    if not works:
        return None
    stream = _STATE.get("send_stream")
    if stream is None:
        stream = _STATE["send_stream"] = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for w in works:
            w.wait()  # NCCL: the current (timing) stream waits for the send; the host does not
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
    return ("cuda", ev)


def _install_exchange(runner, pp=None, async_cls=None, dist=None) -> list[str]:
    """Exchange accounting on the live PP group, worker class and PP handler (PP only). ``pp``
    (vLLM's PP group coordinator), ``async_cls`` (vLLM's ``AsyncIntermediateTensors``) and
    ``dist`` (``torch.distributed``) default to vLLM's and torch's own (tests pass stand-ins)."""
    installed: list[str] = []
    if pp is None:
        try:
            from vllm.distributed.parallel_state import get_pp_group

            pp = get_pp_group()
        except Exception:  # noqa: BLE001  (no PP group: nothing to account)
            return installed
    if pp.world_size <= 1:
        return installed
    orig_send, orig_recv = pp.isend_tensor_dict, pp.irecv_tensor_dict

    def isend_tensor_dict(tensor_dict, *args, **kwargs):
        a = _mark()
        t0 = time.perf_counter()
        out = orig_send(tensor_dict, *args, **kwargs)
        _xrecord("host", metric="pp_send_host_ms", value=(time.perf_counter() - t0) * 1e3)
        try:
            done = _sends_done(out, tensor_dict)
        except Exception as e:  # noqa: BLE001 - a timer must never end the step it times
            done = None
            if not _STATE.get("send_span_failed"):
                _STATE["send_span_failed"] = True
                from vllm.logger import init_logger

                init_logger("vllm.dspark_bench").warning(
                    "dspark_bench: no send span (pp_send_ms): %s", e
                )
        if done is not None:
            _xrecord("span", metric="pp_send_ms", a=a, b=done)
        for k, v in tensor_dict.items():
            if hasattr(v, "numel"):
                _xrecord("bytes", metric=f"pp_send_bytes:{k}", value=_tensor_bytes(v))
        return out

    def irecv_tensor_dict(*args, **kwargs):
        t0 = time.perf_counter()
        tensor_dict, handles, post = orig_recv(*args, **kwargs)
        _xrecord("host", True, metric="pp_recv_host_ms", value=(time.perf_counter() - t0) * 1e3)
        _STATE["recv_post"] = _mark()
        posted = {}
        for k, v in (tensor_dict or {}).items():
            if hasattr(v, "numel"):
                _xrecord("bytes", True, metric=f"pp_recv_bytes:{k}", value=_tensor_bytes(v))
                # before vLLM's wait these are the flat receive buffers of its all-gather path
                # (taken even at TP=1), reshaped to the sent shape only by the post-processing
                posted[k] = list(v.shape)
        _STATE["recv_shapes"] = {"posted": posted} if posted else None
        return tensor_dict, handles, post

    pp.isend_tensor_dict, pp.irecv_tensor_dict = isend_tensor_dict, irecv_tensor_dict
    installed.append("pp_send_recv")

    if async_cls is None:
        import vllm.v1.worker.gpu_worker as gw

        async_cls = gw.AsyncIntermediateTensors
    cls = async_cls
    if not getattr(cls, "_dspark_bench_wait", False):
        orig_wait = cls.wait_for_comm

        def wait_for_comm(self):
            if object.__getattribute__(self, "_comm_waited"):
                return orig_wait(self)
            a = _mark()
            orig_wait(self)
            b = _mark()
            _xrecord("span", metric="pp_recv_wait_ms", a=a, b=b)
            ready = {
                k: list(v.shape)
                for k, v in object.__getattribute__(self, "tensors").items()
                if hasattr(v, "shape")
            }
            if ready:
                _xrecord("host", metric="pp_recv_rows", value=max(x[0] for x in ready.values()))
                cur = _STATE["cur"]
                if cur is not None:
                    cur.setdefault("recv_shapes", {})["usable"] = ready
            post, _STATE["recv_post"] = _STATE["recv_post"], None
            if post is not None:
                _xrecord("span", metric="pp_recv_ready_ms", a=post, b=b)

        cls.wait_for_comm = wait_for_comm
        cls._dspark_bench_wait = True
        installed.append("wait_for_comm")

    handler = getattr(runner, "pp_handler", None)
    if handler is None:
        return installed
    if dist is None:
        import torch.distributed as dist

    if not getattr(dist.broadcast, "_dspark_bench", False):
        orig_bcast = dist.broadcast

        def broadcast(tensor, *args, **kwargs):
            ctx = _STATE["xctx"]
            if ctx is None:
                return orig_bcast(tensor, *args, **kwargs)
            name = ctx["names"][min(ctx["i"], len(ctx["names"]) - 1)]
            ctx["i"] += 1
            a = _mark()
            out = orig_bcast(tensor, *args, **kwargs)
            _xrecord("span", metric="x_bcast_ms", a=a, b=_mark())
            _xrecord("bytes", metric=f"x_bytes:{name}", value=_tensor_bytes(tensor))
            return out

        broadcast._dspark_bench = True
        dist.broadcast = broadcast

    def in_exchange(method: str, names: tuple[str, ...]):
        orig = getattr(handler, method)

        def wrapped(*args, **kwargs):
            _STATE["xctx"] = {"names": names, "i": 0}
            try:
                return orig(*args, **kwargs)
            finally:
                _STATE["xctx"] = None

        setattr(handler, method, wrapped)

    in_exchange("broadcast", X_NAMES[:2])
    in_exchange("broadcast_drafts", X_NAMES[2:])
    in_exchange("receive", X_NAMES)
    orig_prev = handler.get_prev_sampled_outputs

    def get_prev_sampled_outputs(*args, **kwargs):
        a = _mark()
        out = orig_prev(*args, **kwargs)
        if out is not None:
            _xrecord("span", metric="x_wait_ms", a=a, b=_mark())
        return out

    handler.get_prev_sampled_outputs = get_prev_sampled_outputs
    installed.append("exchange_broadcasts")
    side = getattr(handler, "_dspark_tap_side", None)
    if side is not None:
        installed += _install_side(side)
    return installed


def _install_side(side) -> list[str]:
    """Bytes and the last stage's stall of the DSpark tap side channel (its instance methods:
    a sender's ``send``, the last stage's ``post`` and ``take``)."""
    orig_send, orig_post, orig_take = side.send, side.post, side.take
    key = "dspark_tap_partial"

    def send(rows):
        out = orig_send(rows)
        _xrecord("bytes", metric=f"side_send_bytes:{key}", value=_tensor_bytes(out))
        return out

    def post(batch):
        step = orig_post(batch)
        nbytes = sum(_tensor_bytes(b) for b in step.buffers)
        _xrecord("bytes", metric=f"side_recv_bytes:{key}", value=nbytes)
        return step

    def take(batch):
        a = _mark()
        out = orig_take(batch)
        _xrecord("span", metric="side_wait_ms", a=a, b=_mark())
        return out

    side.send, side.post, side.take = send, post, take
    return ["tap_side_channel"]


def _patch_worker(module) -> None:
    module.WorkerBase.dspark_bench_ctl = dspark_bench_ctl


def register() -> None:
    """``vllm.general_plugins`` entry point (benchmark only)."""
    from vllm_dspark_pp.patches import when_imported

    when_imported("vllm.v1.worker.worker_base", _patch_worker)
    when_imported("vllm.v1.worker.gpu.spec_decode.speculator", _patch_speculator_base)
    confidence_mode()  # a wrong value fails at start, naming the choices
    acceptance_schedule()
    when_imported("vllm.v1.worker.gpu.spec_decode.rejection_sampler", _patch_rejection_sampler)
    when_imported("vllm.v1.worker.gpu.spec_decode.adaptive_verification", _patch_adaptive)
