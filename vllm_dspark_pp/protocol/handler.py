"""``DSparkPPHandler``: vLLM's ``PPHandler`` with the DSpark PP token exchange (a subclass).

``patches/v1_worker_gpu_pp_utils.py`` replaces ``vllm.v1.worker.gpu.pp_utils.PPHandler`` by
``DSparkPPHandler(DSparkExchange, PPHandler)`` right after that module is imported, before the
model runner binds the name. The subclass overrides ``broadcast``, ``receive``,
``broadcast_drafts`` and ``_sample_len`` (vllm/v1/worker/gpu/pp_utils.py:104-266) and carries
its state as typed attributes (``exchange_spec``, ``exchange_enabled``, ``exchange_step``).
Both sides compute the step's :class:`~vllm_dspark_pp.protocol.schedule.StepSchedule` with the
same pure function and post exactly its payloads through one method (:meth:`_post`) that checks
shape, dtype, contiguity and 16-byte alignment before the collective is posted. A step that would
post anything other than its schedule raises :class:`ExchangeError` on the spot: an exception
kills the engine cleanly, an unmatched collective hangs it.

The model runner patch brackets each ``sample_tokens`` with :meth:`begin_step` /
:meth:`end_step`, which tell the schedule the step's scheduled draft count and check, after the
step, that every planned payload was posted exactly once (a missing draft broadcast on the last
rank would leave every other rank waiting). The warm-up patch runs vLLM's warm-up inside
:meth:`exchange_disabled`.

Under adaptive verification with PP (``ExchangeSpec.admitted_counts``) the drafts payload has one
more column, each request's admitted draft count; every rank (the last one included) records the
column per request slot when it posts the payload (the slot's latest ``MAX_ADMITTED_LAG + 1``,
for the rows whose output the step broadcasts), and :meth:`admitted_counts_for` hands a verify
step, on the host, each request's count of its draft broadcast ``admitted_lag`` broadcasts
before the latest (1 without async scheduling, 2 with it: that broadcast has landed on every
rank before the scheduler can send the step, so the host does not wait) or of its latest
(``admitted_lag`` 0: the draft being verified, which the host waits for). See
``protocol/adaptive.py``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_dspark_pp import envs
from vllm_dspark_pp.protocol.draft_digest import digest_from_env
from vllm_dspark_pp.protocol.schedule import (
    ALIGN_BYTES,
    COUNTS,
    DRAFTS,
    SAMPLED,
    ExchangeSpec,
    Payload,
    StepSchedule,
    step_schedule,
)

_TORCH_DTYPE = {"int64": torch.int64, "int32": torch.int32}


#: Seconds a verify step may wait on the host for admitted counts already posted (the wait only
#: covers a device-to-host copy of a broadcast whose sender already ran; a longer one is a bug).
ADMITTED_TIMEOUT_ENV = "VLLM_DSPARK_PP_ADMITTED_TIMEOUT_S"


class ExchangeError(RuntimeError):
    """This rank was about to post a collective its schedule does not contain."""


class AdmittedCounts:
    """One step's admitted draft counts on their way to the host (one row per batch row)."""

    def __init__(self, column: torch.Tensor, stream: Any) -> None:
        if column.device.type == "cpu":
            self.cpu, self.event = column.to(torch.int32).clone(), None
            return
        self.cpu = torch.empty(column.shape, dtype=torch.int32, pin_memory=True)
        self.cpu.copy_(column, non_blocking=True)
        self.event = stream.record_event()

    def ready(self) -> bool:
        """Whether :meth:`values` returns without waiting."""
        return self.event is None or bool(self.event.query())

    def values(self) -> np.ndarray:
        if self.event is not None and not self.event.query():
            deadline = time.monotonic() + envs.VLLM_DSPARK_PP_ADMITTED_TIMEOUT_S
            while not self.event.query():
                if time.monotonic() > deadline:
                    raise ExchangeError(
                        "PP exchange: the admitted draft counts of an earlier step never "
                        f"arrived (waited {ADMITTED_TIMEOUT_ENV} seconds); the last PP rank "
                        "stopped posting its draft broadcasts"
                    )
                time.sleep(0.0002)
        return self.cpu.numpy()


