"""The CPU parity rule (float32, greedy): identical tokens, identical spec-decode counters.

A mismatch report names the first differing position of each prompt and, from the reference's
top-2 logprobs, whether it is a numerical near-tie (gap < :data:`NEAR_TIE`).
"""

from __future__ import annotations

NEAR_TIE = 1e-3  # top-2 logprob gap below which a flipped greedy token counts as a near-tie


def explain_mismatch(ref, got) -> str:
    lines = []
    for i, (a, b) in enumerate(zip(ref.tokens, got.tokens, strict=True)):
        if a == b:
            continue
        pairs = zip(a, b, strict=False)
        pos = next((j for j, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))
        note = ""
        if ref.logprobs and ref.logprobs[i] and pos < len(ref.logprobs[i]):
            top = sorted(ref.logprobs[i][pos].items(), key=lambda kv: -kv[1])[:2]
            if len(top) == 2:
                gap = top[0][1] - top[1][1]
                kind = (
                    "NEAR-TIE (numerical noise)"
                    if gap < NEAR_TIE
                    else "not a near-tie (a real bug)"
                )
                note = f"; reference top-2 {top} gap {gap:.2e}: {kind}"
        lines.append(
            f"prompt {i}: first difference at output position {pos}: "
            f"ref {a[pos : pos + 4]} got {b[pos : pos + 4]}{note}"
        )
    return "\n".join(lines)


def assert_same_tokens(ref, got, what: str, length: int | None) -> None:
    """Same greedy tokens; ``length``: every output has it, or None: stopped at EOS, so the
    finish reasons must agree too."""
    assert got.tokens == ref.tokens, (
        f"{what}: greedy output differs from PP=1 no-spec:\n" + explain_mismatch(ref, got)
    )
    if length is None:
        assert got.finish_reasons == ref.finish_reasons, (what, got.finish_reasons)
    else:
        assert all(len(t) == length for t in got.tokens)


def describe(m: dict) -> str:
    d, t, a = m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]
    return (
        f"{d} drafts, {a}/{t} accepted, per position {m['accepted_per_pos']}, "
        f"mean acceptance length {1 + a / max(d, 1):.3f}"
    )


def assert_same_counters(ref, got, what: str) -> None:
    assert got.metrics == ref.metrics, (
        f"{what}: spec-decode counters differ from PP=1 DSpark:\n  PP=1: {describe(ref.metrics)}\n"
        f"  got:  {describe(got.metrics)}"
    )
