"""Random cases, a pure-torch reference and a checker for vLLM's DFlash/DSpark prepare-inputs
kernel.

The kernel is ``vllm.v1.worker.gpu.spec_decode.dflash.speculator.prepare_dflash_inputs`` (vLLM
0.34.0, speculator.py:920-1007, Triton bodies at :668-917). Each drafting step it writes the
drafter's query inputs for the real requests and pads every persistent buffer up to
``max_num_reqs`` / ``max_num_tokens`` so a CUDA graph captured for a larger batch replays safely:
padding query rows get ``is_padding=True``, ``input_ids=0``, ``positions=0`` and PAD slots; padding
sample rows get index 0, position 0 and idx mapping ``-1``; padding requests get ``seq_lens=0``
and a flat ``query_start_loc``.

:func:`check_case` fills every output buffer with a poison value, runs the kernel, and compares
every element of every buffer with :func:`reference` (integer arithmetic in int64 on the CPU,
float64 for the copied temperatures), which starts from the same poisoned buffers, so a row the
kernel fails to write (or writes but should not) is a mismatch. It runs twice with two different
poison sets so no poison value can coincide with an expected one (booleans get True, then False).

Used by tests/gpu/test_dflash_prepare_inputs_gpu.py on CUDA and by
tests/unit/support/test_gpu_tools_dflash_reference.py on the CPU through the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

PAD_SLOT_ID = -1  # vllm/v1/attention/backends/utils.py PAD_SLOT_ID (checked in check_case)

OUTPUTS = (
    "input_ids",
    "positions",
    "is_padding",
    "query_start_loc",
    "seq_lens",
    "query_slot_mapping",
    "context_positions",
    "context_slot_mapping",
    "sample_indices",
    "sample_pos",
    "sample_idx_mapping",
    "temperature",
    "seeds",
)


@dataclass
class Case:
    """One random drafting step. Sizes follow DFlashSpeculator's buffers."""

    seed: int
    num_reqs: int
    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int
    num_speculative_steps: int
    sample_from_anchor: bool  # True: DSpark layout (N query rows), False: DFlash (1 + N)
    block_size: int
    max_blocks: int
    mask_token_id: int
    num_states: int  # persistent request-state slots (>= max_num_reqs)
    inputs: dict = field(default_factory=dict)

    @property
    def num_query_per_req(self) -> int:
        return self.num_speculative_steps + (0 if self.sample_from_anchor else 1)

    def describe(self) -> str:
        return (
            f"seed={self.seed} num_reqs={self.num_reqs}/{self.max_num_reqs} "
            f"max_num_tokens={self.max_num_tokens} N={self.num_speculative_steps} "
            f"{'dspark(anchor)' if self.sample_from_anchor else 'dflash(1+N)'} "
            f"block_size={self.block_size} max_model_len={self.max_model_len}"
        )


