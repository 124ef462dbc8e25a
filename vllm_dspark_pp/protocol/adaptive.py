"""Adaptive verification under PP: the last stage decides, every stage applies the same counts.

vLLM 0.34.0 decides a verify step's trimmed layout inside that step's ``prepare_inputs``, on the
one rank that holds a speculator (the last PP stage). Under PP the first stage runs the step
before the last stage has seen it, so the decision cannot be shipped from the verify step
itself. Here the last stage decides at the end of the step that *drafted* (right after
``record_confidences``): for each request, how many of its ``k`` drafts the next verify step
checks (its admitted count). The count rides as one more column of the step's drafts payload
(``ExchangeSpec.admitted_counts``) and every stage, the last one included, builds the verify
step from the same host-side counts (:class:`ShippedCounts`), so every stage computes the same
token count, CUDA graph and layout. See docs/protocol.md, "Adaptive verification under PP".

Which decision a verify step applies (``ExchangeSpec.admitted_lag``, from
``VLLM_DSPARK_PP_ADAPTIVE_LAG`` or, unset, the scheduling (``resolve_adaptive_lag``), checked by
the start-up handshake): with lag L >= 1 the one shipped with the request's draft broadcast L
before the latest, i.e. the count the last stage decided L drafting rounds earlier, from that
round's confidences. Without async scheduling (lag 1) that broadcast has landed on every stage
before the scheduler can send the verify step (each stage's GPU waited for it before the forward
whose output the scheduler needed); with async scheduling vLLM may send the next round while the
previous one is in flight, so the default is 2 there (lag 1 waited in 5 of 10 verify steps on an
H200, 2026-12-06). With lag 0 (the behaviour before) it is the one shipped with the draft being
verified: every stage's host waits until the last stage has drafted it. Either way only the
number of drafts verified changes, never the verification rule, so the output is the same.

The decision reuses vLLM's own pieces: the budget is vLLM's
``AdaptiveVerificationManager.get_num_tokens`` applied to the next verify batch as the drafting
batch predicts it (each request: one bonus token, ``k`` drafts), and the per-request split is
vLLM's ranking kernel ``assign_draft_token_budget`` on the fresh confidences. The step-cost curve
is the pipeline's: every stage profiles its own forward at the same token counts and the last
stage prices a verify position at the sum of the stages' costs (:func:`pipeline_verify_curve`).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import numpy as np

from vllm_dspark_pp.protocol.adaptive_config import (  # noqa: F401 - re-exported
    ships_admitted_counts,
    uncovered_reason,
)

#: What reads the stage's summary line below (the one-GPU test, benchmarks/adaptive_bench.py):
#: PP stage, counts lag, host waits for counts.
SUMMARY_LINE = re.compile(
    r"DSpark PP adaptive verification \(stage (\d+)\): .*?counts lag (\d+), (\d+) host waits"
)

#: Every stage publishes its profiled verify-cost curve under this prefix (one key per stage).
CURVE_PREFIX = "vllm_dspark_pp/adaptive_cost"


def next_verify_batch(req_ids: list[str], k: int) -> tuple[dict[str, int], dict[str, list[int]]]:
    """The verify step the drafting batch predicts, in ``get_num_tokens``' argument form."""
    return {r: 1 + k for r in req_ids}, {r: [0] * k for r in req_ids}


def decide_admitted_counts(manager: Any, input_batch: Any, rows: np.ndarray) -> Any:
    """Last stage, after ``record_confidences``: each row's admitted draft count for its next
    verify step (int32 on the device; rows not in ``rows`` get 0)."""
    import torch
    from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av

    k = manager.num_speculative_steps
    n = input_batch.num_reqs
    idx_mapping = input_batch.idx_mapping[:n]
    device = idx_mapping.device
    if not rows.any():
        return torch.zeros(n, dtype=torch.int32, device=device)
    # Built on the host and copied without blocking: this runs right after propose() in every
    # drafting step, and a blocking copy of the mask or a boolean-mask assignment (nonzero) would
    # make the host wait for the draft to finish on the GPU (issue 30).
    capacities = _to_device(np.where(rows, k, 0).astype(np.int32), device)
    if manager.cost_tables is None:  # not profiled (yet): verify every draft
        return capacities
    req_ids = [r for r, keep in zip(input_batch.req_ids, rows, strict=True) if keep]
    # vLLM's own budget (host, from its host copy of earlier confidences; not the ShippedCounts
    # override); its stash belongs to the verify step's prepare_inputs, so it is put back.
    saved, states = manager._batch_budget, manager.req_states
    manager.req_states = _SamplingNext(states)
    try:
        num_tokens = av.AdaptiveVerificationManager.get_num_tokens(
            manager, *next_verify_batch(req_ids, k)
        )
    finally:
        manager._batch_budget, manager.req_states = saved, states
    budget = num_tokens - len(req_ids)
    if budget < k * len(req_ids):
        av.assign_draft_token_budget(
            manager._confidence_probs, idx_mapping, capacities, budget, manager._draft_survival
        )
    return capacities