#: The largest ``admitted_lag`` (``VLLM_DSPARK_PP_ADAPTIVE_LAG``): the earlier counts a slot keeps.
MAX_ADMITTED_LAG = 2


def admitted_lag_from_config() -> int:
    """The admitted-count lag of this process's vLLM config (1 where there is none)."""
    from vllm.config.vllm import get_current_vllm_config_or_none

    from vllm_dspark_pp.protocol.adaptive_config import resolve_adaptive_lag

    return resolve_adaptive_lag(get_current_vllm_config_or_none())


def admitted_counts_from_config() -> bool:
    """Whether this process's vLLM config ships admitted counts (adaptive verification, PP)."""
    from vllm.config.vllm import get_current_vllm_config_or_none

    from vllm_dspark_pp.protocol.adaptive_config import ships_admitted_counts

    cfg = get_current_vllm_config_or_none()
    return cfg is not None and ships_admitted_counts(cfg)


@dataclass
class StepState:
    """One step's exchange: its index, draft count, schedule and what was posted so far."""

    index: int
    num_spec_tokens: int | None
    bracketed: bool  # begun by begin_step (the model runner patch), not by a bare call
    schedule: StepSchedule | None = None
    posted: list[str] = field(default_factory=list)


def schedule_for(handler: DSparkExchange, input_batch: Any, num_spec_tokens: int) -> StepSchedule:
    return step_schedule(
        handler.exchange_spec, input_batch, num_spec_tokens, enabled=handler.exchange_enabled
    )


def alloc_payload(payload: Payload, device: torch.device, fill: int | None = None) -> torch.Tensor:
    """A fresh contiguous buffer for ``payload`` (the caching allocators align to >= 64 B)."""
    dtype = _TORCH_DTYPE[payload.dtype]
    if fill is None:
        return torch.empty(payload.shape, dtype=dtype, device=device)
    return torch.full(payload.shape, fill, dtype=dtype, device=device)


