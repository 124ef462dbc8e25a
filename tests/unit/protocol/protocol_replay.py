"""Replay a random case through the real patched PPHandler of every PP rank, in one process,
with a recording broadcast: returns each rank's collective sequence and every problem seen
(misaligned view, wrong data, wrong ring delivery)."""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np
import torch
from protocol_sim import (
    Case,
    FakeGroup,
    admitted_for,
    aligned,
    last_rank_execute,
    last_rank_step,
    make_handler,
    non_last_execute,
    non_last_sample,
    payload_for,
    random_case,
)

from vllm_dspark_pp.protocol.schedule import need_sampled_mask


class RecordingWire:
    """Stands in for torch.distributed.broadcast: records every post of every rank, hands the
    last rank's tensors to the receivers when shapes and dtypes match."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.step = -1
        self.log: dict[int, list] = {r: [] for r in range(world_size)}
        self.inbox: dict[int, deque] = {r: deque() for r in range(world_size)}
        self.problems: list[str] = []

    def broadcast(self, tensor, src, group=None, async_op=False):
        r = group.rank
        self.log[r].append((self.step, tuple(tensor.shape), str(tensor.dtype)))
        if not aligned(tensor):
            self.problems.append(f"step {self.step}: rank {r} posted a misaligned buffer")
        if r == src:
            for other in range(self.world_size):
                if other != src:
                    self.inbox[other].append(tensor.clone())
        elif self.inbox[r]:
            sent = self.inbox[r].popleft()
            if sent.shape == tensor.shape and sent.dtype == tensor.dtype:
                tensor.copy_(sent)


def expected_wire(seed, step_idx, batch, k, with_drafts):
    sampled, ns, nr, drafts = payload_for(seed, step_idx, batch, k)
    n = batch.num_reqs
    width = k + 1 if k > 0 else 1
    padded = torch.full((n, width), -1, dtype=torch.int64)
    padded[:, : sampled.shape[1]] = sampled
    return padded, ns, nr, (drafts if with_drafts else None)


def replay(case: Case, monkeypatch_broadcast) -> tuple[dict[int, list], list[str]]:
    world = case.pp_size
    last = world - 1
    wire = RecordingWire(world)
    monkeypatch_broadcast(wire.broadcast)
    handlers = {
        r: make_handler(
            r, world, case.k, case.max_num_reqs, FakeGroup(r), case.adaptive, case.admitted_lag
        )
        for r in range(world)
    }
    # slot -> [(generation, count), ...] of its draft broadcasts, the latest last
    expected_admitted: dict[int, list[tuple[int, int]]] = {}
    problems = wire.problems
    # the ring each non-last rank should hold: step index of each pending receive
    ring = {r: deque([None] * world) for r in range(last)}
    gen = np.zeros(case.max_num_reqs, dtype=np.int64)
    gen_at = {}
    for t, step in enumerate(case.steps):
        wire.step = t
        last_rank_execute(handlers[last], step)
        for r in range(last):
            out = non_last_execute(handlers[r], step)
            src = ring[r].popleft()
            ring[r].append(None)
            _check_delivery(case, r, t, src, out, gen_at, gen, problems)
        for slot in step.freed:
            gen[slot] += 1
        check_admitted(case, t, handlers, gen, expected_admitted, problems)
        last_rank_step(handlers[last], case.seed, t, step, case.k)
        keep_expected_admitted(case, t, step, gen, expected_admitted)
        for r in range(last):
            non_last_sample(handlers[r], step)
            slot = handlers[r].queue[-1]
            if slot is not None:
                ring[r][-1] = t
                gen_at[t] = gen[step.batch.idx_mapping_np].copy()
                _check_received(case, r, t, step, slot, problems)
    return wire.log, problems


def keep_expected_admitted(case, t, step, gen, expected):
    """What every rank should hold after step t: the counts of the step's draft broadcast, for
    the rows whose output the step broadcasts."""
    if not case.adaptive or step.batch is None or step.num_spec_tokens == 0:
        return
    mask = need_sampled_mask(step.batch)
    if mask is None:
        return  # the step posts nothing
    counts = admitted_for(case.seed, t, step.batch, case.k)
    for row, slot in enumerate(step.batch.idx_mapping_np):
        if mask[row]:
            expected.setdefault(int(slot), []).append((int(gen[slot]), int(counts[row])))


def expected_count(history: list[tuple[int, int]], gen: int, lag: int) -> int:
    """The count a verify step applies: the slot's ``lag``-th draft broadcast before its latest,
    if that and every later one were sent to the request now in the slot (-1: none)."""
    if len(history) <= lag or any(g != gen for g, _ in history[-1 - lag :]):
        return -1
    return history[-1 - lag][1]


def check_admitted(case, t, handlers, gen, expected, problems):
    """Before step t: every rank returns the same admitted count for every slot, the one the last
    rank sent in the slot's latest draft broadcast (lag 0) or the one before it (lag 1; -1: none,
    or freed since)."""
    slots = np.arange(case.max_num_reqs)
    want = np.array(
        [expected_count(expected.get(s, []), gen[s], case.admitted_lag) for s in slots.tolist()],
        dtype=np.int32,
    )
    for r, h in handlers.items():
        got = h.admitted_counts_for(slots)
        if not np.array_equal(got, want):
            problems.append(f"step {t}: rank {r} admitted counts {got.tolist()} != {want.tolist()}")


def _check_received(case, r, t, step, slot, problems):
    with_drafts = case.k > 0 and step.num_spec_tokens > 0
    padded, ns, nr, drafts = expected_wire(case.seed, t, step.batch, case.k, with_drafts)
    views = {
        "sampled_tokens": slot.sampled_tokens,
        "num_sampled": slot.num_sampled,
        "num_rejected": slot.num_rejected,
    }
    if slot.draft_tokens is not None:
        views["draft_tokens"] = slot.draft_tokens
    for name, v in views.items():
        if not aligned(v):
            problems.append(f"step {t}: rank {r} {name} view not 16-byte aligned")
    if not torch.equal(slot.sampled_tokens, padded):
        problems.append(f"step {t}: rank {r} sampled tokens differ from what was sent")
    if not (torch.equal(slot.num_sampled, ns) and torch.equal(slot.num_rejected, nr)):
        problems.append(f"step {t}: rank {r} counts differ from what was sent")
    if (drafts is None) != (slot.draft_tokens is None) or (
        drafts is not None and not torch.equal(slot.draft_tokens, drafts)
    ):
        problems.append(f"step {t}: rank {r} drafts differ from what was sent")


def _check_delivery(case, r, t, src, out, gen_at, gen, problems):
    """The outputs consumed at step t are those received at step src (= t - pp_size), minus
    rows freed since and rows that needed nothing."""
    if src is None:
        if out is not None:
            problems.append(f"step {t}: rank {r} consumed outputs from an empty ring slot")
        return
    batch = case.steps[src].batch
    from vllm_dspark_pp.protocol.schedule import need_sampled_mask

    mask = need_sampled_mask(batch)
    live = (gen[batch.idx_mapping_np] == gen_at[src]) & mask
    if not live.any():
        if out is not None:
            problems.append(f"step {t}: rank {r} consumed outputs of freed requests")
        return
    if out is None:
        problems.append(f"step {t}: rank {r} lost the outputs of step {src}")
        return
    with_drafts = case.k > 0 and case.steps[src].num_spec_tokens > 0
    padded, ns, nr, drafts = expected_wire(case.seed, src, batch, case.k, with_drafts)
    idx = out["idx_mapping"].numpy()
    want_idx = np.where(live, batch.idx_mapping_np, -1)
    if not np.array_equal(idx, want_idx):
        problems.append(f"step {t}: rank {r} idx_mapping {idx} != {want_idx}")
    if not torch.equal(out["sampled_tokens"], padded) or not torch.equal(out["num_sampled"], ns):
        problems.append(f"step {t}: rank {r} deferred outputs differ from step {src}'s")


def minimal_reproducer(seed: int, monkeypatch_broadcast, check) -> str:
    """Shortest prefix of the seed's case that still fails ``check``, printed step by step."""
    case = random_case(seed)
    n = len(case.steps)
    for m in range(1, n + 1):
        sub = dataclasses.replace(case, steps=case.steps[:m])
        if check(sub, monkeypatch_broadcast):
            n = m
            break
    lines = [
        f"minimal reproducer: seed={seed} pp_size={case.pp_size} k={case.k} "
        f"adaptive={case.adaptive} lag={case.admitted_lag} "
        f"max_num_reqs={case.max_num_reqs} first {n} steps "
        f"(rerun: protocol_replay.replay(protocol_sim.random_case({seed}) with steps[:{n}]))"
    ]
    lines += [f"  step {i}: {s.describe()}" for i, s in enumerate(case.steps[:n])]
    return "\n".join(lines)