def _to_device(host: np.ndarray, device: Any) -> Any:
    """``host`` on ``device`` without making the host wait (pinned staging on CUDA; the caching
    host allocator keeps the pinned block until the copy has run)."""
    import torch

    t = torch.from_numpy(host)
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class _SamplingNext:
    """vLLM's request states as the next verify step sees them: a request whose output this step
    needs has its prompt computed by then (vLLM's budget counts it as a sampling request)."""

    def __init__(self, states: Any) -> None:
        self._states = states

    def __getattr__(self, name: str) -> Any:
        return getattr(self._states, name)

    @property
    def num_computed_tokens_np(self) -> np.ndarray:
        return np.maximum(self._states.num_computed_tokens_np, self._states.prefill_len.np)


def admitted_layout(scheduled: np.ndarray, shipped: np.ndarray, max_drafts: int) -> np.ndarray:
    """Drafts each request verifies: its shipped count (none shipped: all scheduled), never more
    than scheduled, and in all at most ``max_drafts`` (vLLM's one-chunk logits bound), taken
    off the last rows first. The same arrays give the same answer on every stage."""
    admitted = np.where(shipped < 0, scheduled, np.minimum(scheduled, shipped)).astype(np.int32)
    excess = int(admitted.sum()) - max(0, max_drafts)
    for i in range(len(admitted) - 1, -1, -1):
        if excess <= 0:
            break
        cut = min(excess, int(admitted[i]))
        admitted[i] -= cut
        excess -= cut
    return admitted


class ShippedCounts:
    """Mixed into vLLM's ``AdaptiveVerificationManager`` on every PP stage (see
    patches/v1_worker_gpu_model_runner__adaptive.py). ``pp_handler``, ``is_last_stage`` and
    ``pipeline_ranks`` are set by the patch."""

    pp_handler: Any = None
    is_last_stage: bool = True
    pipeline_ranks: tuple[int, ...] = ()
    stage: int = 0
    # Set by vLLM's AdaptiveVerificationManager (the class this one is mixed into); declared for
    # the type checker only.
    req_states: Any
    _max_total_logits: int
    num_bonus_tokens: int

    # -- the decision (last stage; vLLM calls this right before broadcast_drafts, sample_tokens)
    def record_confidences(self, confidence_probs: Any, input_batch: Any) -> None:
        super().record_confidences(confidence_probs, input_batch)  # type: ignore[misc]
        handler = self.pp_handler
        step = getattr(handler, "exchange_step", None)
        schedule = getattr(step, "schedule", None)
        if schedule is None or schedule.drafts is None:
            return  # no drafts broadcast this step: no decision to ship
        handler.step_admitted = decide_admitted_counts(
            self, input_batch, np.asarray(schedule.need_sampled_mask, dtype=bool)
        )

    # -- applying it (every stage; replaces the budget of adaptive_verification.py:399-467)
    def get_num_tokens(
        self, num_tokens_per_req: dict[str, int], draft_tokens: dict[str, list[int]]
    ) -> int:
        req_ids = list(num_tokens_per_req)
        scheduled = np.array([len(draft_tokens.get(r, ())) for r in req_ids], dtype=np.int32)
        non_draft = np.array([num_tokens_per_req[r] for r in req_ids], dtype=np.int32) - scheduled
        slots = np.array([self.req_states.req_id_to_index[r] for r in req_ids], dtype=np.intp)
        shipped = self.pp_handler.admitted_counts_for(slots)
        max_drafts = self._max_total_logits - len(req_ids) * self.num_bonus_tokens
        admitted = admitted_layout(scheduled, shipped, max_drafts)
        self.count_verified(int(admitted.sum()), int(scheduled.sum()))
        # vLLM's compact_batch and reallocate_drafts read this stash; with the per-request
        # "scheduled" counts equal to the admitted ones its ranking kernel is not run and the
        # device layout is exactly these counts (adaptive_verification.py:533-545).
        self._batch_budget = (
            dict(zip(req_ids, admitted.tolist(), strict=True)),
            dict(zip(req_ids, non_draft.tolist(), strict=True)),
            int(admitted.sum()),
        )
        return int(non_draft.sum()) + int(admitted.sum())

    verify_steps: int = 0
    verified_drafts: int = 0
    scheduled_drafts: int = 0

    def count_verified(self, verified: int, scheduled: int) -> None:
        self.verify_steps += 1
        self.verified_drafts += verified
        self.scheduled_drafts += scheduled
        steps = self.verify_steps
        if steps == 1 or steps % (10 if steps <= 100 else 100) == 0:
            handler = self.pp_handler
            spec = getattr(handler, "exchange_spec", None)
            wait_s = getattr(handler, "admitted_wait_s", None)
            _logger().info(
                "DSpark PP adaptive verification (stage %d): %d verify steps, %d of %d scheduled "
                "drafts verified; counts lag %s, %s host waits for counts (%s ms)",
                self.stage,
                steps,
                self.verified_drafts,
                self.scheduled_drafts,
                getattr(spec, "admitted_lag", "?"),
                getattr(handler, "admitted_waits", "?"),
                "?" if wait_s is None else f"{1000 * wait_s:.1f}",
            )

    # -- the pipeline's cost curve (replaces the tables' input, adaptive_verification.py:350-371)
    def set_cost_curves(self, draft_curve: list, verify_curve: list) -> None:
        store = _store()
        if not self.is_last_stage:
            publish_curve(store, self.pipeline_ranks, self.stage, verify_curve)
            return  # only the last stage decides
        others = fetch_curves(store, self.pipeline_ranks, range(len(self.pipeline_ranks) - 1))
        curve = pipeline_verify_curve([verify_curve, *others])
        super().set_cost_curves(draft_curve, curve)  # type: ignore[misc]