def make_case(
    seed: int,
    num_reqs: int,
    *,
    max_num_reqs: int = 8,
    max_num_tokens: int = 1024,
    num_speculative_steps: int = 4,
    sample_from_anchor: bool = True,
    block_size: int = 16,
    long_prefill: bool = True,
) -> Case:
    """A random step: decode rows (1 + drafts scheduled, some rejected), chunked-prefill rows
    (``num_sampled == 0``), a long prefill that spans more than one 128-wide kernel block, a
    request near ``max_model_len`` (clamps), null (0) blocks in the block table, shuffled
    request-state slots."""
    g = torch.Generator().manual_seed(seed)

    def ri(lo, hi, n=None):  # inclusive lo, exclusive hi
        if n is None:
            return int(torch.randint(lo, hi, (1,), generator=g))
        return torch.randint(lo, hi, (n,), generator=g)

    max_model_len = 512
    max_blocks = max_model_len // block_size  # query rows past the end clamp to the last block
    num_states = max_num_reqs + 4
    case = Case(
        seed=seed,
        num_reqs=num_reqs,
        max_num_reqs=max_num_reqs,
        max_num_tokens=max_num_tokens,
        max_model_len=max_model_len,
        num_speculative_steps=num_speculative_steps,
        sample_from_anchor=sample_from_anchor,
        block_size=block_size,
        max_blocks=max_blocks,
        mask_token_id=7,
        num_states=num_states,
    )
    N = num_speculative_steps
    num_sched, num_rejected, start_pos, num_sampled = [], [], [], []
    for r in range(num_reqs):
        kind = r % 4
        if kind == 3 and long_prefill:  # long prefill chunk: > 128 tokens
            n = ri(130, 200)
            rej, sampled, p0 = 0, ri(0, 2), ri(0, 100)
        elif kind == 2:  # short prefill chunk, nothing sampled yet
            n = ri(1, 12)
            rej, sampled, p0 = 0, 0, ri(0, 50)
        else:  # decode: 1 + N verified tokens, some rejected
            n = 1 + N
            rej = ri(0, n)  # at most n-1: one valid context token always remains
            sampled = ri(1, N + 2)
            p0 = ri(1, 300)
        num_sched.append(n)
        num_rejected.append(rej)
        num_sampled.append(sampled)
        start_pos.append(p0)
    if num_reqs >= 2:  # one request at the end of the context window: clamps engage
        r = 1
        start_pos[r] = max_model_len - num_sched[r] - ri(0, 2)
    total = sum(num_sched)
    assert total + N * max_num_reqs <= max_num_tokens, "max_num_tokens too small for this case"

    qsl = [0]
    for n in num_sched:
        qsl.append(qsl[-1] + n)
    positions = torch.zeros(max_num_tokens, dtype=torch.int64)
    for r in range(num_reqs):
        positions[qsl[r] : qsl[r + 1]] = start_pos[r] + torch.arange(num_sched[r])
    idx_mapping = torch.randperm(num_states, generator=g)[:num_reqs].to(torch.int32)
    block_table = torch.randint(1, 5000, (max_num_reqs, max_blocks), generator=g, dtype=torch.int32)
    # null blocks (0): evicted sliding-window entries; their slots must be PAD
    holes = torch.rand((max_num_reqs, max_blocks), generator=g) < 0.15
    block_table[holes] = 0
    case.inputs = {
        "target_positions": positions,
        "target_query_start_loc": torch.tensor(qsl, dtype=torch.int32),
        "num_scheduled_tokens": np.array(num_sched, dtype=np.int32),
        "idx_mapping": idx_mapping,
        "num_sampled": torch.tensor(num_sampled, dtype=torch.int32),
        "num_rejected": torch.tensor(num_rejected, dtype=torch.int32),
        "last_sampled": ri(10, 500, num_states).to(torch.int64),
        "next_prefill_tokens": ri(10, 500, num_states).to(torch.int32),
        "in_temperature": torch.rand(num_states, generator=g, dtype=torch.float32) * 2,
        "in_seeds": ri(0, 1 << 40, num_states).to(torch.int64),
        "block_table": block_table,
    }
    return case


POISONS = (
    # int poison, bool poison, float poison
    (-12345, True, -3.25),
    (987654, False, 77.5),
)


def _buffers(case: Case, poison_set: int) -> dict[str, torch.Tensor]:
    ip, bp, fp = POISONS[poison_set]
    M, T, S = case.max_num_reqs, case.max_num_tokens, case.max_num_reqs * case.num_speculative_steps
    return {
        "input_ids": torch.full((T,), ip, dtype=torch.int32),
        "positions": torch.full((T,), ip, dtype=torch.int64),
        "is_padding": torch.full((T,), bp, dtype=torch.bool),
        "query_start_loc": torch.full((M + 1,), ip, dtype=torch.int32),
        "seq_lens": torch.full((M,), ip, dtype=torch.int32),
        "query_slot_mapping": torch.full((T,), ip, dtype=torch.int64),
        "context_positions": torch.full((T,), ip, dtype=torch.int64),
        "context_slot_mapping": torch.full((T,), ip, dtype=torch.int64),
        "sample_indices": torch.full((S,), ip, dtype=torch.int64),
        "sample_pos": torch.full((S,), ip, dtype=torch.int64),
        "sample_idx_mapping": torch.full((S,), ip, dtype=torch.int64),
        "temperature": torch.full((case.num_states,), fp, dtype=torch.float32),
        "seeds": torch.full((case.num_states,), ip, dtype=torch.int64),
    }


