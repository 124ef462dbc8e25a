"""Test harness for the PP token exchange: fake PP groups, a recording broadcast, a random
engine that produces realistic step sequences, and drivers that run the REAL patched vLLM
``PPHandler`` (last rank and non-last ranks) through those steps the way the model runner does.

Used in-process (recording broadcast) and in gloo worker processes (real broadcast).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass, field

from support.env import set_cpu_env_defaults

set_cpu_env_defaults()  # also in the spawned gloo workers, which import this module

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_dspark_pp.protocol.schedule import ALIGN_BYTES  # noqa: E402

# ----------------------------------------------------------------------------------------------
# CPU stand-ins for the CUDA stream API PPHandler uses (vLLM's CPU worker installs similar ones).


class _Stream:
    def __init__(self, *a, **k):
        self.device = torch.device("cpu")

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _Event()

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass


@contextmanager
def cpu_streams():
    """Swap torch.cuda's stream API for no-op CPU stand-ins inside the block."""
    saved = (
        torch.cuda.Stream,
        torch.cuda.Event,
        torch.cuda.current_stream,
        torch.cuda.stream,
        torch.Tensor.record_stream,
    )
    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Event
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda *a, **k: _Stream()
    torch.Tensor.record_stream = lambda self, *a, **k: None
    try:
        yield
    finally:
        (
            torch.cuda.Stream,
            torch.cuda.Event,
            torch.cuda.current_stream,
            torch.cuda.stream,
            torch.Tensor.record_stream,
        ) = saved


def apply_protocol_patches() -> None:
    from vllm_dspark_pp.patches import (
        v1_worker_gpu_model_runner__protocol,
        v1_worker_gpu_pp_utils,
        v1_worker_gpu_warmup,
    )

    v1_worker_gpu_pp_utils.apply()
    v1_worker_gpu_warmup.apply()
    v1_worker_gpu_model_runner__protocol.apply()
    import vllm.v1.worker.gpu.pp_utils  # noqa: F401  (triggers the on-import patch)


# ----------------------------------------------------------------------------------------------
# Fake PP group


class FakeGroup:
    """Stands for a broadcast group as seen by one rank."""

    def __init__(self, rank: int, real=None):
        self.rank = rank
        self.real = real


class FakePPGroup:
    def __init__(self, rank: int, world_size: int, broadcast_group):
        self.rank_in_group = rank
        self.world_size = world_size
        self.is_last_rank = rank == world_size - 1
        self.last_rank = world_size - 1
        self.ranks = list(range(world_size))
        self._bgroup = broadcast_group

    def make_sibling_device_group(self, group_desc=None):
        return self._bgroup


def make_handler(
    rank: int, world_size: int, k: int, max_num_reqs: int, broadcast_group, adaptive=False, lag=1
):
    """The real (patched) vLLM PPHandler for one rank, on CPU (``adaptive``: the drafts payload
    carries admitted draft counts; ``lag``: which of them a verify step applies)."""
    from vllm.v1.worker.gpu import pp_utils

    fake = FakePPGroup(rank, world_size, broadcast_group)
    saved = pp_utils.get_pp_group
    pp_utils.get_pp_group = lambda: fake
    try:
        handler = pp_utils.PPHandler(max_num_reqs, k, torch.device("cpu"))
        handler.set_admitted_counts(adaptive, lag=lag)
        return handler
    finally:
        pp_utils.get_pp_group = saved


# ----------------------------------------------------------------------------------------------
# A batch as the model runner builds it (the fields PPHandler reads)


@dataclass
class Batch:
    req_ids: list[str]
    idx_mapping_np: np.ndarray
    num_computed_tokens_np: np.ndarray
    num_scheduled_tokens: np.ndarray
    prefill_len_np: np.ndarray
    max_seq_len_np: np.ndarray | None
    is_prefilling_np: np.ndarray
    num_drafts_np: np.ndarray
    idx_mapping: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.idx_mapping = torch.from_numpy(self.idx_mapping_np.astype(np.int64))

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_draft_tokens(self) -> int:
        return int(self.num_drafts_np.sum())

    def describe(self) -> str:
        rows = []
        for i, r in enumerate(self.req_ids):
            kind = "prefill" if self.is_prefilling_np[i] else "decode"
            rows.append(
                f"{r}@{self.idx_mapping_np[i]}:{kind} computed={self.num_computed_tokens_np[i]} "
                f"sched={self.num_scheduled_tokens[i]} prefill_len={self.prefill_len_np[i]} "
                f"drafts={self.num_drafts_np[i]}"
                + (
                    f" max_seq_len={self.max_seq_len_np[i]}"
                    if self.max_seq_len_np is not None
                    else ""
                )
            )
        return "[" + "; ".join(rows) + "]"


