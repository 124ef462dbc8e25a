"""The GPU parity rule, as data: identical greedy tokens except at a proven near-tie.

On the GPU the runs are bf16, and a speculative verify step computes the target's logits for
``1 + k`` tokens at once where the plain run computes one, so two candidates whose logits are
within bf16 rounding may swap. A mismatch is excused only when it is *proven* to be such a tie:
at the first differing position of a request, the reference run's top-k logprobs hold both the
reference token and the other run's token, and their gap is at most ``near_tie`` nats. Tokens
after an excused first mismatch are not compared (the contexts differ from there on). Every
first mismatch is reported with its gap, excused or not.

Acceptance: the rate ``accepted / draft tokens`` of two speculative runs may differ by at most
``points`` percentage points (2 by default), and both must have drafted at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_NEAR_TIE = float(os.environ.get("DSPARK_GPU_NEAR_TIE", "0.125"))


@dataclass
class Mismatch:
    request: int
    position: int
    ref_token: int
    got_token: int
    gap: float | None  # ref logprob - got logprob at that position; None when not in the top-k
    excused: bool

    def describe(self) -> str:
        gap = "not in the reference top-k" if self.gap is None else f"top-2 gap {self.gap:.4f} nats"
        verdict = "near-tie (excused)" if self.excused else "NOT a near-tie"
        return (
            f"request {self.request} position {self.position}: reference {self.ref_token} vs "
            f"{self.got_token}, {gap}: {verdict}"
        )


@dataclass
class ParityReport:
    num_requests: int
    num_tokens: int
    mismatches: list[Mismatch]
    length_problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.length_problems and all(m.excused for m in self.mismatches)

    @property
    def identical(self) -> bool:
        return not self.length_problems and not self.mismatches

    def describe(self) -> str:
        head = f"{self.num_requests} requests, {self.num_tokens} tokens: " + (
            "identical" if self.identical else "OK (near-ties only)" if self.ok else "MISMATCH"
        )
        lines = (
            [head]
            + [f"  {m.describe()}" for m in self.mismatches]
            + [f"  {p}" for p in self.length_problems]
        )
        return "\n".join(lines)


def _lp(pos: dict | None, token: int) -> float | None:
    if not pos:
        return None
    v = pos.get(str(token), pos.get(token))  # JSON keys are strings
    return None if v is None else float(v)


def compare_tokens(
    ref_tokens: list[list[int]],
    got_tokens: list[list[int]],
    ref_logprobs: list | None = None,
    near_tie: float = DEFAULT_NEAR_TIE,
) -> ParityReport:
    """Compare request by request; see the module docstring for the rule."""
    mismatches: list[Mismatch] = []
    problems: list[str] = []
    if len(ref_tokens) != len(got_tokens):
        problems.append(f"request count differs: reference {len(ref_tokens)} vs {len(got_tokens)}")
    total = 0
    for r, (a, b) in enumerate(zip(ref_tokens, got_tokens, strict=False)):
        total += len(a)
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None:
            if len(a) != len(b):
                problems.append(
                    f"request {r}: length {len(a)} vs {len(b)} with equal common prefix"
                )
            continue
        pos = None
        if ref_logprobs is not None and r < len(ref_logprobs) and ref_logprobs[r] is not None:
            if first < len(ref_logprobs[r]):
                pos = ref_logprobs[r][first]
        la, lb = _lp(pos, a[first]), _lp(pos, b[first])
        gap = None if la is None or lb is None else la - lb
        excused = gap is not None and abs(gap) <= near_tie
        mismatches.append(Mismatch(r, first, a[first], b[first], gap, excused))
    return ParityReport(len(ref_tokens), total, mismatches, problems)


def acceptance_rate(m: dict) -> float:
    d = int(m.get("num_draft_tokens", 0))
    return 100.0 * int(m.get("num_accepted_tokens", 0)) / d if d else float("nan")


def acceptance_close(a: dict, b: dict, points: float = 2.0) -> tuple[bool, str]:
    """(ok, description) for the acceptance rule between two speculative runs' counters."""
    ra, rb = acceptance_rate(a), acceptance_rate(b)
    desc = (
        f"acceptance {ra:.2f}% ({a.get('num_accepted_tokens')}/{a.get('num_draft_tokens')}) vs "
        f"{rb:.2f}% ({b.get('num_accepted_tokens')}/{b.get('num_draft_tokens')}), limit {points} "
        f"points"
    )
    if not a.get("num_draft_tokens") or not b.get("num_draft_tokens"):
        return False, desc + ": a run drafted NO tokens (speculation did not engage)"
    return abs(ra - rb) <= points, desc


def within_points(a: int, b: int, scale: int, points: float = 2.0) -> bool:
    """``a`` and ``b`` differ by at most ``points`` percent of ``scale`` (at least 1 allowed)."""
    return abs(a - b) <= max(1.0, points / 100.0 * scale)


def counters_close(got: dict, ref: dict, points: float = 2.0) -> tuple[bool, str]:
    """The acceptance rule plus the same number of drafts and the same accepted tokens per draft
    position, each within ``points`` percent of the reference's drafts."""
    ok, desc = acceptance_close(got, ref, points)
    n = int(ref.get("num_drafts", 0))
    problems = []
    if not within_points(int(got.get("num_drafts", 0)), n, n, points):
        problems.append(f"drafts {got.get('num_drafts')} vs {n}")
    gp, rp = list(got.get("accepted_per_pos") or []), list(ref.get("accepted_per_pos") or [])
    if len(gp) != len(rp) or not rp:
        problems.append(f"per-position counters missing or of another length: {gp} vs {rp}")
    else:
        bad = [i for i, (x, y) in enumerate(zip(gp, rp, strict=True)) if not within_points(x, y, n)]
        if bad:
            problems.append(f"accepted per position differ at {bad}: {gp} vs {rp}")
    desc += f"; drafts {got.get('num_drafts')} vs {n}; per position {gp} vs {rp}"
    return ok and not problems, desc + ("" if not problems else "; " + "; ".join(problems))