def counts_views(counts: torch.Tensor, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_sampled`` and ``num_rejected`` row views of a ``[2, C]`` counts buffer."""
    return counts[0, :num_reqs], counts[1, :num_reqs]


def draft_columns(drafts: torch.Tensor, k: int) -> torch.Tensor:
    """The ``[N, k]`` draft tokens of a drafts payload, contiguous (vLLM's post-update asserts
    it, vllm/v1/worker/gpu/input_batch.py:667); a copy when the payload has the admitted column."""
    return drafts if drafts.shape[1] == k else drafts[:, :k].contiguous()


def is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN_BYTES == 0


class DSparkExchange:
    """The exchange half of ``DSparkPPHandler``; see :func:`dspark_pp_handler_class`."""

    exchange_spec: ExchangeSpec
    exchange_enabled: bool  # False during warm-up: no rank posts anything
    exchange_step: StepState | None
    exchange_step_index: int
    # Set by vLLM's PPHandler, the class this one is mixed into (dspark_pp_handler_class); declared
    # here for the type checker only.
    is_last_rank: bool
    last_rank: int
    num_speculative_steps: int
    broadcast_group: Any
    main_stream: Any
    broadcast_stream: Any
    device: Any
    queue: Any
    req_idx_gen_np: Any

    def __init__(self, max_num_reqs: int, num_speculative_steps: int, device: Any) -> None:
        super().__init__(max_num_reqs, num_speculative_steps, device)  # type: ignore[call-arg]
        self.exchange_enabled = True
        self.exchange_step = None
        self.exchange_step_index = 0
        # The last rank's admitted counts of the current step (set before broadcast_drafts).
        self.step_admitted: torch.Tensor | None = None
        self._step_idx_np = np.zeros(0, dtype=np.intp)
        # Per request slot: the generation, record and row of its latest admitted counts, newest
        # first (column j: j broadcasts before the latest; generation -1: none, or another
        # request's). MAX_ADMITTED_LAG + 1 columns.
        depth = MAX_ADMITTED_LAG + 1
        self.admitted_gen = np.full((max_num_reqs, depth), -1, dtype=np.int64)
        self.admitted_rec: list[list[AdmittedCounts | None]] = [
            [None] * depth for _ in range(max_num_reqs)
        ]
        self.admitted_row = np.zeros((max_num_reqs, depth), dtype=np.int64)
        # Counts a verify step read before their copy to the host had landed (a host wait), and
        # the seconds those reads waited.
        self.admitted_waits = 0
        self.admitted_wait_s = 0.0
        self.set_admitted_counts(num_speculative_steps > 0 and admitted_counts_from_config())
        # VLLM_DSPARK_PP_DRAFT_DIGEST: every rank's running digest of the draft payloads
        self.draft_digest = digest_from_env(self) if num_speculative_steps > 0 else None
        _log_transport(self)

    def set_admitted_counts(self, enabled: bool, lag: int | None = None) -> None:
        """Ship admitted draft counts in the drafts payload (every rank alike); ``lag`` (default:
        :func:`~vllm_dspark_pp.protocol.adaptive_config.resolve_adaptive_lag` of the current
        config) says which one a verify step applies."""
        lag = admitted_lag_from_config() if lag is None else int(lag)
        if not 0 <= lag <= MAX_ADMITTED_LAG:
            raise ExchangeError(f"admitted-count lag {lag} is not in 0..{MAX_ADMITTED_LAG}")
        self.exchange_spec = ExchangeSpec(
            self.num_speculative_steps, admitted_counts=enabled, admitted_lag=lag
        )

    def _keep_admitted(self, column: torch.Tensor, idx_mapping_np: np.ndarray) -> None:
        """Record the posted count column for the rows whose output this step broadcasts (the
        others drafted nothing: a non-final prefill chunk's 0 must not become its count)."""
        record = AdmittedCounts(column, self.broadcast_stream)
        step = self.exchange_step
        mask = None if step is None or step.schedule is None else step.schedule.need_sampled_mask
        for row, slot in enumerate(idx_mapping_np):
            if mask is not None and not mask[row]:
                continue
            gen = self.req_idx_gen_np[slot]
            gens, recs, rows = (
                self.admitted_gen[slot],
                self.admitted_rec[slot],
                self.admitted_row[slot],
            )
            if gens[0] != gen or recs[0] is None:  # another request: forget the slot's older ones
                gens[:] = -1
                recs[:] = [None] * len(recs)
            gens[1:] = gens[:-1].copy()
            rows[1:] = rows[:-1].copy()
            recs[1:] = recs[:-1]
            gens[0], recs[0], rows[0] = gen, record, row

    def admitted_counts_for(self, idx_mapping_np: np.ndarray) -> np.ndarray:
        """Each slot's admitted draft count (-1: none, or the slot's request was freed since):
        the count of the request's draft broadcast ``admitted_lag`` broadcasts before its latest
        (0: the latest). Every PP rank returns the same values (the same broadcasts, recorded
        alike)."""
        lag = self.exchange_spec.admitted_lag
        out = np.full(len(idx_mapping_np), -1, dtype=np.int32)
        for i, slot in enumerate(idx_mapping_np):
            record = self.admitted_rec[slot][lag]
            if record is None or self.admitted_gen[slot, lag] != self.req_idx_gen_np[slot]:
                continue
            landed = record.ready()
            self.admitted_waits += not landed  # counted before the (bounded) poll may raise
            t0 = time.perf_counter()
            values = record.values()  # polls until the copy lands, if it has not
            if not landed:
                self.admitted_wait_s += time.perf_counter() - t0
            out[i] = values[self.admitted_row[slot, lag]]
        return out

    # -- one width for every step (replaces pp_utils.py:104-106)
    def _sample_len(self, input_batch: Any = None) -> int:
        return self.exchange_spec.sample_width

    # -- warm-up
    def set_exchange_enabled(self, enabled: bool) -> None:
        self.exchange_enabled = bool(enabled)

    @contextmanager
    def exchange_disabled(self):
        """No rank posts any sampled-token or draft broadcast inside (warm-up)."""
        previous = self.exchange_enabled
        self.exchange_enabled = False
        try:
            yield
        finally:
            self.exchange_enabled = previous

    # -- step brackets (the model runner patch)
    def begin_step(self, num_spec_tokens: int) -> None:
        self.exchange_step_index += 1
        self.exchange_step = StepState(self.exchange_step_index, int(num_spec_tokens), True)

    def end_step(self) -> None:
        """Check the step posted exactly its schedule, then forget it."""
        step = self.exchange_step
        self.exchange_step = None
        if step is None or step.schedule is None:
            return
        planned = [p.name for p in step.schedule.payloads]
        if step.posted != planned:
            raise ExchangeError(
                f"PP exchange step {step.index} ({'last' if self.is_last_rank else 'non-last'} "
                f"rank) posted {step.posted} but its schedule is {planned} "
                f"({step.schedule.describe()}); the other PP ranks would wait forever."
            )

    def _current_step(self, num_spec_tokens_hint: int | None) -> StepState:
        step = self.exchange_step
        if step is None or not step.bracketed:
            # Called outside a bracketed sample_tokens (a bare handler, as in unit tests): every
            # call starts a step of its own and the draft count comes from the caller's hint.
            self.exchange_step_index += 1
            step = StepState(self.exchange_step_index, num_spec_tokens_hint, False)
            self.exchange_step = step
        return step

    def _post(self, step: StepState, tensor: torch.Tensor, payload: Payload) -> None:
        if tuple(tensor.shape) != payload.shape or tensor.dtype != _TORCH_DTYPE[payload.dtype]:
            raise ExchangeError(
                f"PP exchange step {step.index}: {payload.name} buffer is "
                f"{list(tensor.shape)}:{tensor.dtype}, schedule says {payload.describe()}"
            )
        if not tensor.is_contiguous() or not is_aligned(tensor):
            raise ExchangeError(
                f"PP exchange step {step.index}: {payload.name} buffer is not contiguous and "
                f"{ALIGN_BYTES}-byte aligned"
            )
        if payload.name in step.posted:
            raise ExchangeError(
                f"PP exchange step {step.index}: {payload.name} would be posted twice in one step"
            )
        assert step.schedule is not None  # every caller set the step's schedule first
        expected = [p.name for p in step.schedule.payloads]
        if expected[: len(step.posted) + 1] != step.posted + [payload.name]:
            raise ExchangeError(
                f"PP exchange step {step.index}: {payload.name} posted out of order "
                f"(posted {step.posted}, schedule {expected})"
            )
        torch.distributed.broadcast(tensor, src=self.last_rank, group=self.broadcast_group)
        step.posted.append(payload.name)

    def broadcast(
        self,
        sampled_token_ids: torch.Tensor,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        input_batch: Any,
    ) -> None:
        """Last rank: post the step's sampled tokens and counts (fixed width, aligned)."""
        assert self.is_last_rank
        step = self._current_step(None)
        nst = step.num_spec_tokens if step.num_spec_tokens is not None else 1
        sched = step.schedule = schedule_for(self, input_batch, nst)
        self._step_idx_np = np.asarray(input_batch.idx_mapping_np)
        self.step_admitted = None  # decided later in this step (after propose), or not at all
        self.sampled_tokens_broadcast = sched.posts
        if not sched.posts:
            return
        if sampled_token_ids.dtype != torch.int64:
            raise ExchangeError(f"sampled tokens must be int64, got {sampled_token_ids.dtype}")
        from vllm.platforms import current_platform

        if current_platform.is_xpu():
            self.main_stream.synchronize()

        n = sched.num_reqs
        with torch.cuda.stream(self.broadcast_stream):
            self.broadcast_stream.wait_stream(self.main_stream)
            sampled_p, counts_p = sched.sampled, sched.counts
            assert sampled_p is not None and counts_p is not None  # a schedule that posts has both
            width = sampled_token_ids.shape[-1]
            if width > sampled_p.shape[1] or sampled_token_ids.shape[0] != n:
                raise ExchangeError(
                    f"sampled tokens {list(sampled_token_ids.shape)} do not fit "
                    f"{sampled_p.describe()}"
                )
            if width == sampled_p.shape[1] and sampled_token_ids.is_contiguous():
                sampled = sampled_token_ids
            else:
                # Pad a plain-sampler [N, 1] result to the fixed width; the padding is never read
                # (the post-update reads num_sampled columns).
                sampled = alloc_payload(sampled_p, sampled_token_ids.device, fill=-1)
                sampled[:, :width].copy_(sampled_token_ids)
            counts = alloc_payload(counts_p, num_sampled.device, fill=0)
            s_view, r_view = counts_views(counts, n)
            s_view.copy_(num_sampled)
            r_view.copy_(num_rejected)
            self._post(step, sampled, sampled_p)
            self._post(step, counts, counts_p)
            for tensor in (sampled_token_ids, num_sampled, num_rejected):
                tensor.record_stream(self.broadcast_stream)

    def broadcast_drafts(self, draft_tokens: torch.Tensor) -> None:
        """Last rank: the step's single draft broadcast, if its schedule has one."""
        assert self.is_last_rank
        step = self.exchange_step
        if step is None or step.schedule is None or not step.schedule.posts:
            return  # nothing was broadcast this step; the other ranks expect no drafts either
        drafts_p = step.schedule.drafts
        if drafts_p is None:
            if step.num_spec_tokens is None:
                return
            raise ExchangeError(
                f"PP exchange step {step.index}: drafts broadcast but the schedule has none "
                f"(num_spec_tokens={step.num_spec_tokens})"
            )
        k = self.exchange_spec.num_speculative_steps
        with torch.cuda.stream(self.broadcast_stream):
            self.broadcast_stream.wait_stream(self.main_stream)
            tensor = draft_tokens
            if self.exchange_spec.admitted_counts:
                # Column k: the admitted counts the adaptive manager decided this step (no
                # decision: all k drafts, i.e. no trim).
                tensor = alloc_payload(drafts_p, draft_tokens.device, fill=k)
                tensor[:, :k].copy_(draft_tokens[:, :k])
                if self.step_admitted is not None:
                    tensor[:, k].copy_(self.step_admitted)
                    self.step_admitted.record_stream(self.broadcast_stream)
            if tensor.dtype != torch.int64:
                tensor = tensor.to(torch.int64)
            if not tensor.is_contiguous() or not is_aligned(tensor):
                tensor = tensor.contiguous().clone()
            self._post(step, tensor, drafts_p)
            if self.draft_digest is not None:
                self.draft_digest.add(tensor)
            draft_tokens.record_stream(self.broadcast_stream)
            if self.exchange_spec.admitted_counts:
                self._keep_admitted(tensor[:, k], self._step_idx_np)
        self.step_admitted = None

    def receive(self, input_batch: Any, recv_drafts: bool) -> bool:
        """Non-last rank: post the receives of the step's schedule; returns True iff every row of
        the batch needs its sampled output (same contract as vLLM's ``PPHandler.receive``)."""
        assert not self.is_last_rank
        from vllm.v1.worker.gpu.pp_utils import PendingRecv

        step = self._current_step(1 if recv_drafts else 0)
        nst = step.num_spec_tokens
        assert nst is not None  # begin_step and the hint above both give a count
        if (nst > 0) != bool(recv_drafts):
            raise ExchangeError(
                f"PP exchange step {step.index}: recv_drafts={recv_drafts} but the step schedules "
                f"{nst} draft tokens"
            )
        sched = step.schedule = schedule_for(self, input_batch, nst)
        if not sched.posts:
            return False  # this step's ring slot stays None

        gen_at_receive_np = self.req_idx_gen_np[input_batch.idx_mapping_np]
        n = sched.num_reqs
        with torch.cuda.stream(self.broadcast_stream):
            self.broadcast_stream.wait_stream(self.main_stream)
            buffers = {p.name: alloc_payload(p, self.device) for p in sched.payloads}
            for p in sched.payloads:
                self._post(step, buffers[p.name], p)
            if DRAFTS in buffers and self.draft_digest is not None:
                self.draft_digest.add(buffers[DRAFTS])  # the whole payload, as posted
            if DRAFTS in buffers and self.exchange_spec.admitted_counts:
                k = self.exchange_spec.num_speculative_steps
                self._keep_admitted(buffers[DRAFTS][:, k], input_batch.idx_mapping_np)
                buffers[DRAFTS] = draft_columns(buffers[DRAFTS], k)
            event = self.broadcast_stream.record_event()
            for t in buffers.values():
                t.record_stream(self.main_stream)
        num_sampled, num_rejected = counts_views(buffers[COUNTS], n)
        mask = sched.need_sampled_mask
        assert mask is not None  # a schedule that posts has its mask (schedule.step_schedule)
        self.queue[-1] = PendingRecv(
            event,
            buffers[SAMPLED],
            num_sampled,
            num_rejected,
            input_batch.idx_mapping,
            input_batch.idx_mapping_np,
            mask,
            gen_at_receive_np,
            buffers.get(DRAFTS),
        )
        return sched.all_rows_need_sampled


def exchange_transport(handler: Any) -> str:
    """The backend that carries the exchange (``nccl`` on CUDA, ``gloo`` on CPU), or why unknown."""
    group = getattr(handler, "broadcast_group", None)
    try:
        return str(torch.distributed.get_backend(group))
    except Exception as exc:  # noqa: BLE001 - a bare handler in unit tests has no group
        return f"unknown ({type(exc).__name__})"


def _log_transport(handler: Any) -> None:
    """One line per rank naming the exchange's transport (the one-GPU PP tier checks it says
    nccl: the sampled-token and draft broadcasts did not fall back to another backend)."""
    from vllm.logger import init_logger

    init_logger("vllm.dspark_pp.exchange").info(
        "DSpark PP exchange: %s rank, sampled-token and draft broadcasts from PP rank %s over %s",
        "last" if getattr(handler, "is_last_rank", False) else "non-last",
        getattr(handler, "last_rank", "?"),
        exchange_transport(handler),
    )


def prewarm_deferred_post_update(model_runner: Any, num_reqs: int = 3) -> int:
    """Non-last ranks: compile the deferred post-update (plain and draft-adopting variants)
    now, on buffers laid out exactly as :func:`receive` lays them out, with every row masked
    (idx -1) so no request state changes. Returns the number of variants run."""
    handler = model_runner.pp_handler
    if handler is None or handler.is_last_rank:
        return 0
    spec: ExchangeSpec = handler.exchange_spec
    num_reqs = max(1, min(num_reqs, model_runner.max_num_reqs))
    device = handler.device
    variants = [False, True] if spec.num_speculative_steps > 0 else [False]
    for with_drafts in variants:
        fake = _MaskedBatch(num_reqs)
        sched = step_schedule(spec, fake, 1 if with_drafts else 0, enabled=True)
        buffers = {p.name: alloc_payload(p, device, fill=0) for p in sched.payloads}
        num_sampled, num_rejected = counts_views(buffers[COUNTS], num_reqs)
        idx_mapping = torch.full((num_reqs,), -1, dtype=torch.int64, device=device)
        model_runner.postprocess_sampled(
            idx_mapping=idx_mapping,
            sampled_tokens=buffers[SAMPLED],
            num_sampled=num_sampled,
            num_rejected=num_rejected,
            draft_tokens=(
                draft_columns(buffers[DRAFTS], spec.num_speculative_steps)
                if DRAFTS in buffers
                else None
            ),
        )
    if torch.device(device).type != "cpu":
        torch.accelerator.synchronize()
    return len(variants)


class _MaskedBatch:
    """A batch of decodes that all need their sampled output (for the pre-warm schedule)."""

    def __init__(self, n: int) -> None:
        self.num_reqs = n
        self.num_computed_tokens_np = np.full(n, 8, dtype=np.int32)
        self.num_scheduled_tokens = np.ones(n, dtype=np.int32)
        self.prefill_len_np = np.full(n, 4, dtype=np.int32)
        self.max_seq_len_np = None
        self.is_prefilling_np = np.zeros(n, dtype=bool)


def dspark_pp_handler_class(pp_handler_cls: type) -> type:
    """``class DSparkPPHandler(DSparkExchange, PPHandler)`` for vLLM's ``PPHandler`` class
    (built when pp_utils is imported: this module does not import vLLM's GPU worker modules)."""
    if issubclass(pp_handler_cls, DSparkExchange):
        return pp_handler_cls
    return type(
        "DSparkPPHandler",
        (DSparkExchange, pp_handler_cls),
        {"__module__": __name__, "__doc__": "vLLM's PPHandler with the DSpark PP token exchange."},
    )


def vllm_pp_handler_class(cls: type) -> type:
    """vLLM's own ``PPHandler`` under a ``DSparkPPHandler`` (or ``cls`` itself)."""
    return next((b for b in cls.__mro__ if b.__name__ == "PPHandler"), cls)
