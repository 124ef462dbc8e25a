"""The PP token-exchange schedule: what every pipeline rank sends or receives in one step.

With a pipeline-parallel target, only the last stage samples (and, under speculative decoding,
verifies and drafts). Every earlier stage keeps its own request state up to date from a broadcast
of the last stage's results on the PP broadcast group. A broadcast that one side posts and the
other does not (or posts with another shape) leaves a collective kernel waiting forever.

This module is the single source of truth for that exchange. :func:`step_schedule` is a pure
function of data every rank holds identically for a step (the scheduled batch, the speculative
settings and whether the exchange is enabled); the patched ``PPHandler`` on the last rank and on
every other rank both ask it what to post, and post exactly that, in that order, with those
shapes and dtypes. No torch is imported here: the schedule can be tested, printed and compared
without a device.

Payloads of one step, in order (see docs/protocol.md):

1. ``sampled``: ``[N, W]`` int64, ``W = k + 1`` when speculative decoding is configured (``k``
   drafts per step) and ``1`` otherwise. The width never depends on whether this batch carried
   drafts: a plain-sampler ``[N, 1]`` result is padded on the last rank. One width means one
   kernel specialization of the deferred post-update on the receiving ranks.
2. ``counts``: ``[2, C]`` int32 with ``C = N`` rounded up to a multiple of 4, so that both rows
   (``num_sampled``, ``num_rejected``) start on a 16-byte boundary. Triton specializes kernels on
   pointer alignment; a misaligned row view would compile a second variant while serving.
3. ``drafts`` (only when ``k > 0`` and the step schedules drafts): ``[N, D]`` int64, posted by the
   last rank after the drafter ran. It is the only draft broadcast of a step. ``D = k``, or
   ``k + 1`` under adaptive verification with PP (``ExchangeSpec.admitted_counts``): column ``k``
   then holds each request's admitted draft count, the number of its drafts every PP rank
   verifies in the request's next step (docs/protocol.md, "Adaptive verification under PP").

A step whose batch has no request needing its sampled output (only non-final prefill chunks,
prefills finishing at their length cap, or no requests) posts nothing at all, on any rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Every payload (and every row view handed to a kernel) starts on this boundary.
ALIGN_BYTES = 16

_ITEMSIZE = {"int64": 8, "int32": 4}

SAMPLED = "sampled"
COUNTS = "counts"
DRAFTS = "drafts"


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def counts_row_len(num_reqs: int) -> int:
    """Row length of the ``[2, C]`` int32 counts payload: both rows 16-byte aligned."""
    per_row = ALIGN_BYTES // _ITEMSIZE["int32"]
    return round_up(max(num_reqs, 1), per_row)


@dataclass(frozen=True)
class ExchangeSpec:
    """The speculative settings that shape the exchange; identical on every PP rank (the
    start-up handshake checks it)."""

    num_speculative_steps: int = 0
    # Adaptive verification under PP: the drafts payload carries one more column, the admitted
    # draft count of each request (same value on every rank: the handshake checks it).
    admitted_counts: bool = False
    # Which of a request's shipped counts its verify step applies: L >= 1, the one of its draft
    # broadcast L before the latest (already on every stage's host: 1 without async scheduling,
    # 2 with it, protocol/adaptive_config.resolve_adaptive_lag); 0, the latest (the draft being
    # verified; the host waits for it). Checked at start-up (the handshake).
    admitted_lag: int = 1

    @property
    def sample_width(self) -> int:
        return self.num_speculative_steps + 1 if self.num_speculative_steps > 0 else 1

    @property
    def draft_width(self) -> int:
        """Columns of the drafts payload: ``k`` drafts, then the admitted count if shipped."""
        return self.num_speculative_steps + (1 if self.admitted_counts else 0)


@dataclass(frozen=True)
class Payload:
    """One broadcast from the last rank: which buffer, its shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "int64" | "int32"

    @property
    def nbytes(self) -> int:
        n = _ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        return f"{self.name}{list(self.shape)}:{self.dtype}"