def _slot(pos: int, block_id: int, block_size: int) -> int:
    return PAD_SLOT_ID if block_id == 0 else block_id * block_size + pos % block_size


def reference(case: Case, poison_set: int) -> dict[str, torch.Tensor]:
    """What every output buffer must hold after the kernel (CP size 1), in plain Python/torch."""
    out = {k: v.clone() for k, v in _buffers(case, poison_set).items()}
    inp = case.inputs
    n, M, T = case.num_reqs, case.max_num_reqs, case.max_num_tokens
    N, Q, bs = case.num_speculative_steps, case.num_query_per_req, case.block_size
    bt = inp["block_table"].to(torch.int64)
    stride = bt.shape[1]
    pos_t = inp["target_positions"].to(torch.int64)
    qsl = inp["target_query_start_loc"].to(torch.int64)
    for r in range(n):
        state = int(inp["idx_mapping"][r])
        c0, c1 = int(qsl[r]), int(qsl[r + 1])
        valid_end = c1 - int(inp["num_rejected"][r])
        num_valid = valid_end - c0
        bonus = (
            int(inp["last_sampled"][state])
            if int(inp["num_sampled"][r]) > 0
            else int(inp["next_prefill_tokens"][state])
        )
        last_valid_pos = int(pos_t[valid_end - 1])
        for j in range(c1 - c0):  # context rows: valid ones keep their slot, rejected -> 0 / PAD
            if j < num_valid:
                p = int(pos_t[c0 + j])
                blk = int(bt[r, min(p // bs, stride - 1)])
                out["context_positions"][c0 + j] = p
                out["context_slot_mapping"][c0 + j] = _slot(p, blk, bs)
            else:
                out["context_positions"][c0 + j] = 0
                out["context_slot_mapping"][c0 + j] = PAD_SLOT_ID
        for k in range(Q):  # query rows
            qp = last_valid_pos + 1 + k
            qi = r * Q + k
            blk = int(bt[r, min(qp // bs, stride - 1)])
            out["input_ids"][qi] = bonus if k == 0 else case.mask_token_id
            out["is_padding"][qi] = False
            out["positions"][qi] = min(qp, case.max_model_len - 1)
            out["query_slot_mapping"][qi] = _slot(qp, blk, bs)
            off = 0 if case.sample_from_anchor else 1
            if k >= off:
                si = r * N + (k - off)
                out["sample_indices"][si] = qi
                out["sample_pos"][si] = qp + 1 if case.sample_from_anchor else qp
                out["sample_idx_mapping"][si] = state
        out["query_start_loc"][r] = r * Q
        out["seq_lens"][r] = min(last_valid_pos + 1 + Q, case.max_model_len)
        out["temperature"][state] = float(inp["in_temperature"][state].double())
        out["seeds"][state] = int(inp["in_seeds"][state])
    # padding for CUDA-graph replay of a larger batch
    out["query_start_loc"][n : M + 1] = n * Q
    out["seq_lens"][n:M] = 0
    out["sample_indices"][n * N : M * N] = 0
    out["sample_pos"][n * N : M * N] = 0
    out["sample_idx_mapping"][n * N : M * N] = -1
    out["input_ids"][n * Q : T] = 0
    out["positions"][n * Q : T] = 0
    out["is_padding"][n * Q : T] = True
    out["query_slot_mapping"][n * Q : T] = PAD_SLOT_ID
    return out


def run_kernel(case: Case, poison_set: int, device: str) -> dict[str, torch.Tensor]:
    """Run vLLM's prepare_dflash_inputs on poisoned buffers; return them on the CPU."""
    from vllm.v1.worker.gpu.input_batch import InputBuffers
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash

    buf = {k: v.to(device) for k, v in _buffers(case, poison_set).items()}
    ib = InputBuffers(case.max_num_reqs, case.max_num_tokens, torch.device(device))
    ib.input_ids, ib.positions, ib.is_padding = (
        buf["input_ids"],
        buf["positions"],
        buf["is_padding"],
    )
    ib.query_start_loc, ib.seq_lens = buf["query_start_loc"], buf["seq_lens"]
    inp = case.inputs
    batch = SimpleNamespace(
        num_reqs=case.num_reqs,
        num_scheduled_tokens=inp["num_scheduled_tokens"],
        positions=inp["target_positions"].to(device),
        query_start_loc=inp["target_query_start_loc"].to(device),
        idx_mapping=inp["idx_mapping"].to(device),
    )
    dflash.prepare_dflash_inputs(
        ib,
        buf["query_slot_mapping"],
        buf["context_positions"],
        buf["context_slot_mapping"],
        buf["sample_indices"],
        buf["sample_pos"],
        buf["sample_idx_mapping"],
        buf["temperature"],
        buf["seeds"],
        batch,
        inp["num_sampled"].to(device),
        inp["num_rejected"].to(device),
        inp["last_sampled"].to(device),
        inp["next_prefill_tokens"].to(device),
        inp["in_temperature"].to(device),
        inp["in_seeds"].to(device),
        inp["block_table"].to(device),
        case.block_size,
        0,  # cp_rank
        1,  # cp_size
        1,  # cp_interleave
        case.mask_token_id,
        case.num_query_per_req,
        case.num_speculative_steps,
        case.max_num_reqs,
        case.max_num_tokens,
        case.max_model_len,
        case.sample_from_anchor,
        case.num_reqs,
    )
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return {k: v.cpu() for k, v in buf.items()}


def compare(case: Case, got: dict, want: dict) -> list[str]:
    """Human-readable mismatches (empty when equal), naming the region of each bad index."""
    problems = []
    n, Q, N = case.num_reqs, case.num_query_per_req, case.num_speculative_steps
    for name in OUTPUTS:
        g, w = got[name], want[name]
        if g.dtype != w.dtype or g.shape != w.shape:
            problems.append(
                f"{name}: dtype/shape {g.dtype}{tuple(g.shape)} != {w.dtype}{tuple(w.shape)}"
            )
            continue
        bad = (g != w).nonzero().flatten().tolist()
        if not bad:
            continue
        limit = {"query": n * Q, "sample": n * N, "req": n}
        region = (
            "query"
            if name in ("input_ids", "positions", "is_padding", "query_slot_mapping")
            else "sample"
            if name.startswith("sample")
            else "req"
            if name in ("query_start_loc", "seq_lens")
            else None
        )
        where = []
        for i in bad[:6]:
            tag = ""
            if region is not None:
                tag = " (PADDING row)" if i >= limit[region] else " (real row)"
            where.append(f"[{i}]{tag} got {g[i].item()} want {w[i].item()}")
        problems.append(f"{name}: {len(bad)} mismatches: " + "; ".join(where))
    return problems


def check_case(case: Case, device: str) -> list[str]:
    """Run both poison sets; return all mismatches (empty list = pass)."""
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID as VLLM_PAD

    assert VLLM_PAD == PAD_SLOT_ID, (
        f"vLLM PAD_SLOT_ID is {VLLM_PAD}, reference assumes {PAD_SLOT_ID}"
    )
    problems = []
    for ps in range(len(POISONS)):
        got = run_kernel(case, ps, device)
        want = reference(case, ps)
        problems += [f"poison set {ps}: {p}" for p in compare(case, got, want)]
    return problems