def pipeline_verify_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """A verify position costs every stage: the pipeline's curve is the stages' sum at each
    token count every stage profiled."""
    common = set.intersection(*({int(n) for n, _ in c} for c in curves)) if curves else set()
    return [
        (n, float(sum(dict((int(a), b) for a, b in c)[n] for c in curves))) for n in sorted(common)
    ]


def _logger():
    from vllm.logger import init_logger

    # under "vllm": the only namespace vLLM's logging config prints at INFO
    return init_logger("vllm.dspark_pp.adaptive")


def _store() -> Any:
    from vllm_dspark_pp.protocol.handshake import default_store

    return default_store()


def _curve_key(ranks: tuple[int, ...], stage: int) -> str:
    return f"{CURVE_PREFIX}/{'-'.join(map(str, ranks))}/stage{stage}"


def publish_curve(store: Any, ranks: tuple[int, ...], stage: int, curve: list) -> None:
    store.set(_curve_key(ranks, stage), json.dumps([[int(n), float(c)] for n, c in curve]))


def fetch_curves(
    store: Any, ranks: tuple[int, ...], stages: Any, timeout: float | None = None
) -> list[list[tuple[int, float]]]:
    """Every listed stage's curve, waiting at most the handshake timeout (only non-blocking
    ``check`` calls), else a start-up error naming the silent stages."""
    from vllm_dspark_pp.protocol.handshake import _poll, timeout_s

    keys = {s: _curve_key(ranks, s) for s in stages}
    deadline = time.monotonic() + (timeout_s() if timeout is None else timeout)
    missing = _poll(store, list(keys.values()), deadline)
    if missing:
        silent = sorted(s for s, key in keys.items() if key in missing)
        raise RuntimeError(
            f"vllm-dspark-pp adaptive verification: PP stage(s) {silent} published no "
            "profiled step cost; every stage must profile with the plugin installed"
        )
    return [[(int(n), float(c)) for n, c in json.loads(store.get(keys[s]))] for s in keys]


def shipped_counts_class(manager_cls: type) -> type:
    """``class ShippedCountsVerification(ShippedCounts, AdaptiveVerificationManager)``."""
    if issubclass(manager_cls, ShippedCounts):
        return manager_cls
    return type(
        "ShippedCountsVerification",
        (ShippedCounts, manager_cls),
        {"__module__": __name__, "__doc__": ShippedCounts.__doc__},
    )


def profile_stage_curve(runner: Any, manager: Any) -> None:
    """A non-last stage times the dummy runs vLLM's last stage times (the same token counts, the
    same ``batches_to_profile``) with vLLM's own ``StepTimingCollector``: vLLM records each
    step's start on every stage (model_runner.py:2113-2116) but its ``_dummy_run`` returns on a
    non-last stage (model_runner.py:978-980) before the end marks (991-1032), so they are closed
    here. The curve then goes through ``set_initial_cost_curves`` to
    ``ShippedCounts.set_cost_curves``, which publishes it for the last stage."""
    import torch

    timing = runner.step_timing
    with torch.inference_mode(), timing.collect() as samples:
        for batch in manager.batches_to_profile(runner.cudagraph_manager.captured_token_counts()):
            runner._dummy_run(**batch, skip_eplb=True)
            timing.forward_end()
            timing.drafter_start()
            timing.drafter_end()
    manager.set_initial_cost_curves(samples)


#: Key of the sending stage's batch layout in the activations it sends: a plain tuple, which
#: vLLM's ``isend_tensor_dict`` carries in the metadata message (``_split_tensor_dict`` keeps
#: non-tensor values, parallel_state.py:124-139) and the receiver reads before any data arrives.
#: Padded sizes alone cannot tell two layouts of one padded size apart.
LAYOUT_KEY = "dspark_pp_batch_layout"