@dataclass
class Step:
    """One engine step: requests freed before it (finished, aborted, preempted), then the batch
    (None: an empty step, no sample_tokens call), the scheduled draft count."""

    freed: list[int]
    batch: Batch | None
    num_spec_tokens: int

    def describe(self) -> str:
        b = "empty step" if self.batch is None else self.batch.describe()
        return f"free={self.freed} num_spec_tokens={self.num_spec_tokens} batch={b}"


@dataclass
class Case:
    seed: int
    pp_size: int
    k: int
    max_num_reqs: int
    steps: list[Step]
    adaptive: bool = False  # adaptive verification: admitted counts ride with the drafts
    # which shipped count a verify step applies (ExchangeSpec.admitted_lag): 0 in adaptive cases
    # whose seed is 3 mod 4, 2 where it is 2 mod 4 (the default under async scheduling), else 1
    admitted_lag: int = 1


def random_case(seed: int, num_steps: int = 24) -> Case:
    """A seeded random engine run: prefill chunks, decodes with and without drafts, aborts,
    preemptions, max-length finishes and empty steps; PP size 2..4; k in {0, 1, 2, 3, 5};
    adaptive verification (admitted counts) in every other block of 15 seeds with k > 0, applied
    with lag 0 where the seed is 3 mod 4, lag 2 where it is 2 mod 4 and lag 1 otherwise."""
    rng = random.Random(seed)
    pp_size = 2 + seed % 3
    k = [0, 1, 2, 3, 5][(seed // 3) % 5]
    adaptive = k > 0 and (seed // 15) % 2 == 1
    max_num_reqs = rng.choice([1, 2, 3, 5, 8, 13])
    chunk = rng.choice([3, 7, 16, 64])
    free_slots = list(range(max_num_reqs))
    rng.shuffle(free_slots)
    reqs: dict[str, dict] = {}
    reqs_pending: list[tuple[str, int, int]] = []
    counter = 0
    steps: list[Step] = []
    for _ in range(num_steps):
        freed: list[int] = []

        def free(rid, freed=freed):
            slot = reqs.pop(rid)["slot"]
            free_slots.append(slot)
            freed.append(slot)

        # finishes at max length, aborts, preemptions
        for rid in list(reqs):
            r = reqs[rid]
            if r["computed"] >= r["max_seq_len"] - 1:
                free(rid)
            elif rng.random() < 0.05:
                free(rid)  # abort
            elif rng.random() < 0.04:
                # preemption: freed now, re-added later as a new request with its output as prompt
                prompt = r["computed"] + 1
                free(rid)
                counter += 1
                reqs_pending.append((f"r{counter}p", prompt, r["max_seq_len"]))
        # new requests
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 3)):
                counter += 1
                prompt = rng.randint(1, 40)
                max_seq_len = prompt + rng.randint(1, 12)
                reqs_pending.append((f"r{counter}", prompt, max_seq_len))
        while reqs_pending and free_slots:
            rid, prompt, max_seq_len = reqs_pending.pop(0)
            reqs[rid] = dict(
                slot=free_slots.pop(0),
                prompt=prompt,
                computed=0,
                max_seq_len=max(max_seq_len, prompt + 1),
            )
        if not reqs or rng.random() < 0.06:
            steps.append(Step(freed, None, k))
            continue
        num_spec_tokens = k if (k > 0 and rng.random() < 0.8) else 0
        ids, slots, comp, sched, plen, mlen, drafts = [], [], [], [], [], [], []
        for rid, r in reqs.items():
            if rng.random() < 0.15:
                continue  # not scheduled this step (PP keeps decodes in flight)
            if r["computed"] < r["prompt"]:
                n = min(chunk, r["prompt"] - r["computed"])
                d = 0
            else:
                d = k if (k > 0 and num_spec_tokens > 0 and rng.random() < 0.7) else 0
                n = 1 + d
            ids.append(rid)
            slots.append(r["slot"])
            comp.append(r["computed"])
            sched.append(n)
            plen.append(r["prompt"])
            mlen.append(r["max_seq_len"])
            drafts.append(d)
        if not ids:
            steps.append(Step(freed, None, k))
            continue
        comp_np = np.array(comp, dtype=np.int32)
        plen_np = np.array(plen, dtype=np.int32)
        prefilling = comp_np < plen_np
        batch = Batch(
            req_ids=ids,
            idx_mapping_np=np.array(slots, dtype=np.intp),
            num_computed_tokens_np=comp_np,
            num_scheduled_tokens=np.array(sched, dtype=np.int32),
            prefill_len_np=plen_np,
            max_seq_len_np=np.array(mlen, dtype=np.int32) if prefilling.any() else None,
            is_prefilling_np=prefilling,
            num_drafts_np=np.array(drafts, dtype=np.int32),
        )
        for rid, n, d in zip(ids, sched, drafts, strict=True):
            # prefill chunks advance by the chunk; a decode by 1 + its accepted drafts
            reqs[rid]["computed"] += n - d + rng.randint(0, d)
        steps.append(Step(freed, batch, num_spec_tokens))
    lag = {3: 0, 2: 2}.get(seed % 4, 1)
    return Case(seed, pp_size, k, max_num_reqs, steps, adaptive, lag)


# ----------------------------------------------------------------------------------------------
# Deterministic payloads, so every process can compute what the last rank sends


def payload_for(seed: int, step_idx: int, batch: Batch, k: int):
    g = torch.Generator().manual_seed(seed * 100003 + step_idx)
    n = batch.num_reqs
    width = k + 1 if batch.num_draft_tokens > 0 else 1
    sampled = torch.randint(0, 50000, (n, width), generator=g, dtype=torch.int64)
    num_sampled = torch.randint(0, width + 1, (n,), generator=g, dtype=torch.int32)
    num_rejected = torch.randint(0, max(k, 1), (n,), generator=g, dtype=torch.int32)
    drafts = torch.randint(0, 50000, (n, max(k, 1)), generator=g, dtype=torch.int64)[:, :k]
    return sampled, num_sampled, num_rejected, drafts.contiguous()


def admitted_for(seed: int, step_idx: int, batch: Batch, k: int) -> torch.Tensor:
    """The admitted draft counts the last rank decides in a step (int32, 0..k)."""
    g = torch.Generator().manual_seed(seed * 7919 + step_idx)
    return torch.randint(0, k + 1, (batch.num_reqs,), generator=g, dtype=torch.int32)


def last_rank_step(handler, seed, step_idx, step: Step, k: int):
    """What GPUModelRunner.sample_tokens does on the last rank (0.34.0 call pattern)."""
    if step.batch is None:
        return
    sampled, ns, nr, drafts = payload_for(seed, step_idx, step.batch, k)
    handler.begin_step(step.num_spec_tokens)
    handler.broadcast(sampled, ns, nr, step.batch)
    if k > 0 and step.num_spec_tokens > 0:
        if handler.exchange_spec.admitted_counts:
            handler.step_admitted = admitted_for(seed, step_idx, step.batch, k)
        handler.broadcast_drafts(drafts)
    handler.end_step()


def non_last_execute(handler, step: Step):
    """What GPUModelRunner.execute_model does first on a non-last rank: consume the ring slot of
    pp_size steps ago, then free the finished/preempted request slots."""
    out = handler.get_prev_sampled_outputs()
    for slot in step.freed:
        handler.on_req_idx_freed(slot)
    return out


def non_last_sample(handler, step: Step):
    if step.batch is None:
        return None
    handler.begin_step(step.num_spec_tokens)
    all_decode = handler.receive(step.batch, recv_drafts=step.num_spec_tokens > 0)
    handler.end_step()
    return all_decode


def last_rank_execute(handler, step: Step):
    for slot in step.freed:
        handler.on_req_idx_freed(slot)


def aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN_BYTES == 0