@dataclass(frozen=True)
class StepSchedule:
    """What one step exchanges. ``payloads`` is empty when nothing is posted."""

    num_reqs: int
    payloads: tuple[Payload, ...]
    # Rows whose sampled output a later step on the non-last ranks needs (None: no row does).
    need_sampled_mask: np.ndarray | None = field(compare=False, repr=False, default=None)

    @property
    def posts(self) -> bool:
        return bool(self.payloads)

    @property
    def sampled(self) -> Payload | None:
        return self.payload(SAMPLED)

    @property
    def counts(self) -> Payload | None:
        return self.payload(COUNTS)

    @property
    def drafts(self) -> Payload | None:
        return self.payload(DRAFTS)

    @property
    def all_rows_need_sampled(self) -> bool:
        return self.need_sampled_mask is not None and bool(self.need_sampled_mask.all())

    def payload(self, name: str) -> Payload | None:
        for p in self.payloads:
            if p.name == name:
                return p
        return None

    def describe(self) -> str:
        if not self.payloads:
            return f"N={self.num_reqs}: nothing"
        return f"N={self.num_reqs}: " + ", ".join(p.describe() for p in self.payloads)

    def digest(self) -> str:
        return hashlib.sha1(self.describe().encode()).hexdigest()[:12]


def need_sampled_mask(batch: Any) -> np.ndarray | None:
    """Rows of ``batch`` whose sampled output a later decode step needs, or None if none does.

    Same rule as vLLM 0.34.0 ``compute_need_sampled_mask`` (vllm/v1/worker/gpu/pp_utils.py:38-52;
    a unit test checks the two agree): non-final prefill chunks sample nothing, and a final
    prefill chunk whose single sampled token reaches the request's length cap finishes the
    request. ``batch`` needs ``num_computed_tokens_np``, ``num_scheduled_tokens``,
    ``prefill_len_np``, ``max_seq_len_np`` and ``is_prefilling_np`` (an ``InputBatch`` has them).
    """
    if batch.num_reqs == 0:
        return None
    mask = batch.num_computed_tokens_np + batch.num_scheduled_tokens >= batch.prefill_len_np
    if batch.max_seq_len_np is not None:
        capped = (batch.prefill_len_np + 1 >= batch.max_seq_len_np) & batch.is_prefilling_np
        mask = mask & ~capped
    return mask if mask.any() else None


def step_schedule(
    spec: ExchangeSpec,
    batch: Any,
    num_spec_tokens: int,
    enabled: bool = True,
) -> StepSchedule:
    """The exchange of one step, from data every PP rank holds identically.

    ``num_spec_tokens`` is the step's scheduled draft count (``ExecuteModelState
    .num_spec_tokens_to_schedule``, 0 when drafts are skipped); ``enabled`` is False during
    warm-up, on every rank at once.
    """
    num_reqs = int(batch.num_reqs)
    mask = need_sampled_mask(batch) if enabled else None
    if mask is None:
        return StepSchedule(num_reqs, ())
    payloads = [
        Payload(SAMPLED, (num_reqs, spec.sample_width), "int64"),
        Payload(COUNTS, (2, counts_row_len(num_reqs)), "int32"),
    ]
    if spec.num_speculative_steps > 0 and num_spec_tokens > 0:
        payloads.append(Payload(DRAFTS, (num_reqs, spec.draft_width), "int64"))
    return StepSchedule(num_reqs, tuple(payloads), need_sampled_mask=mask)


def row_offsets_bytes(payload: Payload) -> list[int]:
    """Byte offsets of the row views a receiving rank hands to kernels (counts rows)."""
    if payload.name != COUNTS:
        return [0]
    row_bytes = payload.shape[1] * _ITEMSIZE[payload.dtype]
    return [r * row_bytes for r in range(payload.shape[0])]


class ExchangeMismatch(AssertionError):
    """Two PP ranks would post different collectives in the same step."""


def compare_sequences(per_rank: dict[int, Sequence[Any]]) -> None:
    """Raise :class:`ExchangeMismatch` naming the first step where the ranks' collective
    sequences differ (each sequence is a list of comparable records, one per collective)."""
    ranks = sorted(per_rank)
    ref_rank = ranks[-1]
    ref = list(per_rank[ref_rank])
    for r in ranks:
        seq = list(per_rank[r])
        if seq == ref:
            continue
        n = min(len(seq), len(ref))
        i = next((i for i in range(n) if seq[i] != ref[i]), n)
        mine = seq[i] if i < len(seq) else "(nothing)"
        theirs = ref[i] if i < len(ref) else "(nothing)"
        raise ExchangeMismatch(
            f"collective #{i} differs: rank {r} posts {mine}, rank {ref_rank} posts {theirs}"
        )