def batch_layout(input_batch: Any) -> tuple[int, int]:
    """``(tokens, checksum)`` of a stage's batch: its real token count and a CRC-32 of that
    count and the per-request query offsets (what the stage's forward lays out from the shipped
    counts). Every stage computes both from the same scheduler output and the same shipped
    counts, so honest stages agree on them exactly."""
    import zlib

    num_reqs = int(input_batch.num_reqs)
    parts = [np.asarray([int(input_batch.num_tokens), num_reqs], dtype=np.int64)]
    offsets = getattr(input_batch, "query_start_loc_np", None)
    if offsets is not None:
        parts.append(np.asarray(offsets[: num_reqs + 1], dtype=np.int64))
    return int(input_batch.num_tokens), zlib.crc32(b"".join(p.tobytes() for p in parts))


def tag_sent_activations(runner: Any, output: Any) -> None:
    """Non-last stage, after its forward: add this step's :func:`batch_layout` to the
    activations the worker sends (a new dict: the model's or the graph's own is not touched)."""
    state = getattr(runner, "execute_model_state", None)
    batch = getattr(state, "input_batch", None)
    tensors = getattr(output, "tensors", None)
    if batch is None or not isinstance(tensors, dict):
        return
    output.tensors = {**tensors, LAYOUT_KEY: batch_layout(batch)}


def check_received_activations(runner: Any, received: Any, input_batch: Any) -> None:
    """Non-first stage, right after ``prepare_inputs``: compare the token count of the received
    activations (known from the metadata, without waiting for the data) with this stage's batch.

    Until vLLM's ``wait_for_comm`` runs, a received tensor is the flat receive buffer
    (``irecv_tensor_dict`` takes its all-gather path even at TP = 1 and reshapes afterwards:
    vllm/distributed/parallel_state.py:1331-1362), so its row count is its element count over
    the elements of one row of this stage's own buffer for the same key
    (``runner.intermediate_tensors``, vLLM's persistent receive copy). The first H200 run
    (2026-12-04) read ``shape[0]`` of the flat buffer (4,096 = 32 rows x 128) and stopped a
    correct batch."""
    import math

    tensors = object.__getattribute__(received, "tensors")
    own = getattr(getattr(runner, "intermediate_tensors", None), "tensors", None) or {}
    runner._dspark_pp_steps = getattr(runner, "_dspark_pp_steps", 0) + 1
    expected = int(input_batch.num_tokens_after_padding)
    sent = tensors.get(LAYOUT_KEY)
    if sent is not None:
        mine = batch_layout(input_batch)
        if tuple(sent) != mine:
            raise RuntimeError(
                f"vllm-dspark-pp: PP stage "
                f"{getattr(runner.adaptive_verification, 'stage', -1)} built a batch of "
                f"{mine[0]} tokens (layout {mine[1]:#010x}) in step {runner._dspark_pp_steps} "
                f"but the previous stage sent one of {sent[0]} tokens (layout {sent[1]:#010x}): "
                "the stages disagree on the (adaptive verification) batch shape"
            )
    for key, value in tensors.items():
        ref = own.get(key)
        if ref is None or not hasattr(value, "numel"):
            continue  # a key this stage keeps no buffer for: nothing to read a row size from
        per_row = math.prod(ref.shape[1:])
        if per_row <= 0:
            continue
        rows, rest = divmod(int(value.numel()), per_row)
        if rest == 0 and rows == expected:
            continue
        shapes = ", ".join(
            f"{k} {tuple(v.shape) if hasattr(v, 'shape') else v}" for k, v in tensors.items()
        )
        check_activation_tokens(
            runner._dspark_pp_steps,
            expected,
            rows,
            getattr(runner.adaptive_verification, "stage", -1),
            detail=(
                f" (received {key}: {int(value.numel())} elements for rows of {per_row}; "
                f"all received: {shapes}; this stage's batch: "
                f"num_reqs {getattr(input_batch, 'num_reqs', '?')}, "
                f"num_tokens {getattr(input_batch, 'num_tokens', '?')}, "
                f"num_tokens_after_padding {expected})"
            ),
        )


def check_activation_tokens(
    step: int, expected: int, received: int, stage: int, detail: str = ""
) -> None:
    """Before a non-first stage's forward: the activations it received must cover the tokens
    its own batch shape says (a stage that decided another shape fails here, loudly)."""
    if received != expected:
        raise RuntimeError(
            f"vllm-dspark-pp: PP stage {stage} built a batch of {expected} tokens in step {step} "
            f"but received activations for {received} tokens from the previous stage: the "
            f"stages disagree on the (adaptive verification) batch shape{detail}"
        )
